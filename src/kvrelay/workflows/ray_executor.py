"""Agents as Ray actors; payloads through the Ray object store without extra copies.

One actor per agent, one model per actor: the actor loads its model itself, by zoo name (or a
local folder / transformers id) or — for tests — from a tiny-model spec ``(arch, seed)`` that
rebuilds the exact same random model in any process (``kvrelay.models.tiny.tiny_lm``). The
driver only orchestrates: tokens, prompts and object references travel through it, caches never do.

A payload crosses the object store as a plain dict (``payload_to_numpy``)::

    {"meta": {str: str},                       PayloadMeta.to_strings()
     "keys": [ndarray (B, H_kv, T_l, D)], "values": [...],   float32 | float16 | int16 (= bf16 bits)
     "token_ids", "positions": ndarray (B, T) int64, "mask": ndarray (B, T) bool}

numpy has no bfloat16, so bf16 tensors travel as an ``int16`` view of the same bytes. The
sender's ``ray.put`` is the one copy (into shared memory, plasma); the receiver's ``ray.get``
maps those pages and ``payload_from_numpy`` wraps them with ``torch.from_numpy`` — zero-copy,
read-only views. Nothing writes to them: ``to_cache`` clones when it builds the model's cache.

``RayWorkflowRunner`` runs a ``kvrelay.workflows`` workflow with these actors and returns the
same ``RunTrace`` as ``workflows.run.run_workflow``; on the same model the greedy outputs are
the same tokens (tested on a 3-agent chain). See ``docs/ray.md`` for a multi-node cluster.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvrelay.kv.payload import DTYPES, KVPayload, PayloadMeta
from kvrelay.workflows.run import (
    MODES,
    AgentRecord,
    Finished,
    RunTrace,
    needs_payload,
    release_unused,
    resolve_inputs,
)
from kvrelay.workflows.spec import Workflow

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
    """A model an actor can load by itself: a zoo name / folder / transformers id, or a tiny random model."""

    name: str | None = None
    tiny_arch: str | None = None  # llama | qwen2 | gemma3
    seed: int = 0
    engine: str = "fp32"  # kernel mode (kvrelay.models.engine); agents of one workflow share it

    def __post_init__(self):
        if (self.name is None) == (self.tiny_arch is None):
            raise ValueError("give exactly one of name (zoo name, folder, transformers id) or tiny_arch")

    @classmethod
    def tiny(cls, arch: str, seed: int = 0) -> ModelSpec:
        return cls(tiny_arch=arch, seed=seed)

    def load(self):
        if self.tiny_arch is not None:
            from kvrelay.models.loader import with_engine
            from kvrelay.models.tiny import tiny_lm

            return with_engine(tiny_lm(self.tiny_arch, self.seed), self.engine)
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

    def reset(self) -> None:
        """A fresh ``Agent`` (round counter, staleness records) on the loaded model: one per run."""
        from kvrelay.agents.agent import Agent

        self.agent = Agent(self.lm, self.name, self.role, max_new_tokens=self.max_new_tokens)

    def fingerprint(self) -> str:
        return self.lm.identity.fingerprint

    def context_ids(self, context: str) -> list[int]:
        """The shared context as a root reads it (one user turn), as in ``run_workflow``."""
        return self.agent.encode(self.agent.fmt.user(context))

    def respond(self, prompt: str, base: list[int], cache_box: list | None, *, layout: str, max_new_tokens: int,
                min_new_tokens: int, want_payload: bool) -> dict:
        """One turn. ``cache_box`` is ``[ObjectRef]`` of a relayed payload (boxed so that the get is timed
        here) or None (text channel: ``base`` is re-encoded). Returns the turn's record fields and,
        when asked for, ``[ObjectRef]`` of this agent's whole-turn payload."""
        import ray

        from kvrelay.workflows.run import turn_ids

        agent = self.agent
        get_s, cache = 0.0, None
        if cache_box:
            t0 = time.perf_counter()
            cache = payload_from_numpy(ray.get(cache_box[0]))  # zero-copy views of the object store
            get_s = time.perf_counter() - t0
        arg = cache if cache is not None else torch.tensor(base, dtype=torch.int64)
        t1 = time.perf_counter()
        r = agent.respond(prompt, arg, layout=layout, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                          return_payload=want_payload)
        t2 = time.perf_counter()
        ids = turn_ids(agent, prompt, base, layout, r.token_ids)
        if r.payload is not None and r.payload.token_ids[0].tolist() != ids:
            raise RuntimeError(f"{self.name}: payload tokens differ from the turn's token sequence")
        out_box, put_s = None, 0.0
        if r.payload is not None:
            t3 = time.perf_counter()
            out_box = [ray.put(payload_to_numpy(r.payload))]  # the one copy: into shared memory
            put_s = time.perf_counter() - t3
        prefix = len(agent.encode(agent.fmt.system(agent.role))) if (cache is not None and layout == "replace") else 0
        encode_s = (t2 - t1 - r.cache_build_s - r.prefill_s - r.decode_s) if r.payload is not None else 0.0
        return {"text": r.text, "token_ids": tuple(r.token_ids), "ids": ids, "payload": out_box,
                "input_tokens": r.prefill_tokens + r.relayed_tokens + prefix, "prefill_tokens": r.prefill_tokens + prefix,
                "relayed_tokens": r.relayed_tokens, "prefill_s": r.prefill_s, "decode_s": r.decode_s,
                "relay_bytes": cache.nbytes if cache is not None else 0, "relay_encode_s": max(encode_s, 0.0),
                "put_s": put_s, "get_s": get_s, "relay_decode_s": r.cache_build_s if cache is not None else 0.0}


