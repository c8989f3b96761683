"""Workflows as data: agents, edges with a channel, and a position layout.

The *token sequence* each agent reads is fixed by the graph alone, so that every channel
choice feeds it the same tokens and greedy outputs can be compared exactly:

* a root (no incoming edge) reads the shared context as a user turn, then its own turn;
* an agent with one predecessor reads that predecessor's whole turn (everything the
  predecessor read, its prompt and its answer), then its own turn;
* an agent with several predecessors (fan-in) reads the context they all share (they must have
  the same predecessor, or all be roots), then its own turn, which quotes their answers.

The *channel* of an edge says only how those tokens arrive:

* ``text``    — the receiver re-encodes them (prefills every token itself): the baseline.
* ``kv``      — the sender's whole-turn cache is relayed; the receiver prefills only its own
  turn. Single-predecessor edges only: several whole-turn caches cannot be one prefix.
* ``kv+text`` — fan-in edges: the cache the senders started from (their shared context) is
  relayed, and the senders' answers arrive as text inside the receiver's turn.
* ``auto``    — single-predecessor edges: a policy decides per run (``workflows.auto``: the cost and
  value models of ``kvrelay.policy``, gated by a runtime switch) whether the sender's turn arrives as
  its cache (``kv``, with a codec), as tokens (``text``), or not at all (``none``: the receiver reads
  only its own turn, for a receiver whose prompt already holds what the sender read). The decision and
  its reason are in the trace (``AgentRecord.decision``).

``on_refused`` says what happens when the receiver refuses the relayed payload (a typed
``PayloadError``: corrupt, incompatible, stale, a missing round, expired, unsigned...) or the store
lost it: ``stop`` (default) raises ``EdgeRefused`` naming the edge; ``text`` rebuilds the edge from
text (the receiver re-encodes the same tokens) and the trace says so (``AgentRecord.fallback``).
``verify = {k = 32}`` (also ``full = true``, ``seed = N``) makes the receiver recompute part of the
relayed payload from its own token ids before using it (``agents.verify``); one that fails is
``TamperedPayload``, refused like any other. An agent's ``max_bytes`` is its byte budget as a receiver:
a relayed payload that decodes to more is ``OverBudget`` (refused before it is decoded or used), and
``on_refused`` applies to it like to any refusal.
"""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, dataclass, field, replace
from pathlib import Path

from kvrelay.agents.agent import LAYOUTS
from kvrelay.agents.verify import VerifySpec
from kvrelay.core.errors import InvalidWorkflow
from kvrelay.transport.budget import ByteBudget

CHANNELS = ("text", "kv", "kv+text", "auto")
RELAYING = ("kv", "auto")  # single-edge channels that may hand the sender's whole-turn cache on
ON_REFUSED = ("stop", "text")  # what a receiver does when it refuses an edge's relayed payload


@dataclass(frozen=True, slots=True)
class AgentSpec:
    name: str
    role: str  # the agent's standing instruction (folded into its turn in the continue layout)
    prompt: str  # what it is asked to do in its turn
    max_new_tokens: int = 48
    min_new_tokens: int = 0  # stop tokens suppressed until this many tokens are written
    max_bytes: int | None = None  # its byte budget as a receiver (agents.receive.admit); None: none

    def __post_init__(self):
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"agent name must be non-empty without spaces, got {self.name!r}")
        if self.max_bytes is not None and (type(self.max_bytes) is not int or self.max_bytes < 1):
            raise ValueError(f"{self.name}: max_bytes (its byte budget as a receiver) must be an integer >= 1, "
                             f"got {self.max_bytes!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"{self.name}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"{self.name}: need 0 <= min_new_tokens ({self.min_new_tokens}) "
                             f"<= max_new_tokens ({self.max_new_tokens})")

    def budget(self) -> ByteBudget | None:
        """Its byte budget as a receiver (policy ``refuse``: a receiver keeps no payload to evict)."""
        return None if self.max_bytes is None else ByteBudget(self.max_bytes)


