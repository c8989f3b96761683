"""``KVPayload``: one relayed context, exactly as the producer's attention cached it.

Tensor layout (stated once, repeated at each reshape in this package):

    keys[l], values[l]   (B, H_kv, T_l, D)   post-RoPE K/V of held layer l
    token_ids            (B, T)              int64, the tokens the cache encodes
    positions            (B, T)              int64, absolute RoPE positions of those tokens
    mask                 (B, T)              bool, True = real token, False = left padding

``T_l == T`` on full-attention layers. Sliding-window layers keep only the tail of the sequence
(transformers keeps ``window - 1`` tokens there), so ``T_l = min(T, window - 1)`` and layer ``l``
covers the slots ``T - T_l .. T - 1``; every transform in ``kv.transforms`` respects that.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

import torch

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv.layout import LAYER_TYPES, held_tokens, tensor_name
from kvrelay.models.identity import ModelIdentity, RopeSpec, rope_for

FORMAT = "kvrelay/1"
# Positions of real tokens lie in [0, MAX_POSITION]: far past any model's context, and small enough that
# the next position (+1), the RoPE phases and every int32 index a kernel uses stay exact.
MAX_POSITION = 2**31 - 2
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported payload dtype {dtype}; expected one of {sorted(DTYPES)}")


RAW = "raw"  # the codec of a decoded (float) payload, whose tensors can be read as they are

STRING_FIELDS = ("model_fingerprint", "tokenizer_hash", "arch", "dtype", "codec", "producer", "format", "adapter", "engine")
OPTIONAL_FIELDS = ("adapter", "engine")  # fields a kvrelay/1 writer may omit (added after the format was first published)


@dataclass(frozen=True, slots=True)
class PayloadMeta:
    """Everything a receiver needs to prove a payload compatible and use it position-exactly."""

    model_fingerprint: str
    tokenizer_hash: str
    arch: str
    num_model_layers: int
    layer_indices: tuple[int, ...]  # which model layers are held, in order
    layer_types: tuple[str, ...]  # per held layer
    sliding_window: int | None
    rope: tuple[RopeSpec, ...]  # one per distinct layer type
    dtype: str = "float32"
    codec: str = RAW
    producer: str = ""
    round: int = 0
    created_at: float = field(default_factory=time.time)
    format: str = FORMAT
    adapter: str = ""  # "" = made by model_fingerprint itself; else "NAME@FINGERPRINT" of the adapter that mapped it
    engine: str = "fp32"  # the producer's engine mode (``models.engine``); absent on the wire = fp32

    def __post_init__(self):
        if len(self.layer_indices) != len(self.layer_types):
            raise ValueError(
                f"layer_indices ({len(self.layer_indices)}) and layer_types ({len(self.layer_types)}) differ in length"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if any(not 0 <= i < self.num_model_layers for i in self.layer_indices):
            raise ValueError(f"layer_indices {self.layer_indices} out of range for {self.num_model_layers} layers")

    @classmethod
    def from_identity(cls, ident: ModelIdentity, **kw) -> PayloadMeta:
        return cls(
            model_fingerprint=ident.fingerprint,
            tokenizer_hash=ident.tokenizer_hash,
            arch=ident.arch,
            num_model_layers=ident.num_layers,
            layer_indices=tuple(range(ident.num_layers)),
            layer_types=ident.layer_types,
            sliding_window=ident.sliding_window,
            rope=ident.rope,
            engine=ident.engine,
            **kw,
        )

    @property
    def complete(self) -> bool:
        """True when every model layer is held (a receiver can use it directly)."""
        return self.layer_indices == tuple(range(self.num_model_layers))

    def rope_for(self, layer_type: str) -> RopeSpec:
        return rope_for(self.rope, layer_type)

    def to_strings(self) -> dict[str, str]:
        """Flat ``str -> str`` form (safetensors ``__metadata__``)."""
        d = asdict(self)
        return {k: v if isinstance(v, str) else json.dumps(v) for k, v in d.items()}

    @classmethod
    def from_strings(cls, d: Mapping[str, str]) -> PayloadMeta:
        """The inverse of ``to_strings``, strict: a missing, mistyped or inconsistent field is a
        ``CorruptPayload`` naming that field (metadata comes off the wire and is untrusted)."""
        names = set(cls.__dataclass_fields__)
        missing = names - set(d) - set(OPTIONAL_FIELDS)
        if missing:
            raise CorruptPayload(f"metadata lacks the fields {sorted(missing)}")
        raw = {k: _field(k, d[k]) for k in names if k in d}
        layers, types = raw["layer_indices"], raw["layer_types"]
        if len(layers) != len(types):
            raise CorruptPayload(f"metadata field 'layer_types': {len(types)} entries for {len(layers)} layer_indices")
        if any(i >= raw["num_model_layers"] for i in layers):
            raise CorruptPayload(f"metadata field 'layer_indices': {list(layers)} out of range for "
                                 f"num_model_layers={raw['num_model_layers']}")
        roped = [r.layer_type for r in raw["rope"]]
        if len(set(roped)) != len(roped) or not set(types) <= set(roped):
            raise CorruptPayload(f"metadata field 'rope': entries for {roped}, expected one per layer type {sorted(set(types))}")
        if raw["dtype"] not in DTYPES:
            raise CorruptPayload(f"metadata field 'dtype': {raw['dtype']!r} is not one of {sorted(DTYPES)}")
        return cls(**raw)


def _bad(name: str, want: str, got: object) -> CorruptPayload:
    shown = repr(got)
    shown = shown if len(shown) <= 120 else shown[:117] + "..."  # a hostile value can be megabytes long
    return CorruptPayload(f"metadata field {name!r}: expected {want}, got {shown}")


def _is_int(v: object) -> bool:
    return type(v) is int  # bool is an int subclass: refused


def _is_num(v: object) -> bool:
    return (type(v) is int or type(v) is float) and math.isfinite(v)


def _ints(name: str, v: object, lo: int) -> tuple[int, ...]:
    if not isinstance(v, list) or any(not _is_int(i) or i < lo for i in v):
        raise _bad(name, f"a list of ints >= {lo}", v)
    return tuple(v)


def _rope(v: object) -> tuple[RopeSpec, ...]:
    keys = {"layer_type", "inv_freq", "attention_scaling"}
    if not isinstance(v, list) or not v:
        raise _bad("rope", "a non-empty list of rope entries", v)
    out = []
    for r in v:
        if (not isinstance(r, dict) or set(r) != keys or r["layer_type"] not in LAYER_TYPES
                or not isinstance(r["inv_freq"], list) or not r["inv_freq"]
                or any(not _is_num(f) for f in r["inv_freq"]) or not _is_num(r["attention_scaling"])):
            raise _bad("rope", f"entries {{layer_type in {list(LAYER_TYPES)}, inv_freq: [numbers], "
                       "attention_scaling: number}", r)
        out.append(RopeSpec(r["layer_type"], tuple(float(f) for f in r["inv_freq"]), float(r["attention_scaling"])))
    return tuple(out)


def _field(name: str, s: object):
    """One metadata field from its wire string, type-checked."""
    if not isinstance(s, str):
        raise _bad(name, "a string", s)
    if name in STRING_FIELDS:
        return s
    try:
        v = json.loads(s)
    except (ValueError, RecursionError):
        raise _bad(name, "JSON", s) from None
    if name == "num_model_layers":
        if not _is_int(v) or v < 1:
            raise _bad(name, "an int >= 1", v)
        return v
    if name == "round":
        if not _is_int(v) or v < 0:
            raise _bad(name, "an int >= 0", v)
        return v
    if name == "sliding_window":
        if v is not None and (not _is_int(v) or v < 1):
            raise _bad(name, "null or an int >= 1", v)
        return v
    if name == "created_at":
        if not _is_num(v):
            raise _bad(name, "a finite number (seconds since the epoch)", v)
        return float(v)
    if name == "layer_indices":
        t = _ints(name, v, 0)
        if list(t) != sorted(set(t)):
            raise _bad(name, "strictly increasing layer indices", v)
        return t
    if name == "layer_types":
        if not isinstance(v, list) or any(x not in LAYER_TYPES for x in v):
            raise _bad(name, f"a list of {list(LAYER_TYPES)}", v)
        return tuple(v)
    if name == "rope":
        return _rope(v)
    raise _bad(name, "a known metadata field", s)  # pragma: no cover - every field is handled above


def check_tokens(token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """The rules of a payload's token tensors (every codec's output carries them as they are); returns (B, T).

    token_ids / positions int64 and mask bool, all (B, T); the mask left-padded with at least one
    real token per row; on real slots, positions strictly increasing in [0, MAX_POSITION] and
    token ids >= 0. ``ValueError`` saying which rule failed.
    """
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids must be (B, T), got shape {tuple(token_ids.shape)}")
    B, T = token_ids.shape
    for name, t, dt in (("positions", positions, torch.int64), ("mask", mask, torch.bool),
                        ("token_ids", token_ids, torch.int64)):
        if tuple(t.shape) != (B, T):
            raise ValueError(f"{name} must be (B, T) = {(B, T)}, got {tuple(t.shape)}")
        if t.dtype != dt:
            raise ValueError(f"{name} must be {dt}, got {t.dtype}")
    if not bool(mask.any(dim=1).all()):
        raise ValueError("every row must hold at least one real token (mask all False on a row)")
    real = positions[mask]
    if bool(((real < 0) | (real > MAX_POSITION)).any()):
        raise ValueError(f"positions of real tokens must lie in [0, {MAX_POSITION}], got "
                         f"{int(real.min())}..{int(real.max())}")
    if bool((token_ids[mask] < 0).any()):
        raise ValueError("token_ids of real tokens must be >= 0")
    if T > 1:
        valid_pairs = mask[:, 1:] & mask[:, :-1]
        steps = positions[:, 1:] - positions[:, :-1]
        if bool((steps[valid_pairs] <= 0).any()):
            raise ValueError("positions must be strictly increasing on valid (mask=True) slots")
    if bool((mask[:, 1:].int() < mask[:, :-1].int()).any()):
        raise ValueError("mask must be left-padded: a padding slot (False) after a real token (True)")
    return B, T


@dataclass(frozen=True, slots=True)
class KVPayload:
    keys: tuple[torch.Tensor, ...]  # per held layer (B, H_kv, T_l, D)
    values: tuple[torch.Tensor, ...]  # per held layer (B, H_kv, T_l, D)
    token_ids: torch.Tensor  # (B, T) int64
    positions: torch.Tensor  # (B, T) int64
    mask: torch.Tensor  # (B, T) bool
    meta: PayloadMeta

    def __post_init__(self):
        m = self.meta
        if len(self.keys) != len(self.values):
            raise ValueError(f"{len(self.keys)} key layers but {len(self.values)} value layers")
        if len(self.keys) != len(m.layer_indices):
            raise ValueError(f"{len(self.keys)} layers of tensors but meta lists {len(m.layer_indices)} layers")
        B, T = check_tokens(self.token_ids, self.positions, self.mask)
        want = DTYPES[m.dtype]
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k.ndim != 4 or k.shape != v.shape:
                raise ValueError(f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} must be equal (B, H, T, D)")
            if k.dtype != want or v.dtype != want:
                raise ValueError(f"layer {i}: tensors are {k.dtype}/{v.dtype}, meta declares {m.dtype}")
            if k.shape[0] != B:
                raise ValueError(f"layer {i}: batch {k.shape[0]} != token_ids batch {B}")
            if k.shape[2] != self.held_tokens(i):
                raise ValueError(
                    f"layer {i} ({m.layer_types[i]}): holds {k.shape[2]} tokens, expected {self.held_tokens(i)} of T={T}"
                )

    # -- derived facts -------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        """Slots T (including left padding)."""
        return self.token_ids.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens per row, (B,)."""
        return self.mask.sum(dim=1)

    @property
    def next_positions(self) -> torch.Tensor:
        """The position the next token of each row takes under the *continue* layout, (B,)."""
        last = torch.where(self.mask, self.positions, torch.full_like(self.positions, -1)).max(dim=1).values
        return last + 1

    def held_tokens(self, layer: int) -> int:
        return held_tokens(self.meta.layer_types[layer], self.meta.sliding_window, self.num_tokens)

    @property
    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, self.token_ids, self.positions, self.mask)
        return sum(t.numel() * t.element_size() for t in tensors)

    def with_meta(self, **changes) -> KVPayload:
        return replace(self, meta=replace(self.meta, **changes))


def payload_tensors(p: KVPayload) -> dict[str, torch.Tensor]:
    """The named tensors of a payload as the wire format and the byte stores hold them (``kv.layout``)."""
    out = {"token_ids": p.token_ids, "positions": p.positions, "mask": p.mask}
    for i, (k, v) in enumerate(zip(p.keys, p.values, strict=True)):
        out[tensor_name(i, "k")], out[tensor_name(i, "v")] = k, v
    return out
