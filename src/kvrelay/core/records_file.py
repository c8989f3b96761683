"""Where a run folder (``kvrelay audit --out``) keeps its trial records: ``records.jsonl``, or the same lines
gzip-compressed as ``records.jsonl.gz`` (the committed audits under docs/audit are stored so: docs/audit.md).

A folder holds one of the two. Every reader takes whichever is there (``records_file``; ``core.jsonl``
decompresses a ``.gz``). A run that adds trials to a folder holding ``records.jsonl.gz`` first unpacks it to
``records.jsonl`` (``unpack_records``) and appends there, as to any plain folder; ``gzip -9n records.jsonl``
packs it again. A folder holding both is refused, since which one is current cannot be told."""

from __future__ import annotations

import json
from pathlib import Path

from kvrelay.core.atomic import write_text_atomic
from kvrelay.core.errors import RecordsError
from kvrelay.core.jsonl import read_text

PLAIN = "records.jsonl"
PACKED = "records.jsonl.gz"
NAMES = (PLAIN, PACKED)
DESCRIBED = "records.jsonl (or records.jsonl.gz)"  # how messages name the file a folder must hold
ENGINE_BEFORE_RECORDED = "fp32"  # the engine mode of folders written before run files recorded one


def records_file(folder: Path | str) -> Path:
    """``folder``'s records: ``records.jsonl.gz`` when that is what it holds, else ``records.jsonl`` (which
    need not exist yet: where a new run writes). ``RecordsError`` when the folder holds both."""
    folder = Path(folder)
    plain, packed = folder / PLAIN, folder / PACKED
    if packed.is_file() and plain.is_file():
        raise RecordsError(f"{folder} holds both {PLAIN} and {PACKED}; keep the one that is current "
                           f"(remove the other, or `gzip -9nf {plain}` to pack the plain one over it)")
    return packed if packed.is_file() else plain


def has_records(folder: Path | str) -> bool:
    """Whether ``folder`` holds ``records.jsonl`` or ``records.jsonl.gz``."""
    return records_file(folder).is_file()


def is_records_file(path: Path | str) -> bool:
    """Whether ``path`` is an existing file named ``records.jsonl`` or ``records.jsonl.gz``."""
    path = Path(path)
    return path.is_file() and path.name in NAMES


def record_folders(root: Path | str) -> list[Path]:
    """``[root]`` when ``root`` holds records, else its sub-folders that do, sorted (a folder of audits)."""
    root = Path(root)
    if has_records(root):
        return [root]
    return sorted(p for p in root.iterdir() if p.is_dir() and has_records(p)) if root.is_dir() else []


def unpack_records(folder: Path | str) -> Path:
    """``folder``'s ``records.jsonl``, written from its ``records.jsonl.gz`` (atomically; the ``.gz`` removed
    after) when that is what it holds: the file a run appends its trials to. Without a ``.gz`` nothing
    changes."""
    path = records_file(folder)
    if path.name != PACKED:
        return path
    plain = write_text_atomic(path.with_name(PLAIN), read_text(path))
    path.unlink()
    return plain


def records_engine(folder: Path | str) -> str | None:
    """The engine mode ``folder``'s trials were made in: ``config.json``'s ``versions.engine``, else the one
    ``run.json`` records (folders whose config predates recording it); None when neither says (such folders
    ran in ``ENGINE_BEFORE_RECORDED``, which a reader that must not guess leaves unchecked). Unreadable files
    say nothing."""
    folder = Path(folder)
    for name, get in (("config.json", lambda d: (d.get("versions") or {}).get("engine")),
                      ("run.json", lambda d: d.get("engine"))):
        try:
            made = get(json.loads((folder / name).read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        if made is not None:
            return made
    return None
