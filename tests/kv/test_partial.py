"""Receiver-driven partial payloads on tiny random models: exactness at 100 %, RoPE phases, budgets, inspect.

The phase test is the contract a receiver depends on: attending to the partial payload gives the logits
of a full prefill of (context + question) in which the question's tokens may not see the dropped
positions (per layer and KV head), the context itself being computed over everything, as the sender did.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.agents.partial import partial_relay
from kvrelay.core.errors import CorruptPayload, InvalidInput
from kvrelay.kv import wire
from kvrelay.kv.cache import to_cache
from kvrelay.kv.describe import describe
from kvrelay.kv.partial import Budget, PartialRequest, select
from tests.conftest import random_ids

ARCHS = ("llama", "qwen2", "gemma3")
KEEP_MASK = "kvrelay_test_keep_mask"
_keep: dict[int, torch.Tensor] = {}  # model layer -> (H_kv, T_total) bool keys the question rows may see
_q_start: list[int] = [0]


def _register_keep_mask() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask_fn(*args, **kwargs):
        return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})

    def attn(module, query, key, value, attention_mask, **kwargs):
        B, Hq, q, _ = query.shape  # (B, Hq, q, D); key (B, H_kv, kv, D)
        H, kv = key.shape[1], key.shape[2]
        m = attention_mask.expand(B, Hq, q, kv).clone()  # (B, Hq, q, kv) bool, True = attend
        keep = _keep[module.layer_idx].repeat_interleave(Hq // H, dim=0)  # (Hq, kv): query heads of a group adjacent
        m[:, :, _q_start[0]:, :] &= keep[None, :, None, :]
        return sdpa_attention_forward(module, query, key, value, m, is_causal=False, **kwargs)

    AttentionInterface.register(KEEP_MASK, attn)
    AttentionMaskInterface.register(KEEP_MASK, mask_fn)


@pytest.fixture(scope="module")
def cases(tiny_by_arch):
    out = {}
    for arch, lm in tiny_by_arch.items():
        a = Agent(lm, "sender", role="read")
        r = Agent(lm, "receiver", max_new_tokens=6)
        out[arch] = (lm, a, r, a.prefill(random_ids(40, 7)))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_all_positions_reproduce_full_relay(cases, arch):
    lm, sender, receiver, p = cases[arch]
    full = receiver.respond("what is the key", p)
    out = partial_relay(sender, p, receiver, "what is the key", Budget(fraction=1.0))
    full_layers = [j for j, t in enumerate(p.meta.layer_types) if t == "full_attention"]
    assert out.selection.positions_kept == p.num_tokens and bool(out.selection.kept[full_layers].all())
    for a, b in zip((*p.keys, *p.values), (*out.payload.keys, *out.payload.values), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(out.payload.positions, p.positions)
    assert out.response.token_ids == full.token_ids
    assert out.hop.request_bytes > 0 and out.hop.reply_bytes > p.nbytes // 2 and out.ttft_s > out.response.ttft_s


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["headwise", "layerwise"])
def test_selected_positions_keep_their_rope_phase(cases, arch, mode):
    """Logits over the partial cache == logits of a full prefill with the dropped positions masked out."""
    lm, _, receiver, p = cases[arch]
    model = lm.model
    q_ids = receiver.prompt_ids("which code is blue")
    req = PartialRequest(tuple(q_ids), Budget(fraction=0.6), mode=mode, sink=2, recent=3, verify=False)
    sel = select(p, req, model=model)
    assert sel.positions_kept < p.num_tokens  # something was dropped
    part = sel.compressed.decompress()
    T, q = p.num_tokens, len(q_ids)
    pos = torch.arange(T, T + q)[None]
    got = model(input_ids=torch.tensor([q_ids]), position_ids=pos, cache=to_cache(part, model.config),
                use_cache=True).logits[0]  # (q, V)
    _register_keep_mask()
    _keep.clear()
    for j in range(len(p.keys)):
        _keep[j] = torch.cat((sel.kept[j], torch.ones(sel.kept.shape[1], q, dtype=torch.bool)), dim=1)  # (H, T + q)
    _q_start[0] = T
    ids = torch.cat((p.token_ids, torch.tensor([q_ids])), 1)
    before = model.config._attn_implementation
    model.set_attn_implementation(KEEP_MASK)
    try:
        want = model(input_ids=ids, position_ids=torch.arange(T + q)[None], use_cache=False).logits[0, T:]
    finally:
        model.set_attn_implementation(before)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # and the selection matters: attending to the full cache gives other logits
    full = model(input_ids=torch.tensor([q_ids]), position_ids=pos, cache=to_cache(p, model.config),
                 use_cache=True).logits[0]
    assert (full - got).abs().max() > 1e-3


def test_sliding_layers_keep_their_window(cases):
    lm, _, receiver, p = cases["gemma3"]
    sel = select(p, PartialRequest(tuple(receiver.prompt_ids("which")), Budget(fraction=0.25)), model=lm.model)
    part = sel.compressed.decompress()
    w = p.meta.sliding_window - 1
    for j, t in enumerate(p.meta.layer_types):
        if t == "sliding_attention":
            assert torch.equal(part.keys[j], p.keys[j])  # the whole window, untouched
            assert bool(sel.kept[j, :, -w:].all()) and not sel.kept[j, :, :-w].any()
    assert int(part.next_positions[0]) == int(p.next_positions[0])  # the receiver continues at the original end


@pytest.mark.parametrize("encoding", ["raw", "int8", "int4"])
def test_budgets_fraction_topk_bytes_layers(cases, encoding):
    lm, _, receiver, p = cases["qwen2"]
    q = tuple(receiver.prompt_ids("what is the key"))
    topk = select(p, PartialRequest(q, Budget(top_k=20), encoding=encoding), model=lm.model)
    assert topk.positions_kept == 20
    full = select(p, PartialRequest(q, Budget(fraction=1.0), encoding=encoding), model=lm.model)
    cap = full.compressed.nbytes // 2
    fit = select(p, PartialRequest(q, Budget(nbytes=cap), encoding=encoding), model=lm.model)
    assert fit.compressed.nbytes <= cap < select(
        p, PartialRequest(q, Budget(top_k=fit.positions_kept + 1), encoding=encoding), model=lm.model).compressed.nbytes
    both = select(p, PartialRequest(q, Budget(fraction=0.5, top_k=15), encoding=encoding), model=lm.model)
    assert both.positions_kept == 15  # the tightest wins
    sub = select(p, PartialRequest(q, Budget(fraction=0.5), layers=(0, 1), encoding=encoding), model=lm.model)
    out = sub.compressed.decompress()
    assert out.meta.layer_indices == (0, 1) and out.num_tokens == 20 and sub.kept.shape[0] == 2


def test_request_wire_round_trip_and_refusals():
    r = PartialRequest((5, 6, 7), Budget(fraction=0.25, nbytes=1000), layers=(0, 2), encoding="int8")
    assert PartialRequest.from_bytes(r.to_bytes()) == r
    with pytest.raises(CorruptPayload, match="not a kvrelay-partial-request/1 request"):
        PartialRequest.from_bytes(b'{"format": "something else"}')
    with pytest.raises(CorruptPayload, match="malformed partial request"):
        PartialRequest.from_bytes(b'{"format": "kvrelay-partial-request/1", "question_ids": [1]}')
    with pytest.raises(CorruptPayload, match="malformed partial request"):
        PartialRequest.from_bytes(b'\xff not json')
    with pytest.raises(InvalidInput, match="budget fraction 1.5; expected .*in \\(0, 1\\]"):
        Budget(fraction=1.5)
    with pytest.raises(InvalidInput, match="needs a fraction"):
        Budget()
    with pytest.raises(InvalidInput, match="representation only"):
        PartialRequest((1,), Budget(top_k=3), encoding="evict:0.2+int8")
    w = PartialRequest((5, 6, 7), Budget(fraction=0.25), window=2, pool=7)
    assert PartialRequest.from_bytes(w.to_bytes()) == w
    la = PartialRequest((5, 6, 7), Budget(fraction=0.25), lookahead=8)
    assert PartialRequest.from_bytes(la.to_bytes()) == la
    bf = PartialRequest((5, 6, 7), Budget(fraction=0.25), backfill=True)
    assert PartialRequest.from_bytes(bf.to_bytes()) == bf
    older = json.loads(bf.to_bytes())
    del older["backfill"]  # a request from before the field: no backfill
    assert PartialRequest.from_bytes(json.dumps(older).encode()).backfill is False
    for bad in ({"pool": 4}, {"pool": 0}, {"window": 0}, {"window": 1.5}, {"lookahead": -1}, {"lookahead": 2.0},
                {"backfill": 1}, {"backfill": "yes"}, {"verify": 1}, {"first_exact": 1}):
        with pytest.raises(InvalidInput, match="window|pool|lookahead|backfill|verify|first_exact"):
            PartialRequest((1,), Budget(top_k=3), **bad)
    v = PartialRequest((5, 6, 7), Budget(fraction=0.25), verify=True)
    assert PartialRequest.from_bytes(v.to_bytes()) == v
    older = json.loads(v.to_bytes())
    del older["verify"], older["first_exact"]
    assert PartialRequest.from_bytes(json.dumps(older).encode()).verify is False
    assert PartialRequest.from_bytes(json.dumps(older).encode()).first_exact is False
    first = PartialRequest((5, 6, 7), Budget(fraction=0.25), verify=True, first_exact=True)
    assert PartialRequest.from_bytes(first.to_bytes()) == first


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_verify_sends_the_candidate_that_best_reproduces_the_look_ahead(cases, arch):
    """With ``verify`` the sender selects under each candidate pool and mode and sends the payload whose
    teacher-forced reading of its own look-ahead answer fits best; the whole cache fits it exactly."""
    from kvrelay.kv.evict import answer_probe
    from kvrelay.kv.partial import VERIFY_CANDIDATES, answer_fit

    lm, _, receiver, p = cases[arch]
    question = receiver.prompt_ids("what is the code")
    probe = answer_probe(lm.model, p, question, 4)
    assert len(probe.answer) == probe.lookahead > 0
    assert answer_fit(lm.model, p, question, probe.answer)[0] == len(probe.answer)  # the answer is the greedy one
    req = PartialRequest(tuple(question), Budget(fraction=0.6), lookahead=4, verify=True, first_exact=False)
    got = select(p, req, model=lm.model, probe=probe)
    fits = {}
    for pool, mode in VERIFY_CANDIDATES:
        one = select(p, dataclasses.replace(req, pool=pool, mode=mode, verify=False), probe=probe)
        fits[pool, mode] = (answer_fit(lm.model, one.compressed.decompress(), question, probe.answer), one)
    assert len({str(f[1].kept.tolist()) for f in fits.values()}) > 1  # the candidates differ
    fit, chosen = fits[got.pool, got.mode]
    assert fit == max(f[0] for f in fits.values())
    assert torch.equal(got.kept, chosen.kept)
    own = (req.pool, req.mode)
    order = [own] + [c for c in VERIFY_CANDIDATES if c != own]  # the request's own choice is read first
    distinct = []  # candidates keeping the same positions are read once
    for c in order:
        if not any(torch.equal(fits[c][1].kept, k) for k in distinct):
            distinct.append(fits[c][1].kept)
    assert got.checked == len(distinct)
    first_best = next(c for c in order if fits[c][0] == fit)  # ties go to the earlier candidate
    assert torch.equal(got.kept, fits[first_best][1].kept)
    # first_exact: the first candidate (in the same order) that predicts every look-ahead token is sent unchecked
    # by the rest; without one, the same choice as checking them all
    exact = select(p, dataclasses.replace(req, first_exact=True), model=lm.model, probe=probe)
    perfect = next((c for c in order if fits[c][0][0] == len(probe.answer)), None)
    assert perfect is not None  # at 60% of the positions some candidate reproduces the tiny model's answer
    assert torch.equal(exact.kept, fits[perfect][1].kept) and (exact.pool, exact.mode) == perfect
    upto = order[:order.index(perfect) + 1]
    assert exact.checked == len({str(fits[c][1].kept.tolist()) for c in upto}) < got.checked  # fewer forwards
    tiny = select(p, dataclasses.replace(req, budget=Budget(fraction=0.01)), model=lm.model, probe=probe)
    assert tiny.checked == 1 and (tiny.pool, tiny.mode) == own  # only the sinks and the recent tail: one selection
    with pytest.raises(ValueError, match="pass model="):
        select(p, req, probe=probe)
    no_answer = dataclasses.replace(probe, answer=())  # nothing to check against: the request's own choice
    plain = select(p, dataclasses.replace(req, verify=False), probe=no_answer)
    assert torch.equal(select(p, req, probe=no_answer).kept, plain.kept)
    sub = dataclasses.replace(req, layers=(0, 1))  # a layer subset cannot be read whole: the request's own choice
    got_sub = select(p, sub, model=lm.model, probe=probe)
    assert (got_sub.pool, got_sub.mode) == (req.pool, req.mode)
    assert torch.equal(got_sub.kept, select(p, dataclasses.replace(sub, verify=False), probe=probe).kept)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_answer_fit_reads_the_logits_that_predict_each_answer_token(cases, arch):
    """``answer_fit`` keeps only the logits it needs; they are a full forward's, position by position:
    the answer's i-th token is predicted at the position before it (the question's last for the first)."""
    from kvrelay.kv.partial import answer_fit
    from kvrelay.models.generate import forward_all

    lm, _, receiver, p = cases[arch]
    question = receiver.prompt_ids("what is the code")
    for answer in ([5, 9, 5, 12], [7]):
        ids = torch.tensor([question + answer])
        start = int(p.next_positions[0])
        logits = forward_all(lm.model, ids, (start + torch.arange(ids.shape[1]))[None], to_cache(p, lm.model.config),
                             None)[0]  # (q + k, V)
        at = logits[len(question) - 1:-1]  # (k, V)
        want = torch.tensor(answer)
        hits, logprob = answer_fit(lm.model, p, question, answer)
        assert hits == int((at.argmax(-1) == want).sum())
        assert logprob == pytest.approx(float(at.log_softmax(-1).gather(1, want[:, None]).sum()), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_backfill_corrects_the_kept_values_for_the_answer_rows(cases, arch):
    """With ``backfill`` the same positions travel, keys untouched, and the kept values are corrected so
    that the look-ahead's answer rows read from them closer to what they read from the whole cache."""
    from kvrelay.kv.evict import answer_probe

    lm, _, receiver, p = cases[arch]
    question = receiver.prompt_ids("what is the code")
    probe = answer_probe(lm.model, p, question, 4)
    req = PartialRequest(tuple(question), Budget(fraction=0.4), lookahead=4, verify=False)
    plain = select(p, req, probe=probe)
    fixed = select(p, dataclasses.replace(req, backfill=True), probe=probe)
    assert torch.equal(plain.kept, fixed.kept)
    a, b = plain.compressed.decompress(), fixed.compressed.decompress()
    assert all(torch.equal(x, y) for x, y in zip(a.keys, b.keys, strict=True))
    err_plain = err_fixed = 0.0
    for j in range(len(p.keys)):
        for h in range(p.keys[j].shape[1]):
            P = probe.probs[j][0, h].double()  # (R, T) the answer rows
            kept = plain.kept[j, h].nonzero().squeeze(1)  # (T',) sorted, as the payload holds them
            A = P[:, kept] / P[:, kept].sum(-1, keepdim=True)  # (R, T') what the rows see after the drop
            want = P @ p.values[j][0, h].double()  # (R, D)
            err_plain += float((A @ a.values[j][0, h].double() - want).norm())
            err_fixed += float((A @ b.values[j][0, h].double() - want).norm())
    assert err_fixed < 0.8 * err_plain
    assert sum(b.values[j].sub(a.values[j]).abs().max() for j in range(len(p.keys))) > 1e-4
    full = select(p, dataclasses.replace(req, budget=Budget(fraction=1.0), backfill=True), probe=probe)
    assert all(torch.equal(x, y) for x, y in zip(full.compressed.decompress().values, p.values, strict=True))


