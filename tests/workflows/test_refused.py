"""A workflow edge whose relayed payload its receiver refuses: it stops with ``EdgeRefused`` naming the edge,
or, when the edge says ``on_refused = "text"``, rebuilds that edge from text and says so in the trace.

The faults are real: the bytes in the store are edited (a tensor byte flipped) or deleted between the
sender's turn and the receiver's, in process and with every agent in its own OS process."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.core.errors import EdgeRefused
from kvrelay.models.loader import load_model
from kvrelay.workflows.executors import InProcessExecutor
from kvrelay.workflows.process_executor import ProcessExecutor
from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.spec import AgentSpec, Workflow, chain

MODEL = "tiny:qwen2:3"
CONTEXT = "the key of the blue vault is four and the bug is in line seven of the code " * 3


def _chain(on_refused: str = "stop") -> Workflow:
    specs = [AgentSpec("reader", "read the report", "what is the bug", 5, 5),
             AgentSpec("fixer", "fix the code", "where is the fix", 5, 5),
             AgentSpec("checker", "check the fix", "is it right", 5, 5)]
    wf = chain("chain3", specs)
    return replace(wf, edges=tuple(replace(e, on_refused=on_refused) if e.dst == "checker" else e for e in wf.edges))


def flip_a_tensor_byte(store, key: str) -> None:
    data = bytearray(store.get_bytes(key))
    data[-3] ^= 0x40  # inside the last tensor: its digest no longer matches
    store.put_bytes(key, bytes(data))


class Tampering(InProcessExecutor):
    """The in-process executor through a store, with ``fault(store, key)`` applied to what ``victim`` receives."""

    def __init__(self, lm, victim: str, fault, **kw):
        super().__init__(lm, **kw)
        self.victim, self.fault = victim, fault

    def turn(self, agent, prompt, base, cache, **kw):
        if agent == self.victim and cache is not None:
            self.fault(self.store, cache)
        return super().turn(agent, prompt, base, cache, **kw)


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def reference(lm):
    return run_workflow(lm, _chain(), CONTEXT)


@pytest.mark.parametrize("fault", [flip_a_tensor_byte, lambda store, key: store.delete(key)],
                         ids=["tampered", "lost"])
def test_a_refused_edge_stops_naming_the_edge(lm, fault):
    ex = Tampering(lm, "checker", fault, store="memory://refused-stop", codec="raw")
    with pytest.raises(EdgeRefused) as e:
        run_workflow(ex, _chain("stop"), CONTEXT)
    assert (e.value.src, e.value.dst) == ("fixer", "checker")
    assert e.value.kind in ("CorruptPayload", "PayloadNotFound") and "fixer->checker" in str(e.value)


@pytest.mark.parametrize("fault", [flip_a_tensor_byte, lambda store, key: store.delete(key)],
                         ids=["tampered", "lost"])
def test_a_refused_edge_falls_back_to_text_when_it_says_so(lm, reference, fault):
    ex = Tampering(lm, "checker", fault, store="memory://refused-text", codec="raw")
    trace = run_workflow(ex, _chain("text"), CONTEXT)
    assert trace.outputs() == reference.outputs()  # the same tokens, re-encoded: the same answer
    by = {a.name: a for a in trace.agents}
    assert by["fixer"].channel == "kv" and by["fixer"].fallback == ""
    assert by["checker"].channel == "kv->text" and by["checker"].relayed_tokens == 0
    assert by["checker"].fallback.split(":")[0] in ("CorruptPayload", "PayloadNotFound")
    assert trace.to_dict()["agents"][2]["fallback"] == by["checker"].fallback


def test_an_edge_option_round_trips_through_toml_and_is_checked():
    wf = _chain("text")
    assert Workflow.from_toml(wf.to_toml()) == wf
    assert 'on_refused = "text"' in wf.to_toml() and "on_refused" not in _chain().to_toml()
    with pytest.raises(ValueError, match="on_refused must be one of"):
        replace(wf.edges[0], on_refused="retry")


def test_worker_processes_report_a_refusal_the_runner_acts_on(tmp_path, reference):
    """Agents in their own processes through a disk store; the driver edits the stored payload in between."""

    class Tamper(ProcessExecutor):
        def turn(self, agent, prompt, base, cache, **kw):
            if agent == "checker" and cache is not None:
                flip_a_tensor_byte(self.store, cache)
            return super().turn(agent, prompt, base, cache, **kw)

    with Tamper(MODEL, _chain("stop"), store=str(tmp_path / "store"), codec="raw") as ex:
        with pytest.raises(EdgeRefused) as e:
            ex.run(CONTEXT)
        assert (e.value.src, e.value.dst, e.value.kind) == ("fixer", "checker", "CorruptPayload")
        trace = run_workflow(ex, _chain("text"), CONTEXT)  # the same workers, the edge now falls back
    assert trace.outputs() == reference.outputs()
    assert trace.agents[2].channel == "kv->text" and trace.agents[2].fallback.startswith("CorruptPayload: ")


def rewrite_the_last_layer(store, key: str) -> None:
    """What a writer with store access can do: new K/V for one layer, every checksum recomputed."""
    from kvrelay.kv import wire

    tensors, meta = wire.unpack(store.get_bytes(key))
    last = max(int(n.split(".")[1]) for n in tensors if n.startswith("layers."))
    tensors[f"layers.{last}.k"] = tensors[f"layers.{last}.k"].flip(2)  # the positions' keys reordered
    store.put_bytes(key, wire.pack(tensors, meta))


@pytest.mark.parametrize("on_refused", ["stop", "text"])
def test_an_edge_that_verifies_catches_a_rewritten_payload(lm, reference, on_refused):
    from kvrelay.agents.verify import VerifySpec

    wf = _chain(on_refused)
    wf = replace(wf, edges=tuple(replace(e, verify=VerifySpec(k=4)) if e.dst == "checker" else e for e in wf.edges))
    assert Workflow.from_toml(wf.to_toml()) == wf and "verify = {k = 4, full = false}" in wf.to_toml()
    plain = run_workflow(Tampering(lm, "checker", rewrite_the_last_layer, store="memory://unverified", codec="raw"),
                         _chain(on_refused), CONTEXT)
    assert plain.agents[2].channel == "kv"  # without verification the rewrite goes unnoticed
    ex = Tampering(lm, "checker", rewrite_the_last_layer, store=f"memory://verified-{on_refused}", codec="raw")
    if on_refused == "stop":
        with pytest.raises(EdgeRefused) as e:
            run_workflow(ex, wf, CONTEXT)
        assert (e.value.src, e.value.dst, e.value.kind) == ("fixer", "checker", "TamperedPayload")
        return
    trace = run_workflow(ex, wf, CONTEXT)
    assert trace.outputs() == reference.outputs()
    assert trace.agents[2].channel == "kv->text" and trace.agents[2].fallback.startswith("TamperedPayload: ")
    clean = run_workflow(InProcessExecutor(lm, store="memory://verified-clean", codec="raw"), wf, CONTEXT)
    assert [a.channel for a in clean.agents] == ["root", "kv", "kv"]  # a genuine payload passes the check


def test_verify_tables_in_toml_are_checked():
    text = _chain().to_toml().replace('channel = "kv"', 'channel = "kv"\nverify = {k = 8, seed = 3}', 1)
    wf = Workflow.from_toml(text)
    assert wf.edges[0].verify.k == 8 and wf.edges[0].verify.seed == 3 and wf.verify_for("fixer").k == 8
    with pytest.raises(ValueError, match="verify takes k, full and seed"):
        Workflow.from_toml(text.replace("seed = 3", "depth = 3"))
    with pytest.raises(ValueError, match="k must be an int >= 2"):
        Workflow.from_toml(text.replace("k = 8", "k = 1"))
