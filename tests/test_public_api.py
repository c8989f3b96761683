"""`import kvrelay as kr` gives the names a user needs, lazily: importing it loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_is_light_and_names_resolve_on_use():
    code = ("import sys, kvrelay as kr; assert 'torch' not in sys.modules, 'import kvrelay loaded torch'; "
            "kr.Agent; assert 'torch' in sys.modules; print(sorted(kr.__all__))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for name in ("load_model", "Agent", "KVPayload", "save", "load", "open_store", "put_payload", "get_payload",
                 "MemoryStore", "DiskStore", "RedisStore", "Workflow", "run_workflow", "audit"):
        assert f"'{name}'" in r.stdout


def test_public_names_are_the_library_objects(tmp_path):
    import kvrelay as kr
    from kvrelay.agents.agent import Agent
    from kvrelay.kv.wire import load, save
    from kvrelay.transport.stores import open_store
    from kvrelay.workflows.run import run_workflow

    assert (kr.Agent, kr.save, kr.load, kr.open_store, kr.run_workflow) == (Agent, save, load, open_store,
                                                                            run_workflow)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kr.nope  # noqa: B018
    lm = kr.load_model("tiny:llama")
    p = kr.Agent(lm, "s").prefill(list(range(9, 40)))
    kr.save(p, tmp_path / "p.kv")
    assert kr.load(tmp_path / "p.kv", expect=lm.identity).num_tokens == 31
    store = kr.open_store(f"file://{tmp_path}/store")
    assert kr.get_payload(store, kr.put_payload(store, p, "int8")).num_tokens == 31


def test_audit_is_callable_and_runs_a_config():
    import kvrelay as kr
    from kvrelay.audit.presets import preset  # importing a submodule first must not hide the function

    assert preset("smoke").preset == "smoke"
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        kr.audit("nope", "/nonexistent-out")
