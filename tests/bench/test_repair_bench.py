"""bench repair on tiny models: the frontier's two ends are what they claim, rows carry the contract's fields."""

from __future__ import annotations

import json

import pytest

from kvrelay.audit.tasks.generated import generate
from kvrelay.bench.repair import FIELDS, plot, read_records, run_case, summarize, target_met, trial_row
from kvrelay.models.tiny import tiny_lm

METHODS = ("raw", "recompute:tokens=0.3", "recompute:tokens=1", "recompute:layers=0-1", "reprefill")


@pytest.fixture(scope="module")
def tasks():
    return generate(3, seed=0, doc_tokens=60, n_distractors=0, n_facts=2)


@pytest.mark.parametrize("case", ["variant", "replace"])
def test_rows_and_ends(case, tasks, tmp_path):
    receiver = tiny_lm("qwen2", seed=0)
    sender = tiny_lm("qwen2", seed=1) if case == "variant" else receiver
    rows = summarize(case, run_case(case, sender, receiver, tasks, METHODS, max_new_tokens=4, progress=False))
    by = {r["method"]: r for r in rows}
    assert set(by) == set(METHODS)
    for r in rows:
        assert set(FIELDS) <= set(r) and r["n"] == len(tasks) and r["case"] == case
        assert 0.0 <= r["budget"] <= 1.0 and 0.0 <= r["accuracy"] <= 100.0
    assert by["raw"]["budget"] == 0.0 and by["reprefill"]["budget"] == 1.0
    assert by["reprefill"]["agreement"] == 1.0 and by["reprefill"]["delta"] == 0.0
    assert by["recompute:tokens=1"]["agreement"] == 1.0  # full recompute is the receiver's own prefill
    assert by["recompute:layers=0-1"]["budget"] == pytest.approx(0.5)
    assert 0.5 < by["recompute:tokens=0.3"]["budget"] < 1.0
    path = tmp_path / "r.png"
    plot(rows, path)
    assert path.stat().st_size > 1000
    json.dumps(rows)
    assert set(target_met(rows)) == {case}


def test_cases_refuse_the_wrong_pairing(tasks):
    a, b = tiny_lm("qwen2", seed=0), tiny_lm("qwen2", seed=1)
    with pytest.raises(ValueError, match="same model"):
        run_case("replace", a, b, tasks, progress=False)
    with pytest.raises(ValueError, match="different variants"):
        run_case("variant", a, a, tasks, progress=False)


def test_cli_writes_the_contract_rows_and_a_plot(tmp_path):
    from typer.testing import CliRunner

    from kvrelay.cli.app import app

    out = tmp_path / "repair.json"
    r = CliRunner().invoke(app, ["bench", "repair", "--sender", "tiny:qwen2:1", "--receiver", "tiny:qwen2:0",
                                 "--model", "tiny:qwen2", "--n", "2", "--context-tokens", "64",
                                 "--methods", "raw;recompute:tokens=1;reprefill", "--json", str(out)])
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert {(row["case"], row["method"]) for row in rows} == {
        (c, m) for c in ("variant", "replace") for m in ("raw", "recompute:tokens=1", "reprefill")}
    assert all(set(FIELDS) <= set(row) for row in rows)
    assert out.with_suffix(".png").stat().st_size > 1000


def test_records_resume_runs_only_the_missing_tasks(tasks, tmp_path):
    receiver, sender = tiny_lm("qwen2", seed=0), tiny_lm("qwen2", seed=1)
    methods = ("raw", "recompute:tokens=0.5", "reprefill")
    setup = {"sender": "tiny:qwen2:1", "receiver": "tiny:qwen2:0"}
    path = tmp_path / "records.jsonl"
    batches = []

    def sink(trials):
        batches.append([t.task for t in trials])
        with path.open("a") as fh:
            fh.write("".join(json.dumps(trial_row("variant", setup, t)) + "\n" for t in trials))

    first = run_case("variant", sender, receiver, tasks[:2], methods, max_new_tokens=3, progress=False, sink=sink)
    assert batches == [[tasks[0].id] * 3, [tasks[1].id] * 3]  # one batch per task, every method in it
    done = read_records(path, "variant", setup)
    assert done == first
    assert read_records(path, "variant", {**setup, "seed": 1}) == [] and read_records(path, "replace", setup) == []
    batches.clear()
    more = run_case("variant", sender, receiver, tasks, methods, max_new_tokens=3, progress=False, done=done,
                    sink=sink)
    assert batches == [[tasks[2].id] * 3]  # only the task the records lack ran
    assert more[:6] == first and len(more) == 9
    assert summarize("variant", read_records(path, "variant", setup)) == summarize("variant", more)


