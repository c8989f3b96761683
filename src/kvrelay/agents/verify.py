"""Verification: recompute part of a relayed cache from its own token ids and compare, before attending to it.

Checksums and signatures prove who wrote the bytes; they cannot prove the bytes are a cache of the
tokens they claim (a producer with the key, or a bug, can write anything). The payload carries its
token ids and positions, so a receiver on the same model can recompute any part of it:

1. **Invariants**: every K/V value finite (NaN/Inf refused).
2. **Layer 0 at every position**, almost free: layer 0's K/V depend only on each token and its
   position (embedding -> input norm -> k/v projections -> RoPE on keys), no attention, so all T
   positions are recomputed with two projections of one layer. Relabelled or reordered token ids,
   shifted positions, another text's cache, other weights and noise on layer 0 all show here.
3. **A spot check of k random positions through every layer**: the chosen tokens go through the
   decoder's public forward once, at their own positions, over the relayed cache
   (``fuse.recompute.chosen_kv``: each attends to the relayed K/V before it); their fresh K/V are
   compared with the stored ones in every layer. Tampering at a chosen position shows in every
   layer; tampering elsewhere before it shows through attention in the layers above the first.
   The positions are drawn fresh for each check (``secrets``) unless a seed is given, so a forger
   cannot know which ones will be looked at.

``full=True`` re-prefills every token instead (cost 1.0). The error measure is, per layer and
position, ``|fresh - stored| / |stored|`` over (H_kv, D), for keys and values; a payload is
``tampered`` when the largest exceeds ``tolerance(engine, dtype, codec)``, a bound set by how the
producer made and shipped it (``TOLERANCES``). ``cost_fraction`` counts the linear-layer
multiply-adds run, over those of a full re-prefill of the same tokens (attention scores are left
out of both).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from kvrelay.core.errors import IncompatiblePayload, TamperedPayload
from kvrelay.core.modes import split_mode
from kvrelay.fuse.recompute import check_recomputable, chosen_kv, prefill_kv
from kvrelay.kv.payload import KVPayload

VERDICTS = ("ok", "tampered", "refused")
# Relative K/V error a genuine payload stays under, by how it was shipped (the dtype it holds, then
# the codec's encoding). fp32 recompute differs from the producer's forward by kernel order only
# (batch shapes differ); storage in 16 bits and int8/int4 codecs add their rounding, which also
# reaches the spot-checked tokens through the context they attend to. Norm-matched noise has a
# relative error near sqrt(2): int4's own rounding leaves the thinnest margin.
# Calibrated on qwen2.5-coder-0.5b (genuine payloads of real text): the largest errors seen were ~0.004
# through fp16, ~0.043 through bf16, ~0.034 through int8 and ~0.51 through int4; each bound is >= 1.7x that.
TOLERANCES = {"float32": 0.01, "float16": 0.02, "bfloat16": 0.12, "int8": 0.12, "int4": 0.9}
# A mode's prefill precision (``core.modes``) sets a floor: a bf16 prefill's payload and the receiver's
# recompute of it run bf16 GEMMs over different batch shapes, whose roundings differ like bf16 storage.
# The decode precision never touches a payload (payloads are written by prefills). Measured on
# qwen2.5-coder-0.5b: a raw bf16-prefill payload shows ~0.020 (twice the fp32 bound), through int8 ~0.037
# (benchmarks/verify_prefill_tolerance.py, docs/bench/verify_prefill_tolerance.json).
PREFILL_TOLERANCE = {"fp32": 0.0, "bf16": TOLERANCES["bfloat16"]}


def tolerance(engine: str, dtype: str, codec: str = "raw") -> float:
    """The largest relative K/V error a genuine payload of this engine mode, dtype and codec shows.

    ``codec``: the codec the payload travelled under (``kv.codecs`` names); its encoding decides
    (``raw``/``fp16``/``bf16``: the 16-bit rounding of that dtype; ``int8-gG``/``int4-gG``: theirs).
    ``engine``: the producer's mode (``core.modes`` names); only its prefill precision matters
    (``PREFILL_TOLERANCE``); a name that is not a mode is refused."""
    prefill = split_mode(engine)[0]  # ValueError names the expected form
    if dtype not in TOLERANCES or dtype in ("int8", "int4"):
        raise ValueError(f"unknown payload dtype {dtype!r}; expected float32, float16 or bfloat16")
    from kvrelay.kv.codecs import parse

    enc = parse(codec).encoding.name.split("-")[0]  # raw | fp16 | bf16 | int8 | int4
    shipped = {"raw": dtype, "fp16": "float16", "bf16": "bfloat16"}.get(enc, enc)
    return max(TOLERANCES[dtype], TOLERANCES[shipped], PREFILL_TOLERANCE[prefill])


@dataclass(frozen=True, slots=True)
class VerifySpec:
    """How a receiver verifies: ``k`` spot-checked positions (>= 2: a one-token forward would take an
    engine's decode kernels), or ``full`` re-prefill; ``seed`` fixes the positions (tests, benchmarks)."""

    k: int = 32
    full: bool = False
    seed: int | None = None
    codec: str = "raw"  # the codec payloads reach this receiver under (sets the tolerance)

    def __post_init__(self):
        if type(self.k) is not int or self.k < 2:
            raise ValueError(f"verify k must be an int >= 2, got {self.k!r}")
        if self.seed is not None and (type(self.seed) is not int or self.seed < 0):
            raise ValueError(f"verify seed must be None or an int >= 0, got {self.seed!r}")
        from kvrelay.kv.codecs import parse

        parse(self.codec)  # ValueError listing the codec forms


@dataclass(frozen=True, slots=True)
class Verdict:
    verdict: str  # ok | tampered | refused
    reason: str
    checked_positions: tuple[int, ...]  # slots recomputed in every layer (layer 0 covers all of them)
    cost_fraction: float  # linear-layer multiply-adds run / those of a full re-prefill
    detected_by: str = ""  # invariants | layer0 | spot-check | full | "" (ok) | the refusal's error type
    max_error: float = 0.0  # the largest relative K/V error seen
    tolerance: float = 0.0
    layer: int | None = None  # where the largest error was (held-layer index)
    position: int | None = None

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "reason": self.reason, "checked_positions": list(self.checked_positions),
                "cost_fraction": self.cost_fraction, "detected_by": self.detected_by,
                "max_error": self.max_error, "tolerance": self.tolerance, "layer": self.layer,
                "position": self.position}


