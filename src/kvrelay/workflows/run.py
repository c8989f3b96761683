"""The one runner: run a workflow agent by agent on an executor, and account for every token and second.

``run_workflow(executor_or_lm, wf, context, mode=...)`` is the same loop for every executor
(``workflows.executors``: in-process, Ray actors, one OS process per agent); a loaded model means
the in-process executor. Each agent's turn is ``workflows.turn.take_turn``.

A run is either ``text`` (every edge re-encodes: the baseline) or ``kv`` (edges as declared; an
``auto`` edge is decided per run by ``policy``, a ``workflows.auto.AutoPolicy``, on an executor that can
tell compatibility and run the switch's probe: the in-process one).
Both feed each agent the same token sequence (see ``spec``), so greedy outputs are comparable
one to one. Per agent we record what it prefilled, what arrived as a cache, what it decoded,
and the relay costs, split the way a transport would split them:

* ``relay_encode_s``   — sender side: finishing the turn into a payload (the last answer token
  and end-of-turn marker go through the model, then the cache is snapshotted);
* ``relay_transfer_s`` — moving it: the executor's hand-off (sender) + fetch (receiver); 0 for an
  in-process hand-over of the object itself, a store's put + get when edges go through a store;
* ``relay_decode_s``   — receiver side: building the model cache from the payload (in the
  replace layout this includes prefilling the receiver's own prefix and re-rotating keys).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvrelay.core.errors import (
    EdgeRefused,
    InvalidWorkflow,
    OverBudget,
    PayloadError,
    PayloadNotFound,
    StoreError,
    WorkerError,
)
from kvrelay.workflows.auto import AutoPolicy, Route, event_dict
from kvrelay.workflows.executors import Executor, InProcessExecutor
from kvrelay.workflows.spec import Workflow
from kvrelay.workflows.turn import TurnOut, take_turn, turn_ids  # noqa: F401 - turn_ids/take_turn: public here too

RUN_MODES = ("text", "kv")  # run_workflow(mode=...): every edge re-encoded as text, or each edge as written


@dataclass(frozen=True, slots=True)
class AgentRecord:
    name: str
    channel: str  # how its input arrived: root | text | kv | kv+text (| kv+text:no-cache | kv->text | kv+text->text
    #               | auto:kv | auto:kv+CODEC | auto:text | auto:none on an auto edge)
    input_tokens: int  # its whole input sequence (context + its own turn)
    prefill_tokens: int  # tokens it pushed through the model before the first answer token
    relayed_tokens: int  # tokens that arrived as a cache
    prefill_s: float
    decode_tokens: int  # answer tokens written (stop token excluded)
    decode_s: float
    relay_bytes: int  # size of the payload it received (0 without one)
    relay_encode_s: float
    relay_transfer_s: float
    relay_decode_s: float
    wall_s: float  # the whole step, measured around it
    text: str
    token_ids: tuple[int, ...]
    fallback: str = ""  # why its relayed payload was refused and the edge rebuilt from text ("" = it was not)
    decision: dict | None = None  # an auto edge's route (``workflows.auto.Route.to_dict``); None otherwise

    @property
    def relay_s(self) -> float:
        return self.relay_encode_s + self.relay_transfer_s + self.relay_decode_s

    @property
    def other_s(self) -> float:
        """Wall time not in prefill, decode or relay (tokenizing, prompt building)."""
        return self.wall_s - self.prefill_s - self.decode_s - self.relay_s


@dataclass(frozen=True, slots=True)
class RunTrace:
    workflow: str
    mode: str
    layout: str
    context_tokens: int  # the shared context as the root reads it (one user turn)
    agents: tuple[AgentRecord, ...]
    wall_s: float  # the whole run, measured around it
    switch_events: tuple[dict, ...] = ()  # relay switched off/on on an auto edge during this run, with evidence

    def totals(self) -> dict:
        keys = ("prefill_tokens", "relayed_tokens", "decode_tokens", "relay_bytes")
        tot = {k: sum(getattr(a, k) for a in self.agents) for k in keys}
        for k in ("prefill_s", "decode_s", "relay_s", "relay_encode_s", "relay_decode_s", "wall_s"):
            tot[f"agents_{k}" if k == "wall_s" else k] = sum(getattr(a, k) for a in self.agents)
        tot["wall_s"] = self.wall_s
        return tot

    def outputs(self) -> dict[str, tuple[int, ...]]:
        """Each agent's answer as token ids, by agent name (what text and kv runs compare)."""
        return {a.name: a.token_ids for a in self.agents}

    def texts(self) -> dict[str, str]:
        """Each agent's answer as text, by agent name."""
        return {a.name: a.text for a in self.agents}

    @property
    def final_text(self) -> str:
        """The last agent's answer."""
        return self.agents[-1].text

    def to_dict(self) -> dict:
        rows = [asdict(a) | {"relay_s": a.relay_s} for a in self.agents]
        for r in rows:
            r["token_ids"] = list(r["token_ids"])
        return {"workflow": self.workflow, "mode": self.mode, "layout": self.layout,
                "context_tokens": self.context_tokens, "wall_s": self.wall_s, "totals": self.totals(),
                "agents": rows, "switch_events": list(self.switch_events)}