def test_records_reader_drops_a_cut_last_line_and_names_a_bad_one(tmp_path):
    from kvrelay.bench.repair import Trial

    row = json.dumps(trial_row("replace", {"model": "m"}, Trial("t1", "raw", 1.0, (1, 2), 0.5, 0.0, 10)))
    path = tmp_path / "r.jsonl"
    path.write_text(row + "\n" + row[:40])  # killed mid-write
    assert [t.task for t in read_records(path, "replace", {"model": "m"})] == ["t1"]
    path.write_text(row[:40] + "\n" + row + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:1: not valid JSON"):
        read_records(path, "replace", {"model": "m"})
    path.write_text(json.dumps({"case": "replace", "setup": {}, "task": "t"}) + "\n" + row + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl: trial 1: expected a bench repair trial"):
        read_records(path, "replace", {"model": "m"})


def test_cli_records_extend_an_earlier_run(tmp_path):
    from typer.testing import CliRunner

    from kvrelay.cli.app import app

    rec, out = tmp_path / "r.jsonl", tmp_path / "r.json"
    args = ["bench", "repair", "--sender", "tiny:qwen2:1", "--receiver", "tiny:qwen2:0", "--cases", "variant",
            "--context-tokens", "64", "--methods", "raw;reprefill", "--records", str(rec), "--json", str(out)]
    r = CliRunner().invoke(app, [*args, "--n", "2"])
    assert r.exit_code == 0, r.output
    first = rec.read_text().splitlines()
    assert len(first) == 4
    r = CliRunner().invoke(app, [*args, "--n", "3"])
    assert r.exit_code == 0, r.output
    lines = rec.read_text().splitlines()
    assert lines[:4] == first and len(lines) == 6  # the first two tasks were not rerun
    body = json.loads(out.read_text())
    assert body["records"] == str(rec) and {row["n"] for row in body["rows"]} == {3}
    assert (body["trials_measured"], body["trials_from_records"]) == (2, 4)  # the load describes only the new task
    rec.write_text("\n".join(lines) + "\n" + lines[0][:30])  # a run killed while writing its last task
    r = CliRunner().invoke(app, [*args, "--n", "4"])
    assert r.exit_code == 0, r.output
    grown = rec.read_text().splitlines()
    assert grown[:6] == lines and len(grown) == 8  # the cut line is gone, the new task's lines follow
    rec.write_text("not json\n" + "\n".join(lines) + "\n")
    r = CliRunner().invoke(app, [*args, "--n", "3"])
    assert r.exit_code == 2 and "r.jsonl:1: not valid JSON" in r.output


@pytest.mark.network
def test_squad_long_hides_one_passage_among_other_articles():
    from kvrelay.audit.tasks.datasets import load_tasks
    from kvrelay.audit.tasks.task import approx_tokens
    from kvrelay.bench.repair import squad_long

    first = load_tasks("squad", seed=0)[:4]
    long = squad_long(4, 600, seed=0)
    assert [t.prompt for t in long] == [t.prompt for t in first] and [t.answers for t in long] == [t.answers for t in first]
    for short, t in zip(first, long, strict=True):
        parts = t.context.split("\n\n")
        covs = dict(t.covariates)
        assert parts[covs["target_index"]] == short.context and parts.count(short.context) == 1
        assert approx_tokens(t.context) >= 600 and len(parts) == covs["passages"] > 1
    assert squad_long(4, 600, seed=0) == long and squad_long(4, 600, seed=1) != long
    assert squad_long(2, 600, seed=0) == long[:2]  # a run extended to more questions keeps its first tasks
