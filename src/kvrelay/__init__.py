"""kvrelay: relay KV caches between LLM agents, audit when it pays, decide per request.

The names a user needs, loaded on first use (``import kvrelay`` itself imports nothing heavy)::

    import kvrelay as kr
    lm = kr.load_model("qwen2.5-coder-0.5b")            # or "tiny:qwen2" (random, no download)
    sender, receiver = kr.Agent(lm, "sender"), kr.Agent(lm, "receiver")
    payload = sender.read(open("docs/demo/context.md").read())
    kr.save(payload, "context.kv")                      # kvrelay/1 file; kr.load(path, expect=lm.identity)
    print(receiver.respond("Which function has the bug?", payload).text)

Stores (``open_store("redis://...")``, ``put_payload(store, p, "int8")``, ``get_payload(store, key)``),
workflows (``Workflow``, ``chain``, ``run_workflow`` with an executor) and ``audit`` are here too.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_NAMES = {
    "load_model": "kvrelay.models.loader",
    "Agent": "kvrelay.agents.agent", "Response": "kvrelay.agents.agent",
    "KVPayload": "kvrelay.kv.payload", "PayloadMeta": "kvrelay.kv.payload",
    "save": "kvrelay.kv.wire", "load": "kvrelay.kv.wire", "encode": "kvrelay.kv.wire", "decode": "kvrelay.kv.wire",
    "MemoryStore": "kvrelay.transport.stores", "DiskStore": "kvrelay.transport.stores",
    "RedisStore": "kvrelay.transport.stores", "open_store": "kvrelay.transport.stores",
    "put_payload": "kvrelay.transport.stores", "get_payload": "kvrelay.transport.stores",
    "prefix_payload": "kvrelay.transport.stores",
    "Workflow": "kvrelay.workflows.spec", "AgentSpec": "kvrelay.workflows.spec", "Edge": "kvrelay.workflows.spec",
    "chain": "kvrelay.workflows.spec", "hierarchy": "kvrelay.workflows.spec",
    "run_workflow": "kvrelay.workflows.run", "RunTrace": "kvrelay.workflows.run",
    "InProcessExecutor": "kvrelay.workflows.executors",
    "ProcessExecutor": "kvrelay.workflows.process_executor",
    "RayExecutor": "kvrelay.workflows.ray_executor",
    "audit": ("kvrelay.audit", None), "AuditConfig": "kvrelay.audit.runner",  # audit: a callable package
}
__all__ = ["__version__", *_NAMES]


def __getattr__(name: str):
    where = _NAMES.get(name)
    if where is None:
        raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = importlib.import_module(module) if attr is None else getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
