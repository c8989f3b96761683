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
positions are not ``0..T-1`` (partial selections): the engine numbers a request's tokens from 0
(``InvalidInput`` says which). Cached blocks are a bonus to the engine: when the free share of its cache
falls under the scheduler's safety margin it evicts them — the injected prefix included — and prefills
the whole prompt again, giving the same answer at a full prefill's cost; ``blocks_needed`` sizes the
cache so the injected prefix leaves that margin free. The connector does not check that the payload is
the engine's model's: callers do first (``Agent.check``), as ``bench.connector`` does.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from kvrelay.core.errors import InvalidInput
from kvrelay.kv.payload import KVPayload

PAGE_SIZE = 16
MAX_BATCH_TOKENS = 256
SAFETY_MARGIN = 0.15  # transformers' FIFO scheduler default, set explicitly: the free share it keeps
PREFIX_REQUEST = "kvrelay-prefix"


class _QuietPersistent(logging.Filter):
    """Drops the engine's warning that a persistent manager was sized for its first requests (it is
    started here for exactly one request and stopped after it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "persistent_manager=True" not in record.getMessage()


logging.getLogger("ContinuousBatchingLogger").addFilter(_QuietPersistent())


@dataclass(frozen=True, slots=True)
class EngineResult:
    tokens: tuple[int, ...]  # greedy tokens the engine generated (a stop token it wrote included)
    reused_tokens: int  # prompt tokens the engine did not feed its model: taken from the injected blocks
    prefilled_tokens: int  # prompt tokens it fed its model (counted at the model's forward, not assumed)
    inject_s: float = 0.0  # writing the payload's blocks into the engine's cache
    first_token_s: float = 0.0  # from submitting the request to its first generated token

    @property
    def ttft_s(self) -> float:
        """Time to first token with the payload in hand: injection plus the engine's own first token."""
        return self.inject_s + self.first_token_s


def cb_config(page_size: int = PAGE_SIZE, num_blocks: int = 64, max_batch_tokens: int = MAX_BATCH_TOKENS):
    """A small, explicit continuous-batching configuration with prefix sharing (on CPU the default sizing
    takes a share of all free memory)."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(allow_block_sharing=True, page_size=page_size, num_blocks=num_blocks,
                                    max_batch_tokens=max_batch_tokens, safety_margin=SAFETY_MARGIN)


def blocks_needed(total_tokens: int, page_size: int = PAGE_SIZE, margin: float = SAFETY_MARGIN) -> int:
    """Pages for a request of ``total_tokens`` (prompt + new tokens) whose prefix was injected: the reused
    whole pages, the re-prefilled tail's pages and the injected partial page until it is freed, with the
    scheduler's ``margin`` free beside the cached prefix (under it the engine evicts the prefix, module
    docstring)."""
    pages = -(-total_tokens // page_size) + 4
    return math.ceil(pages / (1 - margin)) + 1


def _check(p: KVPayload) -> None:
    if p.batch_size != 1 or not bool(p.mask.all()):
        raise InvalidInput(f"a payload of {p.batch_size} row(s) with padding={not bool(p.mask.all())}",
                           "one unpadded row (the connector writes one request's prefix)")
    if not p.meta.complete:
        raise InvalidInput(f"a payload holding layers {list(p.meta.layer_indices)} only",
                           "every layer (the connector needs them all)")
    if any(t != "full_attention" for t in p.meta.layer_types):
        raise InvalidInput("a model with sliding-window layers", "full-attention layers only: continuous batching "
                           "in transformers 5.24 shares no sliding-window blocks, so it cannot take a relayed prefix")
    if not torch.equal(p.positions[0], torch.arange(p.num_tokens)):
        raise InvalidInput("a payload whose positions are not 0..T-1 (a partial selection or a moved payload)",
                           "positions 0..T-1: the engine numbers a request's tokens from 0")


def _manager(model, gen_config, cfg, *, sharing: bool = True):
    """The persistent manager (created by a one-token warm-up request when there is none) and its cache;
    ``sharing``: refuse a cache without prefix sharing."""
    mgr = getattr(model, "_cached_continuous_batching_manager", None)
    if mgr is None:
        model.generate_batch(inputs=[[0]], generation_config=gen_config, continuous_batching_config=cfg,
                             persistent_manager=True, max_new_tokens=1)
        mgr = model._cached_continuous_batching_manager
    cache = mgr.batch_processor.cache
    if sharing and (not cache.use_prefix_sharing or "full_attention" not in cache.cache_allocators):
        raise InvalidInput("a continuous-batching cache without prefix sharing (allow_block_sharing off, or "
                           "layers whose allocator does not share blocks)", "a cache that shares blocks")
    return mgr, cache


def inject_blocks(cache, p: KVPayload) -> int:
    """Write ``p`` into the paged ``cache`` (a running engine's ``PagedAttentionCache``, its loop paused or
    not yet running) as cached, hashed blocks; returns the tokens a request will reuse."""
    from transformers.generation.continuous_batching.requests import RequestState

    _check(p)
    alloc = cache.cache_allocators["full_attention"]
    ids = p.token_ids[0].tolist()
    T = len(ids)
    state = RequestState(request_id=PREFIX_REQUEST, initial_tokens=ids, max_new_tokens=1)
    if not cache.can_store_request_tokens(state, T):
        raise InvalidInput(f"{T} tokens for an engine cache of {cache.num_blocks} pages of {alloc.tokens_per_page}",
                           "more num_blocks")
    write = torch.tensor(alloc.get_write_indices(PREFIX_REQUEST, 0, T), dtype=torch.long)
    nothing = torch.tensor([], dtype=torch.long)
    for li in alloc.layer_indices:
        k = p.keys[li][0].transpose(0, 1).to(cache.dtype)  # (H, T, D) -> (T, H, D)
        v = p.values[li][0].transpose(0, 1).to(cache.dtype)
        alloc.update(k, v, li, nothing, write)
    alloc.mark_complete_blocks(PREFIX_REQUEST, ids, T // alloc.tokens_per_page)
    cache.free_blocks(PREFIX_REQUEST)  # the blocks stay cached under their hashes
    return (T // alloc.tokens_per_page) * alloc.tokens_per_page  # whole pages only (module docstring)


def inject_prefix(model, p: KVPayload, gen_config, cfg) -> int:
    """``inject_blocks`` into the model's persistent engine (started by a one-token request if there is none)."""
    _check(p)
    _, cache = _manager(model, gen_config, cfg)
    return inject_blocks(cache, p)


