"""One model replica: a queue of chat requests and one worker thread, which answers them one after another
or — with ``batch`` — hands them to a continuous-batching engine (``serve.batcher``) that answers them
together, each joining the running batch at the next step.

A request's context is, in order, the messages of the handles it passes (``kv_context``) and then
its own messages. The replica continues the first handle's cache when every check passes —
signature, expiry, present in the store, bytes verify (``kv.wire``), content key, compatible with
this model (``agents.receive``), and tokens equal to the handle's messages as this model tokenizes
them — and prefills only the rest (the continue layout: exact). Otherwise it re-encodes the text
and reports why (``Use.reason``). After answering it stores the whole turn's cache, with the
answer re-tokenized the way a text re-send would read it, so a continuation is exact either way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from kvrelay.agents.agent import Agent
from kvrelay.agents.receive import RoundBook
from kvrelay.core.errors import CorruptPayload, IncompatiblePayload, OverBudget, PayloadNotFound
from kvrelay.kv.payload import KVPayload
from kvrelay.kv.transforms import select_tokens
from kvrelay.serve import handles
from kvrelay.serve.batcher import Batcher, Finished
from kvrelay.serve.chat import Message, answer_start_ids, conversation_ids
from kvrelay.serve.hosts import Placement, host_of
from kvrelay.serve.protocol import ChatRequest, RequestError, Usage
from kvrelay.transport.bytestore import ByteStore
from kvrelay.transport.keys import payload_key
from kvrelay.transport.payloads import get_payload, put_payload

REASONS = {  # why a handle's cache was not used (its text was re-encoded instead)
    "unsigned": "its signature does not hold under this server's key (edited, or from another server)",
    "expired": "it expired",
    "missing": "the store no longer has its cache",
    "corrupt": "its cache's bytes or content key do not verify",
    "incompatible": "its cache was made by another model",
    "mismatch": "its cache's tokens are not its messages as this model reads them",
    "not_first": "only the first handle's cache can be continued exactly; later handles are read as text",
}


@dataclass(frozen=True, slots=True)
class Use:
    """What happened to one handle of ``kv_context``."""

    index: int
    channel: str  # "kv": its cache was continued; "text": its messages were re-encoded
    reason: str  # "" for kv, else a key of REASONS
    tokens: int  # tokens of its context

    def to_json(self) -> dict:
        d = {"index": self.index, "channel": self.channel, "tokens": self.tokens}
        return d | ({"fallback": self.reason, "detail": REASONS[self.reason]} if self.reason else {})


@dataclass(frozen=True, slots=True)
class Result:
    text: str
    token_ids: tuple[int, ...]
    finish: str  # "stop" (end of turn) or "length" (max_tokens reached)
    usage: Usage
    uses: tuple[Use, ...]
    handle: str | None
    queue_s: float  # waiting for the replica
    ttft_s: float  # from arrival to the first token (queue + context + prefill)
    prefill_s: float  # building the cache and prefilling (the answer's own part of ttft_s)
    decode_s: float
    total_s: float
    handle_error: str = ""  # why a turn that asked for a handle has none (its cache did not fit the store's budget)
    host_busy: float = 1.0  # mean busy replicas of this replica's host while it was answered, itself included

    def ext(self, model: str) -> dict:
        """The response's ``kvrelay`` extension object."""
        return {"handle": self.handle, "replica_model": model, "context": [u.to_json() for u in self.uses],
                "relayed_tokens": self.usage.relayed_tokens, "queue_s": self.queue_s, "ttft_s": self.ttft_s} | (
                    {"handle_error": self.handle_error} if self.handle_error else {})


@dataclass(slots=True)
class Job:
    req: ChatRequest
    opened: Sequence[handles.Opened]
    future: Future
    on_text: Callable[[str], None] | None
    arrived: float


@dataclass(slots=True)
class Running:
    """A request the batching engine is answering (``Replica`` with ``batch``): what finishing it needs."""

    job: Job
    cache: KVPayload | None
    ids: list[int]
    whole: list[Message]
    uses: list[Use]
    started: float
    deltas: Deltas | None
    mark: tuple[float, float]  # the host's (time, busy area) when it started: ``hosts.Host.mean_busy``
    done: Finished | None = None
    error: BaseException | None = None


