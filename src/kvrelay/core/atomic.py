"""Writing a file so that a reader never sees half of it: the text goes to a temporary file beside the
target, which is then renamed over it (``os.replace``, atomic on one filesystem). A crash mid-write leaves
the old file whole; two processes writing the same file at once leave one of the two whole files."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_bytes_atomic(path: Path | str, data: bytes) -> Path:
    """Replace ``path`` with ``data`` atomically, its folder made; the temporary file is removed on failure
    (a full disk)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: Path | str, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) atomically (``write_bytes_atomic``)."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path | str, obj: object, *, indent: int = 2, end: str = "\n") -> Path:
    """Replace ``path`` with ``obj`` as JSON (``indent``, then ``end``) atomically (``write_text_atomic``)."""
    return write_text_atomic(path, json.dumps(obj, indent=indent) + end)
