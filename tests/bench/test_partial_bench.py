"""`bench partial`: paired statistics in points, budget-1 partial relay equals full relay, resumable records."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvrelay.bench.partial import Trial, by_set, run, summarize
from kvrelay.cli.app import app


def t(task: str, method: str, score: float, budget: float = 1.0, nbytes: int = 100) -> Trial:
    return Trial(task, "gen_easy", method, budget, score, nbytes, 0.5, 0.0, budget, 40)


def test_summarize_pairs_each_method_with_full_on_the_same_tasks():
    trials = [t(f"k{i}", "full", 1.0, nbytes=1000) for i in range(10)]
    trials += [t(f"k{i}", "receiver_driven", float(i < 7), 0.25, 250) for i in range(10)]
    trials += [t(f"k{i}", "none", 0.0, nbytes=0) for i in range(10)]
    rows = {(r["method"], r["budget"]): r for r in summarize(trials)}
    rd = rows[("receiver_driven", 0.25)]
    assert rd["accuracy"] == pytest.approx(70.0) and rd["delta_vs_full"] == pytest.approx(-30.0)
    assert rd["delta_ci_low"] < -30 < rd["delta_ci_high"] <= 0
    assert rd["bytes_vs_full"] == pytest.approx(0.25) and rd["n"] == 10
    assert rows[("none", 1.0)]["delta_vs_full"] == pytest.approx(-100.0)
    assert rows[("full", 1.0)]["delta_ci_low"] == 0.0
    assert [r["method"] for r in summarize(trials)] == ["full", "receiver_driven", "none"]


def test_receiver_driven_is_paired_with_agnostic_eviction_and_the_note_on_the_same_tasks():
    trials = [t(f"k{i}", "full", 1.0, nbytes=1000) for i in range(10)]
    trials += [t(f"k{i}", "receiver_driven+int8", float(i < 7), 0.25, 70) for i in range(10)]
    trials += [t(f"k{i}", "evict_agnostic+int8", float(i < 2), 0.25, 70) for i in range(10)]
    trials += [t(f"k{i}", "evict_agnostic", 1.0, 0.25, 250) for i in range(10)]  # raw coding: not its pair
    trials += [t(f"k{i}", "text_message", float(i < 4), nbytes=40) for i in range(8)]  # two tasks without a note
    rd = {(r["method"], r["budget"]): r for r in summarize(trials)}[("receiver_driven+int8", 0.25)]
    assert rd["delta_vs_agnostic"] == pytest.approx(50.0) and 0 < rd["delta_vs_agnostic_ci_low"]
    assert rd["delta_vs_text_message"] == pytest.approx(100 * (7 / 8 - 4 / 8))  # the 8 tasks both ran
    assert rd["delta_vs_text_message_ci_low"] <= rd["delta_vs_text_message"] <= rd["delta_vs_text_message_ci_high"]


def test_each_task_set_is_summarized_on_its_own():
    def in_set(trial: Trial, name: str) -> Trial:
        return Trial(trial.task, name, *[getattr(trial, f) for f in list(Trial.__dataclass_fields__)[2:]])

    easy = [in_set(t(f"e{i}", m, 1.0, b), "gen_easy") for i in range(6) for m, b in (("full", 1.0),
                                                                                    ("receiver_driven", 0.25))]
    squad = [in_set(t(f"s{i}", "full", 1.0), "squad") for i in range(6)]
    squad += [in_set(t(f"s{i}", "receiver_driven", float(i < 3), 0.25), "squad") for i in range(6)]
    sets = by_set(easy + squad)
    assert list(sets) == ["gen_easy", "squad"]
    delta = {name: {r["method"]: r["delta_vs_full"] for r in rows}["receiver_driven"] for name, rows in sets.items()}
    assert delta == {"gen_easy": 0.0, "squad": -50.0}  # the pooled -25 is all SQuAD's
    pooled = {r["method"]: r for r in summarize(easy + squad)}["receiver_driven"]
    assert pooled["delta_vs_full"] == pytest.approx(-25.0) and pooled["n"] == 12


def test_full_budget_partial_answers_like_full_relay(tiny_by_arch):
    from kvrelay.audit.tasks import load_tasks

    tasks = [("gen_easy", x) for x in load_tasks("gen_easy", limit=2)]
    trials = run(tiny_by_arch["llama"], tasks, budgets=(1.0,), encodings=("raw",),
                 methods=("full", "receiver_driven", "evict_agnostic", "none"), max_new_tokens=4, progress=False)
    by = {(x.task, x.method): x for x in trials}
    for _, task in tasks:
        full = by[(task.id, "full")]
        for m in ("receiver_driven", "evict_agnostic"):
            assert by[(task.id, m)].score == full.score and by[(task.id, m)].kept == 1.0
            assert by[(task.id, m)].ttft_s > 0


def test_bench_partial_cli_writes_rows_and_resumes(tmp_path):
    out, rec = tmp_path / "p.json", tmp_path / "rec.jsonl"
    argv = ["bench", "partial", "--model", "tiny:qwen2", "--tasks", "gen_easy", "--limit", "2", "--budgets", "0.25",
            "--encodings", "raw,int8", "--methods", "full,receiver_driven,evict_agnostic,text_full,none",
            "--max-new-tokens", "3", "--records", str(rec), "--json", str(out)]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    fields = {"method", "budget", "bytes", "accuracy", "ci_low", "ci_high", "delta_vs_full", "delta_ci_low",
              "delta_ci_high", "ttft_s", "n"}
    assert all(fields <= set(row) for row in d["rows"])
    methods = {(row["method"], row["budget"]) for row in d["rows"]}
    assert ("receiver_driven+int8", 0.25) in methods and ("evict_agnostic", 0.25) in methods
    by = {row["method"]: row for row in d["rows"] if row["budget"] == 0.25}
    assert by["receiver_driven+int8"]["bytes"] < by["receiver_driven"]["bytes"] < by["receiver_driven"]["bytes"] * 4
    assert d["command"].startswith("kvrelay bench partial") and "load1_before" in d["load_average"]
    assert list(d["by_set"]) == ["gen_easy"] and d["by_set"]["gen_easy"] == d["rows"]  # one set: the same rows
    assert d["trials_run"] == len(d["rows"]) * 2  # every method and budget on both tasks
    for row in d["rows"]:  # the partial rows say what of their TTFT was the sender's scoring and selecting
        partial = row["method"].startswith(("receiver_driven", "evict_agnostic"))
        assert (row["probe_s"] is not None and row["select_s"] is not None) == partial
        if partial:
            assert 0 < row["probe_s"] + row["select_s"] < row["ttft_s"]
    lines = rec.read_text().splitlines()
    r2 = CliRunner().invoke(app, argv)  # resumed: nothing rerun, same rows
    assert r2.exit_code == 0 and rec.read_text().splitlines() == lines
    assert json.loads(out.read_text())["rows"] == d["rows"]
    assert json.loads(out.read_text())["trials_run"] == 0  # rebuilt from the records
    assert {"window", "pool", "lookahead"} <= set(d["setup"])
    r3 = CliRunner().invoke(app, [*argv, "--pool", "5", "--lookahead", "0"])  # other scoring: its own trials
    assert r3.exit_code == 0, r3.output
    again = rec.read_text().splitlines()
    assert again[: len(lines)] == lines and len(again) == 2 * len(lines)
    assert json.loads(out.read_text())["setup"] | {"pool": 5, "lookahead": 0} == json.loads(out.read_text())["setup"]
    assert json.loads(out.read_text())["setup"]["verify"] is True  # the default
    assert json.loads(out.read_text())["setup"]["first_exact"] is True  # the default
    r4 = CliRunner().invoke(app, [*argv, "--no-verify"])  # one selection, unchecked: its own trials
    assert r4.exit_code == 0, r4.output
    assert len(rec.read_text().splitlines()) == 3 * len(lines)
    # records written before the verify, backfill and first_exact fields ran without them (all off): they resume
    old = [json.loads(x) for x in rec.read_text().splitlines()]
    for row in old:
        if row["setup"]["verify"] is False:
            assert row["setup"]["first_exact"] is False  # unchecked: first_exact means nothing, recorded off
            row["setup"].pop("verify"), row["setup"].pop("backfill"), row["setup"].pop("first_exact")
        row.pop("probe_s"), row.pop("select_s")  # and before the hop's parts were recorded
    rec.write_text("".join(json.dumps(row) + "\n" for row in old))
    r5 = CliRunner().invoke(app, [*argv, "--no-verify"])
    assert r5.exit_code == 0 and len(rec.read_text().splitlines()) == 3 * len(lines)
    assert all(row["select_s"] is None for row in json.loads(out.read_text())["rows"])  # not recorded: not 0


def test_a_wider_run_reuses_the_recorded_trials_and_runs_only_the_others(tmp_path):
    """Adding methods, budgets or codings to a recorded run makes only the new trials, and the rows equal
    those of one fresh run with everything (greedy answers do not depend on the methods beside them)."""
    rec, fresh, out = tmp_path / "rec.jsonl", tmp_path / "fresh.jsonl", tmp_path / "p.json"
    base = ["bench", "partial", "--model", "tiny:qwen2", "--tasks", "gen_easy", "--limit", "2",
            "--max-new-tokens", "3", "--json", str(out)]
    narrow = [*base, "--budgets", "0.25", "--encodings", "raw", "--methods", "full,receiver_driven"]
    wide = [*base, "--budgets", "0.25,0.5", "--encodings", "raw,int8", "--methods", "full,receiver_driven,none"]
    assert CliRunner().invoke(app, [*narrow, "--records", str(rec)]).exit_code == 0
    assert json.loads(out.read_text())["trials_run"] == 2 * 2
    r = CliRunner().invoke(app, [*wide, "--records", str(rec)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    # per task: receiver_driven at 0.5, +int8 at 0.25 and 0.5, none — full and receiver_driven 0.25 reused
    assert (d["trials_run"], d["trials_reused"]) == (2 * 4, 2 * 2)
    assert CliRunner().invoke(app, [*wide, "--records", str(fresh)]).exit_code == 0
    once = json.loads(out.read_text())
    assert json.loads(out.read_text())["trials_run"] == 2 * 6

    def scores(rows):
        return {(x["method"], x["budget"]): (x["accuracy"], x["n"], x["kept"]) for x in rows}

    assert scores(d["rows"]) == scores(once["rows"])
    r = CliRunner().invoke(app, [*wide, "--pool", "5", "--records", str(rec)])  # other scoring: none reused
    assert r.exit_code == 0 and json.loads(out.read_text())["trials_reused"] == 0
    r = CliRunner().invoke(app, [*wide, "--engine", "bf16", "--records", str(rec)])  # another kernel mode: none
    assert r.exit_code == 0 and json.loads(out.read_text())["trials_reused"] == 0
    assert json.loads(out.read_text())["setup"]["engine"] == "bf16"


def test_bench_partial_mistakes(tmp_path):
    r = CliRunner().invoke(app, ["bench", "partial", "--model", "tiny:qwen2", "--budgets", "0.25,2"])
    assert r.exit_code == 2 and "expected a number in (0, 1]" in r.output
    r = CliRunner().invoke(app, ["bench", "partial", "--model", "tiny:qwen2", "--methods", "receiver_driven"])
    assert r.exit_code == 2 and "full among the methods" in r.output
    r = CliRunner().invoke(app, ["bench", "partial", "--model", "tiny:qwen2", "--pool", "4"])
    assert r.exit_code == 2 and "--pool an odd number" in r.output
    r = CliRunner().invoke(app, ["bench", "partial", "--model", "tiny:qwen2", "--lookahead", "-1"])
    assert r.exit_code == 2 and "--lookahead 0 (score by the prompt) or a positive count" in r.output
