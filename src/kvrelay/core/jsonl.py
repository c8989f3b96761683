"""JSON lines, as the runs that write a line per trial leave them: one reader and one rewriter for every such file."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_json_lines(path: Path | str, *, cut_tail_ok: bool = False) -> list[dict]:
    """The JSON objects of ``path``, one per non-blank line, in order.

    A line that is not a JSON object raises ``ValueError`` naming the file and line. With
    ``cut_tail_ok`` a last line that is not valid JSON is dropped instead: a run killed while writing
    leaves one, and the run that resumes from the file writes that trial again."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            if cut_tail_ok and i == last:
                break
            raise ValueError(f"{path}:{i}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object per line, got {type(obj).__name__}")
        out.append(obj)
    return out


def write_json_lines(path: Path | str, rows: list[dict]) -> None:
    """Replace ``path`` with ``rows``, one JSON object per line, atomically (a temporary file renamed over
    it): a resumed run rewrites its records without a cut last line, and a crash mid-write loses nothing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)
