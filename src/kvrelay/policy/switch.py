"""The runtime switch: watch a cheap signal on a sampled fraction of requests and turn relay off (and back on)
per edge when its estimated value crosses a threshold. Plain numbers in, decisions and a log out.

The signal (``agents.probe.relay_gain``) is the receiver's drop in negative log-likelihood per token of the
sender's text with the relayed cache versus without it: positive when the cache carries what the text
talks about, ~0 or negative when it does not (another task's cache, or a receiver that already has the
context). Per edge the switch keeps a running mean of the sampled signals; once ``min_samples`` are in,
relay is turned off when the mean falls below ``threshold`` and on again when it rises above
``threshold + hysteresis``. Every switch is a ``SwitchEvent`` with its evidence (the samples behind it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvrelay.core.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class SwitchEvent:
    edge: str
    relay_on: bool  # the new state
    estimate: float  # running mean of the signal when it switched
    samples: int
    evidence: tuple[float, ...]  # the signals behind the estimate (latest last)
    reason: str


@dataclass
class RelaySwitch:
    threshold: float = 0.05  # nats per token the cache must save to keep relaying
    hysteresis: float = 0.05
    sample_rate: float = 0.1  # share of requests that pay for the probe
    min_samples: int = 3
    window: int = 16  # the estimate is the mean of the last ``window`` signals
    seed: int = 0
    log: list[SwitchEvent] = field(default_factory=list)

    def __post_init__(self):
        if not 0.0 < self.sample_rate <= 1.0:
            raise InvalidInput(f"sample_rate {self.sample_rate!r}", "a share in (0, 1]")
        if self.min_samples < 1 or self.window < self.min_samples or self.hysteresis < 0:
            raise InvalidInput("switch window/min_samples/hysteresis", "1 <= min_samples <= window, hysteresis >= 0")
        self._rng = random.Random(self.seed)
        self._signals: dict[str, list[float]] = {}
        self._on: dict[str, bool] = {}

    def relay_on(self, edge: str) -> bool:
        return self._on.get(edge, True)

    def should_sample(self, edge: str) -> bool:
        """Whether this request on ``edge`` pays for the probe (seeded; always while an edge is warming up)."""
        warming = len(self._signals.get(edge, ())) < self.min_samples
        return warming or self._rng.random() < self.sample_rate

    def estimate(self, edge: str) -> float | None:
        xs = self._signals.get(edge)
        return sum(xs) / len(xs) if xs else None

    def observe(self, edge: str, signal: float) -> SwitchEvent | None:
        """Add one sampled signal; returns the switch it caused, if any (also appended to ``log``)."""
        xs = self._signals.setdefault(edge, [])
        xs.append(float(signal))
        del xs[:-self.window]
        if len(xs) < self.min_samples:
            return None
        est, on = sum(xs) / len(xs), self.relay_on(edge)
        if on and est < self.threshold:
            why = f"relay off on {edge}: the cache saves {est:.3f} nats/token < {self.threshold:g} over {len(xs)} samples"
        elif not on and est > self.threshold + self.hysteresis:
            why = (f"relay on on {edge}: the cache saves {est:.3f} nats/token > {self.threshold + self.hysteresis:g} "
                   f"over {len(xs)} samples")
        else:
            return None
        self._on[edge] = not on
        ev = SwitchEvent(edge, not on, est, len(xs), tuple(xs), why)
        self.log.append(ev)
        return ev
