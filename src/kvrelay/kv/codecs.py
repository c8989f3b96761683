"""Codecs by name: what a payload becomes on the wire, and back.

A codec name is a ``+``-joined chain of stages, applied left to right::

    [layers:SPEC +] [evict…:F +] [raw | fp16 | bf16 | int8 | int4 | int8-gG | int4-gG]

* ``layers:0-11`` / ``layers:0,2,5-7`` — keep a subset of layers (``select_layers``). The
  receiver gets an incomplete payload (``meta.complete`` False): it must recompute or fill the
  missing layers, ``to_cache`` refuses it as is.
* ``evict:F`` (layerwise), ``evict-h:F`` (headwise), ``evict-s:F`` (one token set for all layers),
  ``evict-obf:F`` / ``evict-h-obf:F`` (with Orthogonal BackFill of evicted values) — keep the
  sinks, the recent tail and the top ``F`` of the other tokens by attention score (``kv.evict``).
* the last stage is the representation: ``raw`` (as is), ``fp16`` / ``bf16`` (cast; the
  receiver casts back to the producer's dtype), ``int8`` / ``int4`` (``kv.quant``, group 32;
  ``int8-g64`` sets the group). Omitted = ``raw``.

Eviction needs scores. ``compress(p, model=..., probe_ids=...)`` measures them with the model
(``evict.attention_probe``: the probe tokens — the receiver's question when known, else the
payload's own tail re-read); ``scores=`` (L, B, H_kv, T) or ``probe=`` (an ``AttentionProbe``)
pass them in, aligned with the payload as given (a ``layers:`` stage subsets them; the model is
run on the complete payload before any stage). With none of those, eviction falls back to
model-free key-norm scores (``evict.key_norm_scores``) — cheaper and worse on real models; OBF
has no fallback (it needs attention rows). Scores measured on the tiny random models are only a
little better than key norms; on them the gain of OBF is the large one.

``Compressed`` holds exactly the tensors that travel; ``nbytes`` counts their bytes (the
kvrelay/1 header, a few KB, is on top: ``wire_nbytes`` packs it for real);
``compression_ratio`` = the input payload's bytes with K/V as fp32 ÷ ``nbytes``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv.evict import EVICTION_MODES, AttentionProbe, attention_probe, evict, key_norm_scores
from kvrelay.kv.layout import tensor_name
from kvrelay.kv.payload import DTYPES, KVPayload, PayloadMeta, payload_tensors
from kvrelay.kv.quant import QuantizedPayload, dequantize, quantize
from kvrelay.kv.transforms import select_layers, to_dtype

DEFAULT_GROUP = 32
# What a payload leaving its process is sent as unless the caller names a codec: half the bytes of
# fp32 and, measured, the same greedy answers (docs/codecs.md, "The default on the wire"). Library
# calls (``compress``, ``put_payload``) take the codec they are given and default to lossless ``raw``.
WIRE_CODEC = "fp16"
_FLOATS = {"raw": None, "fp16": torch.float16, "bf16": torch.bfloat16}
_EVICT = {"evict": ("layerwise", False), "evict-h": ("headwise", False), "evict-s": ("shared", False),
          "evict-obf": ("layerwise", True), "evict-h-obf": ("headwise", True), "evict-s-obf": ("shared", True)}
_INT = re.compile(r"^int(4|8)(?:-g(\d+))?$")


def available_codecs() -> list[str]:
    """Every accepted name form (``F`` a fraction in [0, 1], ``G`` a group size, ``SPEC`` layers)."""
    return ["raw", "fp16", "bf16", "int8", "int4", "int8-gG", "int4-gG",
            *(f"{k}:F" for k in _EVICT), "layers:SPEC", "STAGE+STAGE (e.g. evict:0.2+int8, layers:0-11+fp16)"]


def _unknown(name: str, why: str) -> ValueError:
    return ValueError(f"unknown codec {name!r} ({why}); available: {', '.join(available_codecs())}")


# -- stages ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Layers:
    layers: tuple[int, ...]

    @property
    def name(self) -> str:
        runs, start = [], None
        for i, li in enumerate(self.layers):
            start = li if start is None else start
            if i + 1 == len(self.layers) or self.layers[i + 1] != li + 1:
                runs.append(f"{start}" if start == li else f"{start}-{li}")
                start = None
        return "layers:" + ",".join(runs)


@dataclass(frozen=True, slots=True)
class Evict:
    keep: float
    mode: str  # one of evict.EVICTION_MODES
    obf: bool

    @property
    def name(self) -> str:
        kind = next(k for k, v in _EVICT.items() if v == (self.mode, self.obf))
        return f"{kind}:{self.keep:g}"


@dataclass(frozen=True, slots=True)
class Encoding:
    """The last stage: a float cast (``bits`` None) or int quantization."""

    kind: str  # raw | fp16 | bf16 | int
    bits: int | None = None
    group_size: int = DEFAULT_GROUP

    @property
    def name(self) -> str:
        return f"int{self.bits}-g{self.group_size}" if self.kind == "int" else self.kind

    def float_dtype(self, payload_dtype: str) -> torch.dtype:
        """The dtype K/V travel in under a float encoding (``raw``: the payload's own ``payload_dtype``)."""
        if self.kind == "int":
            raise ValueError(f"{self.name} stores int codes, not float K/V")
        return _FLOATS[self.kind] or DTYPES[payload_dtype]


def _parse_layers(name: str, spec: str) -> Layers:
    out: list[int] = []
    try:
        for part in spec.split(","):
            a, _, b = part.partition("-")
            out.extend(range(int(a), int(b) + 1) if b else [int(a)])
    except ValueError:
        raise _unknown(name, f"bad layer spec {spec!r}") from None
    if not out or len(set(out)) != len(out) or out != sorted(out) or out[0] < 0:
        raise _unknown(name, f"layer spec {spec!r} must list increasing, distinct, non-negative layers")
    return Layers(tuple(out))


def _parse_stage(name: str, s: str):
    if s in _FLOATS:
        return Encoding(s)
    if m := _INT.match(s):
        g = int(m.group(2) or DEFAULT_GROUP)
        if g < 1:
            raise _unknown(name, "group size must be >= 1")
        return Encoding("int", int(m.group(1)), g)
    kind, sep, arg = s.partition(":")
    if sep and kind == "layers":
        return _parse_layers(name, arg)
    if sep and kind in _EVICT:
        try:
            keep = float(arg)
        except ValueError:
            raise _unknown(name, f"keep fraction {arg!r} is not a number") from None
        if not 0.0 <= keep <= 1.0:
            raise _unknown(name, f"keep fraction {keep} is not in [0, 1]")
        return Evict(keep, *_EVICT[kind])
    raise _unknown(name, f"no stage called {s!r}")


@dataclass(frozen=True, slots=True)
class Codec:
    """A parsed codec name: pre-stages (layer subset, eviction) then one encoding."""

    stages: tuple[Layers | Evict, ...]
    encoding: Encoding

    @property
    def name(self) -> str:
        """Canonical name (defaults spelled out: ``int8`` -> ``int8-g32``; ``raw`` dropped after stages)."""
        parts = [s.name for s in self.stages]
        if self.encoding.kind != "raw" or not parts:
            parts.append(self.encoding.name)
        return "+".join(parts)

    @property
    def lossless(self) -> bool:
        return not self.stages and self.encoding.kind == "raw"

    @property
    def keeps_tokens(self) -> bool:
        """True when the output holds every token of the input (no eviction stage)."""
        return not any(isinstance(s, Evict) for s in self.stages)

    def compress(self, p: KVPayload, **ctx) -> Compressed:
        return compress(p, self, **ctx)

    def decompress(self, c: Compressed) -> KVPayload:
        if c.codec.name != self.name:
            raise ValueError(f"{c.codec.name!r} payload given to codec {self.name!r}")
        return decompress(c)


def parse(name: str) -> Codec:
    """``Codec`` for a name; ``ValueError`` listing the available forms when it is not one."""
    if not isinstance(name, str) or not name.strip():
        raise _unknown(str(name), "empty name")
    parts = [s.strip() for s in name.split("+")]
    stages = [_parse_stage(name, s) for s in parts]
    enc = [s for s in stages if isinstance(s, Encoding)]
    if len(enc) > 1 or (enc and stages[-1] is not enc[0]):
        raise _unknown(name, "one encoding (raw/fp16/bf16/intN) at most, and it must come last")
    if sum(isinstance(s, Evict) for s in stages) > 1:
        raise _unknown(name, "at most one eviction stage")
    pre = tuple(s for s in stages if not isinstance(s, Encoding))
    return Codec(pre, enc[0] if enc else Encoding("raw"))


# -- the compressed object -------------------------------------------------------------------
def _fp32_nbytes(p: KVPayload) -> int:
    kv = sum(t.numel() * 4 for t in (*p.keys, *p.values))
    return kv + sum(t.numel() * t.element_size() for t in (p.token_ids, p.positions, p.mask))


@dataclass(frozen=True, eq=False)
class Compressed:
    """What travels: ``tensors`` + ``meta`` (``meta.codec`` = canonical codec name; ``meta.dtype`` =
    the float dtype ``decompress`` restores). ``raw_nbytes``: the input payload's bytes as fp32."""

    codec: Codec
    tensors: dict[str, torch.Tensor] = field(repr=False)
    meta: PayloadMeta
    raw_nbytes: int

    @property
    def name(self) -> str:
        return self.codec.name

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor that travels (codes, scales, token ids, positions, mask)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def compression_ratio(self) -> float:
        return self.raw_nbytes / self.nbytes

    def to_wire(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        meta = {**self.meta.to_strings(), RAW_NBYTES_FIELD: str(self.raw_nbytes)}
        return {k: t.contiguous() for k, t in self.tensors.items()}, meta

    @classmethod
    def from_wire(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Compressed:
        """The inverse of ``to_wire``. Metadata faults are ``CorruptPayload``; the tensors' layout is
        the caller's to check (``kv.wire.decode_compressed`` checks it before reading them)."""
        known = PayloadMeta.__dataclass_fields__
        pm = PayloadMeta.from_strings({k: v for k, v in meta.items() if k in known})
        return cls(codec_of(pm), dict(tensors), pm, raw_nbytes_of(meta))

    def wire_nbytes(self) -> int:
        """Exact size of the kvrelay/1 bytes (packs them: checksums every tensor)."""
        from kvrelay.kv.wire import pack

        return len(pack(*self.to_wire()))

    def decompress(self) -> KVPayload:
        return decompress(self)


RAW_NBYTES_FIELD = "codec_raw_nbytes"  # the metadata field ``to_wire`` records ``raw_nbytes`` in


def raw_nbytes_of(meta: Mapping[str, str]) -> int:
    """``codec_raw_nbytes`` of wire metadata (0 when absent); anything but a decimal int >= 0 is corrupt."""
    s = meta.get(RAW_NBYTES_FIELD, "0")
    if not isinstance(s, str) or not s.isascii() or not s.isdigit() or len(s) > 20:
        raise CorruptPayload(f"metadata field {RAW_NBYTES_FIELD!r}: expected a decimal int >= 0, got {s!r}")
    return int(s)


def codec_of(meta: PayloadMeta) -> Codec:
    """The codec ``meta.codec`` names, which must be a canonical name (what ``compress`` writes)."""
    try:
        c = parse(meta.codec)
    except ValueError as e:
        raise CorruptPayload(f"metadata field 'codec': {e}") from None
    if c.name != meta.codec:
        raise CorruptPayload(f"metadata field 'codec': {meta.codec!r} is not written that way; expected {c.name!r}")
    return c


# -- compress / decompress -------------------------------------------------------------------
def _scores_for(p: KVPayload, st: Evict, ctx: dict) -> tuple[torch.Tensor, AttentionProbe | None]:
    probe = ctx.get("probe")
    if st.obf and probe is None:
        raise ValueError(f"{st.name} needs attention rows: pass model= (and probe_ids=) or probe=")
    scores = ctx.get("scores")
    if scores is None:
        scores = probe.scores if probe is not None else key_norm_scores(p)
    return scores, probe


def _subset(x, idx: list[int]):
    if x is None:
        return None
    if isinstance(x, AttentionProbe):
        return replace(x, probs=tuple(x.probs[j] for j in idx))
    return x[idx]


def _encode(p: KVPayload, enc: Encoding) -> tuple[dict[str, torch.Tensor], PayloadMeta]:
    if enc.kind == "int":
        q = quantize(p, enc.bits, enc.group_size)
        return q.tensors(), q.meta
    cast = to_dtype(p, _FLOATS[enc.kind]) if _FLOATS[enc.kind] is not None else p
    return payload_tensors(cast), p.meta


def compress(p: KVPayload, codec: str | Codec, **ctx) -> Compressed:
    """Run the stages of ``codec`` on ``p``. ctx: ``model``, ``probe_ids``, ``n_probe``, ``scores``,
    ``probe`` (eviction scores, see the module docstring); ``sink`` (4), ``recent`` (8),
    ``obf_rank`` (8) (eviction knobs)."""
    c = parse(codec) if isinstance(codec, str) else codec
    raw = _fp32_nbytes(p)
    ev = next((st for st in c.stages if isinstance(st, Evict)), None)
    if ev is not None and ctx.get("probe") is None and ctx.get("model") is not None and (
            ctx.get("scores") is None or ev.obf):
        # Measured on the payload as given (complete), before any layer subset drops layers the model needs.
        ctx = {**ctx, "probe": attention_probe(ctx["model"], p, ctx.get("probe_ids"), n_probe=ctx.get("n_probe", 8))}
    for st in c.stages:
        if isinstance(st, Layers):
            held = {li: j for j, li in enumerate(p.meta.layer_indices)}
            idx = [held[li] for li in st.layers if li in held]
            p = select_layers(p, st.layers)  # raises naming layers it does not hold
            ctx = {**ctx, "scores": _subset(ctx.get("scores"), idx), "probe": _subset(ctx.get("probe"), idx)}
        else:
            scores, probe = _scores_for(p, st, ctx)
            p = evict(p, scores, st.keep, sink=ctx.get("sink", 4), recent=ctx.get("recent", 8), mode=st.mode,
                      obf=probe if st.obf else None, obf_rank=ctx.get("obf_rank", 8))
    tensors, meta = _encode(p, c.encoding)
    return Compressed(c, tensors, replace(meta, codec=c.name), raw)


def decompress(c: Compressed) -> KVPayload:
    """A float payload in ``c.meta.dtype`` with codec ``raw`` (lossy stages are not undone)."""
    enc, meta = c.codec.encoding, c.meta
    if meta.codec != c.codec.name:
        raise ValueError(f"meta names codec {meta.codec!r}, object holds {c.codec.name!r}")
    if enc.kind == "int":
        return dequantize(QuantizedPayload.from_tensors(c.tensors, replace(meta, codec=enc.name), enc.bits,
                                                        enc.group_size))
    dt = DTYPES[meta.dtype]
    try:
        n = len(meta.layer_indices)
        keys = tuple(c.tensors[tensor_name(i, "k")].to(dt) for i in range(n))
        values = tuple(c.tensors[tensor_name(i, "v")].to(dt) for i in range(n))
        t = c.tensors
        return KVPayload(keys, values, t["token_ids"], t["positions"], t["mask"], replace(meta, codec="raw"))
    except KeyError as e:
        raise ValueError(f"compressed payload lacks tensor {e.args[0]!r}") from None


def apply(p: KVPayload, name: str, **ctx) -> KVPayload:
    """``decompress(compress(p, name))``: what a receiver gets after codec ``name`` (the audit's
    ``kv_codec:NAME`` arm). Same layout conventions as ``p``; fewer tokens after eviction, fewer
    layers after ``layers:``."""
    return decompress(compress(p, name, **ctx))


__all__ = ["EVICTION_MODES", "Codec", "Compressed", "apply", "available_codecs", "codec_of", "compress", "decompress", "parse",
           "raw_nbytes_of"]
