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
