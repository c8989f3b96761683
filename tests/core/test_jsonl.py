"""The one JSON-lines reader: blank lines skipped, a cut last line dropped only when asked, errors name the line."""

from __future__ import annotations

import pytest

from kvrelay.core.jsonl import read_json_lines


def test_objects_in_order_blank_lines_skipped(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert read_json_lines(path) == [{"a": 1}, {"a": 2}]


def test_a_cut_last_line_is_dropped_only_when_asked(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n{"a": 2, "b"\n\n')  # killed mid-write; trailing blank lines do not hide it
    assert read_json_lines(path, cut_tail_ok=True) == [{"a": 1}]
    with pytest.raises(ValueError, match=r"r.jsonl:2: not valid JSON"):
        read_json_lines(path)


def test_a_bad_line_before_the_last_is_never_dropped(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(ValueError, match=r"r.jsonl:2: not valid JSON"):
        read_json_lines(path, cut_tail_ok=True)
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"r.jsonl:2: expected a JSON object per line, got list"):
        read_json_lines(path, cut_tail_ok=True)
