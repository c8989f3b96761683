"""Asymmetric int8 / int4 quantization of a payload's K/V (KIVI-style), as pure functions.

Layout (see ``payload.py``): keys/values per held layer ``(B, H, T_l, D)``. KIVI's observation is
that keys have outlier *channels* and values do not, so:

* keys are quantized **per channel**: one (scale, zero) per channel ``d`` for each group of
  ``group_size`` consecutive tokens — scales ``(B, H, ceil(T_l / G), D)``;
* values are quantized **per token**: one (scale, zero) per token for each group of
  ``group_size`` consecutive channels — scales ``(B, H, T_l, ceil(D / G))``.

Asymmetric min/max: ``zero = min``, ``scale = (max - min) / (2**bits - 1)``,
``q = round((x - zero) / scale)``, ``x̂ = zero + q * scale``. Scales and zeros travel as fp16
(4 bytes per group of G numbers; fp32 would push int8 over 30 % of fp32 bytes at G = 32); the
codes are computed against the fp16-rounded scale/zero so the error stays ≤ scale / 2 plus fp16
rounding. int4 codes are packed two per byte along the last dim (low nibble = even index).
Left-padding slots (mask False) are excluded from every min/max and come back as exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvrelay.kv.layout import tensor_name
from kvrelay.kv.payload import DTYPES, KVPayload, PayloadMeta

BITS = (4, 8)
QUANT_PARTS = ("codes", "scale", "zero")  # side tensors per K/V: layers.{i}.k.codes, ...
SCALE_DTYPE = torch.float16


def codec_name(bits: int, group_size: int) -> str:
    return f"int{bits}-g{group_size}"


def quantized_shapes(B: int, H: int, T: int, D: int, bits: int, group_size: int
                     ) -> dict[str, dict[str, tuple[int, ...]]]:
    """The shapes of ``codes`` / ``scale`` / ``zero`` of a layer's K (``"k"``) and V (``"v"``) quantized
    from float tensors (B, H, T, D): the layout ``quantize_tensor`` writes and a reader must find."""
    codes = (B, H, T, -(-D // 2) if bits == 4 else D)
    key_stats = (B, H, -(-T // group_size), D)  # per channel, groups of G tokens
    value_stats = (B, H, T, -(-D // group_size))  # per token, groups of G channels
    return {"k": {"codes": codes, "scale": key_stats, "zero": key_stats},
            "v": {"codes": codes, "scale": value_stats, "zero": value_stats}}


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """One K or V tensor of one layer, quantized. ``shape`` is the float tensor's (B, H, T_l, D)."""

    codes: torch.Tensor  # uint8: (B, H, T_l, D) for int8, (B, H, T_l, ceil(D/2)) for int4
    scale: torch.Tensor  # fp16, keys (B, H, ceil(T_l/G), D) | values (B, H, T_l, ceil(D/G))
    zero: torch.Tensor  # fp16, same shape as scale

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


