"""Codecs: int8/int4 quantization, attention-score eviction (+OBF), layer subsets, names, wire form.

Tolerances are stated where they are asserted. Random payloads get a realistic geometry (head_dim
64, 256 tokens) with KIVI's key outlier channels; model tests use the tiny random models.
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.kv import codecs, wire
from kvrelay.kv.cache import to_cache
from kvrelay.kv.evict import attention_probe, evict, eviction_plan, key_norm_scores
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.kv.quant import dequantize, quantize
from kvrelay.kv.transforms import pad_batch, unpad_row
from kvrelay.models.generate import forward_all
from kvrelay.models.identity import RopeSpec
from tests.conftest import random_ids

TOL = 1e-4  # fp32 exactness, as in tests/relay/test_exact.py


def random_payload(T=256, layers=8, heads=2, D=64, seed=0) -> KVPayload:
    """A llama-like payload: keys with a few outlier channels (what per-channel key groups are for)."""
    g = torch.Generator().manual_seed(seed)
    chan = torch.ones(D)
    chan[torch.randperm(D, generator=g)[:4]] = 8.0  # (D,) outlier channels
    keys = tuple(torch.randn(1, heads, T, D, generator=g) * chan for _ in range(layers))
    values = tuple(torch.randn(1, heads, T, D, generator=g) for _ in range(layers))
    rope = (RopeSpec("full_attention", tuple(10000.0 ** (-i / (D // 2)) for i in range(D // 2))),)
    meta = PayloadMeta("f" * 64, "t" * 64, "llama", layers, tuple(range(layers)), ("full_attention",) * layers,
                       None, rope)
    ids = torch.randint(9, 60, (1, T), generator=g)
    return KVPayload(keys, values, ids, torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool), meta)


def rel_rms(a: KVPayload, b: KVPayload) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True))
    den = sum(float(x.pow(2).sum()) for x in (*a.keys, *a.values))
    return (num / den) ** 0.5


def logits_after(lm, payload, new_ids):
    """Receiver logits for ``new_ids`` continuing ``payload`` at its next position (the explicit cursor)."""
    cache = to_cache(payload, lm.model.config)
    start = int(payload.next_positions[0])
    pos = torch.arange(start, start + len(new_ids))[None]
    return forward_all(lm.model, torch.tensor([new_ids]), pos, cache, None)[0]


def rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


# -- quantization ----------------------------------------------------------------------------
def test_int8_int4_error_and_bytes():
    p = random_payload()
    i8, i4 = quantize(p, 8, 32), quantize(p, 4, 32)
    e8, e4 = rel_rms(p, dequantize(i8)), rel_rms(p, dequantize(i4))
    assert e8 <= 0.01  # int8: ≤ 1 % of the RMS (measured ~0.4 %)
    assert e4 <= 0.12  # int4: ≤ 12 % of the RMS (measured ~7 %)
    assert e4 > e8
    fp32 = p.nbytes
    assert i8.nbytes <= 0.30 * fp32  # issue 5: int8 payloads ≤ 30 % of fp32 bytes (28.3 % here)
    assert i4.nbytes <= 0.16 * fp32  # 15.8 % here: 0.5 B codes + 4 B fp16 scale/zero per 32 numbers
    back = dequantize(i8)
    assert back.meta.codec == "raw" and back.meta.dtype == "float32" and i8.meta.codec == "int8-g32"
    assert all(k.shape == b.shape for k, b in zip(p.keys, back.keys, strict=True))


def test_keys_per_channel_beat_keys_per_token_on_outlier_channels():
    """Why keys are grouped per channel: a per-token group would share its scale with the outliers."""
    from kvrelay.kv.quant import dequantize_tensor, quantize_tensor

    k = random_payload(T=128, layers=1).keys[0]
    valid = torch.ones(1, 1, 128, 1, dtype=torch.bool)
    err = {axis: rms(dequantize_tensor(quantize_tensor(k, valid, 4, 32, axis), valid, 4, 32, axis,
                                       torch.float32) - k) for axis in ("token", "channel")}
    assert err["token"] < 0.7 * err["channel"]


@pytest.mark.parametrize("bits,group", [(8, 7), (4, 5), (4, 64), (8, 1)])
def test_quantize_odd_groups_and_error_bound(bits, group):
    p = random_payload(T=37, layers=2, D=10, seed=bits + group)
    q = quantize(p, bits, group)
    back = dequantize(q)
    for x, y, qt in zip(p.values, back.values, q.values, strict=True):
        # per-token value groups: |error| ≤ scale / 2 (+ fp16 rounding of scale and zero)
        step = qt.scale.float().repeat_interleave(group, dim=3)[..., :10]
        assert bool(((x - y).abs() <= step * 0.5 + 2e-3 * x.abs().amax() + 1e-6).all())


def test_padding_slots_stay_zero(tiny):
    sender = Agent(tiny, "sender")
    batch = pad_batch([sender.prefill(random_ids(n, 40 + n)) for n in (5, 30)])
    for name in ("int8", "int4", "fp16", "evict:0.5+int4"):
        out = codecs.apply(batch, name)
        for j, (k, v) in enumerate(zip(out.keys, out.values, strict=True)):
            pad = ~out.mask[:, -k.shape[2]:]  # (B, T_l)
            assert bool((k[pad[:, None, :, None].expand_as(k)] == 0).all()), (name, j)
            assert bool((v[pad[:, None, :, None].expand_as(v)] == 0).all()), (name, j)
        assert bool(torch.isfinite(out.keys[0]).all())


def test_quantized_padded_rows_close_to_rows_alone(tiny):
    sender = Agent(tiny, "sender")
    rows = [sender.prefill(random_ids(n, 50 + n)) for n in (6, 19)]
    back = dequantize(quantize(pad_batch(rows), 8, 32))
    for i, p in enumerate(rows):
        assert rel_rms(p, unpad_row(back, i)) <= 0.01


# -- eviction --------------------------------------------------------------------------------
def test_plan_keeps_sinks_recent_and_topk():
    p = random_payload(T=100, layers=2)
    scores = torch.zeros(2, 1, 2, 100)
    hot = [10, 20, 30, 40, 50, 60, 70, 80]
    scores[:, :, :, hot] = 1.0
    scores[0, 0, 1, 15] = 5.0  # head 1 of layer 0 prefers slot 15 over the rest
    plan, consensus = eviction_plan(p, scores, 0.1, sink=4, recent=8)  # rest = 88 -> keep 9
    want = [0, 1, 2, 3, *hot, *range(92, 100)]
    assert plan.shape == (2, 2, 4 + 9 + 8)
    assert set(want) <= set(plan[1, 0].tolist()) and 15 in plan[0, 0].tolist()  # layerwise: shared by heads
    head_plan, _ = eviction_plan(p, scores, 0.1, sink=4, recent=8, mode="headwise")
    assert 15 in head_plan[0, 1].tolist() and head_plan[0, 0].tolist() != head_plan[0, 1].tolist()
    assert set(want) <= set(consensus.tolist())
    out = evict(p, scores, 0.1, sink=4, recent=8)
    assert out.num_tokens == 21 and int(out.next_positions[0]) == 100  # cursor = original end
    assert torch.equal(out.positions[0], consensus) and torch.equal(out.keys[1][0, 0], p.keys[1][0, 0, plan[1, 0]])
    with pytest.raises(ValueError, match="recent >= 1"):
        evict(p, scores, 0.1, recent=0)
    with pytest.raises(ValueError, match="scores must be"):
        evict(p, scores[:, :, :, :50], 0.1)


def test_attention_scores_are_distributions_and_model_is_restored(tiny):
    p = Agent(tiny, "s").prefill(random_ids(30, 7))
    before = tiny.model.config._attn_implementation
    probe = attention_probe(tiny.model, p, random_ids(5, 8))
    assert tiny.model.config._attn_implementation == before
    s = probe.scores
    assert s.shape == (len(p.keys), 1, p.keys[0].shape[1], 30)
    assert torch.allclose(s.sum(-1), torch.ones_like(s.sum(-1)), atol=1e-5)
    for j, k in enumerate(p.keys):  # sliding layers: no mass on slots they never held
        assert float(s[j, ..., : 30 - k.shape[2]].abs().sum()) == 0.0


def test_keep_all_is_exact_relay(tiny):
    agent = Agent(tiny, "sender")
    p, new = agent.prefill(random_ids(40, 11)), random_ids(6, 12)
    probe = attention_probe(tiny.model, p)
    ref = logits_after(tiny, p, new)
    for mode in ("layerwise", "headwise", "shared"):
        out = evict(p, probe.scores, 1.0, mode=mode, obf=probe)
        assert (logits_after(tiny, out, new) - ref).abs().max().item() <= TOL, mode


def test_evicted_receiver_continues_at_original_position(tiny):
    sender, receiver = Agent(tiny, "sender"), Agent(tiny, "receiver", max_new_tokens=4)
    p = sender.prefill(random_ids(64, 13))
    probe = attention_probe(tiny.model, p)
    for name in ("evict:0.2", "evict-h:0.2", "evict-obf:0.2"):
        out = codecs.apply(p, name, probe=probe)
        assert out.num_tokens < p.num_tokens
        assert int(out.next_positions[0]) == 64 and int(out.positions[0, -1]) == 63
        assert torch.equal(out.positions[0, :4], torch.arange(4))  # sinks
        assert bool(torch.isfinite(logits_after(tiny, out, random_ids(5, 14))).all())
    r = receiver.respond("what is the code", out)  # the Agent accepts it (codec back to raw) and answers
    assert r.relayed_tokens == out.num_tokens and len(r.token_ids) > 0


def test_sliding_layers_keep_their_tail_gemma3(tiny_by_arch):
    lm = tiny_by_arch["gemma3"]  # window 8: sliding layers hold 7 slots
    p = Agent(lm, "sender").prefill(random_ids(50, 15))
    scores = attention_probe(lm.model, p).scores
    for mode in ("layerwise", "headwise"):
        out = evict(p, scores, 0.1, sink=4, recent=2, mode=mode)  # recent raised to window - 1 = 7
        assert out.num_tokens == 4 + 4 + 7  # round(0.1 × 39) = 4
        for j, lt in enumerate(p.meta.layer_types):
            if lt == "sliding_attention":
                assert torch.equal(out.keys[j], p.keys[j]) and torch.equal(out.values[j], p.values[j])
        assert torch.equal(out.positions[0, -7:], torch.arange(43, 50))
        assert bool(torch.isfinite(logits_after(lm, out, random_ids(4, 16))).all())


def test_padded_batch_evicts_each_row_alone(tiny):
    sender = Agent(tiny, "sender")
    rows = [sender.prefill(random_ids(n, 60 + n)) for n in (20, 45)]
    batch = pad_batch(rows)
    out = evict(batch, key_norm_scores(batch), 0.3, mode="headwise")
    for i, p in enumerate(rows):
        alone = evict(p, key_norm_scores(p), 0.3, mode="headwise")
        got = unpad_row(out, i)
        assert torch.equal(got.positions, alone.positions)
        assert all(torch.equal(a, b) for a, b in zip(got.keys, alone.keys, strict=True))


def test_obf_reduces_error_vs_plain_eviction(tiny):
    """Receiver logits after eviction vs after the full payload, with and without OBF.

    In-sample: the probe is the receiver's question (the hand-off knows it). Held-out: a different
    continuation the backfill never saw. Measured: OBF cuts the in-sample error 2-4x and the
    held-out error by 15-80 % on the three tiny models.
    """
    agent = Agent(tiny, "sender")
    p, question, other = agent.prefill(random_ids(96, 100)), random_ids(8, 200), random_ids(8, 300)
    probe = attention_probe(tiny.model, p, question)
    for mode in ("layerwise", "headwise"):
        plain = evict(p, probe.scores, 0.2, mode=mode)
        obf = evict(p, probe.scores, 0.2, mode=mode, obf=probe)
        assert all(torch.equal(a, b) for a, b in zip(plain.keys, obf.keys, strict=True))  # values only
        err = {}
        for tag, ids in (("in", question), ("out", other)):
            ref = logits_after(tiny, p, ids)
            err[tag] = (rms(logits_after(tiny, plain, ids) - ref), rms(logits_after(tiny, obf, ids) - ref))
        assert err["in"][1] < 0.7 * err["in"][0], err
        assert err["out"][1] < err["out"][0], err


def test_obf_needs_attention_rows():
    with pytest.raises(ValueError, match="attention rows"):
        codecs.compress(random_payload(T=40, layers=1), "evict-obf:0.2")


def test_key_norm_fallback_without_model():
    p = random_payload(T=100, layers=2)
    out = codecs.apply(p, "evict:0.2")
    assert out.num_tokens == 4 + 18 + 8 and int(out.next_positions[0]) == 100


# -- names, compositions, wire ---------------------------------------------------------------
@pytest.mark.parametrize("name,canonical", [
    ("raw", "raw"), ("fp16", "fp16"), ("int8", "int8-g32"), ("int4", "int4-g32"), ("int8-g64", "int8-g64"),
    ("evict:0.2", "evict:0.2"), ("evict-h:0.20", "evict-h:0.2"), ("evict-obf:0.2", "evict-obf:0.2"),
    ("layers:0-3,5", "layers:0-3,5"), ("layers:0,1,2", "layers:0-2"), ("evict:0.2+int8", "evict:0.2+int8-g32"),
    ("layers:0-1+evict-h:0.5+raw", "layers:0-1+evict-h:0.5"),
])
def test_names_parse_to_canonical(name, canonical):
    assert codecs.parse(name).name == canonical
    assert codecs.parse(canonical).name == canonical


@pytest.mark.parametrize("bad", ["int3", "zip", "", "evict:2", "evict:x", "int8+evict:0.2", "fp16+int8",
                                 "layers:3-1", "evict:0.2+evict:0.3", "int8-g0"])
def test_unknown_names_list_available(bad):
    with pytest.raises(ValueError, match="available: raw, fp16"):
        codecs.parse(bad)


def test_available_codecs_all_parse_and_work():
    """Every advertised name form parses to a codec whose canonical name parses back to itself and which
    compresses and restores a payload of the same geometry (the lossless one bit-exactly)."""
    examples = {"F": "0.2", "G": "64", "SPEC": "0-1"}
    p = random_payload(T=40, layers=4, D=64)
    for form in codecs.available_codecs()[:-1]:
        name = form
        for k, v in examples.items():
            name = name.replace(f"-g{k}", f"-g{v}").replace(f":{k}", f":{v}")
        c = codecs.parse(name)
        assert codecs.parse(c.name) == c, name
        try:
            comp = c.compress(p)
        except ValueError as e:  # attention-scored eviction needs the model: it says so
            assert "needs attention rows" in str(e), name
            continue
        back = c.decompress(comp)
        assert back.batch_size == p.batch_size and back.keys[0].shape[1:2] == p.keys[0].shape[1:2], name
        if c.lossless:
            assert all(torch.equal(a, b) for a, b in zip(back.keys, p.keys, strict=True)), name
    assert codecs.parse("int8").name == "int8-g32" and codecs.parse("raw").lossless


def test_float_codecs_restore_dtype():
    p = random_payload(T=64, layers=2)
    for name, tol in (("fp16", 1e-3), ("bf16", 8e-3), ("raw", 0.0)):
        out = codecs.apply(p, name)
        assert out.keys[0].dtype == torch.float32 and out.meta.dtype == "float32" and out.meta.codec == "raw"
        assert rel_rms(p, out) <= tol


def test_layer_subset_is_incomplete():
    p = random_payload(T=32, layers=4)
    out = codecs.apply(p, "layers:1-2")
    assert out.meta.layer_indices == (1, 2) and not out.meta.complete
    assert torch.equal(out.keys[0], p.keys[1])
    with pytest.raises(ValueError, match="not held"):
        codecs.compress(p, "layers:3-5")


@pytest.mark.parametrize("name", ["int4-g16", "bf16", "layers:0,2+evict-h:0.5+int8"])
def test_wire_round_trip(tiny, name):
    p = Agent(tiny, "sender").prefill(random_ids(33, 17))
    c = codecs.compress(p, name, model=tiny.model)
    data = wire.pack(*c.to_wire())
    back = codecs.Compressed.from_wire(*wire.unpack(data))
    assert back.name == c.name and back.raw_nbytes == c.raw_nbytes and back.nbytes == c.nbytes
    assert len(data) == c.wire_nbytes() > c.nbytes
    a, b = c.decompress(), back.decompress()
    assert all(torch.equal(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True))
    assert b.meta == a.meta and b.meta.codec == "raw"


def test_compression_ratios(capsys):
    """Ratios on a 256-token, 8-layer, 2 × 64 payload (fp32 K/V = 2 MiB); printed as a table."""
    p = random_payload()
    rows = []
    for name in ("raw", "fp16", "int8", "int4", "evict:0.2", "evict:0.2+int8", "evict:0.2+int4", "layers:0-3+int8"):
        c = codecs.compress(p, name)
        rows.append((c.name, c.nbytes, c.compression_ratio, rel_rms(p, c.decompress()) if c.name in
                     ("raw", "fp16", "int8-g32", "int4-g32") else float("nan")))
    ratio = {n: r for n, _, r, _ in rows}
    assert ratio["raw"] == 1.0 and 1.95 < ratio["fp16"] <= 2.0
    assert ratio["int8-g32"] >= 1 / 0.30 and ratio["int4-g32"] >= 1 / 0.16
    assert ratio["evict:0.2+int8-g32"] > ratio["evict:0.2"] > 4 and ratio["evict:0.2+int8-g32"] > ratio["int8-g32"]
    with capsys.disabled():
        print("\ncodec                   bytes     ratio  rel_rms")
        for n, b, r, e in rows:
            print(f"{n:22s} {b:8d} {r:8.2f}  {e:.4f}")