@dataclass(slots=True)
class Finished:
    """What a finished agent leaves for its successors."""

    text: str
    ids: list[int]  # its whole turn as tokens (what its cache would hold)
    base: list[int]  # what it read before its own turn
    payload: Any  # the executor's handle on its whole-turn cache, when a successor takes it
    lost: str = ""  # why its payload never reached the store (``TurnOut.put_error``)
    text_read: str = ""  # what it read before its own turn, as text (an auto edge's features)
    answer_start: int = 0  # index in ``ids`` of its first answer token
    answer: tuple[int, ...] = ()

    @property
    def turn_text(self) -> str:
        """Its whole turn as text, roughly (what a relayed cache of it carries): for an auto edge's features."""
        return self.text_read + "\n" + self.text


def quote_reports(done: Sequence[tuple[str, str]], prompt: str) -> str:
    """A fan-in agent's turn: the senders' answers, then its own prompt."""
    body = "\n\n".join(f"[{name}] {text.strip()}" for name, text in done)
    return f"Reports:\n\n{body}\n\n{prompt}"


def needs_payload(wf: Workflow, name: str) -> bool:
    """A successor continues from this agent's whole turn (kv), or a fan-in two steps on does (kv+text)."""
    for e in wf.outgoing(name):
        if e.channel in ("kv", "auto"):  # auto: the policy may relay it, and the switch's probe reads it
            return True
        if any(g.channel == "kv+text" for g in wf.outgoing(e.dst)):
            return True
    return False


def resolve_inputs(plan: Workflow, spec, done: dict, context_ids: list[int], route: Route | None = None
                   ) -> tuple[str, list[int], str, str | None]:
    """What agent ``spec`` reads, given the finished agents ``done``: (channel, base token ids, prompt,
    name of the agent whose payload it continues from, or None).

    A root reads the shared context; a single predecessor's whole turn comes as its cache (``kv``)
    or as tokens (``text``) — on an ``auto`` edge as ``route`` says, or not at all (``none``); a fan-in
    reads the senders' shared context — as the grand-sender's cache for ``kv+text`` — then its own turn
    quoting their answers.
    """
    ins = plan.incoming(spec.name)
    if not ins:
        return "root", context_ids, spec.prompt, None
    if len(ins) == 1 and ins[0].channel == "auto":
        if route is None:
            raise RuntimeError(f"auto edge {ins[0].src}->{spec.name} has no route")
        src = ins[0].src
        label = "auto:" + route.channel + (f"+{route.codec}" if route.codec not in (None, "raw") else "")
        base = [] if route.channel == "none" else done[src].ids
        return label, base, spec.prompt, (src if route.channel == "kv" else None)
    if len(ins) == 1:
        src = ins[0].src
        return ins[0].channel, done[src].ids, spec.prompt, (src if ins[0].channel == "kv" else None)
    senders = [done[e.src] for e in ins]
    if any(s.base != senders[0].base for s in senders[1:]):
        raise RuntimeError(f"{spec.name}: fan-in senders read different contexts")
    prompt = quote_reports([(e.src, done[e.src].text) for e in ins], spec.prompt)
    grand = plan.incoming(ins[0].src)
    channel, base = ins[0].channel, senders[0].base
    cache_src = grand[0].src if (channel == "kv+text" and grand and done[grand[0].src].payload is not None) else None
    if channel == "kv+text" and cache_src is None:
        channel = "kv+text:no-cache"  # roots share no cache: the shared context is re-encoded
    return channel, base, prompt, cache_src


