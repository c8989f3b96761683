"""Lossless conversion between ``KVPayload`` and transformers' ``DynamicCache``.

``DynamicCache(config=...)`` gives sliding-window layers their own class, which keeps the last
``window - 1`` tokens and counts every token it has seen (``cumulative_length``) to size masks.
A payload's sliding layers hold exactly that tail, so the conversion is a hand-over of tensors plus
that count — no model internals are touched, only the cache object's documented state.

No copies: a cache layer's ``update`` builds *new* tensors (``torch.cat``) and never writes into
the ones it was given, so a payload handed to ``to_cache`` stays intact while the cache grows,
and a snapshot taken by ``from_cache`` shares the cache's tensors (the cache object itself is
mutated by generation, so take snapshots of caches you are done with, or pass ``copy=True``).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvrelay.kv.layout import is_sliding
from kvrelay.kv.payload import KVPayload, PayloadMeta


def to_cache(p: KVPayload, config) -> DynamicCache:
    """A fresh ``DynamicCache`` over ``p``'s tensors (zero-copy; ``p`` is never written to)."""
    if not p.meta.complete:
        raise ValueError(
            f"payload holds layers {list(p.meta.layer_indices)} of {p.meta.num_model_layers}; "
            "a receiver needs every layer (recompute or fill the missing ones first)"
        )
    cache = DynamicCache(config=config)
    if len(cache.layers) != len(p.keys):
        raise ValueError(f"model cache has {len(cache.layers)} layers, payload has {len(p.keys)}")
    T = p.num_tokens
    for i, (layer, k, v) in enumerate(zip(cache.layers, p.keys, p.values, strict=True)):
        sliding = bool(getattr(layer, "is_sliding", False))
        if sliding != is_sliding(p.meta.layer_types[i], p.meta.sliding_window):
            raise ValueError(f"layer {i}: payload says {p.meta.layer_types[i]}, model cache is_sliding={sliding}")
        layer.lazy_initialization(k, v)
        layer.keys = k  # (B, H, T_l, D)
        layer.values = v
        if sliding:
            layer.cumulative_length = T
    return cache


def from_cache(cache: DynamicCache, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               meta: PayloadMeta, *, copy: bool = False) -> KVPayload:
    """Snapshot a cache (after a prefill of ``token_ids``) as a payload, sharing its tensors unless ``copy``."""
    keys = tuple(layer.keys.detach().clone() if copy else layer.keys.detach() for layer in cache.layers)  # (B, H, T_l, D)
    values = tuple(layer.values.detach().clone() if copy else layer.values.detach() for layer in cache.layers)
    return KVPayload(keys, values, token_ids, positions, mask, meta)
