"""`kvrelay bench pipeline` on a workflow TOML with a channel = "auto" edge: the policy is built from the
committed cost profile and the committed audit records (``bench.auto_policy``), the edge is decided per kv
run on a tiny random qwen2 model, and its route is what ran, printed and kept in the JSON. Without
``--profile``/``--value`` the file is refused with one error line, before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvrelay.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "artefacts" / "profiles" / "qwen2.5-coder-0.5b__fp32.json"
AUDIT = ROOT / "docs" / "audit" / "full-qwen2.5-coder-0.5b"
# only the reader reads the shared context; the fixer's prompt shares almost no word with the reader's turn
TOML = ('name = "pair"\n[[agents]]\nname = "reader"\nrole = "read the report"\nprompt = "what is the bug"\n'
        '[[agents]]\nname = "fixer"\nrole = "fix the code"\nprompt = "where does it go"\n'
        '[[edges]]\nsrc = "reader"\ndst = "fixer"\nchannel = "auto"\n')
ARGS = ["bench", "pipeline", "--model", "tiny:qwen2", "--context-tokens", "48", "--repeats", "1",
        "--max-new-tokens", "6", "--min-new-tokens", "3", "--threads", "1", "--no-plot"]


def _run(tmp_path, name: str, *extra: str):
    wf = tmp_path / "pair.toml"
    wf.write_text(TOML)
    out = tmp_path / f"{name}.json"
    r = CliRunner().invoke(app, [*ARGS, "--workflow", str(wf), *extra, "--json", str(out)])
    return r, (json.loads(out.read_text()) if out.is_file() else None)


def test_an_auto_edge_runs_as_decided_and_its_route_is_in_the_output_and_json(tmp_path):
    r, res = _run(tmp_path, "auto", "--profile", str(PROFILE), "--value", str(AUDIT))
    assert r.exit_code == 0, r.output
    fixer = res["per_agent"][1]
    d = fixer["decision"]
    # private facts, in process: the value model gives kv the text answer's success at a fraction of its time
    assert d["edge"] == "reader->fixer" and d["channel"] == "kv" and d["codec"] == "raw"
    assert d["decision"]["channel"] == "kv" and d["reason"].startswith("kv: P(success)")
    assert fixer["channel"] == "auto:kv" and fixer["kv_relayed_tokens"] > 0
    assert res["auto_routes"] == [{"edge": "reader->fixer", "channel": "kv", "codec": "raw", "reason": d["reason"],
                                   "decided": "kv", "repeats": [0]}]
    assert res["policy"]["profile"] == str(PROFILE) and res["policy"]["value_audits"] == [str(AUDIT)]
    assert res["policy"]["slo_s"] is None and res["edges"] == [{"src": "reader", "dst": "fixer", "channel": "auto"}]
    assert f"auto edge reader->fixer: kv (raw) in kv repeat(s) 1 — {d['reason']}" in " ".join(r.output.split())


def test_a_tight_slo_routes_the_edge_none_and_the_receiver_reads_only_its_turn(tmp_path):
    """The committed profile prices any prefill above 0.1 s (136 ms fixed): no channel meets 0.01 s, so the
    fastest, ``none``, is taken; the fixer gets no cache and reads fewer tokens than in text mode."""
    r, res = _run(tmp_path, "slo", "--profile", str(PROFILE), "--value", str(AUDIT), "--slo", "0.01")
    assert r.exit_code == 0, r.output
    fixer = res["per_agent"][1]
    d = fixer["decision"]
    assert d["channel"] == "none" and d["codec"] is None and "no channel meets the SLO 0.01 s" in d["reason"]
    assert fixer["channel"] == "auto:none" and fixer["kv_relayed_tokens"] == 0 and fixer["kv_relay_bytes"] == 0
    assert fixer["kv_prefill_tokens"] < fixer["text_prefill_tokens"]  # the reader's turn was not read
    assert res["policy"]["slo_s"] == 0.01 and res["auto_routes"][0]["channel"] == "none"


def _one_error(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_auto_edges_without_a_profile_are_refused_naming_the_options(tmp_path):
    r, res = _run(tmp_path, "noprofile", "--value", str(AUDIT))
    line = _one_error(r)
    assert 'has channel "auto" edges (reader->fixer) and no --profile' in line
    assert "expected --profile PATH" in line and "--value" in line and res is None
    r, _ = _run(tmp_path, "none")
    assert "no --profile or --value" in _one_error(r)
    r, _ = _run(tmp_path, "missing", "--profile", str(tmp_path / "nosuch.json"), "--value", str(AUDIT))
    assert "--profile" in _one_error(r) and "no such file" in r.stderr


def test_policy_options_without_auto_edges_and_auto_edges_off_process_are_refused(tmp_path):
    r = CliRunner().invoke(app, [*ARGS, "--workflow", "review3", "--profile", str(PROFILE)])
    assert "--profile with --workflow 'review3', which has no channel \"auto\" edge" in _one_error(r)
    r, _ = _run(tmp_path, "ray", "--profile", str(PROFILE), "--value", str(AUDIT), "--backend", "process")
    assert "--backend process with channel \"auto\" edges" in _one_error(r)
