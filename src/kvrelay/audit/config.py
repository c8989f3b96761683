"""What one audit run is: ``AuditConfig`` (the presets in ``presets.py`` are instances of it).

Light on purpose (no torch): the CLI lists presets and checks task specs before anything loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def split_task_spec(spec: str, default: int | None) -> tuple[str, int | None]:
    """``"squad:160"`` → ``("squad", 160)``; ``"squad"`` → ``("squad", default)``."""
    name, sep, count = spec.partition(":")
    if not sep:
        return spec, default
    if not count.isdigit() or int(count) < 2:
        raise ValueError(f"task set {spec!r}: expected NAME or NAME:COUNT with COUNT an integer >= 2")
    return name, int(count)


@dataclass(frozen=True, slots=True)
class AuditConfig:
    """One audit run. Presets in ``presets.py``; the CLI maps onto this 1:1."""

    model: str
    tasks: tuple[str, ...]
    arms: tuple[str, ...]
    seeds: tuple[int, ...] = (0,)
    limit: int | None = 40
    batch_size: int = 8
    message_tokens: int = 48
    similarity_sample: int = 8
    margin: float = 2.8
    n_boot: int = 2000
    preset: str = "custom"
    temperature: float = 0.0  # 0: greedy; > 0: the receiver samples, seeded per (seed, task, arm)

    def __post_init__(self):
        # Arm names are parsed by ``kvrelay.audit.arms.parse_arm`` when a runner is built (that module
        # needs torch; this one stays light so that presets can be listed without it).
        if not self.tasks or not self.arms or not self.seeds:
            raise ValueError("an audit needs at least one task set, one arm and one seed")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 decodes greedily), got {t!r}")
        for t in self.tasks:
            split_task_spec(t, self.limit)

    def task_sets(self) -> list[tuple[str, int | None]]:
        """``(set name, task cap)`` per entry of ``tasks`` (``NAME:COUNT`` overrides ``limit``)."""
        return [split_task_spec(t, self.limit) for t in self.tasks]
