"""Where agents run: the ``Executor`` protocol of the one runner (``workflows.run``), and the in-process one.

An executor owns the agents of a workflow and moves payloads between them; the runner decides who
runs next and what they read. Every executor calls ``workflows.turn.take_turn``; they differ only
in where an agent lives and what a payload handle is:

* ``InProcessExecutor`` — agents in this process; the handle is the ``KVPayload`` itself, or, with a
  ``store`` (a URL, ``transport.stores.open_store``) and/or a ``codec``, the key it was put under;
* ``workflows.ray_executor.RayExecutor`` — Ray actors; the handle is an object-store reference;
* ``workflows.process_executor.ProcessExecutor`` — one OS process per agent; the handle is a store key.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from kvrelay.agents.agent import Agent
from kvrelay.agents.probe import can_cut, relay_gain
from kvrelay.agents.verify import VerifySpec
from kvrelay.core.errors import IncompatiblePayload, StoreError
from kvrelay.kv import codecs
from kvrelay.kv.compat import check_meta
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.kv.sign import Keyring
from kvrelay.transport.stores import get_payload, open_store
from kvrelay.workflows.spec import Workflow
from kvrelay.workflows.turn import TurnOut, store_turn, take_turn


@runtime_checkable
class Executor(Protocol):
    def start(self, wf: Workflow) -> None:
        """Set up (or reset) one agent per ``wf.agents`` before a run; not timed."""

    def context_ids(self, agent: str, context: str) -> list[int]:
        """The shared context as a root agent reads it (one user turn)."""

    def turn(self, agent: str, prompt: str, base: Sequence[int], cache: Any, *, layout: str, max_new_tokens: int,
             min_new_tokens: int, want_payload: bool) -> TurnOut:
        """One turn of ``agent``; ``cache`` is a handle from an earlier ``TurnOut.payload`` or None."""

    def release(self, handle: Any) -> None:
        """No later agent needs this payload: free it."""


def _verify(wf: Workflow, name: str, codec: str) -> VerifySpec | None:
    """The agent's verification, at the tolerance of the codec its payloads travel under."""
    spec = wf.verify_for(name)
    return None if spec is None else replace(spec, codec=codec)


def run_key(run_id: str, agent: str) -> str:
    """The store key of an agent's whole-turn payload in one run."""
    return f"kvrelay-run:{run_id}:{agent}"


