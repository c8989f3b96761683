"""``channel = "auto"`` edges: per run, a policy decides how the sender's turn reaches the receiver.

For each auto edge the runner (``workflows.run``) builds a ``policy.decide.Request`` from what it holds
before relaying — the sender's whole turn as text and its token count, the receiver's prompt, whether the
receiver can prove the sender's cache its own kind, the link — and ``route`` turns the decision into what
the runner does:

* ``kv`` (with the decision's codec) — the sender's whole-turn cache is relayed;
* ``text`` (the decision was ``text_full``) — the receiver re-encodes the same tokens;
* ``none`` — the receiver reads only its own turn (its prompt already holds what the sender read).

The runtime switch (``policy.switch.RelaySwitch``, one estimate per edge, kept across runs) gates relay:
when the decision relays a cache, a sampled run first measures the probe signal (``agents.probe.relay_gain``:
how much the sender's cache explains the sender's answer to the receiver's model) and feeds it to the
switch; while the switch holds relay off on that edge, a kv decision is carried out as ``text``. Every
route is a ``Route`` in the trace (``AgentRecord.decision``) and every switch a ``SwitchEvent``
(``RunTrace.switch_events``), with the evidence behind it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvrelay.core.errors import InvalidInput
from kvrelay.policy.cost import CostProfile, Link
from kvrelay.policy.decide import DEFAULT_CODECS, Decision, Request, Slo, decide
from kvrelay.policy.features import Features
from kvrelay.policy.switch import RelaySwitch, SwitchEvent
from kvrelay.policy.value import ValueModel

ROUTES = ("kv", "text", "none")  # what the runner does on an auto edge


@dataclass(frozen=True, slots=True)
class Route:
    """One auto edge in one run: what ``decide`` chose, what the runner did, and the switch's part in it."""

    edge: str  # "src->dst"
    channel: str  # kv | text | none: what the runner did
    codec: str | None  # the codec the cache was relayed under (kv only)
    decision: Decision
    relay_on: bool  # the switch's state of this edge after this run's probe (True without a switch)
    probe: float | None = None  # the signal sampled in this run (nats/token), None when not sampled
    reason: str = ""  # one line: the decision's reason, and the switch's gate when it overrode a relay

    def __post_init__(self):
        if self.channel not in ROUTES:
            raise InvalidInput(f"route channel {self.channel!r}", f"one of {ROUTES}")
        if not self.reason or "\n" in self.reason:
            raise InvalidInput(f"route reason {self.reason!r}", "one non-empty line")

    def to_dict(self) -> dict:
        return {"edge": self.edge, "channel": self.channel, "codec": self.codec, "relay_on": self.relay_on,
                "probe": self.probe, "reason": self.reason, "decision": self.decision.to_dict()}


@dataclass
class AutoPolicy:
    """What auto edges are decided with: a fitted value model, a cost profile, an SLO, the link between
    agents (``links`` per edge name ``src->dst``, else ``link``; None: in process, or the profile's link),
    the kv codecs the sender may use, and the runtime switch (None: no runtime gating).

    Keep one ``AutoPolicy`` across runs of a workflow: its switch's per-edge estimates carry over."""

    value: ValueModel
    cost: CostProfile
    slo: Slo = field(default_factory=Slo)
    link: Link | None = None
    links: dict[str, Link] = field(default_factory=dict)
    codecs: tuple[str, ...] = DEFAULT_CODECS
    switch: RelaySwitch | None = field(default_factory=RelaySwitch)
    events: list[SwitchEvent] = field(default_factory=list)  # every switch, across runs

    def __post_init__(self):
        self.codecs = tuple(self.codecs)
        if not self.codecs:
            raise InvalidInput("an auto policy without kv codecs", "at least one codec, e.g. raw")
        for c in self.codecs:
            self.cost.codec(c)  # a codec the profile does not price is a mistake now, not at the first edge

    def link_for(self, edge: str) -> Link | None:
        return self.links.get(edge, self.link)

    def request(self, edge: str, *, context: str, prompt: str, context_tokens: int, prompt_tokens: int,
                compatible: bool, engine: str = "fp32", codecs: tuple[str, ...] | None = None) -> Request:
        """The request an auto edge poses: ``context`` is the sender's whole turn as text (what a relay
        would carry), ``prompt`` what the receiver is asked (its role and prompt)."""
        return Request(Features.of(context, prompt, max(context_tokens, 1), engine), prompt_tokens=prompt_tokens,
                       compatible=compatible, codecs=tuple(codecs or self.codecs), link=self.link_for(edge))

    def route(self, edge: str, req: Request, probe: Callable[[], float | None] | None = None) -> Route:
        """Decide ``req`` on ``edge``, sample the probe when the decision relays a cache and the switch asks
        for a sample (``probe()`` measures it, None when it cannot this run; ``probe`` None: no probe
        possible), and gate relay on the switch."""
        d = decide(req, self.slo, self.value, self.cost)
        if d.channel not in ("kv", "text_full", "none"):
            raise InvalidInput(f"decision {d.channel!r} on auto edge {edge}", "kv, text_full or none")
        signal = None
        if d.relays_cache and self.switch is not None and probe is not None and self.switch.should_sample(edge):
            measured = probe()
            if measured is not None:
                signal = float(measured)
                ev = self.switch.observe(edge, signal)
                if ev is not None:
                    self.events.append(ev)
        relay_on = self.switch.relay_on(edge) if self.switch is not None else True
        if d.channel == "kv" and relay_on:
            return Route(edge, "kv", d.codec, d, True, signal, d.reason)
        if d.channel == "kv":
            est = self.switch.estimate(edge)
            sw = self.switch
            why = (f"relay switched off on {edge} (the cache saves {est:.3f} nats/token; off below "
                   f"{sw.threshold:g}, on again above {sw.threshold + sw.hysteresis:g}): text instead of "
                   f"{d.channel}" + (f"+{d.codec}" if d.codec else "") + f"; decide: {d.reason}")
            return Route(edge, "text", None, d, False, signal, why)
        return Route(edge, "text" if d.channel == "text_full" else "none", None, d, relay_on, signal, d.reason)


def event_dict(ev: SwitchEvent) -> dict:
    d = asdict(ev)
    d["evidence"] = list(d["evidence"])
    return d
