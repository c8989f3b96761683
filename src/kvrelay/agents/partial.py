"""The receiver-driven partial relay, as two hops over a byte store: request up, partial payload down.

1. The receiver writes a ``PartialRequest`` (``kv.partial``: its prompt's token ids, a budget, an
   optional layer subset and encoding) under ``KEY.request``.
2. The sender reads it, scores its cached context by attention from those tokens
   (``kv.partial.select``) and writes the partial payload (kvrelay/1 bytes of the codec's output)
   under ``KEY.partial``.
3. The receiver reads and decodes it, and answers through the ordinary receive path
   (``Agent.respond``: compatibility checked, continue layout at the sender's original end).

The extra hop is measured, never hidden: ``PartialHop`` holds the request's bytes, the reply's bytes
and the seconds of every step; ``hop_s`` is what the receiver waits between sending its question and
holding a cache, and ``PartialOutcome.ttft_s`` adds it to the receiver's own time to first token.
Without a store, an in-process ``MemoryStore`` carries the bytes (the same encode/decode either way).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from kvrelay.agents.agent import Agent, Response
from kvrelay.kv import wire
from kvrelay.kv.partial import Budget, PartialRequest, PartialSelection, select
from kvrelay.kv.payload import KVPayload
from kvrelay.transport.memory import MemoryStore
from kvrelay.transport.payloads import compressed_from_bytes


@dataclass(frozen=True, slots=True)
class PartialHop:
    """What the request/reply round cost. Seconds are wall-clock on this machine."""

    request_bytes: int
    reply_bytes: int  # kvrelay/1 bytes of the partial payload
    request_s: float  # receiver encodes and puts the request; sender gets and parses it
    score_s: float  # sender's look-ahead decode and probe forward over the question (and answer) tokens
    select_s: float  # top-k, gather, encoding
    reply_s: float  # sender packs and puts the reply; receiver gets, verifies and decodes it

    @property
    def hop_s(self) -> float:
        return self.request_s + self.score_s + self.select_s + self.reply_s

    def to_json(self) -> dict:
        return {"request_bytes": self.request_bytes, "reply_bytes": self.reply_bytes, "request_s": self.request_s,
                "score_s": self.score_s, "select_s": self.select_s, "reply_s": self.reply_s, "hop_s": self.hop_s}


@dataclass(frozen=True, slots=True)
class PartialOutcome:
    response: Response
    payload: KVPayload  # what the receiver attended to
    selection: PartialSelection
    hop: PartialHop

    @property
    def ttft_s(self) -> float:
        """The receiver's time to first token counting the extra hop."""
        return self.hop.hop_s + self.response.ttft_s


def make_request(receiver: Agent, question: str, budget: Budget, **options) -> PartialRequest:
    """The request ``receiver`` sends for ``question``: the exact tokens it will append (continue layout)."""
    return PartialRequest(tuple(receiver.prompt_ids(question)), budget, **options)


def serve_request(sender: Agent, payload: KVPayload, data, probe=None) -> tuple[bytes, PartialSelection, float]:
    """The sender's side: request bytes in, kvrelay/1 bytes of the partial payload out (+ seconds to pack).

    ``probe``: the attention of the request's tokens over ``payload`` measured already (then the
    selection's ``score_s`` is 0 and the caller accounts for the probe once)."""
    request = PartialRequest.from_bytes(bytes(data))
    sel = select(payload, request, model=sender.model, probe=probe)
    t0 = time.perf_counter()
    reply = wire.pack(*sel.compressed.to_wire())
    return reply, sel, time.perf_counter() - t0


def partial_relay(sender: Agent, payload: KVPayload, receiver: Agent, question: str, budget: Budget, *,
                  store=None, key: str | None = None, max_new_tokens: int | None = None, probe=None,
                  **options) -> PartialOutcome:
    """``receiver`` answers ``question`` from the part of ``sender``'s ``payload`` its question selects.

    ``options`` go to ``PartialRequest`` (``layers``, ``encoding``, ``mode``, ``sink``, ``recent``).
    ``store``: any byte store both sides reach (default: an in-process ``MemoryStore``). ``probe``: see
    ``serve_request`` (benchmarks sweeping budgets score a cache once).
    """
    store = MemoryStore("partial") if store is None else store
    key = key or f"partial-{uuid.uuid4().hex[:12]}"
    t0 = time.perf_counter()
    request = make_request(receiver, question, budget, **options)
    req_bytes = request.to_bytes()
    store.put_bytes(f"{key}.request", req_bytes)
    got = store.get_bytes(f"{key}.request")  # the sender's read
    t1 = time.perf_counter()
    reply, sel, pack_s = serve_request(sender, payload, got, probe)
    t2 = time.perf_counter()
    store.put_bytes(f"{key}.partial", reply)
    data = store.get_bytes(f"{key}.partial")  # the receiver's read
    partial = compressed_from_bytes(data).decompress()  # every tensor's digest verified
    t3 = time.perf_counter()
    store.delete(f"{key}.request")
    store.delete(f"{key}.partial")
    parse_s = (t2 - t1) - sel.score_s - sel.select_s - pack_s  # parsing the request on the sender
    hop = PartialHop(len(req_bytes), len(reply), (t1 - t0) + max(parse_s, 0.0), sel.score_s, sel.select_s,
                     pack_s + (t3 - t2))
    r = receiver.respond(question, partial, max_new_tokens=max_new_tokens)
    return PartialOutcome(r, partial, sel, hop)
