"""A replica's continuous-batching engine: transformers' ``ContinuousBatchingManager`` (the engine behind
``transformers serve --continuous-batching``) kept running over one model, requests joining and leaving
its batch at every step, relayed caches entering as prefix blocks (``kv.connector``).

Each request is submitted with the tokens its cache already holds (a relayed payload's, injected as
cached pages under their content hashes while the engine's loop is paused) followed by the tokens to
read; the engine matches the injected pages and prefills only the rest — together with the other
requests' prefill chunks and decode steps. Prefix sharing also reuses the pages of any earlier request
with the same leading tokens (a conversation re-sent as text finds the pages its earlier turn left).

After a request finishes, ``turn_cache`` reads the pages the engine still holds for its tokens back into a
``KVPayload`` (the handle a client continues), prefilling only the tokens past the last whole cached
page with the replica's own forward, under the same pause.

Only engine modes whose prefill and decode compute with the same weights (``fp32``) batch: other modes
pick their weights by the number of tokens a call reads, and a batch of one-token decodes read together
would compute with the prefill's weights — not the answer the request gets alone.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvrelay.core.errors import InvalidInput
from kvrelay.kv.connector import cached_blocks, cb_config, inject_blocks
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.models.engine import mode

PAGE_SIZE = 16
KV_TOKENS = 16384  # default cache capacity in tokens, all requests together
CHUNK_TOKENS = 256  # tokens one engine step reads (prefill chunks and decodes together)


@dataclass(frozen=True, slots=True)
class Finished:
    """One request's end: the tokens generated (a stop token it wrote included), the tokens taken from
    cached pages, and when its first token and its last came (``time.perf_counter``)."""

    tokens: tuple[int, ...]
    reused_tokens: int
    submitted: float
    first_token: float
    done: float


class Batcher:
    """One running engine over ``lm`` (``close`` stops it)."""

    def __init__(self, lm, name: str, stop_ids: Sequence[int], *, kv_tokens: int = KV_TOKENS,
                 page_size: int = PAGE_SIZE, chunk_tokens: int = CHUNK_TOKENS):
        from transformers import GenerationConfig

        if not mode(lm.identity.engine).phase_uniform:
            raise InvalidInput(f"continuous batching in engine mode {lm.identity.engine!r}",
                               "an engine mode that prefills and decodes with the same weights (fp32): a batch of "
                               "decodes would compute with the prefill's weights, not the answer a request gets alone")
        if any(t != "full_attention" for t in lm.identity.layer_types):
            raise InvalidInput(f"continuous batching for {name!r}, which has sliding-window layers",
                               "full-attention layers only: transformers' engine shares no sliding-window pages, "
                               "so a relayed cache cannot enter it")
        self.lm = lm
        self.page_size = page_size
        self.stop_ids = sorted(stop_ids)
        gen = GenerationConfig(do_sample=False, max_new_tokens=16, pad_token_id=0, eos_token_id=self.stop_ids or -1)
        cfg = cb_config(page_size, -(-kv_tokens // page_size), chunk_tokens)
        self.mgr = lm.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
        self.mgr.start()
        while self.mgr.batch_processor is None:  # the loop builds its cache first thing
            if not self.mgr.is_running():
                raise RuntimeError("transformers' continuous-batching loop stopped while starting")
            threading.Event().wait(0.01)
        self.cache = self.mgr.batch_processor.cache
        self._ids = itertools.count()
        self._live: dict[str, tuple[Future, Callable[[int], None] | None, list[int], float, list[float], int]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._router = threading.Thread(target=self._route, name=f"batcher-{name}", daemon=True)
        self._router.start()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prefix: KVPayload | None, ids: Sequence[int], max_new_tokens: int,
               on_token: Callable[[int], None] | None = None, *, submitted: float) -> Future:
        """Greedy continuation of ``prefix`` + ``ids``; the future resolves to ``Finished``. ``prefix``: a
        payload checked for this model by the caller, positions ``0..T-1``. ``on_token`` sees each token as
        the engine writes it (from the router thread)."""
        prompt = (prefix.token_ids[0].tolist() if prefix is not None else []) + list(ids)
        reused = 0
        if prefix is not None:
            with self.mgr.pause():
                reused = inject_blocks(self.cache, prefix)
        rid = f"kvrelay-{next(self._ids)}"
        fut: Future = Future()
        with self._lock:
            self._live[rid] = (fut, on_token, [], submitted, [], reused)
        if self.mgr.add_request(prompt, request_id=rid, max_new_tokens=max_new_tokens, streaming=True,
                                eos_token_id=self.stop_ids or -1) is None:
            with self._lock:
                self._live.pop(rid, None)
            raise RuntimeError("transformers' continuous-batching engine is not accepting requests (stopping)")
        return fut

    def _route(self) -> None:
        import time

        while not self._closed.is_set():
            out = self.mgr.get_result(timeout=0.1)
            if out is None:
                if not self.mgr.is_running():
                    self._fail_all(RuntimeError("transformers' continuous-batching loop stopped"))
                    return
                continue
            with self._lock:
                entry = self._live.get(out.request_id)
            if entry is None:
                continue
            fut, on_token, seen, submitted, first, reused = entry
            now = time.perf_counter()
            for tok in out.generated_tokens[len(seen):]:
                if not first:
                    first.append(now)
                seen.append(int(tok))
                if on_token is not None:
                    on_token(int(tok))
            if out.error is not None:
                self._drop(out.request_id)
                fut.set_exception(RuntimeError(f"continuous batching failed: {out.error}"))
            elif out.is_finished():
                self._drop(out.request_id)
                fut.set_result(Finished(tuple(seen), reused, submitted, first[0] if first else now, now))

    def _drop(self, rid: str) -> None:
        with self._lock:
            self._live.pop(rid, None)

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            live, self._live = self._live, {}
        for fut, *_ in live.values():
            if not fut.done():
                fut.set_exception(err)

    # -- the turn's cache ----------------------------------------------------------------------
    def turn_cache(self, token_ids: Sequence[int], extend: Callable[[KVPayload | None, list[int]], KVPayload],
                   meta: PayloadMeta) -> KVPayload:
        """The cache of ``token_ids`` (positions ``0..``): the whole pages the engine still holds for them,
        then ``extend(payload or None, rest)`` — the replica's own prefill — for the tokens after them. The
        engine's loop is paused meanwhile (the model is shared)."""
        ids = list(token_ids)
        with self.mgr.pause():
            n, kv = cached_blocks(self.cache, ids)
            head = None
            if n:
                t = torch.tensor([ids[:n]], dtype=torch.int64)  # (1, n)
                keys, values = zip(*((k.float(), v.float()) for k, v in kv), strict=True)
                head = KVPayload(keys, values, t, torch.arange(n)[None], torch.ones_like(t, dtype=torch.bool), meta)
            return extend(head, ids[n:]) if n < len(ids) else head

    def drop_cached_pages(self) -> int:
        """Evict every page kept only for prefix sharing (none a running request holds); returns how many
        were cached. A benchmark calls it between strategies so that none reuses another's pages."""
        with self.mgr.pause():
            n = sum(len(a.ledger.cached_blocks) for a in self.cache.cache_allocators.values())
            self.cache.evict_cached_blocks()
        return n

    def with_model(self):
        """A context in which the caller may run the model itself (the engine's loop paused)."""
        return self.mgr.pause()

    def close(self) -> None:
        """Finish the running requests, stop the engine and free its cache."""
        self.mgr.stop(block=True, keep_for_next_session=False)
        self._closed.set()
        self._router.join(5)
        self._fail_all(RuntimeError("the replica closed"))