def test_pooled_scores_take_the_window_and_keep_a_peak_s_neighbours():
    """``pooled``: rows of the last ``window`` probe tokens only (probe token fastest within a KV group's
    rows), then a max over ``pool`` neighbouring slots, so a peak keeps the slots around it."""
    from kvrelay.kv.evict import AttentionProbe

    B, H, group, q, T = 1, 2, 3, 4, 20
    probs = torch.zeros(B, H, group, q, T)
    probs[:, :, :, :2, 3] = 1.0  # the first two probe tokens look at slot 3
    probs[:, :, :, 2:, 12] = 1.0  # the last two at slot 12
    probe = AttentionProbe((probs.reshape(B, H, group * q, T),), tokens=q)
    assert torch.equal(probe.pooled(), probe.scores)
    last = probe.pooled(window=2)[0, 0, 0]  # (T,)
    assert last[12] == 1.0 and last.sum() == 1.0  # slot 3 is not seen by the window
    wide = probe.pooled(window=2, pool=5)[0, 0, 0]
    assert wide[10:15].tolist() == [1.0] * 5 and wide.sum() == 5.0  # the peak and two slots either side
    both = probe.pooled(pool=3)[0, 0, 1]  # (L, B, H_kv, T): the second KV head
    assert both[2:5].tolist() == [0.5] * 3 and both[11:14].tolist() == [0.5] * 3
    for bad in ({"pool": 2}, {"window": 0}):
        with pytest.raises(ValueError):
            probe.pooled(**bad)
    with pytest.raises(ValueError, match="knows its tokens"):
        AttentionProbe(probe.probs).pooled(window=2)


