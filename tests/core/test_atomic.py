"""core/atomic.py: a file is replaced whole or not at all, in the format asked for."""

from __future__ import annotations

import json

import pytest

from kvrelay.core.atomic import write_json_atomic, write_text_atomic


def test_json_is_written_in_the_format_asked_for_and_replaces_the_file(tmp_path):
    path = tmp_path / "deeper" / "out.json"
    assert write_json_atomic(path, {"a": [1, 2]}) == path  # the folder is made
    assert path.read_text(encoding="utf-8") == json.dumps({"a": [1, 2]}, indent=2) + "\n"
    write_json_atomic(path, {"b": "é"}, indent=1, end="")
    assert path.read_text(encoding="utf-8") == json.dumps({"b": "é"}, indent=1)
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.json"]  # no temporary file left


def test_a_failed_replace_leaves_the_target_as_it_was_and_no_temporary_file(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_text("kept")  # a folder with content cannot be replaced by a file
    with pytest.raises(OSError):
        write_text_atomic(target, "new")
    assert (target / "inside").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