def agent_actor_class(**options):
    """``AgentActor`` as a Ray actor class; ``options`` go to ``ray.remote`` (``num_cpus``, ``resources``...)."""
    import ray

    return ray.remote(**options)(AgentActor)


# -- running a workflow --------------------------------------------------------------------------
class RayWorkflowRunner:
    """The actors of one workflow, started once and reused across runs (``run`` resets their agents).

    ``actor_options`` go to every actor (default ``num_cpus=0``: placement by memory, not CPU
    slots, so any number of agents fits a small local cluster; on a multi-node cluster pass e.g.
    ``{"num_cpus": 2}`` or a custom resource to spread them). ``threads`` sets torch threads per actor.
    """

    def __init__(self, spec: ModelSpec, wf: Workflow, *, actor_options: dict | None = None, threads: int | None = 1):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("call ray.init(...) first (address='auto' for an existing cluster, see docs/ray.md)")
        self.spec, self.wf = spec, wf
        cls = agent_actor_class(**({"num_cpus": 0} if actor_options is None else actor_options))
        self.actors = {a.name: cls.remote(spec, a.name, a.role, a.max_new_tokens, threads) for a in wf.agents}
        fps = set(ray.get([h.fingerprint.remote() for h in self.actors.values()]))
        if len(fps) != 1:
            raise RuntimeError(f"actors loaded different models (fingerprints {sorted(fps)}); relay needs one model")
        self.fingerprint = fps.pop()

    def run(self, context: str, *, mode: str = "kv") -> RunTrace:
        """Same contract as ``run_workflow(lm, wf, context, mode=mode)``; ``relay_transfer_s`` is the
        object-store put (sender) + get (receiver)."""
        import ray

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        plan = self.wf if mode == "kv" else self.wf.with_channels("text")
        ray.get([h.reset.remote() for h in self.actors.values()])
        t_run = time.perf_counter()
        done: dict[str, Finished] = {}
        put_s: dict[str, float] = {}
        records = []
        context_ids = ray.get(self.actors[plan.agents[0].name].context_ids.remote(context))
        for spec in plan.agents:
            t0 = time.perf_counter()
            channel, base, prompt, src_name = resolve_inputs(plan, spec, done, context_ids)
            cache = done[src_name].payload if src_name is not None else None
            out = ray.get(self.actors[spec.name].respond.remote(
                prompt, list(base), cache, layout=plan.layout, max_new_tokens=spec.max_new_tokens,
                min_new_tokens=spec.min_new_tokens, want_payload=needs_payload(plan, spec.name)))
            wall = time.perf_counter() - t0
            put_s[spec.name] = out["put_s"]
            done[spec.name] = Finished(out["text"], out["ids"], list(base), out["payload"])
            transfer = (put_s.get(src_name, 0.0) + out["get_s"]) if cache is not None else 0.0
            records.append(AgentRecord(
                name=spec.name, channel=channel, input_tokens=out["input_tokens"],
                prefill_tokens=out["prefill_tokens"], relayed_tokens=out["relayed_tokens"],
                prefill_s=out["prefill_s"], decode_tokens=len(out["token_ids"]), decode_s=out["decode_s"],
                relay_bytes=out["relay_bytes"], relay_encode_s=out["relay_encode_s"], relay_transfer_s=transfer,
                relay_decode_s=out["relay_decode_s"], wall_s=wall, text=out["text"], token_ids=out["token_ids"]))
            release_unused(plan, done, spec.name)  # dropping a ref frees its object-store copy
        return RunTrace(self.wf.name, mode, plan.layout, len(context_ids), tuple(records),
                        time.perf_counter() - t_run)

    def close(self) -> None:
        import ray

        for h in self.actors.values():
            ray.kill(h)
        self.actors = {}

    def __enter__(self) -> RayWorkflowRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_workflow_ray(spec: ModelSpec | str, wf: Workflow, context: str, *, mode: str = "kv",
                     actor_options: dict | None = None, threads: int | None = 1) -> RunTrace:
    """``run_workflow`` with every agent a Ray actor (needs ``ray.init`` first). ``spec``: a ``ModelSpec``
    or a model name. Starts and stops the actors; reuse a ``RayWorkflowRunner`` to amortise that."""
    if isinstance(spec, str):
        spec = ModelSpec(name=spec)
    with RayWorkflowRunner(spec, wf, actor_options=actor_options, threads=threads) as runner:
        return runner.run(context, mode=mode)


run_chain_ray = run_workflow_ray  # a chain is a workflow; the name the issue asked for

__all__ = ["AgentActor", "ModelSpec", "RayWorkflowRunner", "agent_actor_class", "payload_from_numpy",
           "payload_to_numpy", "run_chain_ray", "run_workflow_ray"]
