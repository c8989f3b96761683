"""A pool whose replicas are Ray actors: one actor per replica, each loading its own model copy.

``ReplicaActor`` wraps a ``serve.replica.Replica`` (its queue and worker thread live in the actor);
``RayReplica`` is its stand-in in the gateway, with the same face (``submit`` -> a future, ``depth``,
``placement``, ``observers``, ``close``), so the app and the scheduler do not know where a replica runs. An answer
streams back as Ray's streaming generator: text pieces, then the ``Result``. Caches travel through
the store, never through the gateway, so the store must be one every actor reaches (``redis://`` or
``file://``; a ``memory://`` store lives in one process). On a cluster, start Ray first
(``docs/ray.md``) and pass ``--ray-address``; actors ask for ``num_cpus`` each.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from kvrelay.core.errors import InvalidInput
from kvrelay.serve import handles
from kvrelay.serve.hosts import Placement
from kvrelay.serve.pool import Pool
from kvrelay.serve.protocol import ChatRequest
from kvrelay.serve.replica import deliver
from kvrelay.workflows.ray_executor import ModelSpec

MAX_IN_FLIGHT = 64  # concurrent calls an actor accepts (they wait in the replica's queue)


class ReplicaActor:
    """One replica inside a Ray actor (wrapped with ``ray.remote`` by ``ray_pool``)."""

    def __init__(self, name: str, spec: ModelSpec, store_url: str, secret: bytes, handle_ttl_s: float,
                 threads: int | None, batch: bool = False):
        import torch

        from kvrelay.serve.replica import Replica
        from kvrelay.transport.stores import open_store

        if threads:
            torch.set_num_threads(threads)
        self.replica = Replica(name, spec.load(), open_store(store_url), secret, handle_ttl_s=handle_ttl_s,
                               batch=batch)

    def info(self) -> tuple[str, int, int, Placement]:
        r = self.replica
        return r.fingerprint, r.params, r.max_positions, r.placement

    def answer(self, req: ChatRequest, opened: list[handles.Opened], sent_at: float):
        """Yields ``("text", piece)``... then ``("done", Result)`` or ``("error", exception)``."""
        q: queue.Queue = queue.Queue()
        arrived = time.perf_counter() - max(0.0, time.time() - sent_at)
        fut = self.replica.submit(req, opened, lambda s: q.put(("text", s)), arrived=arrived)
        fut.add_done_callback(lambda f: q.put(("end", None)))
        while True:
            kind, piece = q.get()
            if kind == "text":
                yield "text", piece
                continue
            err = fut.exception()
            yield ("error", err) if err is not None else ("done", fut.result())
            return

    def close(self) -> None:
        self.replica.close()


class RayReplica:
    """The gateway's handle on one ``ReplicaActor``."""

    def __init__(self, name: str, actor):
        import ray

        self.name, self.actor = name, actor
        self.fingerprint, self.params, self.max_positions, self.placement = ray.get(actor.info.remote())
        self.observers: list[Callable] = []
        self._pending = 0
        self._lock = threading.Condition()

    @property
    def depth(self) -> int:
        with self._lock:
            return self._pending

    def submit(self, req: ChatRequest, opened: Sequence[handles.Opened],
               on_text: Callable[[str], None] | None = None) -> Future:
        import ray

        fut: Future = Future()
        with self._lock:
            self._pending += 1
        gen = self.actor.answer.options(num_returns="streaming").remote(req, list(opened), time.time())

        def follow() -> None:
            try:
                for ref in gen:
                    kind, value = ray.get(ref)
                    if kind == "text":
                        if on_text is not None:
                            on_text(value)
                    elif kind == "error":
                        fut.set_exception(value)
                    else:
                        deliver(self.observers, self.name, fut, value)
            except BaseException as err:  # the actor died, or Ray failed: the caller sees it
                if not fut.done():
                    fut.set_exception(err)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

        threading.Thread(target=follow, name=f"ray-{self.name}", daemon=True).start()
        return fut

    def close(self, timeout: float | None = None) -> None:
        import ray

        with self._lock:
            self._lock.wait_for(lambda: self._pending == 0, timeout)
        ray.get(self.actor.close.remote())
        ray.kill(self.actor)


def ray_pool(models: Sequence[str], store_url: str, secret: bytes, *, replicas: int = 1, engine: str = "fp32",
             handle_ttl_s: float = 600.0, threads: int | None = 1, actor_options: dict | None = None,
             batch: bool = False) -> Pool:
    """One ``ReplicaActor`` per replica of every model on the running Ray cluster (``ray.init`` first)."""
    import ray

    if not store_url.startswith(("redis://", "rediss://", "unix://", "file://")):
        raise InvalidInput(f"store {store_url!r} with Ray actors", "a store every actor reaches: redis:// or file://")
    if not ray.is_initialized():
        raise RuntimeError("call ray.init(...) first (address='auto' for an existing cluster, see docs/ray.md)")
    opts = {"num_cpus": 0, "max_concurrency": MAX_IN_FLIGHT} | (actor_options or {})
    cls = ray.remote(**opts)(ReplicaActor)
    actors = {m: [cls.remote(m, ModelSpec(m, engine), store_url, secret, handle_ttl_s, threads, batch)
                  for _ in range(replicas)] for m in models}
    return Pool({m: tuple(RayReplica(m, a) for a in acts) for m, acts in actors.items()})
