"""The ``kvrelay/1`` header: dtype tables, checksums, and validation before anything is allocated.

``kv.wire`` describes the file layout and the integrity fields. Parsing reads only through
``read(offset, n)`` and the total size, so a hostile header costs at most its own (limited) length;
every failure is a ``CorruptPayload`` saying what was expected.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv.payload import DTYPES, FORMAT

PREFIX_BYTES = 8  # a file starts with its JSON header's length in bytes, uint64 little-endian
MAX_HEADER_BYTES = 16 << 20  # a 100-layer payload's header is ~30 KB; anything near this is hostile
MAX_TOTAL_BYTES = 64 << 30
INTEGRITY_KEYS = ("sha256", "tensor_sha256")

# safetensors dtype code <-> torch dtype: the only dtypes a kvrelay/1 file may hold.
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
              "U8": torch.uint8, "I64": torch.int64, "BOOL": torch.bool}
ST_CODES = {dt: code for code, dt in _ST_DTYPES.items()}
_PAYLOAD_DTYPE_CODES = {name: ST_CODES[dt] for name, dt in DTYPES.items()}  # "float32" -> "F32"

Source = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor as the header declares it; ``begin``/``end`` are offsets into the data section."""

    dtype: str  # safetensors code, e.g. "F32"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _ST_DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class Header:
    """A validated header: the root checksum already matched."""

    tensors: dict[str, TensorEntry]
    meta: dict[str, str]  # every metadata field except the integrity ones
    digests: dict[str, str]  # tensor name -> sha256
    data_start: int  # absolute offset of the data section (PREFIX_BYTES + header length)


def framed_header(header_json: bytes) -> bytes:
    """The start of a file: the length prefix, then ``header_json`` padded with spaces so that the data
    section after it starts 8-aligned."""
    head = header_json + b" " * (-(PREFIX_BYTES + len(header_json)) % 8)
    return len(head).to_bytes(PREFIX_BYTES, "little") + head


def header_length(prefix: Source) -> int:
    """The JSON header's length that a file's first ``PREFIX_BYTES`` bytes declare (``prefix`` may hold more)."""
    n = len(prefix)
    if n < PREFIX_BYTES:
        raise CorruptPayload(f"truncated payload: {n} bytes, expected at least {PREFIX_BYTES} (the header length)")
    return int.from_bytes(prefix[:PREFIX_BYTES], "little")


def tensor_digest(name: str, dtype: str, shape: tuple[int, ...], raw) -> str:
    h = hashlib.sha256()
    h.update(f"{name}\0{dtype}\0{json.dumps(list(shape))}\0".encode())
    h.update(raw)
    return h.hexdigest()