def test_a_pooled_window_changes_what_is_kept(cases):
    """The request's window and pool reach the selection (the same probe, other kept slots)."""
    lm, sender, receiver, p = cases["llama"]
    question = receiver.prompt_ids("what is the code")
    plain = select(p, PartialRequest(tuple(question), Budget(fraction=0.6), lookahead=0, pool=1), model=lm.model)
    pooled = select(p, PartialRequest(tuple(question), Budget(fraction=0.6), window=2, pool=5, lookahead=0),
                    model=lm.model)
    assert plain.positions_kept == pooled.positions_kept
    assert not torch.equal(plain.kept, pooled.kept)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lookahead_scores_by_the_sender_s_own_answer(cases, arch):
    """With ``lookahead`` N the sender decodes the receiver's first N answer tokens on its full cache
    (the tokens full relay answers) and only those tokens' attention rows pick the positions."""
    from kvrelay.kv.evict import answer_probe, attention_probe, lookahead_ids

    lm, sender, receiver, p = cases[arch]
    question = receiver.prompt_ids("what is the code")
    full = receiver.respond("what is the code", p)
    draft = lookahead_ids(lm.model, p, question, 4, stop_ids=receiver.stop_ids)
    assert draft and tuple(draft) == full.token_ids[:4]  # cut where the receiver stops
    probe = answer_probe(lm.model, p, question, 4)
    mine = lookahead_ids(lm.model, p, question, 4)  # cut at the model's own eos
    assert probe.lookahead == probe.tokens == len(mine) > 0
    shorter = answer_probe(lm.model, p, question, 2)  # one decode serves every shorter look-ahead
    assert shorter.lookahead == 2
    for a, b in zip(probe.answer_prefix(2).probs, shorter.probs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert probe.answer_prefix(9) is probe
    # the rows taken while decoding are those of a probe over prompt + answer, the answer's rows only
    # (full-attention layers; a sliding layer's are zeros: it keeps its window whatever the scores)
    two_pass = attention_probe(lm.model, p, question + mine).pooled(window=len(mine))  # (L, 1, H_kv, T)
    full_layers = [j for j, t in enumerate(p.meta.layer_types) if t == "full_attention"]
    got_rows = probe.pooled()
    torch.testing.assert_close(got_rows[full_layers], two_pass[full_layers], atol=1e-5, rtol=1e-4)
    assert not got_rows[[j for j in range(len(p.keys)) if j not in full_layers]].any()
    request = PartialRequest(tuple(question), Budget(fraction=0.5), lookahead=4, verify=False)  # one selection
    got = select(p, request, model=lm.model)
    by_answer = select(p, request, probe=probe)
    assert torch.equal(got.kept, by_answer.kept) and got.score_s > 0 and by_answer.score_s == 0
    rows = select(p, PartialRequest(tuple(question), Budget(fraction=0.5), window=probe.lookahead, verify=False),
                  probe=dataclasses.replace(probe, lookahead=0))  # the last N rows of the same probe
    assert torch.equal(got.kept, rows.kept)
    q_only = attention_probe(lm.model, p, question)
    by_question = select(p, PartialRequest(tuple(question), Budget(fraction=0.5)), probe=q_only)
    assert not torch.equal(got.kept, by_question.kept)


def test_inspect_names_layout_and_partial_selection(cases):
    lm, _, receiver, p = cases["llama"]
    sel = select(p, PartialRequest(tuple(receiver.prompt_ids("which")), Budget(fraction=0.25), mode="shared"),
                 model=lm.model)
    d = describe(wire.pack(*sel.compressed.to_wire()))
    assert d["layout"]["selection"] == "partial" and d["layout"]["positions"] == "gapped"
    assert d["layout"]["kv_axes"] == "B,H_kv,T_l,D"
    whole = describe(wire.encode(p))
    assert whole["layout"]["selection"] == "full" and whole["layout"]["positions"] == "contiguous"
