"""Agents as Ray actors; payloads through the Ray object store without extra copies.

One actor per agent, one model per actor: the actor loads its model itself, by any name
``load_model`` takes (a zoo name, a local folder, a transformers id, or ``tiny:ARCH:SEED``, which
rebuilds the same random model in any process). The driver only orchestrates: tokens, prompts and
object references travel through it, caches never do. Each actor's turn is ``workflows.turn.take_turn``.

A payload crosses the object store as a plain dict (``payload_to_numpy``)::

    {"meta": {str: str},                       PayloadMeta.to_strings()
     "keys": [ndarray (B, H_kv, T_l, D)], "values": [...],   float32 | float16 | int16 (= bf16 bits)
     "token_ids", "positions": ndarray (B, T) int64, "mask": ndarray (B, T) bool}

numpy has no bfloat16, so bf16 tensors travel as an ``int16`` view of the same bytes. The
sender's ``ray.put`` is the one copy (into shared memory, plasma); the receiver's ``ray.get``
maps those pages and ``payload_from_numpy`` wraps them with ``torch.from_numpy`` — zero-copy,
read-only views. Nothing writes to them: ``to_cache`` clones when it builds the model's cache.

``RayExecutor`` is the runner's executor (``run_workflow(RayExecutor(...), wf, context)``);
``RayWorkflowRunner`` keeps one started for repeated runs. On the same model the greedy outputs
are the same tokens as in process (tested on a 3-agent chain). See ``docs/ray.md`` for a cluster.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvrelay.kv.payload import DTYPES, KVPayload, PayloadMeta
from kvrelay.workflows.run import RunTrace, run_workflow
from kvrelay.workflows.spec import Workflow
from kvrelay.workflows.turn import TurnOut, take_turn

_NOT_WRITABLE = "The given NumPy array is not writable"


# -- payload <-> object-store dict -------------------------------------------------------------
def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # same bytes; numpy has no bf16
    return t.numpy()  # a view of the tensor's memory: ray.put makes the only copy


def payload_to_numpy(p: KVPayload) -> dict[str, Any]:
    """The payload as numpy views + metadata strings, ready for ``ray.put`` (no copy here)."""
    return {"meta": p.meta.to_strings(),
            "keys": [_to_numpy(k) for k in p.keys],  # (B, H_kv, T_l, D) each
            "values": [_to_numpy(v) for v in p.values],
            "token_ids": _to_numpy(p.token_ids), "positions": _to_numpy(p.positions), "mask": _to_numpy(p.mask)}


def _from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # object-store buffers are read-only; we never write to them
        warnings.filterwarnings("ignore", message=_NOT_WRITABLE)
        t = torch.from_numpy(a)
    if dtype == torch.bfloat16:
        if t.dtype != torch.int16:
            raise ValueError(f"bf16 tensors travel as int16 bits, got {t.dtype}")
        return t.view(torch.bfloat16)
    return t


def payload_from_numpy(d: dict[str, Any]) -> KVPayload:
    """Rebuild a ``KVPayload`` around the arrays without copying (tensors share the arrays' memory)."""
    meta = PayloadMeta.from_strings(d["meta"])
    dt = DTYPES[meta.dtype]
    return KVPayload(tuple(_from_numpy(a, dt) for a in d["keys"]), tuple(_from_numpy(a, dt) for a in d["values"]),
                     _from_numpy(d["token_ids"], torch.int64), _from_numpy(d["positions"], torch.int64),
                     _from_numpy(d["mask"], torch.bool), meta)


# -- which model an actor loads ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model an actor loads by itself: any ``load_model`` name (``ModelSpec.tiny``: a tiny random model)."""

    name: str
    engine: str = "fp32"  # kernel mode (kvrelay.models.engine); agents of one workflow share it

    @classmethod
    def tiny(cls, arch: str, seed: int = 0) -> ModelSpec:
        return cls(f"tiny:{arch}:{seed}")

    def load(self):
        from kvrelay.models.loader import load_model

        return load_model(self.name, engine=self.engine)


# -- the actor -----------------------------------------------------------------------------------
class AgentActor:
    """One agent on its own model. Wrapped with ``ray.remote`` by ``agent_actor_class``."""

    def __init__(self, spec: ModelSpec, name: str, role: str, max_new_tokens: int = 48, threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.lm = spec.load()
        self.name, self.role, self.max_new_tokens = name, role, max_new_tokens
        self.reset()

    def reset(self, verify=None, budget=None) -> None:
        """A fresh ``Agent`` (round counter, staleness records) on the loaded model: one per run;
        ``verify`` (a ``VerifySpec``): it verifies the payloads it receives; ``budget`` (a ``ByteBudget``):
        its byte budget as a receiver."""
        from kvrelay.agents.agent import Agent

        self.agent = Agent(self.lm, self.name, self.role, max_new_tokens=self.max_new_tokens, verify=verify,
                           budget=budget)

    def fingerprint(self) -> str:
        return self.lm.identity.fingerprint

    def context_ids(self, context: str) -> list[int]:
        """The shared context as a root reads it (one user turn)."""
        return self.agent.encode(self.agent.fmt.user(context))

    def turn(self, prompt: str, base: list[int], cache_box: list | None, *, layout: str, max_new_tokens: int,
             min_new_tokens: int, want_payload: bool) -> TurnOut:
        """One turn. ``cache_box`` is ``[ObjectRef]`` of a relayed payload (boxed so that the get is timed
        here) or None (text channel: ``base`` is re-encoded). The returned handle is ``[ObjectRef]``."""
        import ray

        get_s, cache = 0.0, None
        if cache_box:
            t0 = time.perf_counter()
            cache = payload_from_numpy(ray.get(cache_box[0]))  # zero-copy views of the object store
            get_s = time.perf_counter() - t0
        out = take_turn(self.agent, prompt, base, cache, layout, max_new_tokens=max_new_tokens,
                        min_new_tokens=min_new_tokens, want_payload=want_payload, get_s=get_s)
        if out.payload is None:
            return out
        t0 = time.perf_counter()
        box = [ray.put(payload_to_numpy(out.payload))]  # the one copy: into shared memory
        return out.with_handle(box, put_s=time.perf_counter() - t0)


def agent_actor_class(**options):
    """``AgentActor`` as a Ray actor class; ``options`` go to ``ray.remote`` (``num_cpus``, ``resources``...)."""
    import ray

    return ray.remote(**options)(AgentActor)


# -- the executor --------------------------------------------------------------------------------
class RayExecutor:
    """The actors of one workflow, started once and reused across runs (``start`` resets their agents).

    ``actor_options`` go to every actor (default ``num_cpus=0``: placement by memory, not CPU
    slots, so any number of agents fits a small local cluster; on a multi-node cluster pass e.g.
    ``{"num_cpus": 2}`` or a custom resource to spread them). ``threads`` sets torch threads per actor.
    ``relay_transfer_s`` is the object-store put (sender) + get (receiver).
    """

    def __init__(self, spec: ModelSpec | str, wf: Workflow, *, actor_options: dict | None = None,
                 threads: int | None = 1):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("call ray.init(...) first (address='auto' for an existing cluster, see docs/ray.md)")
        self.spec = ModelSpec(spec) if isinstance(spec, str) else spec
        self.wf = wf
        cls = agent_actor_class(**({"num_cpus": 0} if actor_options is None else actor_options))
        self.actors = {a.name: cls.remote(self.spec, a.name, a.role, a.max_new_tokens, threads) for a in wf.agents}
        fps = set(ray.get([h.fingerprint.remote() for h in self.actors.values()]))
        if len(fps) != 1:
            raise RuntimeError(f"actors loaded different models (fingerprints {sorted(fps)}); relay needs one model")
        self.fingerprint = fps.pop()

    def start(self, wf: Workflow) -> None:
        import ray

        if [a.name for a in wf.agents] != list(self.actors):
            raise ValueError(f"these actors run agents {list(self.actors)}, not {[a.name for a in wf.agents]}")
        ray.get([h.reset.remote(wf.verify_for(name), wf.agent(name).budget())
                 for name, h in self.actors.items()])  # raw object hand-over

    def context_ids(self, agent: str, context: str) -> list[int]:
        import ray

        return ray.get(self.actors[agent].context_ids.remote(context))

    def turn(self, agent: str, prompt: str, base: Sequence[int], cache: Any, *, layout: str, max_new_tokens: int,
             min_new_tokens: int, want_payload: bool) -> TurnOut:
        import ray

        return ray.get(self.actors[agent].turn.remote(prompt, list(base), cache, layout=layout,
                                                      max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                                      want_payload=want_payload))

    def release(self, handle: Any) -> None:
        """Nothing to do: dropping the last reference frees the object-store copy."""

    def run(self, context: str, *, mode: str = "kv") -> RunTrace:
        """``run_workflow(self, self.wf, context, mode=mode)``."""
        return run_workflow(self, self.wf, context, mode=mode)

    def close(self) -> None:
        import ray

        for h in self.actors.values():
            ray.kill(h)
        self.actors = {}

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


RayWorkflowRunner = RayExecutor  # the name the pipeline CLI and docs/ray.md use


def run_workflow_ray(spec: ModelSpec | str, wf: Workflow, context: str, *, mode: str = "kv",
                     actor_options: dict | None = None, threads: int | None = 1) -> RunTrace:
    """``run_workflow`` with every agent a Ray actor (needs ``ray.init`` first). Starts and stops the
    actors; keep a ``RayExecutor`` to amortise that."""
    with RayExecutor(spec, wf, actor_options=actor_options, threads=threads) as ex:
        return ex.run(context, mode=mode)


__all__ = ["AgentActor", "ModelSpec", "RayExecutor", "RayWorkflowRunner", "agent_actor_class", "payload_from_numpy",
           "payload_to_numpy", "run_workflow_ray"]