@dataclass(frozen=True, slots=True)
class QuantizedPayload:
    """A payload whose K/V are int codes + fp16 scales/zeros; ``meta.codec`` names the scheme.

    ``meta.dtype`` is the float dtype ``dequantize`` restores (the dtype the producer had).
    """

    bits: int
    group_size: int
    keys: tuple[QuantizedTensor, ...]  # per held layer, per-channel groups over tokens
    values: tuple[QuantizedTensor, ...]  # per held layer, per-token groups over channels
    token_ids: torch.Tensor  # (B, T) int64
    positions: torch.Tensor  # (B, T) int64
    mask: torch.Tensor  # (B, T) bool
    meta: PayloadMeta

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if len(self.keys) != len(self.values) or len(self.keys) != len(self.meta.layer_indices):
            raise ValueError(f"{len(self.keys)} key / {len(self.values)} value layers for "
                             f"{len(self.meta.layer_indices)} layers in meta")
        if self.meta.codec != codec_name(self.bits, self.group_size):
            raise ValueError(f"meta.codec {self.meta.codec!r} != {codec_name(self.bits, self.group_size)!r}")

    @property
    def nbytes(self) -> int:
        qt = sum(q.nbytes for q in (*self.keys, *self.values))
        return qt + sum(t.numel() * t.element_size() for t in (self.token_ids, self.positions, self.mask))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``name -> tensor`` form for the wire (``layers.{i}.k.codes`` / ``.scale`` / ``.zero``, ...)."""
        out: dict[str, torch.Tensor] = {"token_ids": self.token_ids, "positions": self.positions, "mask": self.mask}
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            for kv, q in (("k", k), ("v", v)):
                for part in QUANT_PARTS:
                    out[tensor_name(i, kv, part)] = getattr(q, part)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: PayloadMeta, bits: int,
                     group_size: int) -> QuantizedPayload:
        n = len(meta.layer_indices)
        try:
            layers = [[QuantizedTensor(*(tensors[tensor_name(i, kv, f)] for f in QUANT_PARTS))
                       for i in range(n)] for kv in ("k", "v")]
            return cls(bits, group_size, tuple(layers[0]), tuple(layers[1]), tensors["token_ids"],
                       tensors["positions"], tensors["mask"], meta)
        except KeyError as e:
            raise ValueError(f"quantized payload lacks tensor {e.args[0]!r}") from None


# -- one tensor ------------------------------------------------------------------------------
def _pad_to(t: torch.Tensor, dim: int, multiple: int, value: float) -> torch.Tensor:
    n = t.shape[dim]
    extra = (-n) % multiple
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat((t, t.new_full(shape, value)), dim=dim)


def _grouped_minmax(x: torch.Tensor, valid: torch.Tensor, dim: int, group: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max over groups of ``group`` along ``dim`` ignoring invalid entries; x, valid broadcastable.

    Returns tensors shaped like ``x`` with ``dim`` reduced to ``ceil(n / group)``.
    """
    valid = valid.expand_as(x)
    lo = _pad_to(torch.where(valid, x, torch.inf), dim, group, torch.inf)
    hi = _pad_to(torch.where(valid, x, -torch.inf), dim, group, -torch.inf)
    shape = list(lo.shape)
    shape[dim: dim + 1] = [shape[dim] // group, group]  # split dim into (groups, group)
    mn = lo.reshape(shape).amin(dim=dim + 1)
    mx = hi.reshape(shape).amax(dim=dim + 1)
    empty = torch.isinf(mn)  # a group with no valid entry (all padding)
    return torch.where(empty, 0.0, mn), torch.where(empty, 0.0, mx)


def _expand_groups(s: torch.Tensor, dim: int, group: int, n: int) -> torch.Tensor:
    """Repeat each group's statistic ``group`` times along ``dim`` and cut to length ``n``."""
    return s.repeat_interleave(group, dim=dim).narrow(dim, 0, n)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """(…, D) codes in 0..15 -> (…, ceil(D/2)) bytes, low nibble = even index."""
    q = _pad_to(q, -1, 2, 0)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def _unpack4(b: torch.Tensor, d: int) -> torch.Tensor:
    lo, hi = b & 0x0F, b >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*b.shape[:-1], -1)[..., :d]  # (…, D)