def cached_blocks(cache, token_ids) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The K/V the engine holds for the longest run of whole pages of ``token_ids`` still cached under their
    hashes (a finished request's pages, or injected ones): ``(n, [(keys (1, H_kv, n, D), values), …] per
    layer)``, ``n`` a multiple of the page size, 0 when none is cached. Read with the engine's own ``update``
    (an empty write, then its read); the caller holds the engine's loop paused."""
    alloc = cache.cache_allocators["full_attention"]
    page = alloc.tokens_per_page
    ids = list(token_ids)
    blocks = alloc.match_prefix_blocks(ids[: len(ids) - len(ids) % page] + [0])  # every whole page, none more
    n = len(blocks) * page
    if not n:
        return 0, []
    read = torch.tensor([b * alloc.block_physical_stride + i for b in blocks for i in range(page)], dtype=torch.long)
    nothing = torch.tensor([], dtype=torch.long)
    empty = torch.empty(0, alloc.num_key_value_heads, alloc.head_dim, dtype=cache.dtype)
    kv = []
    for li in sorted(alloc.layer_indices):
        k, v = alloc.update(empty, empty, li, read, nothing)  # (n, H, D) each
        kv.append((k.transpose(0, 1)[None].clone(), v.transpose(0, 1)[None].clone()))
    return n, kv


def continue_in_engine(model, p: KVPayload | None, prompt_ids, *, max_new_tokens: int, eos_token_id=None,
                       page_size: int = PAGE_SIZE, num_blocks: int | None = None,
                       max_batch_tokens: int = MAX_BATCH_TOKENS) -> EngineResult:
    """Greedy continuation of ``p`` + ``prompt_ids`` by continuous batching, the payload as prefix blocks.

    ``p`` None: the engine reads ``prompt_ids`` itself (its own prefill, the baseline). ``eos_token_id``:
    an id or a list of ids that end the answer. ``num_blocks`` None: enough pages for this one request
    (``blocks_needed``). The engine's persistent manager is started before the timed part (its start is a
    server's, not a request's) and stopped afterwards (its cache is freed)."""
    from transformers import GenerationConfig

    prompt = (p.token_ids[0].tolist() if p is not None else []) + list(prompt_ids)
    if num_blocks is None:
        num_blocks = blocks_needed(len(prompt) + max_new_tokens, page_size)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                           eos_token_id=eos_token_id if eos_token_id is not None else -1)
    cfg = cb_config(page_size, num_blocks, max_batch_tokens)
    try:
        if p is not None:
            _check(p)
        _manager(model, gen, cfg, sharing=p is not None)  # untimed: a serving engine is up before requests come
        t0 = time.perf_counter()
        if p is not None:
            inject_prefix(model, p, gen, cfg)
        t1 = time.perf_counter()
        fed: list[int] = []  # tokens per forward the engine runs: its prefill chunks, then one per decode step
        hook = model.register_forward_pre_hook(lambda _m, args, kw: fed.append(_tokens_fed(args, kw)), with_kwargs=True)
        try:
            out = model.generate_batch(inputs=[prompt], generation_config=gen, continuous_batching_config=cfg,
                                       persistent_manager=True, max_new_tokens=max_new_tokens, record_timestamps=True)
        finally:
            hook.remove()
        res = next(iter(out.values()))
        if res.error is not None:
            raise RuntimeError(f"continuous batching failed: {res.error}")
        tokens = tuple(int(t) for t in res.generated_tokens)
        first = (res.timestamps[0] - t1) if res.timestamps else float("nan")
    finally:
        if getattr(model, "_cached_continuous_batching_manager", None) is not None:
            model.destroy_cached_continuous_batching_manager()
    prefilled = sum(fed) - max(len(tokens) - 1, 0)  # the first token comes from the prefill's last logits
    return EngineResult(tokens, len(prompt) - prefilled, prefilled, t1 - t0, first)


def _tokens_fed(args, kwargs) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return int(ids.shape[-1]) if ids is not None else 0
