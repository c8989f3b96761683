"""An executor under a byte budget: every agent in its own process (``ProcessExecutor``), payloads through a
disk folder or a real Redis server opened with ``?max_bytes=N&evict=POLICY`` by every worker. A budget that
holds one payload but not two: evicting the oldest lets the run relay every edge (the payload it drops
was read already); refusing stops the edge whose payload did not fit, naming it, or rebuilds it from text.
A budget below any payload refuses the first put under every policy.

A receiver under a byte budget (``max_bytes`` on an agent): the edge whose payload decodes to more stops
with ``EdgeRefused`` naming it, or rebuilds from text, handed over in process, through a store, and in
worker processes; a payload exactly at the budget is relayed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.core.errors import EdgeRefused, InvalidWorkflow
from kvrelay.models.loader import load_model
from kvrelay.workflows.executors import InProcessExecutor
from kvrelay.workflows.process_executor import ProcessExecutor
from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.spec import Workflow
from tests.workflows.test_workflow_store_faults import CONTEXT, MODEL, _chain


@pytest.fixture(scope="module")
def reference():
    """The text run (what any fallback reproduces) and the sizes of the reader's and the fixer's fp16
    payloads as a store holds them (an in-process run through a memory store)."""
    lm = load_model(MODEL)
    sized = run_workflow(InProcessExecutor(lm, codec="fp16"), _chain(), CONTEXT)
    sizes = [a.relay_bytes for a in sized.agents[1:]]
    assert all(n > 0 for n in sizes)
    return run_workflow(lm, _chain(), CONTEXT, mode="text"), sizes


@pytest.fixture(params=["disk", "redis"])
def store_url(request, tmp_path):
    if request.param == "disk":
        yield lambda q: f"file://{tmp_path}/store?{q}"
        return
    url, ns = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_namespace")
    yield lambda q: f"{url}?namespace={ns}&{q}"
    from kvrelay.transport.redis_store import RedisStore

    RedisStore(url, namespace=ns).clear()


def _one_not_two(sizes) -> int:
    """Bytes that hold either payload alone but not both (with room for a few bytes of metadata)."""
    assert max(sizes) + 64 < sum(sizes) - 64
    return max(sizes) + 64


def test_evicting_the_oldest_the_run_relays_every_edge(reference, store_url):
    ref, sizes = reference
    with ProcessExecutor(MODEL, _chain("stop"), store=store_url(f"max_bytes={_one_not_two(sizes)}&evict=oldest"),
                         codec="fp16") as ex:
        trace = ex.run(CONTEXT)
    assert [a.channel for a in trace.agents] == ["root", "kv", "kv"]
    assert [a.fallback for a in trace.agents] == ["", "", ""]
    assert trace.outputs() == ref.outputs()


@pytest.mark.parametrize("on_refused", ["stop", "text"])
def test_refusing_stops_the_edge_that_did_not_fit_or_falls_back(reference, store_url, on_refused):
    """The fixer's payload does not fit beside the reader's, which it is still holding when it puts."""
    ref, sizes = reference
    with ProcessExecutor(MODEL, _chain(on_refused), store=store_url(f"max_bytes={_one_not_two(sizes)}&evict=refuse"),
                         codec="fp16") as ex:
        if on_refused == "stop":
            with pytest.raises(EdgeRefused) as e:
                ex.run(CONTEXT)
            assert (e.value.src, e.value.dst, e.value.kind) == ("fixer", "checker", "OverBudget")
            assert "does not fit the byte budget" in e.value.reason
            return
        trace = ex.run(CONTEXT)
    assert [a.channel for a in trace.agents] == ["root", "kv", "kv->text"]
    assert trace.agents[2].fallback.startswith("OverBudget: ")
    assert trace.outputs() == ref.outputs()


@pytest.mark.parametrize("policy", ["refuse", "oldest", "lru"])
def test_a_budget_below_any_payload_refuses_the_first_put(reference, store_url, policy):
    ref, _ = reference
    with ProcessExecutor(MODEL, _chain("text"), store=store_url(f"max_bytes=1000&evict={policy}"), codec="fp16") as ex:
        trace = ex.run(CONTEXT)
    assert [a.channel for a in trace.agents] == ["root", "kv->text", "kv->text"]
    assert all(a.fallback.startswith("OverBudget: ") for a in trace.agents[1:])
    assert trace.outputs() == ref.outputs()


# -- a receiver's byte budget ---------------------------------------------------------------------------
def _receivers_budget(on_refused: str, fixer: int, checker: int) -> Workflow:
    wf = _chain(on_refused)
    limits = {"fixer": fixer, "checker": checker}
    return replace(wf, agents=tuple(replace(a, max_bytes=limits.get(a.name)) for a in wf.agents))


@pytest.fixture(scope="module")
def decoded():
    """The bytes each receiver's payload decodes to (handed over in process: the payload object itself)."""
    lm = load_model(MODEL)
    run = run_workflow(lm, _chain(), CONTEXT)
    return lm, {a.name: a.relay_bytes for a in run.agents[1:]}


def test_a_receivers_budget_round_trips_through_toml_and_refuses_nonsense():
    wf = _receivers_budget("stop", 10**9, 5000)
    text = wf.to_toml()
    assert "max_bytes = 5000" in text and Workflow.from_toml(text) == wf
    at = text.index("max_bytes = 5000")
    for bad in ("0", "-3", "true", '"5000"', "5e3"):
        with pytest.raises(InvalidWorkflow, match="max_bytes"):
            Workflow.from_toml(text[:at] + f"max_bytes = {bad}" + text[at + len("max_bytes = 5000"):])


@pytest.mark.parametrize("via", ["object", "store"])
@pytest.mark.parametrize("on_refused", ["stop", "text"])
def test_a_receiver_over_its_budget_stops_its_edge_or_falls_back(reference, decoded, via, on_refused):
    """The fixer's budget is exactly its payload (relayed); the checker's is one byte less than its own."""
    ref, _ = reference
    lm, sizes = decoded
    wf = _receivers_budget(on_refused, sizes["fixer"], sizes["checker"] - 1)
    ex = InProcessExecutor(lm) if via == "object" else InProcessExecutor(lm, codec="fp16")  # fp16: refused undecoded
    if on_refused == "stop":
        with pytest.raises(EdgeRefused) as e:
            run_workflow(ex, wf, CONTEXT)
        assert (e.value.src, e.value.dst, e.value.kind) == ("fixer", "checker", "OverBudget")
        assert "receiver 'checker'" in e.value.reason and str(sizes["checker"]) in e.value.reason
        return
    trace = run_workflow(ex, wf, CONTEXT)
    assert [a.channel for a in trace.agents] == ["root", "kv", "kv->text"]
    assert trace.agents[2].fallback.startswith("OverBudget: receiver 'checker'")
    assert trace.outputs() == ref.outputs()


def test_a_receivers_budget_reaches_worker_processes(reference, decoded, tmp_path):
    ref, _ = reference
    _, sizes = decoded
    wf = _receivers_budget("text", sizes["fixer"], sizes["checker"] - 1)
    with ProcessExecutor(MODEL, wf, store=f"file://{tmp_path}/store", codec="fp16") as ex:
        trace = ex.run(CONTEXT)
    assert [a.channel for a in trace.agents] == ["root", "kv", "kv->text"]
    assert trace.agents[2].fallback.startswith("OverBudget: receiver 'checker'")
    assert trace.outputs() == ref.outputs()
