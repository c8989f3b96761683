"""Run a workflow on one loaded model, agent by agent, and account for every token and second.

A run is either ``text`` (every edge re-encodes: the baseline) or ``kv`` (edges as declared).
Both feed each agent the same token sequence (see ``spec``), so greedy outputs are comparable
one to one. Per agent we record what it prefilled, what arrived as a cache, what it decoded,
and the relay costs, split the way a transport would split them:

* ``relay_encode_s``   — sender side: finishing the turn into a payload (the last answer token
  and end-of-turn marker go through the model, then the cache is snapshotted);
* ``relay_transfer_s`` — moving it (0 here: in-process hand-over; stores add this later);
* ``relay_decode_s``   — receiver side: building the model cache from the payload (in the
  replace layout this includes prefilling the receiver's own prefix and re-rotating keys).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from kvrelay.agents.agent import Agent, Response
from kvrelay.kv.payload import KVPayload
from kvrelay.workflows.spec import Workflow

MODES = ("text", "kv")


@dataclass(frozen=True, slots=True)
class AgentRecord:
    name: str
    channel: str  # how its input arrived: root | text | kv | kv+text (| kv+text:no-cache)
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

    def totals(self) -> dict:
        keys = ("prefill_tokens", "relayed_tokens", "decode_tokens", "relay_bytes")
        tot = {k: sum(getattr(a, k) for a in self.agents) for k in keys}
        for k in ("prefill_s", "decode_s", "relay_s", "relay_encode_s", "relay_decode_s", "wall_s"):
            tot[f"agents_{k}" if k == "wall_s" else k] = sum(getattr(a, k) for a in self.agents)
        tot["wall_s"] = self.wall_s
        return tot

    def outputs(self) -> dict[str, tuple[int, ...]]:
        return {a.name: a.token_ids for a in self.agents}

    def to_dict(self) -> dict:
        rows = [asdict(a) | {"relay_s": a.relay_s} for a in self.agents]
        for r in rows:
            r["token_ids"] = list(r["token_ids"])
        return {"workflow": self.workflow, "mode": self.mode, "layout": self.layout,
                "context_tokens": self.context_tokens, "wall_s": self.wall_s, "totals": self.totals(),
                "agents": rows}


@dataclass(slots=True)
class Finished:
    """What a finished agent leaves for its successors."""

    text: str
    ids: list[int]  # its whole turn as tokens (what its cache would hold)
    base: list[int]  # what it read before its own turn
    payload: KVPayload | None  # its whole-turn cache, when a successor takes it


def quote_reports(done: Sequence[tuple[str, str]], prompt: str) -> str:
    """A fan-in agent's turn: the senders' answers, then its own prompt."""
    body = "\n\n".join(f"[{name}] {text.strip()}" for name, text in done)
    return f"Reports:\n\n{body}\n\n{prompt}"


def turn_ids(agent: Agent, prompt: str, base: Sequence[int], layout: str, answer: Sequence[int]) -> list[int]:
    """The tokens an agent's cache holds after its turn; equals the returned payload's ``token_ids``."""
    if layout == "replace":
        head = agent.encode(agent.fmt.system(agent.role)) + list(base) + agent.prompt_ids(prompt, with_role=False)
    else:
        head = list(base) + agent.prompt_ids(prompt)
    return head + list(answer) + agent.encode(agent.fmt.assistant_end)


def needs_payload(wf: Workflow, name: str) -> bool:
    """A successor continues from this agent's whole turn (kv), or a fan-in two steps on does (kv+text)."""
    for e in wf.outgoing(name):
        if e.channel == "kv":
            return True
        if any(g.channel == "kv+text" for g in wf.outgoing(e.dst)):
            return True
    return False


def resolve_inputs(plan: Workflow, spec, done: dict, context_ids: list[int]
                   ) -> tuple[str, list[int], str, str | None]:
    """What agent ``spec`` reads, given the finished agents ``done``: (channel, base token ids, prompt,
    name of the agent whose payload it continues from, or None).

    A root reads the shared context; a single predecessor's whole turn comes as its cache (``kv``)
    or as tokens (``text``); a fan-in reads the senders' shared context — as the grand-sender's
    cache for ``kv+text`` — then its own turn quoting their answers.
    """
    ins = plan.incoming(spec.name)
    if not ins:
        return "root", context_ids, spec.prompt, None
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


def run_workflow(lm, wf: Workflow, context: str, *, mode: str = "kv") -> RunTrace:
    """Run every agent of ``wf`` once over the shared ``context``; ``mode="text"`` re-encodes every edge."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    plan = wf if mode == "kv" else wf.with_channels("text")
    layout = plan.layout
    # Agents are set up before the clock starts: a deployed pipeline builds them once.
    agents = {a.name: Agent(lm, a.name, a.role, max_new_tokens=a.max_new_tokens) for a in plan.agents}
    t_run = time.perf_counter()
    done: dict[str, Finished] = {}
    records = []
    context_ids: list[int] | None = None
    for spec in plan.agents:
        t0 = time.perf_counter()
        agent = agents[spec.name]
        if context_ids is None:
            context_ids = agent.encode(agent.fmt.user(context))
        channel, base, prompt, cache_src = resolve_inputs(plan, spec, done, context_ids)
        cache = done[cache_src].payload if cache_src is not None else None
        want_payload = needs_payload(plan, spec.name)
        arg = cache if cache is not None else torch.tensor(base, dtype=torch.int64)
        t1 = time.perf_counter()
        r: Response = agent.respond(prompt, arg, layout=layout, max_new_tokens=spec.max_new_tokens,
                                    min_new_tokens=spec.min_new_tokens, return_payload=want_payload)
        t2 = time.perf_counter()
        wall = t2 - t0
        ids = turn_ids(agent, prompt, base, layout, r.token_ids)
        if r.payload is not None and r.payload.token_ids[0].tolist() != ids:
            raise RuntimeError(f"{spec.name}: payload tokens differ from the turn's token sequence")
        done[spec.name] = Finished(r.text, ids, list(base), r.payload)
        prefix = len(agent.encode(agent.fmt.system(agent.role))) if (cache is not None and layout == "replace") else 0
        encode_s = (t2 - t1 - r.cache_build_s - r.prefill_s - r.decode_s) if r.payload is not None else 0.0
        records.append(AgentRecord(
            name=spec.name, channel=channel, input_tokens=r.prefill_tokens + r.relayed_tokens + prefix,
            prefill_tokens=r.prefill_tokens + prefix, relayed_tokens=r.relayed_tokens, prefill_s=r.prefill_s,
            decode_tokens=len(r.token_ids), decode_s=r.decode_s,
            relay_bytes=cache.nbytes if cache is not None else 0, relay_encode_s=max(encode_s, 0.0),
            relay_transfer_s=0.0, relay_decode_s=r.cache_build_s if cache is not None else 0.0,
            wall_s=wall, text=r.text, token_ids=r.token_ids))
        release_unused(plan, done, spec.name)
    return RunTrace(wf.name, mode, layout, len(context_ids or []), tuple(records), time.perf_counter() - t_run)


def release_unused(wf: Workflow, done: dict[str, Finished], just_ran: str) -> None:
    """Drop whole-turn caches no later agent can use (they are tens of MB at a few thousand tokens)."""
    names = [a.name for a in wf.agents]
    pending = set(names[names.index(just_ran) + 1:])
    for name, d in done.items():
        if d.payload is None:
            continue
        users = {e.dst for e in wf.outgoing(name)}
        users |= {g.dst for e in wf.outgoing(name) for g in wf.outgoing(e.dst)}
        if not users & pending:
            d.payload = None
