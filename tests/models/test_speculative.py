"""Speculative decoding from relayed caches: the same greedy tokens as plain decoding, drafts or not.

Every test decodes the same relayed payload twice — plainly and speculatively — and compares token
for token, with drafts that are partly accepted and partly rejected, so the cache rollback is exercised
(an off-by-one in it, planted once, made these tests fail). gemma3's sliding-window layers (window 8)
are crossed and rolled back too.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.agents.draft import DraftModel
from kvrelay.core.errors import IncompatiblePayload
from kvrelay.models.loader import with_engine
from kvrelay.models.speculative import MAX_PAUSE, LookupDrafter, PromptLookup
from kvrelay.models.tiny import tiny_lm

CONTEXT = "the vault is blue and the key is seven what is the code of the red file " * 3
PROMPT = "what is the key"
N = 40


def _perturbed(lm, scale: float, seed: int = 1):
    """A draft model: ``lm``'s weights plus noise (agrees with it often, not always), same tokenizer."""
    model = copy.deepcopy(lm.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return replace(lm, model=model, identity=replace(lm.identity, fingerprint=f"perturbed-{scale}-{seed}"))


def _answer(lm, payload, **kw):
    return Agent(lm, "receiver").respond(PROMPT, payload, max_new_tokens=N, min_new_tokens=N, **kw)


CASES = [("qwen2", "fp32"), ("llama", "fp32"), ("gemma3", "fp32"), ("qwen2", "int8"), ("gemma3", "int4"), ("qwen2", "fp16w")]


@pytest.mark.parametrize(("arch", "engine"), CASES)
def test_prompt_lookup_writes_what_plain_decoding_writes(arch, engine):
    lm = with_engine(tiny_lm(arch), engine)
    payload = Agent(lm, "sender").read(CONTEXT)
    plain = _answer(lm, payload)
    spec = _answer(lm, payload, speculate=PromptLookup(min_ngram=1))  # 1-grams: many drafts, many rejected
    assert len(spec.token_ids) == N and spec.token_ids == plain.token_ids
    s = spec.speculation
    assert s.accepted > 0 and s.verify_forwards < N - 1  # drafts were kept: they saved target forwards


@pytest.mark.parametrize(("arch", "engine"), CASES[:4])
def test_draft_model_speculation_from_both_relayed_caches_writes_what_plain_decoding_writes(arch, engine):
    lm = with_engine(tiny_lm(arch), engine)
    draft = _perturbed(lm, 0.002)  # agrees often enough that drafting keeps going (and sometimes misses)
    payload, draft_payload = Agent(lm, "sender").read(CONTEXT), Agent(draft, "sender").read(CONTEXT)
    plain = _answer(lm, payload)
    spec = _answer(lm, payload, speculate=DraftModel(draft, draft_payload))
    assert spec.token_ids == plain.token_ids
    assert 0 < spec.speculation.accepted < spec.speculation.drafted


def test_a_draft_identical_to_the_target_is_always_accepted():
    lm = tiny_lm("qwen2")
    payload = Agent(lm, "sender").read(CONTEXT)
    spec = _answer(lm, payload, speculate=DraftModel(lm, payload, num_draft=4))
    assert spec.token_ids == _answer(lm, payload).token_ids
    s = spec.speculation
    assert s.acceptance == 1.0 and s.verify_forwards == -(-(N - 1) // 5)  # 1 + 4 tokens a forward


def test_speculation_leaves_the_cache_plain_decoding_leaves():
    """The whole-turn payload after a speculative answer is the plain one: no rejected draft stays behind."""
    lm = tiny_lm("llama")
    payload = Agent(lm, "sender").read(CONTEXT)
    plain = Agent(lm, "r").respond(PROMPT, payload, max_new_tokens=N, min_new_tokens=N, return_payload=True)
    spec = Agent(lm, "r").respond(PROMPT, payload, max_new_tokens=N, min_new_tokens=N, return_payload=True,
                                  speculate=PromptLookup())
    assert torch.equal(spec.payload.token_ids, plain.payload.token_ids)
    for a, b in zip(spec.payload.keys, plain.payload.keys, strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-4


def test_stop_tokens_end_a_speculative_answer_where_they_end_a_plain_one():
    lm = tiny_lm("qwen2")
    payload = Agent(lm, "sender").read(CONTEXT)
    for n_min in (0, 3):
        plain = Agent(lm, "r").respond(PROMPT, payload, max_new_tokens=N, min_new_tokens=n_min)
        spec = Agent(lm, "r").respond(PROMPT, payload, max_new_tokens=N, min_new_tokens=n_min,
                                      speculate=PromptLookup(num_draft=3, min_ngram=1))
        assert spec.token_ids == plain.token_ids


def test_lookup_proposes_the_continuation_of_the_latest_match():
    seq = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6]
    d = LookupDrafter(PromptLookup(num_draft=3, max_ngram=3, min_ngram=2), seq[:4])
    assert d.propose(seq, 8) == [7, 1, 2]  # [5, 6] last seen before [7, 1, 2]; [x, 5, 6] not seen before
    assert d.propose(seq, 2) == [7, 1]
    d.update(seq, 3, 1)
    assert d.propose(seq, 8) == [7, 1]  # a partly kept draft shortens the next one
    assert d.propose([*seq, 4], 8) == []  # [6, 4] and [5, 6, 4] never occurred


def test_drafting_pauses_longer_while_nothing_is_kept_and_resumes_when_something_is():
    """The pause schedule: after a draft of which nothing is kept, 1, 2, 4, ... steps without drafting
    (up to MAX_PAUSE), each followed by a 1-token probe; a kept probe ends the pausing."""
    seq = [5, 6, 7, 8, 9, 5, 6]
    d = LookupDrafter(PromptLookup(num_draft=4), seq)
    lengths = []
    for _ in range(1 + 2 + 3 + 5 + 9 + 17 + 33 + 33):
        draft = d.propose(seq, 8)
        lengths.append(len(draft))
        d.update(seq, len(draft), 0)
    pauses = [len(run) for run in "".join("x" if n else " " for n in lengths).split("x")[1:-1]]
    assert lengths[0] == 4 and set(lengths[1:]) == {0, 1}
    assert pauses == [1, 2, 4, 8, 16, MAX_PAUSE, MAX_PAUSE]
    while not (probe := d.propose(seq, 8)):
        pass
    assert probe == [7]
    d.update(seq, 1, 1)  # a probe kept: drafting resumes at once, growing again
    assert d.propose(seq, 8) == [7, 8, 9]


def test_with_a_shortest_draft_drafts_never_shrink_below_it_and_a_draft_that_keeps_too_little_pauses():
    """``min_draft`` = 4 (a CPU where 2- and 3-token forwards cost as much as that many steps): drafts stay
    4-8 tokens long; one that keeps 2 tokens pays (the next is 3 shorter than a full one would grow,
    floored at 4), one that keeps 1 does not and starts the pause, whose probes are 4 tokens long."""
    seq = list(range(10, 30)) + list(range(10, 12))  # [10, 11] recurs: its continuation is 12, 13, ...
    d = LookupDrafter(PromptLookup(num_draft=8, min_draft=4), seq[:20])
    assert len(d.propose(seq, 64)) == 8
    d.update(seq, 8, 2)  # kept 2: pays; -1 a step
    assert len(d.propose(seq, 64)) == 7
    for _ in range(5):
        d.update(seq, 7, 2)
        d.propose(seq, 64)
    assert len(d.propose(seq, 64)) == 4  # floored at min_draft, never 1-3
    d.update(seq, 4, 1)  # kept 1 of 4: does not pay for the wider forward
    assert d.propose(seq, 64) == []  # paused one step
    assert d.propose(seq, 64) == list(range(12, 16))  # the probe: min_draft tokens
    d.update(seq, 4, 4)  # a probe that pays ends the pausing and drafts grow again
    assert len(d.propose(seq, 64)) == 6
    with pytest.raises(ValueError, match="min_draft"):
        PromptLookup(num_draft=3, min_draft=4)
    with pytest.raises(ValueError, match="min_draft"):
        DraftModel(None, None, num_draft=4, min_draft=0)


@pytest.mark.parametrize(("arch", "engine"), [("qwen2", "fp32"), ("gemma3", "int4")])
def test_drafts_of_at_least_four_tokens_write_what_plain_decoding_writes(arch, engine):
    lm = with_engine(tiny_lm(arch), engine)
    payload = Agent(lm, "sender").read(CONTEXT)
    plain = _answer(lm, payload)
    spec = _answer(lm, payload, speculate=PromptLookup(min_ngram=1, min_draft=4))
    assert spec.token_ids == plain.token_ids and spec.speculation.drafted > 0
    draft = _perturbed(lm, 0.002)
    spec = _answer(lm, payload, speculate=DraftModel(draft, Agent(draft, "sender").read(CONTEXT), min_draft=4))
    assert spec.token_ids == plain.token_ids and spec.speculation.drafted > 0


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_a_draft_model_that_is_never_right_is_soon_left_idle_and_changes_nothing(arch):
    lm = tiny_lm(arch)
    other = tiny_lm(arch, seed=7)  # same tokenizer, unrelated weights: its drafts are nearly never kept
    payload, draft_payload = Agent(lm, "sender").read(CONTEXT), Agent(other, "sender").read(CONTEXT)
    plain = _answer(lm, payload)
    spec = _answer(lm, payload, speculate=DraftModel(other, draft_payload, num_draft=4))
    assert spec.token_ids == plain.token_ids
    s = spec.speculation
    assert s.accepted <= 2  # the case this test is about: drafts that miss
    # 39 steps: without pausing every step drafts (up to 4 tokens each); with it about 6 probes
    assert s.drafted <= 4 + 8, s
    assert s.verify_forwards == N - 1 - s.accepted


def test_a_draft_payload_of_other_tokens_or_another_tokenizer_is_refused():
    lm = tiny_lm("qwen2")
    payload = Agent(lm, "sender").read(CONTEXT)
    other = Agent(lm, "sender").read("the red file is not blue")
    with pytest.raises(IncompatiblePayload, match="token_ids"):
        _answer(lm, payload, speculate=DraftModel(lm, other))
    foreign = replace(lm, identity=replace(lm.identity, tokenizer_hash="0" * 64), tokenizer=_other_vocabulary(lm))
    with pytest.raises(IncompatiblePayload, match="vocabulary"):
        _answer(lm, payload, speculate=DraftModel(foreign, None))
    chat = replace(lm, identity=replace(lm.identity, tokenizer_hash="1" * 64))  # same ids, another chat template
    assert _answer(lm, payload, speculate=DraftModel(chat, None)).token_ids == _answer(lm, payload).token_ids


def _other_vocabulary(lm):
    tok = copy.deepcopy(lm.tokenizer)
    tok.add_tokens(["zebra"])
    return tok


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_verify_attention_without_repeated_heads_computes_what_transformers_sdpa_does(arch):
    """The verify forward's attention (grouped key/value heads passed to SDPA as they are, the causal
    pattern aligned to the cache's tail) gives the logits transformers' own SDPA path gives for a
    multi-token call over a cache — and is not used on sliding-window models."""
    from contextlib import nullcontext

    from transformers import DynamicCache

    from kvrelay.models.attention import gqa_causal_attention, gqa_causal_fits
    from kvrelay.models.generate import forward_all

    lm = tiny_lm(arch)
    assert gqa_causal_fits(lm.model) and not gqa_causal_fits(tiny_lm("gemma3").model)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(3))  # (1, 30)

    def logits(ctx):
        cache = DynamicCache(config=lm.model.config)
        forward_all(lm.model, ids[:, :24], torch.arange(24)[None], cache, None)
        with ctx:
            return forward_all(lm.model, ids[:, 24:], torch.arange(24, 30)[None], cache, None)  # (1, 6, V)

    ref, got = logits(nullcontext()), logits(gqa_causal_attention(lm.model))
    assert lm.model.config._attn_implementation == "sdpa"  # restored
    assert (ref - got).abs().max().item() < 1e-4
