"""``bench serve`` on two tiny models: every kvrelay strategy runs the same workflows through the
HTTP API; relay with the largest model writes what re-sending the text writes; round-robin's handles
cross models and fall back; the JSON contract; the domination rule."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from kvrelay.bench.serve import (  # noqa: E402
    KVRELAY_STRATEGIES,
    STRATEGIES,
    ServeBenchConfig,
    bench_serve,
    credibly_dominating,
    dominating,
    point_dominating,
    versus,
)
from kvrelay.core.errors import InvalidInput  # noqa: E402

FIELDS = {"name", "p50_s", "p99_s", "throughput_rps", "accuracy", "ci_low", "ci_high"}


@pytest.fixture(scope="module")
def result():
    cfg = ServeBenchConfig(models=("tiny:qwen2", "tiny:llama"), workflows=3, clients=2, doc_tokens=96, max_tokens=6,
                           slo_s=30.0, strategies=KVRELAY_STRATEGIES + ("vllm", "vllm_prefix_arranged"), replicas=2)
    parts: list[dict] = []
    res = bench_serve(cfg, checkpoint=parts.append)
    return res | {"parts": parts}


def test_every_strategy_reports_the_contract(result):
    rows = {r["name"]: r for r in result["strategies"]}
    assert list(rows) == [s for s in STRATEGIES if not s.startswith("transformers_serve")]
    for name in KVRELAY_STRATEGIES:
        r = rows[name]
        assert FIELDS <= set(r) and r["run"] and r["workflows"] == 3 and r["requests"] == 9
        assert 0 < r["p50_s"] <= r["p99_s"] and r["throughput_rps"] > 0 and 0 <= r["accuracy"] <= 1
    for name in ("vllm", "vllm_prefix_arranged"):
        assert not rows[name]["run"] and rows[name]["reason"] and rows[name]["p50_s"] is None
    assert isinstance(result["scheduler_dominated"], bool)
    assert result["scheduler_dominated"] == bool(result["dominated_by"])
    assert result["scheduler_point_dominated"] == bool(result["point_dominated_by"])
    assert set(result["dominated_by"]) <= set(result["versus_scheduler"]) | set(result["point_dominated_by"])
    assert result["load_average"]["status"] in ("quiet", "loaded")
    assert result["replicas"] == 2  # two replicas per model: a handle one made, either continues (below)
    # kvrelay's strategies run interleaved, in rounds of `clients` workflows: after each round, what was
    # measured so far (the CLI writes it: a stopped run keeps it) — 2, then all 3 workflows of each strategy
    assert [[(r["name"], r["workflows"]) for r in p["strategies"]] for p in result["parts"]] == \
        [[(n, k) for n in KVRELAY_STRATEGIES] for k in (2, 3)]
    assert result["complete"] and not any(p["complete"] for p in result["parts"])


def test_relay_writes_what_the_text_re_send_writes(result):
    rows = {r["name"]: r for r in result["strategies"]}
    relay, text = rows["always_largest"], rows["always_text"]
    assert relay["relay_hits"] == 6 and not relay["fallbacks"]  # agents 2 and 3 of every workflow continued
    assert text["relay_hits"] == 0
    assert [r["answer"] for r in relay["records"]] == [r["answer"] for r in text["records"]]
    # and every agent attended to the same conversation, however it arrived
    assert [[s["prompt_tokens"] for s in r["steps"]] for r in relay["records"]] == \
        [[s["prompt_tokens"] for s in r["steps"]] for r in text["records"]]
    assert all(s["relayed_tokens"] > 0 for r in relay["records"] for s in r["steps"][1:])


def test_round_robin_hands_caches_across_models_and_falls_back(result):
    rr = next(r for r in result["strategies"] if r["name"] == "round_robin")
    assert rr["fallbacks"].get("incompatible", 0) > 0
    assert set(rr["models_used"]) == {"tiny:qwen2", "tiny:llama"}


def test_shared_regime_workflows_alternate_with_private_ones_and_relay_writes_what_text_writes():
    """With both regimes, ARC-Challenge workflows (the answerer is asked the whole problem again) alternate
    with the generated-document ones; each row reports each regime on its own, and relaying the cache still
    writes what re-sending the conversation writes."""
    cfg = ServeBenchConfig(models=("tiny:qwen2", "tiny:llama"), workflows=2, clients=2, doc_tokens=96, max_tokens=6,
                           slo_s=30.0, strategies=("always_largest", "always_text"), regimes=("private", "shared"))
    res = bench_serve(cfg)
    assert res["regimes"] == ["private", "shared"] and "arc_challenge (shared regime)" in res["task_set"]
    rows = {r["name"]: r for r in res["strategies"]}
    relay, text = rows["always_largest"], rows["always_text"]
    assert [r["regime"] for r in relay["records"]] == ["private", "shared", "private", "shared"]
    assert [r["task"] for r in relay["records"]][1].startswith("arc_challenge/")
    for row in (relay, text):
        assert set(row["by_regime"]) == {"private", "shared"}
        assert all(g["workflows"] == 2 and 0 <= g["accuracy"] <= 1 for g in row["by_regime"].values())
    assert relay["relay_hits"] == 8 and [r["answer"] for r in relay["records"]] == [r["answer"] for r in text["records"]]
    shared = relay["records"][1]["steps"]  # the answerer re-reads the problem in its own turn
    assert shared[2]["prompt_tokens"] - shared[2]["relayed_tokens"] > shared[1]["prompt_tokens"] - shared[1]["relayed_tokens"]
    with pytest.raises(InvalidInput, match="regimes"):
        ServeBenchConfig(models=("tiny:qwen2",), regimes=("private", "private"))
    with pytest.raises(InvalidInput, match="regimes"):
        ServeBenchConfig(models=("tiny:qwen2",), regimes=("public",))
    with pytest.raises(InvalidInput, match="replicas"):
        ServeBenchConfig(models=("tiny:qwen2",), replicas=0)


def test_a_runs_load_is_judged_against_the_cores_its_replicas_use_together():
    """Two replicas of one thread each use two cores: a load of 2 is the run itself, not a busy machine."""
    assert ServeBenchConfig(models=("tiny:qwen2",), threads=1, replicas=2).cores == 2
    assert ServeBenchConfig(models=("tiny:qwen2",), threads=2).cores == 2
    assert ServeBenchConfig(models=("tiny:qwen2",), threads=1).cores == 1


def test_the_cli_prints_both_dominance_rules_with_who(result, capsys):
    from kvrelay.cli.bench_serve import print_result

    print_result(result)
    out = capsys.readouterr().out
    judged = f"paired by workflow, beyond the 95% intervals): {result['scheduler_dominated']}"
    assert judged in " ".join(out.split())
    assert f"on point estimates alone (p50 and accuracy): {result['scheduler_point_dominated']}" in " ".join(out.split())


def test_point_domination_needs_no_worse_on_both_and_better_on_one():
    def row(name, p50, acc):
        return {"name": name, "run": True, "p50_s": p50, "accuracy": acc}

    me = row("scheduler", 2.0, 0.5)
    assert point_dominating([me, row("a", 2.0, 0.5), row("b", 1.0, 0.4), row("c", 3.0, 0.9)]) == []
    assert point_dominating([me, row("a", 1.9, 0.5)]) == ["a"]
    assert point_dominating([me, row("a", 2.0, 0.6)]) == ["a"]
    assert point_dominating([me, {"name": "vllm", "run": False, "p50_s": None, "accuracy": None}]) == []


def test_a_paired_strategy_dominates_only_beyond_noise_an_unpaired_one_by_its_point():
    def row(name, p50, acc):
        return {"name": name, "run": True, "p50_s": p50, "accuracy": acc}

    rows = [row("scheduler", 39.0, 0.625), row("always_largest", 38.0, 0.625), row("unpaired", 30.0, 0.625),
            row("credible", 35.0, 0.625)]
    tie = {"workflows": 8, "latency_ratio": 0.98, "latency_ratio_ci_low": 0.9, "latency_ratio_ci_high": 1.06,
           "accuracy_delta": 0.0, "accuracy_delta_ci_low": 0.0, "accuracy_delta_ci_high": 0.0}
    paired = {"always_largest": tie, "credible": tie | {"latency_ratio": 0.9, "latency_ratio_ci_high": 0.95}}
    assert point_dominating(rows) == ["always_largest", "unpaired", "credible"]
    # the tie of identical routings is not a win
    assert dominating(rows, paired, point_dominating(rows)) == ["unpaired", "credible"]


def test_credible_domination_needs_an_interval_clear_of_no_difference():
    def v(ratio, lo, hi, acc, acc_lo, acc_hi):
        return {"workflows": 8, "latency_ratio": ratio, "latency_ratio_ci_low": lo, "latency_ratio_ci_high": hi,
                "accuracy_delta": acc, "accuracy_delta_ci_low": acc_lo, "accuracy_delta_ci_high": acc_hi}

    paired = {"noise": v(0.94, 0.89, 1.01, 0.0, 0.0, 0.0),  # faster by the point, not beyond noise
              "faster": v(0.80, 0.70, 0.90, 0.0, -0.1, 0.1),  # credibly faster, as accurate
              "faster_worse": v(0.70, 0.60, 0.80, -0.25, -0.5, 0.0),  # faster but less accurate
              "better": v(1.00, 0.90, 1.10, 0.30, 0.10, 0.50),  # credibly more accurate, no slower
              "better_slower": v(1.20, 1.10, 1.30, 0.30, 0.10, 0.50)}
    assert credibly_dominating(paired) == ["faster", "better"]
    assert credibly_dominating({}) == []


def test_versus_pairs_workflows_by_task():
    def row(name, e2e, scores, run=True):
        recs = [{"task": f"t{i}", "e2e_s": e, "score": sc} for i, (e, sc) in enumerate(zip(e2e, scores, strict=True))]
        return {"name": name, "run": run, "records": recs}

    me = row("scheduler", [10, 20, 30, 40, 50, 60], [1, 0, 1, 0, 1, 0])
    same = row("always_largest", [10.5, 19, 31, 39, 50.5, 60], [1, 0, 1, 0, 1, 0])
    fast = row("always_smallest", [5, 10, 15, 20, 25, 30], [0, 0, 1, 0, 0, 0])
    fast["records"] = list(reversed(fast["records"]))  # paired by task, not by position
    out = versus([me, same, fast, {"name": "vllm", "run": False}])
    assert set(out) == {"always_largest", "always_smallest"}
    assert out["always_smallest"]["latency_ratio"] == pytest.approx(0.5)
    assert out["always_smallest"]["latency_ratio_ci_high"] == pytest.approx(0.5)  # every pair halves
    assert out["always_smallest"]["accuracy_delta"] == pytest.approx(-2 / 6)
    s = out["always_largest"]
    assert s["latency_ratio_ci_low"] < 1 < s["latency_ratio_ci_high"] and s["accuracy_delta"] == 0
    assert versus([same, fast]) == {}  # no scheduler row
    assert out["always_largest"]["units"] == 6


def test_versus_resamples_rounds_not_the_workflows_that_shared_one():
    """Two workflows of an interleaved round ran side by side: a slowdown in that round hits both, so
    they count as one unit; counting them twice would narrow the interval."""
    def row(name, e2e):
        return {"name": name, "run": True,
                "records": [{"task": f"t{i}", "e2e_s": e, "score": 1, "round": i // 2} for i, e in enumerate(e2e)]}

    me = row("scheduler", [10] * 8)
    other = row("always_largest", [13, 13, 10, 10, 10, 10, 10, 10])  # one slow round
    by_round = versus([me, other])["always_largest"]
    assert by_round["units"] == 4 and by_round["workflows"] == 8
    for r in other["records"] + me["records"]:
        del r["round"]
    by_workflow = versus([me, other])["always_largest"]
    assert by_workflow["units"] == 8
    width = lambda v: v["latency_ratio_ci_high"] - v["latency_ratio_ci_low"]  # noqa: E731
    assert width(by_round) > width(by_workflow)


def test_cli_default_strategies_are_the_library_list():
    from typer.main import get_command

    from kvrelay.cli import app

    cmd = get_command(app).commands["bench"].commands["serve"]
    default = next(p.default for p in cmd.params if p.name == "strategies")
    assert tuple(default.split(",")) == STRATEGIES


def test_a_peer_server_gets_only_standard_openai_fields(tmp_path):
    """transformers serve refuses unknown request fields (422): the peer strategy must send none of kvrelay's."""
    import httpx
    from transformers import LlamaConfig

    from kvrelay.audit.tasks import generate
    from kvrelay.bench.peer_servers import PeerServer, transformers_serve
    from kvrelay.bench.serve import Route, run_one
    from tests.models.tiny_model_folders import WORDS, save_tiny_model, save_tiny_tokenizer

    folder = tmp_path / "tiny-llama"
    save_tiny_model(folder, LlamaConfig(vocab_size=len(WORDS) + 2, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=8, max_position_embeddings=4096))
    save_tiny_tokenizer(folder, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    with pytest.raises(ValueError, match="extensions"):
        Route("http://x", lambda: "m", True, extensions=False)
    task = generate(1, 0, doc_tokens=96)[0]
    with PeerServer(transformers_serve(folder, 1)) as url, httpx.Client(timeout=120) as client:
        rec = run_one(client, Route(url, lambda: str(folder), False, extensions=False), task, 3)
    assert len(rec["steps"]) == 3 and all(s["prompt_tokens"] for s in rec["steps"])
    # each agent re-sent the whole conversation: the prompts grow
    assert rec["steps"][0]["prompt_tokens"] < rec["steps"][1]["prompt_tokens"] < rec["steps"][2]["prompt_tokens"]


def test_text_hand_offs_as_a_conversation_extend_the_previous_request_and_as_roles_do_not():
    """``vllm_prefix_arranged`` sends the conversation (a prefix cache reuses every earlier request); ``vllm``
    sends each agent's own system prompt and a transcript (nothing to reuse across agents)."""
    from kvrelay.bench.serve import ROLES, text_messages

    turns, answers = ("DOC\n\nsummarize", "who holds codes?", "what is the code?"), ("a summary", "Ann and Bo")
    conv = [text_messages("conversation", turns, answers[:k]) for k in range(3)]
    for k in (1, 2):
        prev = conv[k - 1]
        assert conv[k][:len(prev)] == prev and conv[k][len(prev)] == {"role": "assistant", "content": answers[k - 1]}
        assert conv[k][-1] == {"role": "user", "content": turns[k]}
    roles = [text_messages("roles", turns, answers[:k]) for k in range(3)]
    assert [m[0]["content"] for m in roles] == list(ROLES) and len(set(ROLES)) == 3
    assert all(len(m) == 2 and m[1]["role"] == "user" and m[1]["content"].endswith(turns[k])
               for k, m in enumerate(roles))
    # the later agents still get everything that was said, the document first
    last = roles[2][1]["content"]
    assert last.index("DOC") < last.index("a summary") < last.index("Ann and Bo") < last.index(turns[2])
    with pytest.raises(ValueError, match="prompts"):
        text_messages("other", turns, ())


def test_peer_strategies_write_hand_offs_as_their_names_say():
    """Each peer has a ``…_prefix_arranged`` strategy (the conversation re-sent: its prefix cache's best case)
    and a plain one (each agent's own prompt, as agents usually write them); both send standard fields only."""
    from kvrelay.bench.serve import ARRANGED, peer_route

    peers = [s for s in STRATEGIES if s not in KVRELAY_STRATEGIES]
    assert {s.removesuffix(ARRANGED) for s in peers} == {"transformers_serve", "vllm"}
    for name in peers:
        route = peer_route(name, "http://x", "m")
        assert not route.relay and not route.extensions and route.model() == "m"
        assert route.prompts == ("conversation" if name.endswith(ARRANGED) else "roles")


def test_vllm_prefix_cache_counters_are_read_from_its_metrics():
    """On the /metrics text a vLLM CPU 0.32.0 server wrote after two requests sharing a prefix."""
    from pathlib import Path

    from kvrelay.bench.peer_servers import prefix_cache_counts
    from kvrelay.core.errors import PeerUnavailable

    text = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()
    counts = prefix_cache_counts(text)
    assert counts["queries"] > counts["hits"] > 0
    with pytest.raises(PeerUnavailable, match="prefix-cache"):
        prefix_cache_counts("# HELP other_total x\n# TYPE other_total counter\nother_total 1.0\n")


def test_a_missing_vllm_environment_is_a_reason_not_a_crash(tmp_path):
    from kvrelay.bench.peer_servers import vllm_available

    assert "make peers-vllm" in vllm_available(tmp_path / "no-python")
    assert vllm_available(tmp_path) is None  # a path that exists


def test_single_requests_send_the_document_and_question_once_and_relay_nothing():
    """``--single``: one plain chat request per workflow, so the kvrelay routes differ only in the model."""
    cfg = ServeBenchConfig(models=("tiny:qwen2", "tiny:llama"), workflows=2, clients=1, doc_tokens=96, max_tokens=4,
                           slo_s=30.0, strategies=("always_largest", "always_text"), single=True)
    res = bench_serve(cfg)
    assert res["agents"] == 1
    rows = {r["name"]: r for r in res["strategies"]}
    for r in rows.values():
        assert r["requests"] == 2 and r["relay_hits"] == 0 and all(len(w["steps"]) == 1 for w in r["records"])
    # the same request either way: the same answer from the same prompt
    assert [w["answer"] for w in rows["always_largest"]["records"]] == [w["answer"] for w in rows["always_text"]["records"]]
    assert [w["steps"][0]["prompt_tokens"] for w in rows["always_largest"]["records"]] == \
        [w["steps"][0]["prompt_tokens"] for w in rows["always_text"]["records"]]