class Deltas:
    """The growing answer as text pieces: each piece sent once, never half a character, and together
    exactly the final text (what a streaming client concatenates)."""

    def __init__(self, agent: Agent, emit: Callable[[str], None]):
        self.agent, self.emit = agent, emit
        self.ids: list[int] = []
        self.sent = ""

    def push(self, tok: int) -> None:
        if tok in self.agent.stop_ids:
            return
        self.ids.append(tok)
        text = self.agent.decode(self.ids)
        if not text.endswith("\ufffd") and text.startswith(self.sent) and len(text) > len(self.sent):
            self.emit(text[len(self.sent):])
            self.sent = text

    def finish(self, text: str) -> None:
        if text.startswith(self.sent) and len(text) > len(self.sent):
            self.emit(text[len(self.sent):])


def deliver(observers: Sequence[Callable[[str, Result], None]], name: str, future: Future, res: Result) -> None:
    """An answer to the replica's observers (metrics, the scheduler's rates), then to its caller: whoever
    waits on it plans with what it taught. In process and on Ray alike."""
    try:
        for observe in observers:
            observe(name, res)
    finally:
        future.set_result(res)


class Replica:
    """One loaded model behind a FIFO queue and one worker thread.

    ``batch``: answer concurrent requests together in transformers' continuous batching (``serve.batcher``;
    engine mode ``fp32``, full-attention models); ``kv_tokens`` sizes its paged cache. Without it, one
    request at a time with kvrelay's own generation loop (every engine mode).
    """

    def __init__(self, name: str, lm, store: ByteStore | None, secret: bytes, *, handle_ttl_s: float = 600.0,
                 batch: bool = False, kv_tokens: int | None = None, placement: Placement | None = None):
        self.name = name
        self.placement = placement if placement is not None else Placement.here()
        self.host = host_of(self.placement)  # shared with this process's other replicas on the host
        self.lm = lm
        self.agent = Agent(lm, name)
        self.store = store
        self.secret = secret
        self.handle_ttl_s = handle_ttl_s
        self.observers: list[Callable[[str, Result], None]] = []  # metrics, scheduler: (model name, result)
        self.max_positions = int(getattr(lm.config, "max_position_embeddings", 0) or 0)
        self.fingerprint = lm.identity.fingerprint
        self.params = sum(p.numel() for p in lm.model.parameters())
        self.batcher = (Batcher(lm, name, self.agent.stop_ids, **({"kv_tokens": kv_tokens} if kv_tokens else {}))
                        if batch else None)
        self._q: queue.Queue[Job | Running | None] = queue.Queue()
        self._busy = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=f"replica-{name}", daemon=True)
        self._thread.start()

    # -- queue ---------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Requests waiting or running."""
        with self._lock:
            return self._q.qsize() + self._busy

    def submit(self, req: ChatRequest, opened: Sequence[handles.Opened],
               on_text: Callable[[str], None] | None = None, *, arrived: float | None = None) -> Future:
        """Queue a request; the future resolves to a ``Result``. ``on_text`` receives the answer in pieces
        (from the worker thread) before the future resolves. ``arrived``: when it reached the server
        (``time.perf_counter``), if earlier than now."""
        fut: Future = Future()
        self._q.put(Job(req, opened, fut, on_text, time.perf_counter() if arrived is None else arrived))
        return fut

    def close(self, timeout: float | None = None) -> None:
        """Finish what is queued (and, batching, what is running), then stop the worker."""
        self._q.put(None)
        self._thread.join(timeout)
        if self.batcher is not None:
            self.batcher.close()

    def _work(self) -> None:
        closing = False
        while True:
            item = self._q.get()
            if item is None:
                closing = True
            elif isinstance(item, Running):
                self._finish(item)
            elif self.batcher is not None:
                self._start(item)
            else:
                with self._lock:
                    self._busy = 1
                mark = self.host.enter()
                try:
                    if item.future.set_running_or_notify_cancel():
                        res = self.answer(item.req, item.opened, item.on_text, arrived=item.arrived)
                        self._deliver(item, replace(res, host_busy=self.host.mean_busy(mark)))
                except BaseException as err:  # the caller sees every failure
                    if not item.future.done():
                        item.future.set_exception(err)
                finally:
                    self.host.leave()
                    with self._lock:
                        self._busy = 0
            if closing:
                with self._lock:
                    if self._busy == 0:
                        return

    def _deliver(self, job: Job, res: Result) -> None:
        deliver(self.observers, self.name, job.future, res)

    # -- batching: a request starts in the engine, and finishes here when the engine is done -----
    def _start(self, job: Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        t0 = time.perf_counter()
        try:
            cache, ids, whole, uses = self.plan(job.req, job.opened)
        except BaseException as err:
            job.future.set_exception(err)
            return
        deltas = Deltas(self.agent, job.on_text) if job.on_text is not None else None
        with self._lock:
            if self._busy == 0:  # the engine starts working: one more busy replica on the host
                self.host.enter()
            self._busy += 1
        run = Running(job, cache, ids, whole, uses, t0, deltas, self.host.mark())
        try:
            fut = self.batcher.submit(cache, ids, job.req.max_tokens,
                                      deltas.push if deltas is not None else None, submitted=t0)
        except BaseException as err:
            job.future.set_exception(err)
            self._idle_one()
            return

        def ended(f: Future) -> None:  # on the engine's router thread: finishing needs the model, so queue it
            run.done, run.error = (None, f.exception()) if f.exception() is not None else (f.result(), None)
            self._q.put(run)

        fut.add_done_callback(ended)

    def _finish(self, run: Running) -> None:
        job = run.job
        try:
            if run.error is not None:
                raise run.error
            done = run.done
            gen = list(done.tokens)
            if gen and gen[-1] in self.agent.stop_ids:
                gen = gen[:-1]
            text = self.agent.decode(gen)
            if run.deltas is not None:
                run.deltas.finish(text)
            handle, handle_error = None, ""
            if job.req.kv_handle and self.store is not None:
                turn = run.whole + [Message("assistant", text)]
                try:
                    handle = self._put_handle(self._turn_payload_batched(turn), turn)
                except OverBudget as e:
                    handle_error = f"OverBudget: {e}"
            held = run.cache.num_tokens if run.cache is not None else 0
            t1 = time.perf_counter()
            finish = "length" if len(gen) >= job.req.max_tokens else "stop"
            self._deliver(job, Result(text, tuple(gen), finish, Usage(held + len(run.ids), len(gen), held),
                                      tuple(run.uses), handle, run.started - job.arrived,
                                      done.first_token - job.arrived, done.first_token - run.started,
                                      done.done - done.first_token, t1 - job.arrived, handle_error,
                                      self.host.mean_busy(run.mark)))
        except BaseException as err:
            if not job.future.done():
                job.future.set_exception(err)
        finally:
            self._idle_one()

    def _idle_one(self) -> None:
        """A batched request is over (answered or failed)."""
        with self._lock:
            self._busy -= 1
            if self._busy == 0:
                self.host.leave()

    def _turn_payload_batched(self, messages: list[Message]) -> KVPayload:
        """The turn's cache from the pages the engine still holds, the rest prefilled (``Batcher.turn_cache``)."""
        def extend(head: KVPayload | None, rest: list[int]) -> KVPayload:
            return self.agent.extend(head, rest) if head is not None else self.agent.prefill(rest)

        return self.batcher.turn_cache(conversation_ids(self.agent, messages), extend, self.agent.meta())

    # -- one request ---------------------------------------------------------------------------
    def _cache_for(self, o: handles.Opened) -> tuple[KVPayload | None, str]:
        """The first handle's cache and "" when every check passes, else (None, reason)."""
        h = o.handle
        if not o.signed:
            return None, "unsigned"
        if time.time() > h.expires:
            return None, "expired"
        if h.fingerprint != self.lm.identity.fingerprint:
            return None, "incompatible"
        if self.store is None:
            return None, "missing"
        try:
            p = get_payload(self.store, h.key, expect=self.lm.identity)
        except PayloadNotFound:
            return None, "missing"
        except IncompatiblePayload:
            return None, "incompatible"
        except CorruptPayload:
            return None, "corrupt"
        try:
            if payload_key(p) != h.key:
                return None, "corrupt"
        except ValueError:
            return None, "corrupt"
        if p.token_ids[0].tolist() != conversation_ids(self.agent, h.messages):
            return None, "mismatch"
        return p, ""

    def plan(self, req: ChatRequest, opened: Sequence[handles.Opened]) -> tuple[KVPayload | None, list[int],
                                                                                 list[Message], list[Use]]:
        """(cache to continue or None, tokens to prefill after it, the whole conversation, one Use per handle)."""
        uses: list[Use] = []
        cache = None
        rest: list[Message] = []
        for i, o in enumerate(opened):
            n = len(conversation_ids(self.agent, o.handle.messages))
            if i == 0:
                cache, reason = self._cache_for(o)
                uses.append(Use(0, "kv" if cache is not None else "text", reason, n))
                if cache is None:
                    rest += o.handle.messages
            else:
                uses.append(Use(i, "text", "not_first", n))
                rest += o.handle.messages
        rest += req.messages
        whole = handles.context_messages(opened) + list(req.messages)
        ids = conversation_ids(self.agent, rest) + answer_start_ids(self.agent)
        held = cache.num_tokens if cache is not None else 0
        if self.max_positions and held + len(ids) + req.max_tokens > self.max_positions:
            raise RequestError(f"this conversation has {held + len(ids)} tokens and asks for up to {req.max_tokens} "
                               f"more, over {self.name}'s {self.max_positions} positions; expected fewer tokens "
                               "or a smaller max_tokens", param="messages", code="context_length_exceeded")
        return cache, ids, whole, uses

    def answer(self, req: ChatRequest, opened: Sequence[handles.Opened],
               on_text: Callable[[str], None] | None = None, *, arrived: float | None = None) -> Result:
        t0 = time.perf_counter()
        arrived = t0 if arrived is None else arrived
        cache, ids, whole, uses = self.plan(req, opened)
        first: list[float] = []
        deltas = Deltas(self.agent, on_text) if on_text is not None else None

        def seen(tok: torch.Tensor) -> None:  # (1,)
            if not first:
                first.append(time.perf_counter())
            if deltas is not None:
                deltas.push(int(tok[0]))

        want = req.kv_handle and self.store is not None
        r = self.agent.respond_ids(ids, cache, max_new_tokens=req.max_tokens, return_payload=want, on_token=seen,
                                   rounds=RoundBook())
        if deltas is not None:
            deltas.finish(r.text)
        handle, handle_error = None, ""
        if want:
            try:
                turn = whole + [Message("assistant", r.text)]
                handle = self._put_handle(self._turn_payload(r.payload, turn), turn)
            except OverBudget as e:  # the answer stands; the client continues by sending the text
                handle_error = f"OverBudget: {e}"
        finish = "length" if len(r.token_ids) >= req.max_tokens else "stop"
        held = cache.num_tokens if cache is not None else 0
        t1 = time.perf_counter()
        return Result(r.text, r.token_ids, finish, Usage(held + len(ids), len(r.token_ids), held), tuple(uses),
                      handle, t0 - arrived, (first[0] if first else t1) - arrived, r.ttft_s, r.decode_s, t1 - arrived,
                      handle_error)

    def _turn_payload(self, p: KVPayload, messages: list[Message]) -> KVPayload:
        """The turn's cache holding exactly ``messages`` as this model tokenizes them.

        The generated tokens are what the model wrote; a client re-sending the answer as text gets it
        re-tokenized, which may split differently. The cache is cut where the two first differ and the
        rest prefilled, so continuing the handle and re-sending the text read the same tokens.
        """
        want = conversation_ids(self.agent, messages)
        have = p.token_ids[0].tolist()
        common = next((i for i, (a, b) in enumerate(zip(have, want, strict=False)) if a != b), min(len(have), len(want)))
        if common < len(have) or common < len(want):
            try:
                p = self.agent.extend(select_tokens(p, range(common)), want[common:]) if common else None
            except ValueError:  # a sliding-window layer no longer holds the cut: read it all again
                p = None
            if p is None:
                p = self.agent.prefill(want)
        return p

    def _put_handle(self, p: KVPayload, messages: list[Message]) -> str:
        """Store the turn's cache ``p`` (holding ``messages``); return its signed handle."""
        key = put_payload(self.store, p, ttl_s=self.handle_ttl_s)
        h = handles.Handle(key, self.name, self.lm.identity.fingerprint, time.time() + self.handle_ttl_s,
                           tuple(messages))
        return handles.encode(h, self.secret)
