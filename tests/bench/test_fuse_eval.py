"""fuse eval on tiny models: every method runs, the JSON has its contract, the ridge arm on an exact map
answers like the receiver re-reading the text, and the mismatched control is paired by task."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvrelay.audit.tasks.task import Task
from kvrelay.bench.fuse_eval import METHODS, run_tasks, summarize
from kvrelay.fuse import layers as LY
from kvrelay.fuse import ridge
from kvrelay.fuse.adapter import mha_from_gqa
from kvrelay.models.identity import model_identity
from kvrelay.models.tiny import WORDS, tiny_lm
from tests.conftest import random_ids


@pytest.fixture(scope="module")
def setup():
    gqa = tiny_lm("llama")
    mha = mha_from_gqa(gqa.model)
    receiver = replace(gqa, name="tiny-mha", model=mha, identity=model_identity(mha, gqa.tokenizer))
    opening = gqa.tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    readings = [opening + random_ids(40, 300 + i) for i in range(16)]
    state = ridge.fit(gqa, receiver, readings, ridge.candidate_layers(4, 4))
    config, tensors = ridge.to_artefact(state, ("r", receiver.identity), ("s", gqa.identity), {"datasets": ["ids"]})
    tasks = [Task(id=f"t/{i}", task="t", regime="private", context=" ".join(WORDS[i: i + 12]),
                  prompt="what is the code", answers=(WORDS[i + 3],), scorer="qa_success") for i in range(4)]
    return receiver, gqa, ridge.RidgeAdapter(config, tensors), tasks


def test_every_method_runs_and_the_json_has_its_contract(setup):
    receiver, sharer, adapter, tasks = setup
    methods = tuple(m for m in METHODS if m != "fuser")  # the fuser's own tests: tests/fuse/test_fuser.py
    with pytest.raises(ValueError, match="'layers' needs its adapter"):
        run_tasks(receiver, sharer, adapter, tasks, METHODS, max_new_tokens=3)
    imp = torch.zeros(4)
    config, tensors = LY.to_artefact(adapter, (0, 1, 2, 3), imp, LY.scores(imp), LY.gaussian_prior(4), 0.5, 1.0, {})
    every = LY.LayersAdapter(config, tensors)  # every layer chosen: the ridge answers, through the layered path
    trials = run_tasks(receiver, sharer, adapter, tasks, methods, max_new_tokens=3, layers=every)
    assert {t.method for t in trials} == set(methods)
    assert sum(t.mismatched for t in trials) == 2 * len(tasks)
    out = summarize(trials, "r", "s", n_boot=200)
    assert {p["method"] for p in out["pairs"]} == set(methods)
    for p in out["pairs"]:
        assert set(p) == {"receiver", "sharer", "regime", "method", "accuracy", "ci_low", "ci_high", "ttft_s", "bytes", "n"}
        assert p["n"] == len(tasks) and 0 <= p["accuracy"] <= 1
    assert [p["method"] for p in out["pairing"]] == ["layers", "ridge"]
    for pairing in out["pairing"]:
        assert set(pairing) == {"receiver", "sharer", "regime", "method", "estimate", "ci_low", "ci_high"}
    by = {(t.task_id, t.method, t.mismatched): t.generation for t in trials}
    # an exact map: the mapped cache answers as the receiver does after reading the text itself
    assert all(by[(t.id, "ridge", False)] == by[(t.id, "text_full", False)] for t in tasks)
    assert all(by[(t.id, "layers", mm)] == by[(t.id, "ridge", mm)] for t in tasks for mm in (False, True))
    sent = {t.task_id: t.bytes for t in trials if t.method == "ridge" and not t.mismatched}
    mapped = {t.task_id: t.bytes for t in trials if t.method == "layers" and not t.mismatched}
    assert all(mapped[k] != sent[k] for k in sent)  # layers counts the mapped receiver-space layers it relays


def test_unknown_method_is_refused(setup):
    receiver, sharer, adapter, tasks = setup
    with pytest.raises(ValueError, match="unknown methods"):
        run_tasks(receiver, sharer, adapter, tasks, ("telepathy",))


def test_resume_runs_only_the_missing_trials(setup):
    receiver, sharer, adapter, tasks = setup
    first = run_tasks(receiver, sharer, adapter, tasks, ("receiver", "ridge"), max_new_tokens=3)
    kept = [t for t in first if t.method == "receiver" or not t.mismatched]
    new = []
    again = run_tasks(receiver, sharer, adapter, tasks, ("receiver", "ridge"), max_new_tokens=3, done=kept,
                      sink=new.append)
    assert len(new) == len(tasks) and all(t.method == "ridge" and t.mismatched for t in new)
    def key(ts):
        return {(t.task_id, t.method, t.mismatched, t.generation) for t in ts}

    assert len(again) == len(first) and key(again) == key(first)


def test_contrasts_pair_each_method_with_the_baseline_on_the_same_task():
    from kvrelay.bench.fuse_eval import Trial, contrasts

    def t(task, method, score, mismatched=False):
        return Trial(task_id=task, task="arc", regime="shared", method=method, generation="", score=score,
                     ttft_s=1.0, bytes=0, mismatched=mismatched)

    trials = [t(f"q{i}", "receiver", float(i % 2)) for i in range(8)]  # right on odd tasks
    trials += [t(f"q{i}", "fuser", 1.0) for i in range(8)]  # right everywhere: +50 on the even tasks only
    trials += [t(f"q{i}", "fuser", 0.0, mismatched=True) for i in range(8)]  # controls never count here
    trials += [t(f"q{i}", "text", float(i % 2 == 0)) for i in range(6)]  # text ran on six tasks
    rows = {(r["method"], r["baseline"]): r for r in contrasts(trials, "R", "S", n_boot=200)}
    assert set(rows) == {("fuser", "receiver"), ("fuser", "text"), ("text", "receiver"), ("receiver", "text")}
    assert rows[("fuser", "receiver")]["estimate"] == 0.5 and rows[("fuser", "receiver")]["n"] == 8
    assert rows[("fuser", "text")]["estimate"] == 0.5 and rows[("fuser", "text")]["n"] == 6
    assert rows[("text", "receiver")]["estimate"] == 0.0  # the same share right, on other tasks
    assert rows[("fuser", "receiver")]["ci_low"] > 0


def test_cli_resume_keeps_the_records_of_tasks_this_run_does_not_ask_for(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvrelay.cli.app import app

    rec = tmp_path / "eval.jsonl"
    other = {"task_id": "gen_easy/elsewhere", "task": "gen_easy", "regime": "private", "method": "receiver",
             "generation": "x", "score": 1.0, "ttft_s": 0.1, "bytes": 0, "mismatched": False}
    rec.write_text(json.dumps(other) + "\n" + json.dumps(other)[:25])  # and a line cut by a killed run
    r = CliRunner().invoke(app, ["fuse", "eval", "--receiver", "tiny:qwen2", "--sharer", "tiny:llama", "--tasks",
                                 "gen_easy", "--limit", "2", "--methods", "receiver", "--max-new-tokens", "2",
                                 "--records", str(rec)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in rec.read_text().splitlines()]  # every line parses: the cut one is gone
    assert rows[0] == other  # a smaller run never drops what a larger one wrote
    assert len(rows) == 3 and {row["task_id"] for row in rows[1:]} != {other["task_id"]}


def test_records_that_are_not_trials_are_a_records_error_naming_the_file(tmp_path):
    from kvrelay.bench.fuse_eval import read_trials
    from kvrelay.core.errors import RecordsError

    path = tmp_path / "eval.jsonl"
    path.write_text('{"task_id": "t/0"}\n')
    with pytest.raises(RecordsError, match=r"eval.jsonl: not a fuse eval trial"):
        read_trials([path])


def test_train_settings_refuse_what_the_cli_refuses():
    from kvrelay.bench.fuse_fit import TrainSettings, problem_sources

    with pytest.raises(ValueError, match="keep 'first'"):
        TrainSettings(keep="first")
    with pytest.raises(ValueError, match="leaves no training tasks"):
        TrainSettings(examples=8, held_out=8)
    assert problem_sources(["fit-sciq/0", "fit-boolq/3", "fit-sciq/1"]) == {"sciq": 2, "boolq": 1}


def test_ttft_result_reports_medians_their_ratio_and_the_load_of_every_repeat(setup):
    from statistics import median

    from kvrelay.bench.fuse_eval import ttft_result

    receiver, sharer, adapter, _ = setup
    readings = iter([0.4, 0.6, 9.0, 0.5])  # before each of 3 repeats, then after: one reading above 2 + 0.5
    out = ttft_result(receiver, sharer, adapter, "ridge", 64, 3, threads=2, load=lambda: next(readings))
    assert len(out["text_full_all"]) == len(out["ridge_all"]) == 3
    assert out["text_full_ttft_s"] == median(out["text_full_all"]) and out["ridge_ttft_s"] == median(out["ridge_all"])
    assert out["speedup"] == pytest.approx(out["text_full_ttft_s"] / out["ridge_ttft_s"])
    assert 0 < out["context_tokens"] <= 64 and out["bytes"] > 0 and out["receiver"] == "tiny-mha"
    assert out["load_average"] == {"load1_before_repeat": [0.4, 0.6, 9.0], "load1_after": 0.5, "status": "loaded",
                                   "limit": 2.5, "max": 9.0}


def test_records_of_another_adapter_are_never_resumed(setup, tmp_path):
    """A retrained adapter is evaluated afresh: trials stamped with another adapter (or none) are refused."""
    import json

    from kvrelay.bench.fuse_eval import evaluate, settings_label
    from kvrelay.core.errors import RecordsError

    receiver, sharer, adapter, tasks = setup
    adapters = {"adapter": adapter, "fuser": None, "layers": None}
    records = tmp_path / "r.jsonl"
    first = evaluate(receiver, sharer, tasks[:2], ("receiver", "ridge"), adapters, max_new_tokens=3,
                     records=records).trials
    label = settings_label(adapters)["adapter"]
    assert {t.adapter for t in first if t.method == "ridge"} == {label}
    assert {t.adapter for t in first if t.method == "receiver"} == {None}
    again = evaluate(receiver, sharer, tasks[:2], ("receiver", "ridge"), adapters, max_new_tokens=3, records=records)
    assert len(again.trials) == again.resumed == len(first)  # the same adapter: resumed, nothing rerun
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    for stamp in ("ridge@0123456789abcdef", None):
        records.write_text("".join(json.dumps({**r, "adapter": stamp if r["method"] == "ridge" else None}) + "\n"
                                   for r in rows))
        with pytest.raises(RecordsError, match="its ridge trials were made with adapter"):
            evaluate(receiver, sharer, tasks[:2], ("receiver", "ridge"), adapters, max_new_tokens=3, records=records)
    kept = evaluate(receiver, sharer, tasks[:2], ("receiver",), adapters, max_new_tokens=3, records=records)
    assert len(kept.trials) == kept.resumed == len(rows)  # a run without that method does not care


def test_eval_result_says_which_trials_it_timed_and_under_what_load(setup, tmp_path):
    """A resumed run's TTFTs mix runs: the JSON counts the trials measured now apart from those taken from the
    records, and records this run's load before and after."""
    from kvrelay.bench.fuse_eval import eval_result

    receiver, sharer, adapter, tasks = setup
    adapters = {"adapter": adapter, "fuser": None, "layers": None}
    records = tmp_path / "r.jsonl"
    first = eval_result(receiver, sharer, tasks[:2], ("receiver",), adapters, threads=2, max_new_tokens=2,
                        records=records, load=iter([0.5, 1.0]).__next__)
    assert (first["trials_measured"], first["trials_from_records"]) == (2, 0)
    assert first["load_average"] == {"load1_before": 0.5, "load1_after": 1.0, "status": "quiet", "limit": 2.5,
                                     "max": 1.0}
    more = eval_result(receiver, sharer, tasks[:3], ("receiver", "ridge"), adapters, threads=2, max_new_tokens=2,
                       records=records, load=iter([3.0, 1.0]).__next__)
    assert (more["trials_measured"], more["trials_from_records"]) == (len(tasks[:3]) * 3 - 2, 2)  # ridge: + control
    assert more["load_average"]["status"] == "loaded" and more["threads"] == 2
    assert {p["method"] for p in more["pairs"]} == {"receiver", "ridge"}