class InProcessExecutor:
    """Agents on one loaded model in this process.

    Without ``store`` and with codec ``raw`` a payload is handed over as the object itself (no copy,
    ``relay_transfer_s`` = 0). With a ``store`` URL, or any other ``codec`` (then a private
    ``memory://`` store), every relayed payload is put there encoded with ``codec`` and the receiver
    gets it back by key (``transport.stores.put_payload`` / ``get_payload``), timed as the transfer.
    ``codec`` None: ``kv.codecs.WIRE_CODEC`` through a store, ``raw`` without one. ``keys`` (a
    ``kv.sign.Keyring``, then a private ``memory://`` store when none is named): each agent signs
    what it puts with its key and refuses what is not signed by one of them.

    ``models`` puts named agents on other loaded models (same tokenizer: edges pass token ids); a receiver
    refuses a cache of another model like any incompatible payload. For ``auto`` edges (``workflows.auto``)
    it tells whether a pair is compatible, prices prompts in tokens, relays a cache under a per-edge codec
    (without a store: compressed and decompressed in process, timed as encode and decode) and runs the
    runtime switch's probe (``agents.probe.relay_gain``) on the receiver's model.
    """

    def __init__(self, lm, *, store: str | None = None, codec: str | None = None, keys: Keyring | None = None,
                 models: Mapping[str, Any] | None = None):
        self.lm = lm
        self.models = dict(models or {})
        if codec is None:
            codec = codecs.WIRE_CODEC if store is not None else "raw"
        self.codec = codecs.parse(codec).name
        self.keys = keys or Keyring()
        if store is None and (self.codec != "raw" or self.keys):
            store = f"memory://kvrelay-inprocess-{secrets.token_hex(4)}"
        self.store = open_store(store) if store is not None else None
        self.unreleased: list[str] = []  # keys a failed delete left in the store
        self.agents: dict[str, Agent] = {}
        self.run_id = ""

    def start(self, wf: Workflow) -> None:
        # Agents are set up before the clock starts: a deployed pipeline builds them once.
        unknown = set(self.models) - {a.name for a in wf.agents}
        if unknown:
            raise ValueError(f"models for agents {sorted(unknown)} that workflow {wf.name!r} does not have")
        self.agents = {a.name: Agent(self.models.get(a.name, self.lm), a.name, a.role, max_new_tokens=a.max_new_tokens,
                                     verify=_verify(wf, a.name, self.codec), budget=a.budget()) for a in wf.agents}
        self.run_id = secrets.token_hex(6)

    def context_ids(self, agent: str, context: str) -> list[int]:
        a = self.agents[agent]
        return a.encode(a.fmt.user(context))

    def turn(self, agent: str, prompt: str, base: Sequence[int], cache: Any, *, layout: str, max_new_tokens: int,
             min_new_tokens: int, want_payload: bool, partial: float | None = None, codec: str | None = None) -> TurnOut:
        a = self.agents[agent]
        if codec is not None and self.store is not None and codecs.parse(codec).name != self.codec:
            raise ValueError(f"an auto edge's codec {codec!r} through a store that carries {self.codec!r}")
        if codec is not None and self.store is None and codecs.parse(codec).name != "raw":
            # an auto edge's codec, relayed in process: compressed and decompressed here
            if cache is None:
                raise ValueError("a per-edge codec needs a relayed payload")
            t0 = time.perf_counter()
            packed = codecs.parse(codec).compress(cache)
            t1 = time.perf_counter()
            cache = packed.decompress()
            t2 = time.perf_counter()
            out = take_turn(a, prompt, base, cache, layout, max_new_tokens=max_new_tokens,
                            min_new_tokens=min_new_tokens, want_payload=want_payload, relay_bytes=packed.nbytes)
            return replace(out, relay_encode_s=out.relay_encode_s + (t1 - t0),
                           relay_decode_s=out.relay_decode_s + (t2 - t1))
        if partial is not None:  # a ``partial`` edge: the receiver's prompt selects the positions it gets
            if self.store is not None or cache is None:
                raise ValueError("a partial edge runs in process, without a store, on a relayed payload")
            from kvrelay.kv.partial import Budget, PartialRequest, select

            sel = select(cache, PartialRequest(tuple(a.prompt_ids(prompt)), Budget(fraction=partial)), model=a.model)
            cache = sel.compressed.decompress()
        if self.store is None:
            return take_turn(a, prompt, base, cache, layout, max_new_tokens=max_new_tokens,
                             min_new_tokens=min_new_tokens, want_payload=want_payload)
        return store_turn(a, self.store, prompt, base, cache, layout, codec=self.codec,
                          out_key=run_key(self.run_id, agent), max_new_tokens=max_new_tokens,
                          min_new_tokens=min_new_tokens, want_payload=want_payload, keys=self.keys,
                          signer=self.keys.signer(agent))

    def release(self, handle: Any) -> None:
        if self.store is not None and isinstance(handle, str):
            try:
                self.store.delete(handle)
            except StoreError:  # an unreachable store does not stop the run: the key is kept for later
                self.unreleased.append(handle)

    # -- what auto edges ask (workflows.auto) ------------------------------------------------------
    def compatible(self, src: str, dst: str) -> bool:
        """Whether ``dst`` can prove ``src``'s caches its own kind: the check its receiver applies."""
        try:
            check_meta(PayloadMeta.from_identity(self.agents[src].identity), self.agents[dst].identity, complete=True)
        except IncompatiblePayload:
            return False
        return True

    def prompt_tokens(self, agent: str, prompt: str) -> int:
        return len(self.agents[agent].prompt_ids(prompt))

    def engine(self, agent: str) -> str:
        return self.agents[agent].identity.engine

    def edge_codecs(self, wanted: Sequence[str]) -> tuple[str, ...]:
        """The codecs an auto edge may pick: any of ``wanted`` without a store; with one, the store's own codec
        (named as in ``wanted`` when it is there: ``int8`` for a store carrying ``int8-g32``)."""
        if self.store is None:
            return tuple(wanted)
        return tuple(c for c in wanted if codecs.parse(c).name == self.codec)[:1] or (self.codec,)

    def probe(self, agent: str, handle: Any, text_ids: Sequence[int], *, upto: int) -> float | None:
        """``agents.probe.relay_gain`` of ``text_ids`` read by ``agent`` after the first ``upto`` tokens of the
        payload behind ``handle``, versus without it; None when the payload cannot be cut there (a
        sliding-window layer already dropped its first tokens)."""
        a = self.agents[agent]
        p = handle if isinstance(handle, KVPayload) else get_payload(self.store, handle, expect=a.identity,
                                                                     keys=self.keys)
        return relay_gain(a, p, text_ids, upto=upto) if can_cut(p, upto) else None

    def close(self) -> None:
        self.agents = {}
