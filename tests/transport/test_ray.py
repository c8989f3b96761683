"""Agents as Ray actors on a real local Ray cluster: payloads through the object store (zero-copy,
bf16 included); chains in both layouts on qwen2 and gemma3, and a fan-in hierarchy, with the same
outputs as in-process; a payload from another model refused inside the receiving actor."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.kv.transforms import to_dtype
from kvrelay.workflows.ray_executor import ModelSpec, RayWorkflowRunner, payload_from_numpy, payload_to_numpy
from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.spec import AgentSpec, chain
from tests.conftest import missing_service

try:
    import ray
except ImportError as e:  # ray is in the dev extra: missing only on a partial install
    missing_service("ray", str(e))

CONTEXT = ("the report of the agent is in the file and the bug is in line seven of the code "
           "the key of the blue vault is four and the answer is not in the plan ") * 3
WORDS = "what is the bug in the code and where is the fix"


@pytest.fixture(scope="session")
def ray_cluster():
    """One local cluster for the session (startup is the slow part on 2 cores)."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _payload(lm, n: int = 24):
    ids = torch.arange(9, 9 + n) % 60 + 9
    return Agent(lm, "sender").prefill(ids.tolist())


def _same(a, b) -> bool:
    return a.meta == b.meta and all(torch.equal(x, y) for x, y in zip(
        (*a.keys, *a.values, a.token_ids, a.positions, a.mask), (*b.keys, *b.values, b.token_ids, b.positions, b.mask),
        strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_payload_through_object_store_is_zero_copy(ray_cluster, tiny_by_arch, dtype):
    p = to_dtype(_payload(tiny_by_arch["gemma3"]), dtype)  # sliding layers: T_l < T
    ref = ray.put(payload_to_numpy(p))
    arrays = ray.get(ref)
    back = payload_from_numpy(arrays)
    assert _same(p, back)
    for a, t in zip(arrays["keys"] + arrays["values"], back.keys + back.values, strict=True):
        assert not a.flags.writeable  # a view of the object store's shared memory ...
        assert t.data_ptr() == a.ctypes.data  # ... that the tensor wraps without a copy
    if dtype == torch.bfloat16:
        assert arrays["keys"][0].dtype.name == "int16"


def test_chain_of_three_actors_matches_in_process(ray_cluster, tiny_by_arch):
    wf = chain("chain3", [AgentSpec(n, f"check the {n}", WORDS, max_new_tokens=6, min_new_tokens=3)
                          for n in ("read", "check", "fix")])
    local_kv = run_workflow(tiny_by_arch["qwen2"], wf, CONTEXT, mode="kv")
    with RayWorkflowRunner(ModelSpec.tiny("qwen2"), wf) as runner:
        assert runner.fingerprint == tiny_by_arch["qwen2"].identity.fingerprint  # each actor rebuilt the same model
        kv = runner.run(CONTEXT, mode="kv")
        text = runner.run(CONTEXT, mode="text")
    assert kv.outputs() == local_kv.outputs() == text.outputs()
    assert [a.channel for a in kv.agents] == ["root", "kv", "kv"]
    assert [a.relayed_tokens > 0 for a in kv.agents] == [False, True, True]
    assert all(a.relay_transfer_s > 0 and a.relay_bytes > 0 for a in kv.agents[1:])
    assert [a.relay_bytes for a in kv.agents] == [a.relay_bytes for a in local_kv.agents]
    assert all(a.relayed_tokens == 0 for a in text.agents)


def test_bench_pipeline_on_ray_backend_matches_in_process(ray_cluster, tiny_by_arch):
    """`bench pipeline --backend ray`: the same workflow through actors gives the in-process outputs."""
    from kvrelay.bench.pipeline import bench_pipeline
    from kvrelay.workflows.workloads import build_workload

    lm = tiny_by_arch["qwen2"]
    wl = build_workload("review3", lm.tokenizer, 48)
    wl = replace(wl, workflow=wl.workflow.with_tokens(6, 3))
    local = bench_pipeline(lm, wl, repeats=1, warmup=False)
    with RayWorkflowRunner(ModelSpec.tiny("qwen2"), wl.workflow) as runner:
        res = bench_pipeline(lm, wl, repeats=1, warmup=False, executor=runner)
    assert res["outputs_identical"] is True
    assert [a["kv_output"] for a in res["per_agent"]] == [a["kv_output"] for a in local["per_agent"]]
    assert [a["kv_relayed_tokens"] for a in res["per_agent"]] == [a["kv_relayed_tokens"] for a in local["per_agent"]]


# -- through actors: replace layout, gemma3, fan-in, and a payload from another model -------------------
def _specs(names):
    return [AgentSpec(n, f"check the {n}", WORDS, max_new_tokens=5, min_new_tokens=3) for n in names]


def _same_trace(got, want) -> None:
    assert got.outputs() == want.outputs()
    assert [a.channel for a in got.agents] == [a.channel for a in want.agents]
    assert [a.relayed_tokens for a in got.agents] == [a.relayed_tokens for a in want.agents]
    assert [a.relay_bytes for a in got.agents] == [a.relay_bytes for a in want.agents]


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_actors_match_in_process_in_both_layouts(ray_cluster, tiny_by_arch, arch):
    """One set of actors runs the chain continue and replace; gemma3's sliding layers cross the object store."""
    wf = chain("chain3", _specs(("read", "check", "fix")))
    with RayWorkflowRunner(ModelSpec.tiny(arch), wf) as runner:
        for layout in ("continue", "replace"):
            w = wf.with_layout(layout)
            got = run_workflow(runner, w, CONTEXT, mode="kv")
            want = run_workflow(tiny_by_arch[arch], w, CONTEXT, mode="kv")
            assert got.layout == want.layout == layout
            _same_trace(got, want)
            assert [a.relayed_tokens > 0 for a in got.agents] == [False, True, True]
            assert all(a.relay_transfer_s > 0 for a in got.agents[1:])  # it really went through the object store


def test_fan_in_hierarchy_through_actors_matches_in_process(ray_cluster, tiny_by_arch):
    from kvrelay.workflows.spec import hierarchy

    plan, w1, w2, agg = _specs(("plan", "w1", "w2", "agg"))
    wf = hierarchy("tree", plan, [w1, w2], agg)
    want = run_workflow(tiny_by_arch["qwen2"], wf, CONTEXT, mode="kv")
    with RayWorkflowRunner(ModelSpec.tiny("qwen2"), wf) as runner:
        got = runner.run(CONTEXT, mode="kv")
    _same_trace(got, want)
    assert [a.channel for a in got.agents] == ["root", "kv", "kv", "kv+text"]  # the aggregator reads both workers
    assert got.agents[-1].relayed_tokens > 0


def test_a_payload_from_another_model_is_refused_inside_the_actor(ray_cluster):
    """Two actors on different weights: the receiving actor raises IncompatiblePayload naming the fingerprint."""
    from kvrelay.core.errors import IncompatiblePayload
    from kvrelay.workflows.ray_executor import agent_actor_class

    cls = agent_actor_class(num_cpus=0)
    sender = cls.remote(ModelSpec.tiny("qwen2", seed=0), "read", "read the report", 4, 1)
    receiver = cls.remote(ModelSpec.tiny("qwen2", seed=1), "fix", "fix the code", 4, 1)
    try:
        fps = ray.get([sender.fingerprint.remote(), receiver.fingerprint.remote()])
        assert fps[0] != fps[1]
        base = ray.get(sender.context_ids.remote(CONTEXT))
        out = ray.get(sender.turn.remote(WORDS, base, None, layout="continue", max_new_tokens=3, min_new_tokens=1,
                                         want_payload=True))
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(receiver.turn.remote(WORDS, list(out.ids), out.payload, layout="continue", max_new_tokens=3,
                                         min_new_tokens=1, want_payload=False))
        cause = e.value.cause  # the typed error raised in the actor, carried back whole
        assert isinstance(cause, IncompatiblePayload)
        assert (cause.field, cause.expected, cause.got) == ("model_fingerprint", fps[1], fps[0])
    finally:
        ray.kill(sender)
        ray.kill(receiver)


def test_a_receivers_byte_budget_reaches_the_actor(ray_cluster, tiny_by_arch):
    """``max_bytes`` on an agent: its actor refuses the relayed payload (``OverBudget`` raised inside it) and
    the edge, ``on_refused = "text"``, is rebuilt from text: the same answers as a text run."""
    agents = [AgentSpec(n, f"check the {n}", WORDS, max_new_tokens=4, min_new_tokens=2) for n in ("read", "check")]
    wf = chain("chain2", agents)
    wf = replace(wf, agents=(agents[0], replace(agents[1], max_bytes=1000)),
                 edges=tuple(replace(e, on_refused="text") for e in wf.edges))
    with RayWorkflowRunner(ModelSpec.tiny("qwen2"), wf) as runner:
        kv = runner.run(CONTEXT, mode="kv")
        text = runner.run(CONTEXT, mode="text")
    assert [a.channel for a in kv.agents] == ["root", "kv->text"]
    assert "OverBudget" in kv.agents[1].fallback and "receiver 'check'" in kv.agents[1].fallback
    assert kv.outputs() == text.outputs()
