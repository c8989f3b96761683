"""Where replicas compute, and what sharing a host's cores costs a request.

Replicas of different models on one host are not independent servers: each forward pass asks for
``threads`` cores, and when more replicas are busy than the host has room for, they time-share
its cores. The model here is processor sharing:

* a host runs ``slots = cores // threads`` busy replicas at full speed (at least one);
* a request sent to a replica while ``a`` other replicas of its host are busy runs ``stretch =
  (a + 1) / slots`` times slower than alone once ``a + 1 > slots`` (while they stay busy);
* and every request waiting or running on those other replicas finishes about ``w / slots`` later,
  ``w`` being the new request's service seconds at full speed — the delay it **imposes** (on a
  saturated single-slot host, work added anywhere delays everything behind it by its own length).

``Host`` measures what a request actually shared: the number of busy replicas of the host,
integrated over time, so a finished request reports the mean number busy while it ran, and the
scheduler can take contention out of the rates it learns (``Result.host_busy``). It counts the
replicas of one process; Ray actors in separate processes on one node each see only themselves.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    host: str  # the machine a replica computes on (its hostname)
    cores: int  # the cores this process may use there
    threads: int  # the cores one forward pass of the replica uses

    @property
    def slots(self) -> int:
        """Busy replicas the host runs at full speed at once."""
        return max(1, self.cores // max(1, self.threads))

    @classmethod
    def here(cls) -> Placement:
        import torch

        return cls(socket.gethostname(), len(os.sched_getaffinity(0)), torch.get_num_threads())


@dataclass(frozen=True, slots=True)
class Sharing:
    stretch: float  # the request's service takes this many times its full-speed seconds
    imposed_per_s: float  # seconds of delay added to other requests per full-speed second of its service


ALONE = Sharing(1.0, 0.0)


def sharing(slots: int, others_busy: Sequence[int]) -> Sharing:
    """What a request sent to an idle-or-own replica shares, given the depth (requests waiting or running)
    of each *other* busy replica on its host."""
    busy = [d for d in others_busy if d > 0]
    if len(busy) + 1 <= slots:
        return ALONE
    return Sharing((len(busy) + 1) / slots, sum(busy) / slots)


def destretch(host_busy: float, slots: int) -> float:
    """The factor by which a request that ran beside ``host_busy`` busy replicas on average (itself
    included) was slowed: its measured seconds divided by this are its full-speed seconds."""
    return max(1.0, host_busy / max(1, slots))


class Host:
    """The busy replicas of one host in this process, and their count integrated over time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = 0
        self._area = 0.0  # integral of the busy count over time, busy-replica-seconds
        self._t = time.perf_counter()

    def _advance(self) -> float:
        now = time.perf_counter()
        self._area += self._busy * (now - self._t)
        self._t = now
        return now

    def enter(self) -> tuple[float, float]:
        """A replica starts working; returns the mark (time, area) its ``mean_busy`` starts from."""
        with self._lock:
            now = self._advance()
            self._busy += 1
            return now, self._area

    def leave(self) -> None:
        with self._lock:
            self._advance()
            self._busy -= 1

    def mark(self) -> tuple[float, float]:
        with self._lock:
            return self._advance(), self._area

    def mean_busy(self, since: tuple[float, float]) -> float:
        """Mean busy replicas (the caller included, if busy) from the mark ``since`` until now."""
        with self._lock:
            now = self._advance()
            t0, a0 = since
            return (self._area - a0) / (now - t0) if now > t0 else float(self._busy)


_HOSTS: dict[str, Host] = {}
_HOSTS_LOCK = threading.Lock()


def host_of(p: Placement) -> Host:
    """The one ``Host`` of this process for ``p.host``: replicas placed on it share it."""
    with _HOSTS_LOCK:
        return _HOSTS.setdefault(p.host, Host())
