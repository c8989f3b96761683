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


def to_layered_cache(p: KVPayload, config) -> DynamicCache:
    """A ``DynamicCache`` whose layers in ``p.meta.layer_indices`` hold ``p``'s tensors and the rest nothing.

    The tokens a receiver then adds land in every layer, so the held layers keep ``p`` as a prefix the
    others lack: layers hold different token counts. Attend with
    ``models.attention.tail_aligned_attention`` (each layer's causal pattern aligned to its own length).
    Full-attention layers only (a missing sliding layer would miscount its window).
    """
    cache = DynamicCache(config=config)
    n = len(cache.layers)
    if p.meta.num_model_layers != n:
        raise ValueError(f"model cache has {n} layers, payload is for {p.meta.num_model_layers}")
    if not p.meta.layer_indices:
        raise ValueError("payload holds no layer")
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            raise ValueError(f"layer {i} is a sliding-window layer: layered caches take full-attention models only")
    for j, i in enumerate(p.meta.layer_indices):
        k, v = p.keys[j], p.values[j]  # (B, H, T, D)
        cache.layers[i].lazy_initialization(k, v)
        cache.layers[i].keys = k
        cache.layers[i].values = v
    return cache


def from_cache(cache: DynamicCache, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               meta: PayloadMeta, *, copy: bool = False) -> KVPayload:
    """Snapshot a cache (after a prefill of ``token_ids``) as a payload, sharing its tensors unless ``copy``."""
    keys = tuple(layer.keys.detach().clone() if copy else layer.keys.detach() for layer in cache.layers)  # (B, H, T_l, D)
    values = tuple(layer.values.detach().clone() if copy else layer.values.detach() for layer in cache.layers)
    return KVPayload(keys, values, token_ids, positions, mask, meta)
