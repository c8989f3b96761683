"""``bench engine``: the kvrelay side on a tiny model and the tokens the peer's pipeline reads
(the report of a recorded llama.cpp run: ``test_engine_report.py``)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.bench.engine import bench_engine, chain_turns, pipeline_workload
from kvrelay.bench.engine_report import markdown, report
from kvrelay.core.errors import MachineLoaded
from kvrelay.models.tiny import tiny_lm
from kvrelay.workflows.run import turn_ids


def test_kvrelay_side_on_a_tiny_model_relays_exactly_and_reports():
    lm = tiny_lm("qwen2")
    quiet = float(torch.get_num_threads()) + 0.5  # the benchmark's own threads + 0.5: still quiet
    raw = bench_engine({"fp32": lm}, context_tokens=48, repeats=2, new_tokens=4, pipeline_tokens=3, codec="raw",
                       array_bytes=1 << 20, load_reader=lambda: quiet)
    res = report(raw, model="tiny", command="c")
    assert res["load_average"]["status"] == "quiet" and "**quiet**" in markdown(res)
    (row,) = res["rows"]
    assert row["engine"] == "kvrelay" and row["mode"] == "fp32"
    assert row["relay_identical"]  # the fp32 mode keeps relay == text
    assert row["relay_bytes"] > 0 and row["decode_tokens"] == 4
    assert [len(e["trials"]) for e in raw["engines"]] == [2]
    (pipe,) = res["pipeline"]
    assert (pipe["engine"], pipe["handoff"], pipe["agents"], pipe["min_decode_tokens"]) == ("kvrelay", "kv", 5, 3)
    assert res["targets"][0]["target"].startswith("decode at")


def test_peer_pipeline_reads_the_same_tokens_as_kvrelays_agents():
    lm = tiny_lm("qwen2")
    wl = pipeline_workload(lm, 64, 3)
    ctx, turns = chain_turns(lm, wl)
    answers = [[10, 11, 12], [13, 14, 15], [16, 17, 18], [19, 20, 21], [22, 23, 24]]
    seq = list(ctx)
    for spec, turn, ans in zip(wl.workflow.agents, turns, answers, strict=True):
        agent = Agent(lm, spec.name, spec.role)
        want = turn_ids(agent, spec.prompt, seq, "continue", ans)  # what kvrelay's agent holds after its turn
        seq = seq + list(turn.prompt_ids) + ans + list(turn.end_ids)
        assert seq == want


class _Readings:
    """Injected 1-minute load readings (a busy machine without making one): counts how often it was read."""

    def __init__(self, value: float):
        self.value, self.calls = value, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.value


def test_a_loaded_machine_stops_the_run_before_anything_is_timed():
    busy = _Readings(torch.get_num_threads() + 0.6)
    with pytest.raises(MachineLoaded, match=r"expected a quiet machine .*--allow-load") as err:
        bench_engine({"fp32": tiny_lm("qwen2")}, context_tokens=48, repeats=2, new_tokens=4, pipeline_tokens=3,
                     codec="raw", array_bytes=1 << 20, load_reader=busy)
    assert busy.calls == 1 and err.value.when == "before the run"


def test_allow_load_keeps_the_figures_and_labels_them_loaded():
    busy = _Readings(torch.get_num_threads() + 0.6)
    raw = bench_engine({"fp32": tiny_lm("qwen2")}, context_tokens=48, repeats=2, new_tokens=4, pipeline_tokens=3,
                       codec="raw", array_bytes=1 << 20, load_reader=busy, allow_load=True)
    res = report(raw, model="tiny", command="c")
    assert busy.calls == 1 + 2 + 2  # the start, each repeat, each pipeline run
    assert res["load_average"]["status"] == "loaded" and res["load_average"]["max"] == busy.value
    assert "**loaded**" in markdown(res)
