"""``kvrelay audit`` as a user runs it: a smoke run on a real zoo model, resumed with another task set."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvrelay.cli import app

pytestmark = [pytest.mark.integration, pytest.mark.network]  # a real model and a real task set


def test_audit_cli_runs_resumes_and_rebuilds(tmp_path):
    out = tmp_path / "audit"
    cli = CliRunner()
    smoke = ["audit", "--preset", "smoke", "--arms", "none,kv,kv_mismatched", "--out", str(out)]
    first = cli.invoke(app, [*smoke, "--tasks", "gen_easy:2"])
    assert first.exit_code == 0, first.output
    assert (out / "report.html").exists() and "report.html" in first.output
    second = cli.invoke(app, [*smoke, "--tasks", "gen_easy:2,arc_challenge:2"])
    assert second.exit_code == 0, second.output
    rows = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    n_arms = 3  # one seed
    assert len(rows) == (2 + 2) * n_arms and len({(r["task_id"], r["arm"]) for r in rows}) == len(rows)
    meta = json.loads((out / "run.json").read_text())
    assert meta["tasks"] == ["gen_easy", "arc_challenge"] and meta["limit"] == {"gen_easy": 2, "arc_challenge": 2}
    assert len(meta["commands"]) == 2 and "arc_challenge:2" in meta["commands"][1]
    summary = json.loads((out / "summary.json").read_text())
    assert {r["task"] for r in summary["similarity"]} == {"gen_easy", "arc_challenge"}  # each set probed once
    assert summary["tasks"] == {"gen_easy": 2, "arc_challenge": 2}
    refused = cli.invoke(app, [*smoke, "--tasks", "gen_easy:3"])
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("error: ")]
    assert refused.exit_code == 2 and len(errors) == 1 and "gen_easy:2" in errors[0], refused.stderr
    assert "Traceback" not in refused.stderr
    rebuilt = cli.invoke(app, ["audit", "report", str(out)])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert json.loads((out / "summary.json").read_text())["effects"] == summary["effects"]
