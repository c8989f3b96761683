"""The ``bench engine`` report, rebuilt from a recorded real run with llama.cpp.

``data/engine_recorded_raw.json`` is the ``raw`` part of the JSON a real ``kvrelay bench engine --peer
llama.cpp`` run wrote (its command is in the file); no test builds or runs llama.cpp.
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import pytest

from kvrelay.bench.engine_report import PIPELINE_FIELDS, ROW_FIELDS, engine_row, markdown, report
from kvrelay.bench.limits import Geometry

RECORDED = Path(__file__).parent / "data" / "engine_recorded_raw.json"


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(RECORDED.read_text())


def _engine(raw: dict, name: str) -> dict:
    return next(e for e in raw["engines"] if e["engine"] == name)


def test_recorded_run_reports_the_contract_fields(recorded):
    res = report(recorded, model="qwen2.5-coder-0.5b", command="kvrelay bench engine")
    assert {"mem_gbs", "gemm_gflops"} <= set(res["machine"])
    assert {r["engine"] for r in res["rows"]} == {"kvrelay", "llama.cpp"}
    for r in res["rows"]:
        assert set(ROW_FIELDS) <= set(r), set(ROW_FIELDS) - set(r)
    assert {(p["engine"], p["handoff"]) for p in res["pipeline"]} >= {
        ("kvrelay", "kv"), ("llama.cpp", "text"), ("llama.cpp", "state")}
    for p in res["pipeline"]:
        assert set(PIPELINE_FIELDS) <= set(p)
        assert p["agents"] == 5 and p["min_decode_tokens"] == recorded["pipeline_tokens"]
    json.dumps(res)  # the report is JSON as it stands


def test_peer_row_is_the_median_of_its_recorded_trials(recorded):
    peer = _engine(recorded, "llama.cpp")
    row = engine_row(peer, recorded["limits"], Geometry(**recorded["geometry"]))
    trials = peer["trials"]
    assert row["decode_tokens_per_s"] == pytest.approx(
        statistics.median((t["decode_tokens"] - 1) / t["decode_s"] for t in trials))
    assert row["prefill_tokens_per_s"] == pytest.approx(
        statistics.median(t["text_prefill_tokens"] / t["text_ttft_s"] for t in trials))
    assert row["relay_ttft_s"] == pytest.approx(statistics.median(t["relay_ttft_s"] for t in trials))
    assert row["relay_bytes"] == peer["relay_bytes"]  # llama.cpp's own state size
    # the fraction of the bandwidth limit: tokens/s over (GB/s / bytes read per token)
    limit = recorded["limits"]["mem_gbs"] * 1e9 / peer["weight_bytes"]
    assert row["decode_fraction_of_limit"] == pytest.approx(row["decode_tokens_per_s"] / limit)


def test_targets_compare_the_fastest_kvrelay_mode_with_the_peer(recorded):
    res = report(recorded, model="m", command="c")
    rows = {(r["engine"], r["mode"]): r for r in res["rows"]}
    best = max((r for r in res["rows"] if r["engine"] == "kvrelay"), key=lambda r: r["decode_tokens_per_s"])
    peer = next(r for r in res["rows"] if r["engine"] == "llama.cpp")
    t = {x["target"]: x for x in res["targets"]}
    dec = t["decode >= 1.0x llama.cpp tokens/s"]
    assert dec["value"] == pytest.approx(best["decode_tokens_per_s"] / peer["decode_tokens_per_s"])
    assert dec["met"] == (dec["value"] >= 1.0)
    assert t["relayed bytes <= llama.cpp's"]["met"] == (best["relay_bytes"] <= peer["relay_bytes"])
    assert len(rows) == len(res["rows"])
    # a faster peer decode flips the decode target
    faster = copy.deepcopy(recorded)
    for tr in _engine(faster, "llama.cpp")["trials"]:
        tr["decode_s"] /= 100
    assert not {x["target"]: x for x in report(faster, model="m", command="c")["targets"]}[
        "decode >= 1.0x llama.cpp tokens/s"]["met"]


def test_targets_judge_the_default_auto_mode_when_it_ran_and_ask_3x_prefill_on_amx(recorded):
    raw = copy.deepcopy(recorded)
    ours = [e for e in raw["engines"] if e["engine"] == "kvrelay"]
    slowest = min(ours, key=lambda e: statistics.median((t["decode_tokens"] - 1) / t["decode_s"] for t in e["trials"]))
    slowest.update(mode="auto", resolved_mode="bf16+int8")
    res = report(raw, model="m", command="c", extra={"cpu_flags": ["avx512f", "amx_tile", "amx_bf16"]})
    row = next(r for r in res["rows"] if r["mode"] == "auto")
    t = {x["target"]: x for x in res["targets"]}
    assert "auto (bf16+int8)" in t["decode at >= 0.7 of the bandwidth limit"]["detail"]
    peer = next(r for r in res["rows"] if r["engine"] == "llama.cpp")
    dec = t["decode >= 1.0x llama.cpp tokens/s"]
    assert dec["value"] == pytest.approx(row["decode_tokens_per_s"] / peer["decode_tokens_per_s"])
    assert t["prefill >= 3x llama.cpp (AMX on this CPU)"]["goal"] == 3.0
    assert "| auto (bf16+int8) |" in markdown(res)
    plain = {x["target"] for x in report(raw, model="m", command="c", extra={"cpu_flags": ["avx512f"]})["targets"]}
    assert "prefill >= 1x llama.cpp (no AMX on this CPU)" in plain


def test_malformed_peer_output_is_refused_naming_what_is_missing(recorded):
    bad = copy.deepcopy(recorded)
    for tr in _engine(bad, "llama.cpp")["trials"]:
        del tr["decode_s"]
    with pytest.raises(ValueError, match="decode_s"):
        report(bad, model="m", command="c")




def test_markdown_shows_both_engines_and_every_target(recorded):
    res = report(recorded, model="m", command="kvrelay bench engine")
    md = markdown(res)
    assert "| llama.cpp |" in md and "| kvrelay |" in md and "`kvrelay bench engine`" in md
    assert all(t["target"] in md for t in res["targets"])


def test_a_vllm_row_is_reported_and_judges_the_cold_text_ttft(recorded):
    """``data/engine_vllm_side.json``: a real ``bench.peers.vllm.VllmPeer`` check and trial (its ``recorded``
    field says how), added to the recorded run as ``bench_engine(..., vllm=...)`` adds it."""
    raw = copy.deepcopy(recorded)
    side = json.loads((RECORDED.parent / "engine_vllm_side.json").read_text())
    raw["engines"].append(side)
    res = report(raw, model="m", command="c")
    row = next(r for r in res["rows"] if r["engine"] == "vllm")
    assert set(ROW_FIELDS) <= set(row) and row["relay_identical"] and row["relay_bytes"] == 0
    assert row["text_ttft_s"] == pytest.approx(side["trials"][0]["text_ttft_s"])
    assert row["decode_tokens_per_s"] == pytest.approx(7 / side["trials"][0]["decode_s"])
    best = max((r for r in res["rows"] if r["engine"] == "kvrelay"), key=lambda r: r["decode_tokens_per_s"])
    t = {x["target"]: x for x in res["targets"]}["cold text TTFT no slower than vLLM's CPU build (bf16)"]
    assert t["value"] == pytest.approx(row["text_ttft_s"] / best["text_ttft_s"]) and t["met"] == (t["value"] >= 1.0)
    assert "| vllm | bf16 |" in markdown(res)
    # the llama.cpp targets stand as they were
    assert [x for x in res["targets"] if "vLLM" not in x["target"]] == report(recorded, model="m", command="c")["targets"]


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_decode_bytes_count_the_head_once_and_no_untied_embedding(tied):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvrelay.bench.engine import bf16_weight_bytes

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied))
    layers = 2 * (16 * 16 * 2 + 16 * 8 * 2 + 3 * 16 * 32 + 2 * 16)  # q, o; k, v; MLP; two norms
    assert bf16_weight_bytes(m) == 2 * (layers + 16 + 100 * 16)  # + final norm + the head (the tied embedding)