def root_digest(meta: Mapping[str, str], tensors: Mapping[str, TensorEntry]) -> str:
    """sha256 over all metadata but ``sha256`` itself and the sorted (name, dtype, shape) list."""
    body = {
        "metadata": {k: v for k, v in meta.items() if k != "sha256"},
        "tensors": [[n, tensors[n].dtype, list(tensors[n].shape)] for n in sorted(tensors)],
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def parse_header(read: Callable[[int, int], bytes], size: int, *, max_header_bytes: int,
                 max_total_bytes: int) -> Header:
    """Validate a header using only ``read(offset, n)`` and the total ``size``; allocates ≤ the header."""
    n = header_length(read(0, PREFIX_BYTES))  # refuses fewer bytes
    if n > max_header_bytes:
        raise CorruptPayload(f"header length {n} bytes exceeds the limit of {max_header_bytes} bytes")
    if PREFIX_BYTES + n > size:
        raise CorruptPayload(f"truncated payload: header declares {n} bytes but only {size - PREFIX_BYTES} follow")
    try:
        header = json.loads(bytes(read(PREFIX_BYTES, n)).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptPayload(f"header is not valid UTF-8 JSON ({e}); expected a safetensors header") from None
    except RecursionError:
        raise CorruptPayload("header JSON is nested too deeply; expected a safetensors header") from None
    if not isinstance(header, dict):
        raise CorruptPayload(f"header is a JSON {type(header).__name__}, expected an object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or "format" not in meta:
        raise CorruptPayload(f"not a {FORMAT} payload: the file has no kvrelay metadata (a foreign safetensors file?)")
    if meta["format"] != FORMAT:
        raise CorruptPayload(f"not a {FORMAT} payload: format is {meta['format']!r}")
    nonstr = sorted(str(k) for k, v in meta.items() if not isinstance(v, str))
    if nonstr:
        raise CorruptPayload(f"metadata fields {nonstr} are not strings; safetensors metadata maps str to str")
    if any(k not in meta for k in INTEGRITY_KEYS):
        raise CorruptPayload(f"metadata lacks the checksums {list(INTEGRITY_KEYS)}")
    data_len = size - PREFIX_BYTES - n
    if data_len > max_total_bytes:
        raise CorruptPayload(f"data section of {data_len} bytes exceeds the limit of {max_total_bytes} bytes")
    tensors = {name: _parse_entry(name, spec, data_len) for name, spec in header.items()}
    end = 0
    for name, e in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != end:
            raise CorruptPayload(f"tensor {name!r} starts at byte {e.begin}, expected {end} (tensors must tile the data)")
        end = e.end
    if end != data_len:
        raise CorruptPayload(f"tensors cover {end} bytes but the data section has {data_len}")
    try:
        digests = json.loads(meta["tensor_sha256"])
    except (json.JSONDecodeError, RecursionError):
        raise CorruptPayload("tensor_sha256 metadata is not JSON") from None
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise CorruptPayload("tensor_sha256 metadata does not list exactly the file's tensors")
    bad = sorted(n for n, d in digests.items() if not _is_hex_digest(d))
    if bad:
        raise CorruptPayload(f"tensor_sha256 of {bad} is not a sha256 hex digest (64 lowercase hex digits)")
    got = root_digest(meta, tensors)
    if got != meta["sha256"]:
        raise CorruptPayload(f"checksum mismatch: header sha256 is {meta['sha256']!r}, "
                             f"the metadata and tensor digests hash to {got!r}")
    plain = {k: v for k, v in meta.items() if k not in INTEGRITY_KEYS}
    return Header(tensors, plain, digests, PREFIX_BYTES + n)


def _parse_entry(name: str, spec, data_len: int) -> TensorEntry:
    if not isinstance(spec, dict):
        raise CorruptPayload(f"tensor {name!r}: header entry is not an object")
    dtype, shape, offs = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise CorruptPayload(f"tensor {name!r}: dtype {dtype!r} is not allowed; expected one of {sorted(_ST_DTYPES)}")
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):  # bools refused too
        raise CorruptPayload(f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
    if (not isinstance(offs, list) or len(offs) != 2 or any(type(o) is not int for o in offs)
            or not 0 <= offs[0] <= offs[1]):
        raise CorruptPayload(f"tensor {name!r}: data_offsets {offs!r} are not [begin, end] with 0 <= begin <= end")
    if offs[1] > data_len:
        raise CorruptPayload(f"truncated payload: tensor {name!r} ends at byte {offs[1]} of a {data_len}-byte data section")
    want = math.prod(shape) * _ST_DTYPES[dtype].itemsize
    if offs[1] - offs[0] != want:
        raise CorruptPayload(f"tensor {name!r}: {offs[1] - offs[0]} bytes for shape {shape} {dtype}, expected {want}")
    return TensorEntry(dtype, tuple(shape), offs[0], offs[1])


def _is_hex_digest(d: object) -> bool:
    return isinstance(d, str) and len(d) == 64 and all(c in "0123456789abcdef" for c in d)


def buffer_reader(buf: memoryview) -> Callable[[int, int], bytes]:
    """``read(offset, n)`` over a byte view, for ``parse_header``."""
    return lambda off, n: buf[off:off + n]


def read_meta(source: Source | str | os.PathLike, *, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, str]:
    """The validated metadata of a payload (bytes or a file), reading only its header."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        buf = memoryview(source).cast("B")
        return parse_header(buffer_reader(buf), buf.nbytes, max_header_bytes=max_header_bytes,
                             max_total_bytes=MAX_TOTAL_BYTES).meta
    with open(source, "rb") as f:
        return file_header(f, max_header_bytes).meta


def read_header(data: Source, *, max_header_bytes: int = MAX_HEADER_BYTES) -> Header:
    """The validated header of kvrelay/1 bytes (root checksum checked; tensors not read)."""
    buf = memoryview(data).cast("B")
    return parse_header(buffer_reader(buf), buf.nbytes, max_header_bytes=max_header_bytes, max_total_bytes=MAX_TOTAL_BYTES)


def tensor_intact(data: Source, h: Header, name: str) -> bool:
    """Whether tensor ``name``'s bytes still hash to the digest its header records."""
    e, buf = h.tensors[name], memoryview(data).cast("B")
    raw = buf[h.data_start + e.begin:h.data_start + e.end]
    return tensor_digest(name, e.dtype, e.shape, raw) == h.digests[name]


def file_header(f, max_header_bytes: int) -> Header:
    """The validated header of an open kvrelay/1 file, read with seeks (tensors not read)."""
    def read(off: int, n: int) -> bytes:
        f.seek(off)
        return f.read(n)

    return parse_header(read, os.fstat(f.fileno()).st_size, max_header_bytes=max_header_bytes,
                         max_total_bytes=MAX_TOTAL_BYTES)