def quantize_tensor(x: torch.Tensor, valid: torch.Tensor, bits: int, group_size: int, axis: str) -> QuantizedTensor:
    """Quantize ``x`` (B, H, T, D) with groups along tokens (``axis='token'``, keys: per-channel
    statistics) or along channels (``axis='channel'``, values: per-token statistics).

    ``valid`` (B, 1, T, 1) bool marks real slots; padding is ignored by min/max.
    """
    if axis not in ("token", "channel"):
        raise ValueError(f"axis must be 'token' or 'channel', got {axis!r}")
    if x.ndim != 4:
        raise ValueError(f"expected (B, H, T, D), got shape {tuple(x.shape)}")
    dim = 2 if axis == "token" else 3
    xf = x.to(torch.float32)
    mn, mx = _grouped_minmax(xf, valid, dim, group_size)  # keys (B,H,nG,D) | values (B,H,T,nG)
    levels = 2**bits - 1
    zero = mn.to(SCALE_DTYPE)
    scale = ((mx - zero.float()) / levels).to(SCALE_DTYPE)
    # An fp16 scale rounded down could leave the max one step past the top code: nudge it up.
    scale = torch.where(zero.float() + scale.float() * levels < mx, torch.nextafter(scale, torch.full_like(scale, 1e4)),
                        scale)
    n = x.shape[dim]
    z = _expand_groups(zero.float(), dim, group_size, n)  # (B, H, T, D)
    s = _expand_groups(scale.float(), dim, group_size, n)
    q = torch.round((xf - z) / s.clamp_min(torch.finfo(torch.float32).tiny))
    q = torch.where(valid.expand_as(q), q.clamp(0, levels), 0).to(torch.uint8)  # (B, H, T, D)
    codes = _pack4(q) if bits == 4 else q
    return QuantizedTensor(codes, scale, zero)


def dequantize_tensor(qt: QuantizedTensor, valid: torch.Tensor, bits: int, group_size: int, axis: str,
                      dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_tensor``; padding slots (``valid`` False) come back as exact zeros."""
    dim = 2 if axis == "token" else 3
    T = qt.codes.shape[2]
    D = qt.scale.shape[3] if axis == "token" else qt.codes.shape[3] * (2 if bits == 4 else 1)
    q = _unpack4(qt.codes, D) if bits == 4 else qt.codes  # (B, H, T, D)
    n = T if axis == "token" else D
    z = _expand_groups(qt.zero.float(), dim, group_size, n)
    s = _expand_groups(qt.scale.float(), dim, group_size, n)
    x = z + q.float() * s  # (B, H, T, D)
    return torch.where(valid.expand_as(x), x, 0.0).to(dtype)


# -- a payload -------------------------------------------------------------------------------
def _valid(mask: torch.Tensor, held: int) -> torch.Tensor:
    return mask[:, mask.shape[1] - held:][:, None, :, None]  # (B, 1, T_l, 1)


def quantize(p: KVPayload, bits: int = 8, group_size: int = 32) -> QuantizedPayload:
    """Keys per-channel, values per-token, ``bits`` in (4, 8), groups of ``group_size``."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if p.keys and bits == 4 and p.keys[0].shape[-1] % 2:
        raise ValueError(f"int4 packs two codes per byte and needs an even head_dim, got {p.keys[0].shape[-1]}")
    keys, values = [], []
    for k, v in zip(p.keys, p.values, strict=True):
        valid = _valid(p.mask, k.shape[2])
        keys.append(quantize_tensor(k, valid, bits, group_size, "token"))
        values.append(quantize_tensor(v, valid, bits, group_size, "channel"))
    meta = replace(p.meta, codec=codec_name(bits, group_size))
    return QuantizedPayload(bits, group_size, tuple(keys), tuple(values), p.token_ids, p.positions, p.mask, meta)


def dequantize(q: QuantizedPayload) -> KVPayload:
    """Float payload in ``q.meta.dtype`` with codec ``raw`` (the loss is not undone, only the format)."""
    dt = DTYPES[q.meta.dtype]
    keys, values = [], []
    for kq, vq in zip(q.keys, q.values, strict=True):
        T_l = kq.codes.shape[2]
        valid = _valid(q.mask, T_l)
        keys.append(dequantize_tensor(kq, valid, q.bits, q.group_size, "token", dt))
        values.append(dequantize_tensor(vq, valid, q.bits, q.group_size, "channel", dt))
    return KVPayload(tuple(keys), tuple(values), q.token_ids, q.positions, q.mask, replace(q.meta, codec="raw"))
