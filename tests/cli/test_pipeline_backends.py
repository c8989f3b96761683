"""`kvrelay bench pipeline --backend process --codec int8`: agents in their own processes, payloads through a
store, the same outputs as the in-process backend with the same codec."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvrelay.cli.app import app

ARGS = ["bench", "pipeline", "--model", "tiny:qwen2", "--workflow", "review3", "--context-tokens", "48",
        "--repeats", "1", "--max-new-tokens", "6", "--min-new-tokens", "3", "--threads", "1", "--no-plot"]


def _run(tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    r = CliRunner().invoke(app, [*ARGS, *extra, "--json", str(out)])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def test_process_backend_through_a_disk_store_matches_in_process(tmp_path):
    local = _run(tmp_path, "local", "--codec", "int8")
    proc = _run(tmp_path, "proc", "--backend", "process", "--store", str(tmp_path / "store"), "--codec", "int8")
    assert proc["backend"] == "process" and proc["codec"] == "int8" and "--backend process" in proc["command"]
    assert [a["kv_output"] for a in proc["per_agent"]] == [a["kv_output"] for a in local["per_agent"]]
    assert [a["kv_relayed_tokens"] for a in proc["per_agent"]] == [a["kv_relayed_tokens"] for a in local["per_agent"]]
    assert any(a["kv_relay_transfer_s"] > 0 for a in proc["per_agent"])
