"""Workflows on tiny random models: text and kv channels agree exactly (continue layout), the
accounting adds up, specs round-trip through TOML, replace runs and reports, the bench dict
has the DESIGN §7 fields."""

from __future__ import annotations

import json

import pytest

from kvrelay.agents.agent import Agent
from kvrelay.bench.pipeline import bench_pipeline, results_markdown
from kvrelay.bench.plot import plot_pipeline
from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.spec import AgentSpec, Edge, Workflow, chain, hierarchy
from kvrelay.workflows.workloads import Workload, build_workload

CONTEXT = ("the report of the agent is in the file and the bug is in line seven of the code "
           "the key of the blue vault is four and the answer is not in the plan ") * 3
WORDS = "what is the bug in the code and where is the fix"


def spec(name: str, n: int = 6, lo: int = 3) -> AgentSpec:
    return AgentSpec(name, f"check the {name}", WORDS, max_new_tokens=n, min_new_tokens=lo)


def chain3(layout: str = "continue") -> Workflow:
    return chain("chain3", [spec("read"), spec("check"), spec("fix")], layout=layout)


def tree(layout: str = "continue") -> Workflow:
    return hierarchy("tree", spec("plan"), [spec("w1"), spec("w2"), spec("w3")], spec("agg"), layout=layout)


def assert_outputs_equal(a, b):
    assert [r.token_ids for r in a.agents] == [r.token_ids for r in b.agents]
    assert all(r.decode_tokens >= 3 for r in a.agents)  # min_new_tokens held


@pytest.mark.parametrize("make", [chain3, tree], ids=["chain3", "hierarchy"])
def test_text_and_kv_channels_give_identical_outputs(tiny, make):
    wf = make()
    text = run_workflow(tiny, wf, CONTEXT, mode="text")
    kv = run_workflow(tiny, wf, CONTEXT, mode="kv")
    assert_outputs_equal(text, kv)
    # every non-root agent got its context as a cache; text mode relays nothing
    assert all(r.relayed_tokens > 0 for r in kv.agents[1:]) and kv.agents[0].relayed_tokens == 0
    assert all(r.relayed_tokens == 0 and r.relay_bytes == 0 for r in text.agents)


@pytest.mark.parametrize("make", [chain3, tree], ids=["chain3", "hierarchy"])
def test_accounting_adds_up(tiny_by_arch, make):
    lm = tiny_by_arch["qwen2"]
    wf = make()
    text = run_workflow(lm, wf, CONTEXT, mode="text")
    kv = run_workflow(lm, wf, CONTEXT, mode="kv")
    tt, kt = text.totals(), kv.totals()
    # prefill tokens saved = relayed tokens, agent by agent and in total
    for a, b in zip(text.agents, kv.agents, strict=True):
        assert a.prefill_tokens - b.prefill_tokens == b.relayed_tokens
        assert a.input_tokens == b.input_tokens == b.prefill_tokens + b.relayed_tokens
        assert b.relay_bytes == 0 or b.relay_bytes > 0 and b.relayed_tokens > 0
    assert tt["prefill_tokens"] - kt["prefill_tokens"] == kt["relayed_tokens"] > 0
    # per-agent parts fit inside the agent's wall time, and agents' walls inside the run's
    for t in (text, kv):
        assert sum(r.wall_s for r in t.agents) <= t.wall_s
        for r in t.agents:
            assert r.prefill_s + r.decode_s + r.relay_s <= r.wall_s + 1e-6
    # the relayed payload's size matches its geometry: T tokens × layers × K,V × heads × dim × 4 B (+ ids)
    ident = lm.identity
    for r in kv.agents:
        if r.relayed_tokens:
            per_tok = ident.num_layers * 2 * ident.num_kv_heads * ident.head_dim * 4 + 8 + 8 + 1
            assert r.relay_bytes == r.relayed_tokens * per_tok


def test_payload_tokens_match_text_transcript(tiny):
    """What a kv receiver holds is token for token what a text receiver re-reads."""
    from kvrelay.workflows.run import turn_ids

    a = Agent(tiny, "a", "check the code", max_new_tokens=5)
    base = a.encode(a.fmt.user(CONTEXT))
    for layout in ("continue", "replace"):
        r = a.respond(WORDS, base, layout=layout, return_payload=True, min_new_tokens=2)
        assert r.payload.token_ids[0].tolist() == turn_ids(a, WORDS, base, layout, r.token_ids)


def test_min_new_tokens_suppresses_stop(tiny_by_arch):
    a = Agent(tiny_by_arch["llama"], "a", max_new_tokens=12)
    a.stop_ids = set(range(200)) - {50}  # every token but one stops: only the minimum forces output
    assert a.respond(WORDS, min_new_tokens=5).token_ids[:5] == (50,) * 5
    assert len(a.respond(WORDS).token_ids) <= 12


def test_replace_layout_runs_and_reports_differences(tiny_by_arch):
    lm = tiny_by_arch["gemma3"]
    wl = Workload(chain3("replace"), CONTEXT, "seven", "prose")
    res = bench_pipeline(lm, wl, repeats=1, warmup=False)
    assert res["layout"] == "replace"
    assert res["fraction_agents_differing"] == len(res["agents_differing"]) / 3
    assert set(res["fact"]) == {"answer", "text_exact_match", "kv_exact_match"}
    assert res["per_agent"][0]["identical"]  # the root reads the same tokens in both modes
    for r in res["per_agent"]:
        assert 0 <= r["common_prefix_tokens"] <= min(r["text_decode_tokens"], r["kv_decode_tokens"])
        assert r["identical"] == (r["text_output"] == r["kv_output"] and
                                  r["common_prefix_tokens"] == r["text_decode_tokens"] == r["kv_decode_tokens"])