def _layer_macs(config) -> tuple[float, float]:
    """(multiply-adds of one decoder layer per token, of its k/v projections alone)."""
    h = config.hidden_size
    nq = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nq
    d = getattr(config, "head_dim", None) or h // nq
    kv = 2 * h * nkv * d
    return h * nq * d * 2 + kv + 3 * h * config.intermediate_size, kv


def layer0_kv(model, p: KVPayload) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's (keys, values) (1, H_kv, T, D) for ``p``'s tokens at its positions: embedding, input
    norm, k/v projections (and k norm where the model has one), RoPE on the keys. No attention."""
    from transformers.models.llama.modeling_llama import rotate_half

    dec = model.get_decoder()
    layer, T = dec.layers[0], p.num_tokens
    attn = layer.self_attn
    D = p.keys[0].shape[-1]
    h = model.get_input_embeddings()(p.token_ids)  # (1, T, H)
    x = layer.input_layernorm(h)
    k = attn.k_proj(x).view(1, T, -1, D)  # (1, T, H_kv, D)
    if getattr(attn, "k_norm", None) is not None:
        k = attn.k_norm(k)
    k = k.transpose(1, 2)  # (1, H_kv, T, D)
    v = attn.v_proj(x).view(1, T, -1, D).transpose(1, 2)  # (1, H_kv, T, D)
    cos, sin = dec.rotary_emb(h, p.positions)  # (1, T, D)
    k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    return k, v


def _rel(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per position relative error, (q,): inputs (1, H_kv, q, D)."""
    new, old = new.float(), old.float()
    return ((new - old) ** 2).sum(dim=(0, 1, 3)).sqrt() / (old ** 2).sum(dim=(0, 1, 3)).sqrt().clamp_min(1e-6)


def _worst(errs: list[torch.Tensor], slots: list[torch.Tensor]) -> tuple[float, int, int]:
    """(largest error, held layer, slot) over per-layer errors ``errs[l]`` (q,) at ``slots[l]`` (q,)."""
    best = (0.0, 0, 0)
    for layer, (e, s) in enumerate(zip(errs, slots, strict=True)):
        if e.numel():
            i = int(e.argmax())
            if float(e[i]) > best[0] or math.isnan(float(e[i])):
                best = (float(e[i]), layer, int(s[i]))
    return best


def _pick(T: int, spec: VerifySpec) -> torch.Tensor:
    k = min(spec.k, T)
    g = torch.Generator().manual_seed(spec.seed if spec.seed is not None else secrets.randbits(63))
    return torch.randperm(T, generator=g)[:k].sort().values  # (k,)


