"""A run folder's records: records.jsonl or records.jsonl.gz, one of the two; a run that adds trials unpacks
the compressed one first (core/records_file.py)."""

from __future__ import annotations

import gzip
import json
import subprocess

import pytest

from kvrelay.core.errors import RecordsError
from kvrelay.core.jsonl import append_json_lines, read_json_lines
from kvrelay.core.records_file import (
    has_records,
    is_records_file,
    record_folders,
    records_engine,
    records_file,
    unpack_records,
)

TEXT = '{"task_id": "a", "arm": "kv", "seed": 0}\n{"task_id": "b", "arm": "kv", "seed": 0}\n'


def test_a_folder_names_the_records_it_holds(tmp_path):
    assert records_file(tmp_path) == tmp_path / "records.jsonl" and not has_records(tmp_path)  # where a run writes
    (tmp_path / "records.jsonl").write_text(TEXT)
    assert records_file(tmp_path) == tmp_path / "records.jsonl" and has_records(tmp_path)
    subprocess.run(["gzip", "-9n", str(tmp_path / "records.jsonl")], check=True)  # what docs/audit.md says to run
    assert records_file(tmp_path) == tmp_path / "records.jsonl.gz" and has_records(tmp_path)
    assert read_json_lines(records_file(tmp_path)) == [json.loads(x) for x in TEXT.splitlines()]
    assert is_records_file(tmp_path / "records.jsonl.gz") and not is_records_file(tmp_path / "records.jsonl")
    (tmp_path / "records.jsonl").write_text(TEXT)
    with pytest.raises(RecordsError, match="holds both records.jsonl and records.jsonl.gz"):
        records_file(tmp_path)


def test_unpacking_gives_the_plain_file_a_run_appends_to(tmp_path):
    (tmp_path / "records.jsonl.gz").write_bytes(gzip.compress(TEXT.encode()))
    plain = unpack_records(tmp_path)
    assert plain == tmp_path / "records.jsonl" and plain.read_text() == TEXT
    assert not (tmp_path / "records.jsonl.gz").exists()
    assert unpack_records(tmp_path) == plain and plain.read_text() == TEXT  # nothing to unpack: unchanged
    append_json_lines(plain, [{"task_id": "c", "arm": "kv", "seed": 0}])
    assert [r["task_id"] for r in read_json_lines(records_file(tmp_path))] == ["a", "b", "c"]
    assert unpack_records(tmp_path / "new") == tmp_path / "new" / "records.jsonl"  # an empty folder: nothing


def test_a_folder_of_audits_lists_the_ones_with_records(tmp_path):
    for name, f in (("b", "records.jsonl.gz"), ("a", "records.jsonl"), ("c", "config.json")):
        (tmp_path / name).mkdir()
        (tmp_path / name / f).write_text("x")
    assert record_folders(tmp_path) == [tmp_path / "a", tmp_path / "b"]
    assert record_folders(tmp_path / "b") == [tmp_path / "b"]  # an audit folder itself
    assert record_folders(tmp_path / "missing") == []


def test_the_engine_mode_of_a_folder_comes_from_its_config_then_its_run_file(tmp_path):
    assert records_engine(tmp_path) is None  # nothing says: a reader that must not guess leaves it unchecked
    (tmp_path / "run.json").write_text(json.dumps({"engine": "fp16w"}))
    assert records_engine(tmp_path) == "fp16w"  # a config from before the engine mode was recorded
    (tmp_path / "config.json").write_text(json.dumps({"versions": {"engine": "int8"}}))
    assert records_engine(tmp_path) == "int8"
    (tmp_path / "config.json").write_text("{not json")
    assert records_engine(tmp_path) == "fp16w"  # an unreadable file says nothing