@dataclass(frozen=True, slots=True)
class Edge:
    src: str
    dst: str
    channel: str = "kv"
    on_refused: str = "stop"  # stop: EdgeRefused naming the edge; text: rebuild it from text (said in the trace)
    verify: VerifySpec | None = None  # the receiver recomputes part of the relayed payload first (agents.verify)
    partial: float | None = None  # kv edges: relay only this share of positions, chosen by the receiver's prompt

    def __post_init__(self):
        if self.partial is not None and (self.channel != "kv" or type(self.partial) not in (int, float)
                                         or not 0 < self.partial <= 1 or self.verify is not None):
            raise ValueError(f"edge {self.src}->{self.dst}: partial must be a fraction in (0, 1] on a kv edge "
                             f"without verify, got partial={self.partial!r} on channel {self.channel!r}")
        if isinstance(self.verify, dict):  # from TOML: verify = {k = 32}
            unknown = set(self.verify) - {"k", "full", "seed"}
            if unknown:
                raise ValueError(f"edge {self.src}->{self.dst}: verify takes k, full and seed, not {sorted(unknown)}")
            object.__setattr__(self, "verify", VerifySpec(**self.verify))
        if self.verify is not None and not isinstance(self.verify, VerifySpec):
            raise ValueError(f"edge {self.src}->{self.dst}: verify must be a table like {{k = 32}}, got {self.verify!r}")
        if self.channel not in CHANNELS:
            raise ValueError(f"edge {self.src}->{self.dst}: channel must be one of {CHANNELS}, got {self.channel!r}")
        if self.on_refused not in ON_REFUSED:
            raise ValueError(f"edge {self.src}->{self.dst}: on_refused must be one of {ON_REFUSED}, "
                             f"got {self.on_refused!r}")
        if self.src == self.dst:
            raise ValueError(f"edge {self.src}->{self.dst} is a self-loop")