@torch.inference_mode()
def verify_payload(model, p: KVPayload, spec: VerifySpec = VerifySpec(), *, codec: str | None = None) -> Verdict:
    """Check ``p`` (decoded, codec raw, for ``model``'s weights) against ``model``'s own recompute.

    ``codec``: the codec it travelled under (sets the tolerance with its engine and dtype; default
    ``spec.codec``). A payload
    that cannot be recomputed (padded, a batch, sliding-window layers, not every layer, positions
    that are not consecutive) is ``refused``, never ``ok``."""
    try:
        check_recomputable(model, p)
    except (ValueError, IncompatiblePayload) as e:
        return Verdict("refused", f"cannot recompute this payload: {e}", (), 0.0, type(e).__name__)
    tol = tolerance(p.meta.engine, p.meta.dtype, spec.codec if codec is None else codec)
    for name, ts in (("keys", p.keys), ("values", p.values)):
        for layer, t in enumerate(ts):
            if not bool(torch.isfinite(t).all()):
                return Verdict("tampered", f"layer {layer} {name} hold NaN or Inf", (), 0.0, "invariants",
                               math.inf, tol, layer)
    L, T = len(p.keys), p.num_tokens
    macs, kv_macs = _layer_macs(model.config)
    if spec.full:
        fresh = prefill_kv(model, p, L)
        slots = [torch.arange(T)] * L
        errs = [torch.maximum(_rel(k, p.keys[i]), _rel(v, p.values[i])) for i, (k, v) in enumerate(fresh)]
        err, layer, pos = _worst(errs, slots)
        return _verdict(err, tol, layer, pos, tuple(range(T)), 1.0, "full")
    k0, v0 = layer0_kv(model, p)
    e0 = torch.maximum(_rel(k0, p.keys[0]), _rel(v0, p.values[0]))  # (T,)
    cost0 = T * kv_macs
    err, layer, pos = _worst([e0], [torch.arange(T)])
    if not err <= tol:
        return _verdict(err, tol, 0, pos, (), round(cost0 / (T * L * macs), 6), "layer0")
    pick = _pick(T, spec)
    fresh = chosen_kv(model, p, pick)
    errs = [torch.maximum(_rel(k, p.keys[i][:, :, pick]), _rel(v, p.values[i][:, :, pick]))
            for i, (k, v) in enumerate(fresh)]
    err, layer, pos = _worst(errs, [pick] * L)
    cost = round((cost0 + len(pick) * L * macs) / (T * L * macs), 6)
    return _verdict(max(err, 0.0), tol, layer, pos, tuple(int(x) for x in pick), cost, "spot-check")


def _verdict(err: float, tol: float, layer: int, pos: int, checked: tuple[int, ...], cost: float,
             by: str) -> Verdict:
    if err <= tol:
        return Verdict("ok", f"largest relative K/V error {err:.2e} is within the tolerance {tol:g}", checked, cost, "",
                       err, tol, layer, pos)
    return Verdict("tampered", f"layer {layer} position {pos}: relative K/V error {err:.3g} exceeds the tolerance "
                   f"{tol:g} (the cache is not what this model computes for its tokens)", checked, cost, by, err, tol,
                   layer, pos)


def require_verified(model, p: KVPayload, spec: VerifySpec) -> Verdict:
    """``verify_payload``, raising ``TamperedPayload`` (naming the producer) unless the verdict is ok."""
    v = verify_payload(model, p, spec)
    if v.verdict != "ok":
        raise TamperedPayload(p.meta.producer, v.verdict, v.reason)
    return v


def verify_bytes(lm, data, spec: VerifySpec = VerifySpec(), *, keys=None) -> Verdict:
    """Verify kvrelay/1 bytes (a file's or a store's) for the loaded model ``lm``: decoded with every
    check the receive path makes (checksums, ``keys``' signatures, compatibility), then
    ``verify_payload`` under the codec the bytes name. A payload those checks refuse is ``refused``
    with the error's type in ``detected_by``."""
    from kvrelay.core.errors import PayloadError
    from kvrelay.kv.wire import read_meta
    from kvrelay.transport.payloads import decode_bytes

    try:
        codec = read_meta(data).get("codec", "raw")
        p = decode_bytes(data, expect=lm.identity, keys=keys)
        from kvrelay.agents.receive import check_geometry
        from kvrelay.kv.compat import check_meta

        check_meta(p.meta, lm.identity, complete=True)
        check_geometry(p, lm.identity)
    except PayloadError as e:
        return Verdict("refused", str(e), (), 0.0, type(e).__name__)
    return verify_payload(lm.model, p, spec, codec=codec)
