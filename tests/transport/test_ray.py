"""Agents as Ray actors on a real local Ray cluster: payloads through the object store (zero-copy,
bf16 included) and a 3-agent chain with the same outputs as in-process."""

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
