"""bench repair on tiny models: the frontier's two ends are what they claim, rows carry the contract's fields."""

from __future__ import annotations

import json

import pytest

from kvrelay.audit.tasks.generated import generate
from kvrelay.bench.repair import FIELDS, plot, run_case, summarize, target_met
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
