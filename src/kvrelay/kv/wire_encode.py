"""Writing ``kvrelay/1``: named tensors (``pack``) or a ``KVPayload`` (``encode``) to bytes, and files atomically.

The layout and checksums are described in ``kv.wire``; the header written here is the one
``kv.wire_header`` validates on the way back.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from kvrelay.kv.payload import FORMAT, KVPayload, payload_tensors
from kvrelay.kv.wire_header import (
    INTEGRITY_KEYS,
    ST_CODES,
    Source,
    TensorEntry,
    framed_header,
    root_digest,
    tensor_digest,
)


def _raw(t: torch.Tensor):
    """The tensor's bytes as a zero-copy uint8 numpy array (C order)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def pack(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> bytes:
    """Serialise ``tensors`` with string metadata into kvrelay/1 bytes (adds format and checksums)."""
    return b"".join(pack_parts(tensors, meta))


def pack_parts(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> list:
    """``pack`` as a list of buffers whose concatenation is the file: the length prefix, the header,
    then each tensor's bytes as a zero-copy view. Writers that stream (files, Redis chunks) skip
    the one big copy ``pack`` makes."""
    bad = [k for k in INTEGRITY_KEYS if k in meta]
    if bad:
        raise ValueError(f"metadata keys {bad} are reserved for the wire checksums")
    if meta.get("format", FORMAT) != FORMAT:
        raise ValueError(f"metadata format is {meta['format']!r}; pack writes {FORMAT!r} only")
    if any(not isinstance(k, str) or not isinstance(v, str) for k, v in meta.items()):
        raise ValueError("metadata must map str to str")
    for name, t in tensors.items():
        if t.dtype not in ST_CODES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}; kvrelay/1 allows {sorted(map(str, ST_CODES))}")
    # Widest dtypes first (as safetensors does) keeps every tensor aligned to its element size.
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    raws, entries, digests, offset = [], {}, {}, 0
    for name in order:
        t = tensors[name]
        raw = _raw(t)
        nbytes = t.numel() * t.element_size()
        entry = TensorEntry(ST_CODES[t.dtype], tuple(t.shape), offset, offset + nbytes)
        entries[name], offset = entry, offset + nbytes
        digests[name] = tensor_digest(name, entry.dtype, entry.shape, raw)
        raws.append(raw)
    full_meta = {**meta, "format": FORMAT, "tensor_sha256": json.dumps(digests, sort_keys=True)}
    full_meta["sha256"] = root_digest(full_meta, entries)
    header = {n: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
              for n, e in entries.items()}
    header["__metadata__"] = full_meta
    head = framed_header(json.dumps(header, separators=(",", ":")).encode())
    return [head, *(memoryview(r).cast("B") for r in raws)]


def encode(p: KVPayload, *, extra_meta: Mapping[str, str] | None = None) -> bytes:
    """``KVPayload`` -> kvrelay/1 bytes. ``extra_meta`` (e.g. a store's expiry) is checksummed too."""
    return b"".join(encode_parts(p, extra_meta=extra_meta))


def encode_parts(p: KVPayload, *, extra_meta: Mapping[str, str] | None = None) -> list:
    """``encode`` as buffers to write one after another (see ``pack_parts``)."""
    meta = p.meta.to_strings()
    clash = sorted(set(extra_meta or ()) & (set(meta) | set(INTEGRITY_KEYS)))
    if clash:
        raise ValueError(f"extra_meta must not override payload metadata {clash}")
    return pack_parts(payload_tensors(p), {**meta, **(extra_meta or {})})


def write_temp(path: str | os.PathLike, data: Source | Sequence[Source], *, fsync: bool = True) -> Path:
    """Write ``data`` to a fresh temporary file beside ``path`` and return its name (nothing visible at
    ``path`` yet: ``os.replace`` it there). On any failure (a full disk) the temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            for part in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                f.write(part)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write(path: str | os.PathLike, data: Source | Sequence[Source], *, fsync: bool = True) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``.

    Readers see the old file or the new one, never a partial one (rename is atomic on POSIX).
    """
    tmp = write_temp(path, data, fsync=fsync)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(p: KVPayload, path: str | os.PathLike, *, extra_meta: Mapping[str, str] | None = None,
         fsync: bool = True) -> None:
    """Write ``p`` to ``path`` atomically (temporary file + rename)."""
    atomic_write(path, encode_parts(p, extra_meta=extra_meta), fsync=fsync)
