"""JSON lines, as the runs that write a line per trial leave them: one reader, one rewriter, and the
resumable-records pair every such run uses (``resume_json_lines`` at the start, ``append_json_lines`` as
trials land), so a killed run is continued by running it again.

A path ending in ``.gz`` holds the same lines gzip-compressed: it is read and rewritten compressed (the
rewrite byte-for-byte reproducible: no timestamp in the header) but never appended to, since a gzip member
cut short by a killed run cannot be read back up to the cut. A run that appends to such records unpacks
them first (``core.records_file.unpack_records``)."""

from __future__ import annotations

import gzip
import json
import warnings
import zlib
from collections.abc import Iterable
from pathlib import Path

from kvrelay.core.atomic import write_bytes_atomic
from kvrelay.core.errors import RecordsError


def _parse(path: Path, text: str, cut_tail_ok: bool) -> tuple[list[dict], bool]:
    """The objects of ``text`` (read from ``path``) and whether a cut last line was dropped."""
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            if cut_tail_ok and i == last:
                return out, True
            raise RecordsError(f"{path}:{i}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise RecordsError(f"{path}:{i}: expected a JSON object per line, got {type(obj).__name__}")
        out.append(obj)
    return out, False


def packed(path: Path) -> bool:
    """Whether ``path`` names gzip-compressed JSON lines (its name ends in ``.gz``)."""
    return path.suffix == ".gz"


def read_text(path: Path) -> str:
    """The text of ``path``, decompressed when it is ``packed``; ``RecordsError`` for a damaged gzip file."""
    if not packed(path):
        return path.read_text(encoding="utf-8")
    try:
        return gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:
        raise RecordsError(f"{path}: not a whole gzip file of UTF-8 JSON lines ({err})") from None


def _encoded(path: Path, text: str) -> bytes:
    """``text`` as the bytes ``path`` stores: gzip-compressed (level 9, no timestamp) when ``packed``."""
    data = text.encode("utf-8")
    return gzip.compress(data, compresslevel=9, mtime=0) if packed(path) else data


def read_json_lines(path: Path | str, *, cut_tail_ok: bool = False) -> list[dict]:
    """The JSON objects of ``path``, one per non-blank line, in order.

    A line that is not a JSON object raises ``RecordsError`` (a ``ValueError``) naming the file and line. With
    ``cut_tail_ok`` a last line that is not valid JSON is dropped instead: a run killed while writing
    leaves one, and the run that resumes from the file writes that trial again. A ``.gz`` path is read
    decompressed."""
    path = Path(path)
    return _parse(path, read_text(path), cut_tail_ok)[0]


def write_json_lines(path: Path | str, rows: Iterable[dict]) -> None:
    """Replace ``path`` with ``rows``, one JSON object per line, atomically (a temporary file renamed over
    it): a resumed run rewrites its records without a cut last line, and a crash mid-write loses nothing.
    A ``.gz`` path is written compressed."""
    path = Path(path)
    write_bytes_atomic(path, _encoded(path, "".join(json.dumps(row) + "\n" for row in rows)))


def resume_json_lines(path: Path | str) -> list[dict]:
    """The rows a resumed run continues from (``[]`` while ``path`` does not exist).

    A last line cut short by a killed run is dropped with a warning and the file rewritten without it, so
    what this run appends stays valid JSON lines (that trial runs again). Any other line that is not a
    JSON object raises ``RecordsError`` naming the file and line; the file is then left as it is."""
    path = Path(path)
    if not path.is_file():
        return []
    text = read_text(path)
    rows, cut = _parse(path, text, cut_tail_ok=True)
    if cut:
        warnings.warn(f"{path}: dropping an unfinished last record; it will be re-run", stacklevel=2)
    if cut or (text and not text.endswith("\n")):
        write_json_lines(path, rows)
    return rows


def append_json_lines(path: Path | str, rows: Iterable[dict]) -> None:
    """Append ``rows`` to ``path``, a line each, flushed before returning (the parent folder made): what a
    run writes as its trials land, so that a kill loses at most the line being written. A ``.gz`` path is
    refused (``RecordsError``): unpack it first (module docstring)."""
    path = Path(path)
    if packed(path):
        raise RecordsError(f"{path}: compressed records are not appended to; unpack them to "
                           f"{path.with_suffix('')} first (core.records_file.unpack_records)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(row) + "\n" for row in rows))
        fh.flush()
