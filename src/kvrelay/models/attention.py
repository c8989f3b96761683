"""Switching a model's attention implementation for a block, through its public API."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def eager_attention(model) -> Iterator[None]:
    """Eager attention inside the block (the only kind that returns attention weights), then back.

    Not thread-safe: do not share ``model`` with another thread meanwhile.
    """
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


TAIL_ALIGNED = "kvrelay_tail_aligned"


def _tail_aligned_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA where every layer's keys are the *tail* of one token sequence: query i sits at the last
    ``q`` slots of whatever this layer holds, so it sees key j when ``j <= kv - q + i``.

    Layers may then hold different numbers of tokens (a prefix some layers hold and others do not):
    the causal pattern is built per layer from its own key length. One unpadded row only: under
    this implementation transformers builds no mask (its own padding mask is never passed here).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, kv = query.shape[2], key.shape[2]  # query (B, H, q, D), key (B, H_kv, kv, D)
    mask = None
    if q > 1:
        mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril(kv - q)[None, None]  # (1, 1, q, kv)
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)


def _register_tail_aligned() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(TAIL_ALIGNED, _tail_aligned_sdpa)


@contextmanager
def tail_aligned_attention(model) -> Iterator[None]:
    """Attention that right-aligns each layer's causal pattern to its own cache length, inside the block.

    For caches whose layers hold different token counts (``kv.cache.to_layered_cache``): a layer
    without the shared prefix attends to its own tokens only. Single unpadded rows only. Not
    thread-safe, like ``eager_attention``.
    """
    _register_tail_aligned()
    before = model.config._attn_implementation
    model.set_attn_implementation(TAIL_ALIGNED)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
