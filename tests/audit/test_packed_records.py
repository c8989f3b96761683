"""Audit folders whose records are stored gzip-compressed (records.jsonl.gz, as the committed ones under
docs/audit are): rebuilt to the same numbers, and resumed by unpacking them before the first new trial."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvrelay.audit.report import rebuild
from kvrelay.audit.runner import AuditConfig, AuditRunner

AUDITS = Path(__file__).resolve().parents[2] / "docs" / "audit"


def test_every_committed_audit_holds_compressed_records_only():
    folders = [f for f in AUDITS.iterdir() if f.is_dir()]
    assert folders
    for f in folders:
        assert (f / "records.jsonl.gz").is_file() and not (f / "records.jsonl").exists(), f


def test_a_committed_compressed_audit_rebuilds_to_its_summary_and_so_does_its_unpacked_copy(tmp_path):
    """The smallest committed audit, rebuilt from records.jsonl.gz: every key its summary.json has comes out
    equal (a key added since, such as seed_design, is new); unpacked with gunzip, the same summary."""
    name = "variant-qa-summarizer"
    packed, plain = tmp_path / "packed", tmp_path / "plain"
    shutil.copytree(AUDITS / name, packed)
    committed = json.loads((packed / "summary.json").read_text())
    rebuild(packed)
    got = json.loads((packed / "summary.json").read_text())
    assert {k: got[k] for k in committed} == committed
    assert sorted(p.name for p in packed.glob("records*")) == ["records.jsonl.gz"]  # a rebuild never unpacks
    shutil.copytree(AUDITS / name, plain)
    subprocess.run(["gzip", "-d", str(plain / "records.jsonl.gz")], check=True)
    rebuild(plain)
    assert json.loads((plain / "summary.json").read_text()) == got


@pytest.fixture(scope="module")
def qwen():
    from kvrelay.models.tiny import tiny_lm

    return tiny_lm("qwen2")


def test_a_compressed_folder_is_resumed_and_unpacked_only_when_a_trial_is_added(qwen, tmp_path):
    base = dict(model="tiny", tasks=("gen_easy",), arms=("none", "kv"), limit=2, batch_size=2)
    AuditRunner(AuditConfig(seeds=(0,), **base), qwen, tmp_path).run()
    plain = tmp_path / "records.jsonl"
    first = plain.read_text()
    subprocess.run(["gzip", "-9n", str(plain)], check=True)
    runner = AuditRunner(AuditConfig(seeds=(0,), **base), qwen, tmp_path)
    assert runner.done_trials() == runner.total_trials() == 4  # counted from the compressed file
    assert runner.run() == tmp_path / "records.jsonl.gz" and not plain.exists()  # nothing to add: still packed
    assert gzip.decompress((tmp_path / "records.jsonl.gz").read_bytes()).decode() == first
    runner = AuditRunner(AuditConfig(seeds=(0, 1), **base), qwen, tmp_path)
    assert runner.done_trials() == 4 and runner.total_trials() == 8
    assert runner.run() == plain and not (tmp_path / "records.jsonl.gz").exists()
    text = plain.read_text()
    rows = [json.loads(x) for x in text.splitlines()]
    assert text.startswith(first) and len(rows) == 8  # the old trials kept, seed 1's appended, none repeated
    assert len({(r["task_id"], r["arm"], r["seed"]) for r in rows}) == 8