AUTO_EXECUTOR = ("compatible", "prompt_tokens", "engine", "edge_codecs", "probe")  # what an executor offers to run auto edges


def run_workflow(executor_or_lm, wf: Workflow, context: str, *, mode: str = "kv",
                 policy: AutoPolicy | None = None) -> RunTrace:
    """Run every agent of ``wf`` once over the shared ``context``; ``mode="text"`` re-encodes every edge.

    ``executor_or_lm``: an ``Executor`` (``workflows.executors``), or a loaded model to run in process.
    ``policy``: decides the ``auto`` edges (``workflows.auto``); keep one across runs so its switch learns.
    """
    if mode not in RUN_MODES:
        raise ValueError(f"mode must be one of {RUN_MODES}, got {mode!r}")
    ex = executor_or_lm if isinstance(executor_or_lm, Executor) else InProcessExecutor(executor_or_lm)
    plan = wf if mode == "kv" else wf.with_channels("text")
    auto = [e for e in plan.edges if e.channel == "auto"]
    if auto and policy is None:
        raise InvalidWorkflow(f"edge {auto[0].src}->{auto[0].dst} is channel \"auto\"; expected a policy to "
                              "decide it (run_workflow(..., policy=AutoPolicy(value, cost)))")
    if auto and not all(callable(getattr(ex, m, None)) for m in AUTO_EXECUTOR):
        raise InvalidWorkflow(f"edge {auto[0].src}->{auto[0].dst} is channel \"auto\" on {type(ex).__name__}; "
                              "expected the in-process executor (it tells compatibility and runs the probe)")
    ex.start(plan)
    t_run = time.perf_counter()
    done: dict[str, Finished] = {}
    put_s: dict[str, float] = {}
    records = []
    n_events = len(policy.events) if policy is not None else 0
    context_ids = ex.context_ids(plan.agents[0].name, context)
    for spec in plan.agents:
        t0 = time.perf_counter()
        ins = plan.incoming(spec.name)
        route = (route_edge(policy, ex, spec, ins[0].src, done[ins[0].src])
                 if len(ins) == 1 and ins[0].channel == "auto" else None)
        channel, base, prompt, src = resolve_inputs(plan, spec, done, context_ids, route)
        cache = done[src].payload if src is not None else None
        kw = {"layout": plan.layout, "max_new_tokens": spec.max_new_tokens, "min_new_tokens": spec.min_new_tokens,
              "want_payload": needs_payload(plan, spec.name)}
        # a partial edge: the receiver's prompt selects the positions it gets; an auto kv route: its codec
        part = {"partial": ins[0].partial} if len(ins) == 1 and ins[0].partial is not None and cache is not None else {}
        if route is not None and cache is not None and route.codec not in (None, "raw"):
            part = {"codec": route.codec}
        fallback, out, kind, why = "", None, None, ""
        if src is not None and cache is None and done[src].lost:  # its sender's store put failed
            kind, _, why = done[src].lost.partition(": ")
        else:
            try:
                out = ex.turn(spec.name, prompt, list(base), cache, **kw, **part)
            except Exception as e:
                kind = refusal(e)
                if cache is None or kind is None:
                    raise
                why = refusal_message(e)
        if out is None:  # the relayed payload was refused, lost or unreadable: never used
            if not all(edge.on_refused == "text" for edge in plan.incoming(spec.name)):
                raise EdgeRefused(src, spec.name, why, kind)
            fallback = f"{kind}: {why}"
            channel, cache = f"{channel}->text", None
            out = ex.turn(spec.name, prompt, list(base), None, **kw)  # the same tokens, re-encoded
        wall = time.perf_counter() - t0
        put_s[spec.name] = out.put_s
        done[spec.name] = Finished(out.text, list(out.ids), list(base), out.payload, out.put_error,
                                   text_read=text_read(plan, spec, done, context, route),
                                   answer_start=out.input_tokens, answer=tuple(out.token_ids))
        transfer = put_s.get(src, 0.0) + out.get_s if cache is not None else 0.0
        records.append(record(spec.name, channel, out, transfer, wall, fallback,
                              route.to_dict() if route is not None else None))
        release_unused(plan, done, spec.name, ex.release)
    events = tuple(event_dict(e) for e in policy.events[n_events:]) if policy is not None else ()
    return RunTrace(wf.name, mode, plan.layout, len(context_ids), tuple(records), time.perf_counter() - t_run,
                    events)


