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
GQA_CAUSAL = "kvrelay_gqa_causal"


def _tail_mask(q: int, kv: int, device) -> torch.Tensor | None:
    """Query i of the last ``q`` of ``kv`` slots sees key j when ``j <= kv - q + i``: (1, 1, q, kv) bool, or None for q = 1."""
    if q == 1:
        return None
    return torch.ones(q, kv, dtype=torch.bool, device=device).tril(kv - q)[None, None]


def _tail_aligned_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA where every layer's keys are the *tail* of one token sequence: query i sits at the last
    ``q`` slots of whatever this layer holds, so it sees key j when ``j <= kv - q + i``.

    Layers may then hold different numbers of tokens (a prefix some layers hold and others do not):
    the causal pattern is built per layer from its own key length. One unpadded row only: under
    this implementation transformers builds no mask (its own padding mask is never passed here).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = _tail_mask(query.shape[2], key.shape[2], query.device)  # query (B, H, q, D), key (B, H_kv, kv, D)
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)


def _gqa_causal_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The tail-aligned causal pattern with grouped-query heads passed to SDPA as they are (``enable_gqa``).

    Transformers' SDPA path repeats every key/value head for a masked multi-token call (a copy of the
    whole cache per layer); a one-token call already skips the copy. One unpadded row of full-attention
    layers, no logit soft-capping.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("the grouped-query causal attention does not soft-cap logits")
    mask = _tail_mask(query.shape[2], key.shape[2], query.device)  # query (B, H, q, D), key (B, H_kv, kv, D)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])  # (B, H, q, D)
    return out.transpose(1, 2).contiguous(), None  # (B, q, H, D), as transformers' attention functions return


def _register_tail_aligned() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(TAIL_ALIGNED, _tail_aligned_sdpa)
    AttentionInterface.register(GQA_CAUSAL, _gqa_causal_sdpa)


def gqa_causal_fits(model) -> bool:
    """Whether ``gqa_causal_attention`` computes what the model's own attention does: every layer full
    attention over the whole cache (no sliding window), no logit soft-capping, SDPA as the model's choice."""
    cfg = model.config.get_text_config(decoder=True)
    types = getattr(cfg, "layer_types", None) or ["full_attention"]
    return (model.config._attn_implementation == "sdpa" and all(t == "full_attention" for t in types)
            and not getattr(cfg, "use_sliding_window", False) and getattr(cfg, "attn_logit_softcapping", None) is None)


@contextmanager
def gqa_causal_attention(model) -> Iterator[None]:
    """Inside the block one unpadded row's multi-token calls attend causally over the cache without
    copying grouped key/value heads (a speculative verify forward); a no-op where ``gqa_causal_fits``
    is false. Not thread-safe, like ``eager_attention``."""
    if not gqa_causal_fits(model):
        yield
        return
    _register_tail_aligned()
    model.set_attn_implementation(GQA_CAUSAL)
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")


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
