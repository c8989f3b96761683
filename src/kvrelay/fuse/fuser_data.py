"""A fuser's training data on disk, one file per task, so thousands of fitting problems train in bounded
memory and a stopped precomputation resumes at the task it reached.

Two folders under a training run's work folder, each with a ``key.json`` saying what its files were made
from (a folder whose key differs from the run's is stale and is emptied before use, never mixed in):

* ``sharer/``: per fitting task in order, ``NNNNN.pt`` = ``{"id", "ids", "feats": {layer: (1, T_s, F) fp16}}``
  with the features of the sharer layers the layer map reads only, or ``{"id", "skipped": True}`` when
  the reading is longer than the token cap;
* ``receiver/``: per kept task, ``NNNNN.pt`` = one ``fuser_train.Example``.

``DiskExamples`` is the read side: a sequence that loads an example when it is indexed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrelay.fuse import fuser_train as FT
from kvrelay.fuse.bridge import TokenBridge


@dataclass(frozen=True)
class DiskExamples(Sequence):
    """Training examples stored one per file; indexing loads one (nothing is held in memory)."""

    files: tuple[Path, ...]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return DiskExamples(self.files[i])
        return torch.load(self.files[i], weights_only=False)

    def __iter__(self) -> Iterator[FT.Example]:
        return (self[i] for i in range(len(self)))


def open_folder(folder: Path, key: dict, log: Callable[[str], None]) -> Path:
    """``folder`` ready for files made from ``key``: created, or emptied when it holds files of another key."""
    marker = folder / "key.json"
    if folder.is_dir() and (not marker.is_file() or json.loads(marker.read_text()) != key):
        log(f"{folder} holds data made from other settings or models: removing it")
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(key, sort_keys=True) + "\n")
    return folder


def _save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)  # a killed run never leaves half a file under the final name


def sharer_readings(s_lm, tasks: Sequence, layers: set[int], max_tokens: int, want: int, folder: Path,
                    progress: Callable | None = None) -> list[Path]:
    """The files of the first ``want`` tasks whose sharer reading fits ``max_tokens`` (read now or earlier)."""
    kept: list[Path] = []
    bar = progress(total=want, initial=0) if progress else None
    for i, task in enumerate(tasks):
        if len(kept) >= want:
            break
        path = folder / f"{i:05d}.pt"
        if path.is_file():
            rec = torch.load(path, weights_only=False)
        else:
            rec = FT.sharer_pass(s_lm, [task.context], layers, max_tokens)[0]
            rec = {"id": task.id, "skipped": True} if rec is None else {"id": task.id, **rec}
            _save(rec, path)
        if rec["id"] != task.id:
            raise ValueError(f"{path} holds {rec['id']}, expected {task.id}: the fitting mix changed; "
                             f"remove {folder}")
        if not rec.get("skipped"):
            kept.append(path)
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    return kept


def receiver_examples(r_lm, tasks_by_id: dict, readings: Sequence[Path], bridge: TokenBridge, folder: Path,
                      progress: Callable | None = None) -> DiskExamples:
    """One ``Example`` file per sharer reading (the receiver's own pass, ``fuser_train.receiver_pass``)."""
    out = []
    for src in progress(readings) if progress else readings:
        path = folder / src.name
        if not path.is_file():
            rec = torch.load(src, weights_only=False)
            ex = FT.receiver_pass(r_lm, [tasks_by_id[rec["id"]]], [rec], bridge)[0]
            _save(ex, path)
        out.append(path)
    return DiskExamples(tuple(out))
