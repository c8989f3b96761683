"""``bench connector`` on tiny models: every receiver continues the relayed cache to re-reading's answer, the
engine takes the payload's whole pages instead of prefilling them, and what cannot be connected is named."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from kvrelay.bench.connector import (
    LMCACHE_VLLM,
    MODES,
    PEER_MODES,
    ROW_FIELDS,
    Setup,
    bench_connector,
    report,
)
from kvrelay.cli.app import app


def quiet() -> float:
    return float(torch.get_num_threads())


def test_every_receiver_writes_the_text_answer_and_the_engine_reuses_whole_pages(tiny_by_arch):
    lm = tiny_by_arch["qwen2"]
    raw = bench_connector(lm, Setup(context_tokens=120, new_tokens=6, repeats=2), load_reader=quiet)
    res = report(raw, model="tiny:qwen2", command="c", decode=lm.tokenizer.decode)
    assert [r["mode"] for r in res["rows"]] == list(MODES)
    by = {r["mode"]: r for r in res["rows"]}
    for r in res["rows"]:
        assert set(ROW_FIELDS) <= set(r) and r["answer_equal_to_text"], r
        assert r["ttft_s"] > 0 and len(r["ttft_s_each"]) == 2
        assert ("inject_s" in r) == r["mode"].startswith("continuous_batching")
    T = raw["context_tokens"]
    assert T >= 32 and by["continuous_batching"]["reused_tokens"] == (T // 16) * 16  # whole pages, not prefilled
    assert by["continuous_batching_text"]["reused_tokens"] == 0
    assert by["continuous_batching"]["prefilled_tokens"] + by["continuous_batching"]["reused_tokens"] == \
        by["text"]["prefilled_tokens"] == by["continuous_batching_text"]["prefilled_tokens"]
    assert by["dynamic_cache"]["reused_tokens"] == T
    assert set(res["unavailable"]) == set(PEER_MODES) and all(res["unavailable"].values())  # not asked for
    assert res["load_average"]["status"] == "quiet" and len(res["load_average"]["load1"]) == 1 + 2 + 1


def test_a_sliding_window_model_names_the_engine_as_unavailable(tiny_by_arch):
    lm = tiny_by_arch["gemma3"]
    raw = bench_connector(lm, Setup(context_tokens=64, new_tokens=3, repeats=1), load_reader=quiet)
    assert list(raw["runs"]) == ["text", "dynamic_cache", "continuous_batching_text"]
    assert "sliding-window" in raw["unavailable"]["continuous_batching"]


def test_bench_connector_cli_writes_the_documented_json(tmp_path):
    out = tmp_path / "c.json"
    argv = ["bench", "connector", "--model", "tiny:llama", "--context-tokens", "80", "--new-tokens", "4",
            "--repeats", "1", "--threads", "1", "--allow-load", "--json", str(out)]
    r = CliRunner().invoke(app, argv, env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "not connected: lmcache_vllm" in " ".join(r.output.split())
    d = json.loads(out.read_text())
    assert d["command"].startswith("kvrelay bench connector") and d["unavailable"][LMCACHE_VLLM]
    assert [row["mode"] for row in d["rows"]] == list(MODES)
    assert all(row["answer_equal_to_text"] for row in d["rows"])


def test_bench_connector_mistakes_stop_before_a_model_loads():
    r = CliRunner().invoke(app, ["bench", "connector", "--model", "tiny:llama", "--context-tokens", "8"])
    assert r.exit_code == 2 and "--context-tokens 8 is too small" in r.output
    r = CliRunner().invoke(app, ["bench", "connector", "--model", "no-such-model-xyz"])
    assert r.exit_code == 2 and "error:" in r.output


def test_lmcache_is_refused_before_a_model_loads_where_vllm_cannot_load_it():
    r = CliRunner().invoke(app, ["bench", "connector", "--model", "tiny:llama", "--lmcache"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--lmcache" in r.output  # no folder of weights for vLLM (or no LMCache at all)


def test_vllm_with_lmcache_is_started_with_its_connector_and_no_prefix_cache_of_its_own(tmp_path):
    from kvrelay.bench.peer_servers import lmcache_server, vllm_lmcache_serve

    cmd = vllm_lmcache_serve(tmp_path, "m", 2, 5599)
    argv = cmd.resolved(8123)
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "LMCacheMPConnector" and cfg["kv_connector_extra_config"]["lmcache.mp.port"] == 5599
    assert "--no-enable-prefix-caching" in argv and argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--model") + 1] == str(tmp_path)  # the name LMCache keys chunks by
    server = lmcache_server(5599)
    assert server.ready_path == "/healthcheck" and "5599" in server.resolved(8124)
