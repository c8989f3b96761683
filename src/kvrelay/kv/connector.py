"""A relayed payload continued inside transformers' continuous batching, without prefilling its context.

transformers' continuous batching (``model.generate_batch``, the engine behind ``transformers serve
--continuous-batching``) keeps K/V in a ``PagedAttentionCache``: pages of ``page_size`` token slots per
layer, a block table per request, and a ledger of content hashes so that a request whose prompt starts
with blocks already cached takes those blocks instead of recomputing them (prefix sharing). This module
writes a payload's K/V into blocks of that cache, registers their hashes as the engine itself does after
a prefill, and releases them as cached blocks; a request whose prompt is the payload's tokens followed
by the receiver's prompt then matches them and the engine prefills only the rest.

Layout: payload keys/values ``(1, H_kv, T, D)`` per layer -> the engine's token rows ``(T, H_kv, D)``.

What transformers 5.24 does not offer, said exactly: there is no public call to add external blocks.
The connector reaches the persistent manager's cache (``model._cached_continuous_batching_manager
.batch_processor.cache``) and uses the engine's own allocator calls — ``can_store_request_tokens``,
``get_write_indices``, ``update`` (the write the attention layers do), ``mark_complete_blocks`` and
``free_blocks`` — so it may break with another transformers version (pinned in pyproject.toml). Prefix
sharing matches whole pages before the prompt's last token only: the payload's last ``T mod page_size``
tokens are prefilled by the engine again. Models with sliding-window layers (gemma3) get no prefix
sharing in 5.24 (its sliding allocator does not share blocks) and are refused, as are payloads whose
positions are not ``0..T-1`` (partial selections): the engine numbers a request's tokens from 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kv.payload import KVPayload

PAGE_SIZE = 16
PREFIX_REQUEST = "kvrelay-prefix"


@dataclass(frozen=True, slots=True)
class EngineResult:
    tokens: tuple[int, ...]  # greedy tokens the engine generated
    reused_tokens: int  # payload tokens the engine took from the injected blocks (not prefilled)
    prefilled_tokens: int  # tokens it prefilled itself (payload tail + prompt)


def cb_config(page_size: int = PAGE_SIZE, num_blocks: int = 64, max_batch_tokens: int = 256):
    """A small, explicit continuous-batching configuration with prefix sharing (on CPU the default sizing
    takes a share of all free memory)."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(allow_block_sharing=True, page_size=page_size, num_blocks=num_blocks,
                                    max_batch_tokens=max_batch_tokens)


def _check(p: KVPayload) -> None:
    if p.batch_size != 1 or not bool(p.mask.all()):
        raise ValueError("the connector takes one unpadded row")
    if not p.meta.complete:
        raise ValueError(f"the connector needs every layer (payload holds {list(p.meta.layer_indices)})")
    if any(t != "full_attention" for t in p.meta.layer_types):
        raise ValueError("continuous batching in transformers 5.24 shares no sliding-window blocks: a model with "
                         "sliding-window layers cannot take a relayed prefix there")
    if not torch.equal(p.positions[0], torch.arange(p.num_tokens)):
        raise ValueError("the engine numbers a request's tokens from 0: the payload's positions must be 0..T-1 "
                         "(a partial selection cannot become prefix blocks)")


def _manager(model, gen_config, cfg):
    """The persistent manager (created by a one-token warm-up request when there is none) and its cache."""
    mgr = getattr(model, "_cached_continuous_batching_manager", None)
    if mgr is None:
        model.generate_batch(inputs=[[0]], generation_config=gen_config, continuous_batching_config=cfg,
                             persistent_manager=True, max_new_tokens=1)
        mgr = model._cached_continuous_batching_manager
    cache = mgr.batch_processor.cache
    if not cache.use_prefix_sharing or "full_attention" not in cache.cache_allocators:
        raise ValueError("this continuous-batching cache has no prefix sharing (allow_block_sharing off, or "
                         "layers whose allocator does not share blocks)")
    return mgr, cache


def inject_prefix(model, p: KVPayload, gen_config, cfg) -> int:
    """Write ``p`` into the engine's cache as cached, hashed blocks; returns the tokens a request will reuse."""
    from transformers.generation.continuous_batching.requests import RequestState

    _check(p)
    _, cache = _manager(model, gen_config, cfg)
    alloc = cache.cache_allocators["full_attention"]
    ids = p.token_ids[0].tolist()
    T = len(ids)
    state = RequestState(request_id=PREFIX_REQUEST, initial_tokens=ids, max_new_tokens=1)
    if not cache.can_store_request_tokens(state, T):
        raise ValueError(f"the engine's cache has no room for {T} tokens; raise num_blocks")
    write = torch.tensor(alloc.get_write_indices(PREFIX_REQUEST, 0, T), dtype=torch.long)
    nothing = torch.tensor([], dtype=torch.long)
    for li in alloc.layer_indices:
        k = p.keys[li][0].transpose(0, 1).to(cache.dtype)  # (H, T, D) -> (T, H, D)
        v = p.values[li][0].transpose(0, 1).to(cache.dtype)
        alloc.update(k, v, li, nothing, write)
    alloc.mark_complete_blocks(PREFIX_REQUEST, ids, T // alloc.tokens_per_page)
    cache.free_blocks(PREFIX_REQUEST)  # the blocks stay cached under their hashes
    return (T // alloc.tokens_per_page) * alloc.tokens_per_page  # whole pages only (module docstring)


def continue_in_engine(model, p: KVPayload, prompt_ids, *, max_new_tokens: int, eos_token_id=None,
                       page_size: int = PAGE_SIZE, num_blocks: int = 64, max_batch_tokens: int = 256) -> EngineResult:
    """Greedy continuation of ``p`` + ``prompt_ids`` by continuous batching, the payload as prefix blocks.

    Stops the engine's persistent manager afterwards (its cache is freed)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                           eos_token_id=eos_token_id if eos_token_id is not None else -1)
    cfg = cb_config(page_size, num_blocks, max_batch_tokens)
    try:
        reused = inject_prefix(model, p, gen, cfg)
        prompt = p.token_ids[0].tolist() + list(prompt_ids)
        out = model.generate_batch(inputs=[prompt], generation_config=gen, continuous_batching_config=cfg,
                                   persistent_manager=True, max_new_tokens=max_new_tokens)
        res = next(iter(out.values()))
        if res.error is not None:
            raise RuntimeError(f"continuous batching failed: {res.error}")
        tokens = tuple(int(t) for t in res.generated_tokens)
    finally:
        if getattr(model, "_cached_continuous_batching_manager", None) is not None:
            model.destroy_cached_continuous_batching_manager()
    return EngineResult(tokens, reused, len(prompt) - reused)

