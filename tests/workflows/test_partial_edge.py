"""Workflow edges with ``partial = F``: the receiver's own prompt selects the positions it is relayed."""

from __future__ import annotations

import pytest

from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.spec import AgentSpec, Edge, Workflow

CONTEXT = ("the report of the agent is in the file and the bug is in line seven of the code "
           "the key of the blue vault is four and the answer is not in the plan ") * 2
A = AgentSpec("reader", "read the report", "what is the bug", 6, 6)
B = AgentSpec("fixer", "fix the code", "where is the fix", 6, 6)
C = AgentSpec("checker", "check the fix", "is the answer yes or no", 6, 6)


def pair(partial):
    return Workflow("pair", (A, B), (Edge("reader", "fixer", "kv", partial=partial),))


def test_partial_edge_toml_round_trip_and_refusals():
    wf = pair(0.25)
    assert "partial = 0.25" in wf.to_toml() and Workflow.from_toml(wf.to_toml()) == wf
    assert wf.with_channels("text").edges[0].partial is None
    for bad in (0.0, 1.5, "0.5"):
        with pytest.raises(ValueError, match="partial must be a fraction"):
            pair(bad)
    with pytest.raises(ValueError, match="on a kv edge"):
        Edge("reader", "fixer", "text", partial=0.5)
    with pytest.raises(ValueError, match="cannot pass its cache on"):
        Workflow("w", (A, B, C), (Edge("reader", "fixer", "kv", partial=0.5), Edge("fixer", "checker", "kv")))
    with pytest.raises(ValueError, match="continue"):
        Workflow("w", (A, B), (Edge("reader", "fixer", "kv", partial=0.5),), layout="replace")


def test_partial_edge_sends_fewer_bytes_and_all_positions_equal_kv(tiny_by_arch):
    lm = tiny_by_arch["qwen2"]
    full = run_workflow(lm, pair(None), CONTEXT)
    everything = run_workflow(lm, pair(1.0), CONTEXT)
    quarter = run_workflow(lm, pair(0.25), CONTEXT)
    assert everything.agents[1].token_ids == full.agents[1].token_ids
    assert everything.agents[1].relay_bytes == full.agents[1].relay_bytes
    assert quarter.agents[1].relay_bytes < full.agents[1].relay_bytes / 2
    assert quarter.agents[1].relayed_tokens < full.agents[1].relayed_tokens
