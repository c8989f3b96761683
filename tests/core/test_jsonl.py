"""The one JSON-lines reader: blank lines skipped, a cut last line dropped only when asked, errors name the line."""

from __future__ import annotations

import json

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


def test_a_resumed_file_loses_its_cut_line_and_takes_appends_as_valid_lines(tmp_path):
    """What every resumable run relies on: the half line a kill left is gone from the file (not only from
    the rows), so the lines appended after it parse; an absent file resumes as no rows."""
    from kvrelay.core.jsonl import append_json_lines, resume_json_lines

    path = tmp_path / "sub" / "r.jsonl"
    assert resume_json_lines(path) == []
    append_json_lines(path, [{"a": 1}, {"a": 2}])  # the folder is made
    path.write_text(path.read_text() + '{"a": 3, "b"')
    with pytest.warns(UserWarning, match="unfinished last record"):
        assert resume_json_lines(path) == [{"a": 1}, {"a": 2}]
    append_json_lines(path, ({"a": k} for k in (3, 4)))
    assert read_json_lines(path) == [{"a": k} for k in (1, 2, 3, 4)]
    path.write_text('{"a": 1}')  # a whole last line without its newline: kept, and the newline restored
    assert resume_json_lines(path) == [{"a": 1}] and path.read_text() == '{"a": 1}\n'


def test_a_bad_line_is_a_typed_error_and_the_file_is_left_alone(tmp_path):
    from kvrelay.core.errors import RecordsError
    from kvrelay.core.jsonl import resume_json_lines

    path = tmp_path / "r.jsonl"
    path.write_text('{"a": \n{"a": 2}\n')
    with pytest.raises(RecordsError, match=r"r.jsonl:1: not valid JSON"):
        resume_json_lines(path)
    assert path.read_text() == '{"a": \n{"a": 2}\n'


# -- gzip-compressed JSON lines (a path ending in .gz) ------------------------------------------------------
def test_a_gz_path_is_read_decompressed_and_rewritten_compressed(tmp_path):
    import gzip

    from kvrelay.core.jsonl import resume_json_lines, write_json_lines

    rows = [{"a": k, "s": "é"} for k in range(3)]
    path = tmp_path / "r.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=5))
    assert read_json_lines(path) == rows == resume_json_lines(path)
    write_json_lines(path, rows[:2])
    assert gzip.decompress(path.read_bytes()).decode() == "".join(json.dumps(r) + "\n" for r in rows[:2])
    first = path.read_bytes()
    write_json_lines(path, rows[:2])  # no timestamp in the header: the same rows give the same bytes
    assert path.read_bytes() == first
    # a cut last line inside the compressed text is dropped and the file rewritten compressed
    path.write_bytes(gzip.compress(b'{"a": 0}\n{"a": 1, "b'))
    with pytest.warns(UserWarning, match="unfinished last record"):
        assert resume_json_lines(path) == [{"a": 0}]
    assert read_json_lines(path) == [{"a": 0}]


def test_a_damaged_gz_file_is_a_typed_error_and_is_never_appended_to(tmp_path):
    import gzip

    from kvrelay.core.errors import RecordsError
    from kvrelay.core.jsonl import append_json_lines

    path = tmp_path / "r.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"a": 0}\n' * 50)[:-12])  # cut short
    with pytest.raises(RecordsError, match=r"r.jsonl.gz: not a whole gzip file"):
        read_json_lines(path, cut_tail_ok=True)
    path.write_bytes(b'{"a": 0}\n')  # plain text under a .gz name
    with pytest.raises(RecordsError, match=r"r.jsonl.gz: not a whole gzip file"):
        read_json_lines(path)
    with pytest.raises(RecordsError, match=r"not appended to; unpack them to .*r.jsonl first"):
        append_json_lines(path, [{"a": 1}])
    assert path.read_bytes() == b'{"a": 0}\n'