def test_toml_round_trip(tmp_path):
    for wf in (chain3(), tree("replace"), build_workload("dialogue", _Tok(), 64).workflow):
        text = wf.to_toml()
        assert Workflow.from_toml(text) == wf
        p = tmp_path / f"{wf.name}.toml"
        p.write_text(text)
        assert Workflow.load(p) == wf


def test_invalid_workflows_fail_loudly():
    a, b, c = spec("a"), spec("b"), spec("c")
    with pytest.raises(ValueError, match="backwards"):
        Workflow("w", (a, b), (Edge("b", "a"),))
    with pytest.raises(ValueError, match="channel"):
        Edge("a", "b", "carrier-pigeon")
    with pytest.raises(ValueError, match="kv\\+text"):
        Workflow("w", (a, b, c), (Edge("a", "c", "kv"), Edge("b", "c", "kv")))
    with pytest.raises(ValueError, match="fan-in"):
        Workflow("w", (a, b), (Edge("a", "b", "kv+text"),))
    with pytest.raises(ValueError, match="min_new_tokens"):
        AgentSpec("x", "", "", max_new_tokens=4, min_new_tokens=5)


def test_bench_json_has_contract_fields(tiny_by_arch, tmp_path):
    lm = tiny_by_arch["llama"]
    wl = build_workload("hierarchy", lm.tokenizer, 64)
    wl = Workload(wl.workflow.with_tokens(4, 2), wl.context, wl.fact, wl.source)
    res = bench_pipeline(lm, wl, repeats=1, model_name="tiny-llama", load=iter([0.5, 9.0]).__next__)
    for k in ("workflow", "agents", "text_s", "kv_s", "speedup", "ideal_speedup", "outputs_identical", "per_agent"):
        assert k in res
    assert res["workflow"] == "hierarchy" and res["agents"] == 5 and len(res["per_agent"]) == 5
    assert res["outputs_identical"] is True
    assert res["speedup"] == pytest.approx(res["text_s"] / res["kv_s"])
    assert res["prefill_tokens_saved"] == res["relayed_tokens"] > 0
    assert [r["channel"] for r in res["per_agent"]] == ["root", "kv", "kv", "kv", "kv+text"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(res))
    png = plot_pipeline(json.loads(path.read_text()), tmp_path / "p.png")
    assert png.stat().st_size > 1000
    assert "| hierarchy | continue |" in results_markdown([res])
    # the load before each repeat and after the last, labelled against the run's threads
    assert res["load_average"] == {"load1_before_repeat": [0.5], "load1_after": 9.0, "status": "loaded",
                                   "limit": res["machine"]["threads"] + 0.5, "max": 9.0}
    assert res["runs"][0]["load1_before"] == 0.5


def test_workload_context_is_real_text_near_budget():
    from kvrelay.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    for name in ("review3", "doc5"):
        wl = build_workload(name, tok, 300, seed=3)
        n = len(tok(wl.context, add_special_tokens=False)["input_ids"])
        assert 200 <= n <= 300 and wl.fact in wl.context
        assert ("def " in wl.context) == (name == "review3")


class _Tok:
    """Whitespace tokenizer: enough for building a workload without a model."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text.split())))}


def test_replace_quality_summary(tiny_by_arch):
    from kvrelay.bench.pipeline import replace_quality

    lm = tiny_by_arch["llama"]
    res = replace_quality(lm, ["review3"], 48, [0, 1], max_new_tokens=4)
    s = res["summary"]
    assert s["runs"] == 2 and 0 <= s["fraction_agent_outputs_differing"] <= 1
    assert all(r["agents"] == 3 and 0 <= r["mean_agreement"] <= 1 for r in res["rows"])
    assert {"text_exact_match", "kv_exact_match", "continue_exact_match"} <= set(s)


def test_fact_first_keeps_graph_and_asks_fact():
    wl = build_workload("hierarchy", _Tok(), 64).fact_first()
    assert wl.workflow.agents[-1].prompt.startswith("First state the internal reference number")
    assert "Finally" not in wl.workflow.agents[-1].prompt
    assert wl.workflow.edges == build_workload("hierarchy", _Tok(), 64).workflow.edges


def test_fan_in_from_roots_reencodes_and_says_so(tiny_by_arch):
    lm = tiny_by_arch["qwen2"]
    a, b, c = spec("a", 3, 1), spec("b", 3, 1), spec("c", 3, 1)
    wf = Workflow("roots", (a, b, c), (Edge("a", "c", "kv+text"), Edge("b", "c", "kv+text")))
    kv, text = run_workflow(lm, wf, CONTEXT, mode="kv"), run_workflow(lm, wf, CONTEXT, mode="text")
    assert kv.agents[-1].channel == "kv+text:no-cache" and kv.agents[-1].relayed_tokens == 0
    assert [r.token_ids for r in text.agents] == [r.token_ids for r in kv.agents]
