"""The flash-attention layout ``[B, T, H_kv, D]``, exactly: a payload's K/V with the head and token axes swapped.

``KVPayload`` holds K/V as transformers' ``DynamicCache`` does, ``(B, H_kv, T_l, D)``. FlashAttention's
``flash_attn_with_kvcache`` (https://github.com/Dao-AILab/flash-attention) and the kernels built on it
take ``(B, T_l, H_kv, D)`` instead. The conversion is a transpose made contiguous, both ways; nothing
else changes (tokens, positions, mask and metadata travel as they are), so a round trip is bit-exact.
Sliding-window layers keep their own ``T_l`` (``kv.layout.held_tokens``) in this layout too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kv.payload import KVPayload, PayloadMeta

NAME = "flash"  # (B, T_l, H_kv, D)


@dataclass(frozen=True, slots=True)
class FlashKV:
    """A payload in the flash layout. ``keys[l]`` / ``values[l]``: (B, T_l, H_kv, D), contiguous."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    token_ids: torch.Tensor  # (B, T) int64
    positions: torch.Tensor  # (B, T) int64
    mask: torch.Tensor  # (B, T) bool
    meta: PayloadMeta

    def __post_init__(self):
        if len(self.keys) != len(self.values) or len(self.keys) != len(self.meta.layer_indices):
            raise ValueError(f"{len(self.keys)} key and {len(self.values)} value layers for "
                             f"{len(self.meta.layer_indices)} held layers")
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k.ndim != 4 or k.shape != v.shape:
                raise ValueError(f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} must be equal "
                                 "(B, T_l, H_kv, D)")


def to_flash(p: KVPayload) -> FlashKV:
    """``p`` with every layer's K/V as (B, T_l, H_kv, D)."""
    keys = tuple(k.transpose(1, 2).contiguous() for k in p.keys)  # (B, H, T_l, D) -> (B, T_l, H, D)
    values = tuple(v.transpose(1, 2).contiguous() for v in p.values)
    return FlashKV(keys, values, p.token_ids, p.positions, p.mask, p.meta)


def from_flash(f: FlashKV) -> KVPayload:
    """The payload of a flash-layout cache; ``KVPayload`` checks every shape against the metadata."""
    keys = tuple(k.transpose(1, 2).contiguous() for k in f.keys)  # (B, T_l, H, D) -> (B, H, T_l, D)
    values = tuple(v.transpose(1, 2).contiguous() for v in f.values)
    return KVPayload(keys, values, f.token_ids, f.positions, f.mask, f.meta)