def text_read(plan: Workflow, spec, done: dict[str, Finished], context: str, route: Route | None) -> str:
    """What ``spec`` read before its own turn, as text (its role and prompt included): an auto edge's features."""
    ins = plan.incoming(spec.name)
    if not ins:
        head = context
    elif route is not None and route.channel == "none":
        head = ""
    else:
        head = done[ins[0].src].turn_text if len(ins) == 1 else done[ins[0].src].text_read
    return "\n".join(t for t in (head, spec.role, spec.prompt) if t)


def route_edge(policy: AutoPolicy, ex, spec, src: str, sender: Finished) -> Route:
    """Decide the auto edge ``src -> spec.name`` for this run (``workflows.auto``); the switch's probe scores
    the sender's answer with the sender's cache cut where that answer starts, versus without it."""
    edge = f"{src}->{spec.name}"
    compatible = ex.compatible(src, spec.name)
    req = policy.request(edge, context=sender.turn_text, prompt="\n".join((spec.role, spec.prompt)),
                         context_tokens=len(sender.ids), prompt_tokens=ex.prompt_tokens(spec.name, spec.prompt),
                         compatible=compatible, engine=ex.engine(spec.name), codecs=ex.edge_codecs(policy.codecs))
    start, n = sender.answer_start, len(sender.answer)
    probe = None
    if compatible and sender.payload is not None and n >= 1 and start >= 2:
        if tuple(sender.ids[start:start + n]) != sender.answer:
            raise RuntimeError(f"{src}: its answer is not at token {start} of its turn")
        def probe() -> float:
            return ex.probe(spec.name, sender.payload, sender.ids[start - 1:start + n], upto=start - 1)
    return policy.route(edge, req, probe)


def refusal(e: BaseException) -> str | None:
    """The error type's name when ``e`` is a receiver refusing a relayed payload (untrusted, or over its byte
    budget) or its store losing it or failing to read it after its retries, in this process or reported by
    a worker (``WorkerError.refused``); None for any other failure."""
    if isinstance(e, (PayloadError, OverBudget, PayloadNotFound, StoreError)):
        return type(e).__name__
    if isinstance(e, WorkerError) and getattr(e, "refused", False):
        return getattr(e, "kind", "") or type(e).__name__
    return None


def refusal_message(e: BaseException) -> str:
    msg = str(e)
    kind = getattr(e, "kind", "")
    return msg.removeprefix(f"{kind}: ") if isinstance(e, WorkerError) and kind else msg


def record(name: str, channel: str, out: TurnOut, transfer_s: float, wall_s: float, fallback: str = "",
           decision: dict | None = None) -> AgentRecord:
    return AgentRecord(
        name=name, channel=channel, input_tokens=out.input_tokens, prefill_tokens=out.prefill_tokens,
        relayed_tokens=out.relayed_tokens, prefill_s=out.prefill_s, decode_tokens=len(out.token_ids),
        decode_s=out.decode_s, relay_bytes=out.relay_bytes, relay_encode_s=out.relay_encode_s,
        relay_transfer_s=transfer_s, relay_decode_s=out.relay_decode_s, wall_s=wall_s, text=out.text,
        token_ids=out.token_ids, fallback=fallback, decision=decision)


def release_unused(wf: Workflow, done: dict[str, Finished], just_ran: str, release=None) -> None:
    """Drop whole-turn caches no later agent can use (they are tens of MB at a few thousand tokens);
    ``release(handle)`` frees one where the executor holds it (a store key, an object-store copy)."""
    names = [a.name for a in wf.agents]
    pending = set(names[names.index(just_ran) + 1:])
    for name, d in done.items():
        if d.payload is None:
            continue
        users = {e.dst for e in wf.outgoing(name)}
        users |= {g.dst for e in wf.outgoing(name) for g in wf.outgoing(e.dst)}
        if not users & pending:
            if release is not None:
                release(d.payload)
            d.payload = None
