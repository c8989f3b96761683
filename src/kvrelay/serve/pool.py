"""The models a server answers for: one or more replicas per model name, each with its own queue.

``Pool.pick(model)`` returns the replica of that model with the fewest requests waiting; which model
answers a request is the scheduler's choice (``serve.scheduler``) when a client asks for ``auto``.
``Pool.sharing(model)`` is what a request sent there now would share of its host's cores with the
other replicas placed on it (``serve.hosts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.core.errors import InvalidInput
from kvrelay.serve.hosts import Sharing, sharing
from kvrelay.serve.replica import Replica


@dataclass(frozen=True, slots=True)
class Pool:
    replicas: dict[str, tuple[Replica, ...]]

    def __post_init__(self):
        if not self.replicas or not all(self.replicas.values()):
            raise InvalidInput("a pool without replicas", "at least one model with one replica")

    @property
    def models(self) -> list[str]:
        return list(self.replicas)

    def depth(self, model: str) -> int:
        return sum(r.depth for r in self.replicas[model])

    def pick(self, model: str) -> Replica:
        return min(self.replicas[model], key=lambda r: r.depth)

    def sharing(self, model: str) -> Sharing:
        """The host contention a request sent to ``model`` now meets: the replica ``pick`` would choose, beside
        the other busy replicas placed on the same host."""
        r = self.pick(model)
        others = [o.depth for o in self.all() if o is not r and o.placement.host == r.placement.host]
        return sharing(r.placement.slots, others)

    def all(self) -> list:
        return [r for rs in self.replicas.values() for r in rs]

    def close(self, timeout: float | None = None) -> None:
        for rs in self.replicas.values():
            for r in rs:
                r.close(timeout)


def in_process_pool(models: Sequence[tuple[str, object]], store, secret: bytes, *, replicas: int = 1,
                    handle_ttl_s: float = 600.0, batch: bool = False) -> Pool:
    """A pool of ``(name, LoadedModel)`` in this process; replicas of one model share its weights (``batch``:
    each replica runs its own continuous-batching engine, ``serve.batcher``)."""
    return Pool({name: tuple(Replica(name, lm, store, secret, handle_ttl_s=handle_ttl_s, batch=batch)
                             for _ in range(replicas)) for name, lm in models})