@dataclass(frozen=True, slots=True)
class Workflow:
    """A DAG of agents; ``agents`` is listed in execution order (every edge points forward)."""

    name: str
    agents: tuple[AgentSpec, ...]
    edges: tuple[Edge, ...] = ()
    layout: str = "continue"
    description: str = ""
    _preds: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "agents", tuple(self.agents))
        object.__setattr__(self, "edges", tuple(self.edges))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not self.agents:
            raise ValueError("a workflow needs at least one agent")
        order = {a.name: i for i, a in enumerate(self.agents)}
        if len(order) != len(self.agents):
            raise ValueError(f"agent names must be unique: {[a.name for a in self.agents]}")
        preds: dict[str, list[Edge]] = {a.name: [] for a in self.agents}
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in order:
                    raise ValueError(f"edge {e.src}->{e.dst}: no agent named {end!r}")
            if order[e.src] >= order[e.dst]:
                raise ValueError(f"edge {e.src}->{e.dst} points backwards: list agents in execution order")
            preds[e.dst].append(e)
        for dst, ins in preds.items():
            if len({e.src for e in ins}) != len(ins):
                raise ValueError(f"{dst}: duplicate incoming edges")
            if len(ins) == 1 and ins[0].channel == "kv+text":
                raise ValueError(f"edge {ins[0].src}->{dst}: kv+text is for fan-in; a single edge is kv or text")
            if len(ins) > 1:
                kv = [e for e in ins if e.channel in RELAYING]
                if kv:
                    raise ValueError(f"edge {kv[0].src}->{dst}: several whole-turn caches cannot form one "
                                     f"prefix ({kv[0].channel}); use kv+text (shared context as cache, answers "
                                     "as text)")
                auto = [p for e in ins for p in preds[e.src] if p.channel == "auto"]
                if auto:
                    raise ValueError(f"edge {auto[0].src}->{auto[0].dst}: a fan-in sender's input cannot be auto "
                                     f"(the senders of {dst} must read one context); make it kv or text")
                grand = {tuple(sorted(p.src for p in preds[e.src])) for e in ins}
                if len(grand) != 1 or len(next(iter(grand))) > 1:
                    raise ValueError(f"{dst}: fan-in senders must share one predecessor (or all be roots); "
                                     f"they have {sorted(grand)}")
        for e in self.edges:
            if e.partial is None:
                continue
            if self.layout != "continue":
                raise ValueError(f"edge {e.src}->{e.dst}: a partial edge needs layout = \"continue\" (positions kept)")
            onward = [g for g in self.edges if g.src == e.dst and (g.channel in RELAYING or any(
                h.src == g.dst and h.channel == "kv+text" for h in self.edges))]
            if onward:
                raise ValueError(f"edge {e.src}->{e.dst}: the receiver of a partial edge cannot pass its cache on "
                                 f"({onward[0].src}->{onward[0].dst} needs it); make that edge text")
        object.__setattr__(self, "_preds", {k: tuple(v) for k, v in preds.items()})

    # -- derived -------------------------------------------------------------------------------
    def agent(self, name: str) -> AgentSpec:
        for a in self.agents:
            if a.name == name:
                return a
        raise KeyError(f"no agent {name!r} in workflow {self.name!r}")

    def incoming(self, name: str) -> tuple[Edge, ...]:
        return self._preds[name]

    def verify_for(self, name: str) -> VerifySpec | None:
        """How ``name`` verifies the payloads it receives: the first incoming edge's ``verify``, if any."""
        return next((e.verify for e in self.incoming(name) if e.verify is not None), None)

    def outgoing(self, name: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.src == name)

    def with_channels(self, channel: str) -> Workflow:
        """The same graph with every edge on ``channel`` (``text``: the re-encode baseline)."""
        return replace(self, edges=tuple(replace(e, channel=channel, partial=e.partial if channel == "kv" else None)
                                         for e in self.edges))

    def with_layout(self, layout: str) -> Workflow:
        return replace(self, layout=layout)

    def with_tokens(self, max_new_tokens: int | None = None, min_new_tokens: int | None = None) -> Workflow:
        def fix(a: AgentSpec) -> AgentSpec:
            hi = a.max_new_tokens if max_new_tokens is None else max_new_tokens
            lo = a.min_new_tokens if min_new_tokens is None else min_new_tokens
            return replace(a, max_new_tokens=max(hi, lo), min_new_tokens=lo)
        return replace(self, agents=tuple(fix(a) for a in self.agents))

    # -- TOML ----------------------------------------------------------------------------------
    def to_toml(self) -> str:
        lines = [f"name = {_q(self.name)}", f"layout = {_q(self.layout)}"]
        if self.description:
            lines.append(f"description = {_q(self.description)}")
        for a in self.agents:
            lines += ["", "[[agents]]", f"name = {_q(a.name)}", f"role = {_q(a.role)}", f"prompt = {_q(a.prompt)}",
                      f"max_new_tokens = {a.max_new_tokens}", f"min_new_tokens = {a.min_new_tokens}"]
            if a.max_bytes is not None:
                lines.append(f"max_bytes = {a.max_bytes}")
        for e in self.edges:
            lines += ["", "[[edges]]", f"src = {_q(e.src)}", f"dst = {_q(e.dst)}", f"channel = {_q(e.channel)}"]
            if e.partial is not None:
                lines.append(f"partial = {e.partial!r}")
            if e.on_refused != "stop":
                lines.append(f"on_refused = {_q(e.on_refused)}")
            if e.verify is not None:
                v = e.verify
                seed = f", seed = {v.seed}" if v.seed is not None else ""
                lines.append(f"verify = {{k = {v.k}, full = {str(v.full).lower()}{seed}}}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str) -> Workflow:
        """Parse the TOML form (``to_toml``). Every key is checked against the fields it fills (names,
        required keys, str / int types, int bounds) first, so a mistake is an ``InvalidWorkflow`` naming
        the key, e.g. ``agents[1].max_new_tokens``, and what was expected."""
        try:
            d = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise InvalidWorkflow(f"not TOML: {e}") from None
        top = {"name": "str", "layout": "str", "description": "str", "agents": "list", "edges": "list"}
        _check_table("workflow", d, top, required=("name",))
        agents = [_fields(f"agents[{i}]", a, AgentSpec) for i, a in enumerate(d.get("agents", []))]
        edges = [_fields(f"edges[{i}]", e, Edge) for i, e in enumerate(d.get("edges", []))]
        try:
            return cls(name=d["name"], layout=d.get("layout", "continue"), description=d.get("description", ""),
                       agents=tuple(AgentSpec(**a) for a in agents), edges=tuple(Edge(**e) for e in edges))
        except ValueError as e:
            raise InvalidWorkflow(str(e)) from None

    @classmethod
    def load(cls, path: str | Path) -> Workflow:
        return cls.from_toml(Path(path).read_text(encoding="utf-8"))


MAX_TOKENS_IN_TOML = 1 << 20  # an int field of a workflow (max_new_tokens, ...) above this is a typo
_EXPECTED = {"str": "a string", "int": "an integer", "list": "an array of tables"}


def _check_table(where: str, d: object, types: dict[str, str], required: tuple[str, ...]) -> None:
    if not isinstance(d, dict):
        raise InvalidWorkflow(f"{where} is {d!r}; expected a table with keys among {sorted(types)}")
    unknown = sorted(set(d) - set(types))
    if unknown:
        raise InvalidWorkflow(f"{where}: unknown keys {unknown}; expected keys among {sorted(types)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise InvalidWorkflow(f"{where}: missing {missing}; expected {', '.join(required)} at least")
    for k, v in d.items():
        want = types[k]
        ok = {"str": isinstance(v, str), "int": type(v) is int, "list": isinstance(v, list)}.get(want, True)
        if not ok:
            raise InvalidWorkflow(f"{where}.{k} is {v!r}; expected {_EXPECTED[want]}")
        if want == "int" and not 0 <= v <= MAX_TOKENS_IN_TOML:
            raise InvalidWorkflow(f"{where}.{k} is {v}; expected an integer from 0 to {MAX_TOKENS_IN_TOML:,}")


def _fields(where: str, d: object, spec: type) -> dict:
    """A TOML table for dataclass ``spec``: its keys are the fields, str / int fields typed as annotated."""
    fs = spec.__dataclass_fields__
    types = {n: str(f.type) for n, f in fs.items() if f.init}
    required = tuple(n for n, f in fs.items() if f.init and f.default is MISSING and f.default_factory is MISSING)
    _check_table(where, d, types, required)
    return d


def _q(s: str) -> str:
    """A TOML basic string."""
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{out}"'


# -- shapes ------------------------------------------------------------------------------------
def chain(name: str, agents: list[AgentSpec] | tuple[AgentSpec, ...], *, channel: str = "kv",
          layout: str = "continue", description: str = "") -> Workflow:
    """Agents in a line, each reading the previous one's whole turn."""
    edges = tuple(Edge(a.name, b.name, channel) for a, b in zip(agents, agents[1:], strict=False))
    return Workflow(name, tuple(agents), edges, layout, description)


def hierarchy(name: str, planner: AgentSpec, workers: list[AgentSpec] | tuple[AgentSpec, ...],
              aggregator: AgentSpec, *, channel: str = "kv", layout: str = "continue",
              description: str = "") -> Workflow:
    """Planner -> workers (each continues from the planner) -> aggregator (reads every worker's answer).

    ``channel="kv"`` relays the planner's cache to each worker and, on the fan-in, the planner's
    cache plus the workers' answers as text (``kv+text``); ``"text"`` re-encodes everything.
    """
    fan_in = "kv+text" if channel == "kv" else channel
    edges = tuple(Edge(planner.name, w.name, channel) for w in workers)
    edges += tuple(Edge(w.name, aggregator.name, fan_in) for w in workers)
    return Workflow(name, (planner, *workers, aggregator), edges, layout, description)
