"""Timing discipline: a figure is *quiet* only when nothing but the benchmark ran on the cores.

A benchmark running ``threads`` threads adds about ``threads`` to the 1-minute load average by
itself. A reading above ``threads + MARGIN`` means other work shared the cores, and shared cores
slow engines unevenly (a thread-pool engine that spins loses more than one that yields), so a
comparison from such a run is not a property of the engines. ``load_status`` labels a run from its
readings; ``require_quiet`` refuses one unless the caller allows load, in which case every figure
of the run carries the label ``loaded``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from kvrelay.core.errors import MachineLoaded

MARGIN = 0.5  # load above the benchmark's own threads that still counts as quiet
QUIET, LOADED = "quiet", "loaded"


def load1() -> float:
    """The machine's 1-minute load average now."""
    return os.getloadavg()[0]


LoadReader = Callable[[], float]


def limit(threads: int) -> float:
    return threads + MARGIN


def load_status(readings: Sequence[float], threads: int) -> dict:
    """``{"status": "quiet"|"loaded", "limit", "max"}`` of a run's 1-minute load readings."""
    if not readings:
        raise ValueError("a timing run records at least one load reading")
    top = max(readings)
    return {"status": LOADED if top > limit(threads) else QUIET, "limit": limit(threads), "max": top}


def repeat_loads(before: Sequence[float], after: float, threads: int) -> dict:
    """A timing JSON's ``load_average``: the reading before each repeat, the one after the last, and their
    ``load_status``."""
    return {"load1_before_repeat": list(before), "load1_after": after, **load_status([*before, after], threads)}


def require_quiet(reading: float, threads: int, allow_load: bool, when: str) -> None:
    """Raise ``MachineLoaded`` for a reading above ``threads + MARGIN`` unless ``allow_load``."""
    if reading > limit(threads) and not allow_load:
        raise MachineLoaded(reading, threads, limit(threads), when)
