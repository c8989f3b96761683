"""The ``kvrelay/1`` wire format: a safetensors file with a checked header and checksums. No pickle.

File layout (plain safetensors, readable by ``safetensors.safe_open``)::

    u64 little-endian N | N bytes of JSON header (space-padded to 8) | tensor bytes

Tensors of a ``KVPayload`` (``i`` = index among the *held* layers, see ``PayloadMeta.layer_indices``)::

    layers.{i}.k, layers.{i}.v   (B, H_kv, T_l, D)   float32 | float16 | bfloat16 (= meta dtype)
    token_ids, positions         (B, T)              int64
    mask                         (B, T)              bool

Codecs add side tensors of their own through ``pack``/``unpack``. ``__metadata__`` holds every
``PayloadMeta`` field as strings plus ``format = kvrelay/1`` and two integrity fields:

* ``tensor_sha256``: JSON ``{name: sha256(name, dtype, shape, raw bytes)}`` — lets a partial load
  verify exactly the tensors it reads;
* ``sha256``: the root, a sha256 over the canonical JSON of every other metadata field and of the
  sorted ``(name, dtype, shape, tensor digest)`` list. It pins the tensor bytes (through their
  digests, so they are hashed once, not twice) *and* the metadata, and is checkable from the
  header alone — before any tensor is read.

Reading validates before allocating: the header length against a limit, the JSON, the dtype
allow-list, that the tensors tile the data section exactly, the root checksum, the shapes
against the metadata; then each tensor it reads against its digest. Every failure is a
``CorruptPayload`` saying what was expected; a payload for another model is ``IncompatiblePayload``.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv.compat import check_meta
from kvrelay.kv.layout import TOKEN_TENSORS, held_tokens, kv_tensor_names, tensor_name
from kvrelay.kv.payload import DTYPES, FORMAT, KVPayload, PayloadMeta, payload_tensors
from kvrelay.models.identity import ModelIdentity

MAX_HEADER_BYTES = 16 << 20  # a 100-layer payload's header is ~30 KB; anything near this is hostile
MAX_TOTAL_BYTES = 64 << 30
INTEGRITY_KEYS = ("sha256", "tensor_sha256")

# safetensors dtype code <-> torch dtype: the only dtypes a kvrelay/1 file may hold.
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
              "U8": torch.uint8, "I64": torch.int64, "BOOL": torch.bool}
_ST_CODES = {dt: code for code, dt in _ST_DTYPES.items()}
_PAYLOAD_DTYPE_CODES = {name: _ST_CODES[dt] for name, dt in DTYPES.items()}  # "float32" -> "F32"

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
    data_start: int  # absolute offset of the data section (8 + header length)


# -- low level: pack / unpack ------------------------------------------------------------------
def _raw(t: torch.Tensor):
    """The tensor's bytes as a zero-copy uint8 numpy array (C order)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def _tensor_digest(name: str, dtype: str, shape: tuple[int, ...], raw) -> str:
    h = hashlib.sha256()
    h.update(f"{name}\0{dtype}\0{json.dumps(list(shape))}\0".encode())
    h.update(raw)
    return h.hexdigest()


def _root_digest(meta: Mapping[str, str], tensors: Mapping[str, TensorEntry]) -> str:
    """sha256 over all metadata but ``sha256`` itself and the sorted (name, dtype, shape) list."""
    body = {
        "metadata": {k: v for k, v in meta.items() if k != "sha256"},
        "tensors": [[n, tensors[n].dtype, list(tensors[n].shape)] for n in sorted(tensors)],
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
        if t.dtype not in _ST_CODES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}; kvrelay/1 allows {sorted(map(str, _ST_CODES))}")
    # Widest dtypes first (as safetensors does) keeps every tensor aligned to its element size.
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    raws, entries, digests, offset = [], {}, {}, 0
    for name in order:
        t = tensors[name]
        raw = _raw(t)
        nbytes = t.numel() * t.element_size()
        entry = TensorEntry(_ST_CODES[t.dtype], tuple(t.shape), offset, offset + nbytes)
        entries[name], offset = entry, offset + nbytes
        digests[name] = _tensor_digest(name, entry.dtype, entry.shape, raw)
        raws.append(raw)
    full_meta = {**meta, "format": FORMAT, "tensor_sha256": json.dumps(digests, sort_keys=True)}
    full_meta["sha256"] = _root_digest(full_meta, entries)
    header = {n: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
              for n, e in entries.items()}
    header["__metadata__"] = full_meta
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)  # data section starts 8-aligned
    return [len(head).to_bytes(8, "little") + head, *(memoryview(r).cast("B") for r in raws)]


def _parse_header(read: Callable[[int, int], bytes], size: int, *, max_header_bytes: int,
                  max_total_bytes: int) -> Header:
    """Validate a header using only ``read(offset, n)`` and the total ``size``; allocates ≤ the header."""
    if size < 8:
        raise CorruptPayload(f"truncated payload: {size} bytes, expected at least 8 (the header length)")
    n = int.from_bytes(read(0, 8), "little")
    if n > max_header_bytes:
        raise CorruptPayload(f"header length {n} bytes exceeds the limit of {max_header_bytes} bytes")
    if 8 + n > size:
        raise CorruptPayload(f"truncated payload: header declares {n} bytes but only {size - 8} follow")
    try:
        header = json.loads(bytes(read(8, n)).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptPayload(f"header is not valid UTF-8 JSON ({e}); expected a safetensors header") from None
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
    data_len = size - 8 - n
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
    except json.JSONDecodeError:
        raise CorruptPayload("tensor_sha256 metadata is not JSON") from None
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise CorruptPayload("tensor_sha256 metadata does not list exactly the file's tensors")
    bad = sorted(n for n, d in digests.items() if not _is_hex_digest(d))
    if bad:
        raise CorruptPayload(f"tensor_sha256 of {bad} is not a sha256 hex digest (64 lowercase hex digits)")
    got = _root_digest(meta, tensors)
    if got != meta["sha256"]:
        raise CorruptPayload(f"checksum mismatch: header sha256 is {meta['sha256']!r}, "
                             f"the metadata and tensor digests hash to {got!r}")
    plain = {k: v for k, v in meta.items() if k not in INTEGRITY_KEYS}
    return Header(tensors, plain, digests, 8 + n)


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


def _reader(buf: memoryview) -> Callable[[int, int], bytes]:
    return lambda off, n: buf[off:off + n]


def _read(buf: memoryview, h: Header, name: str, verify: bool, index: tuple[slice, ...] = ()) -> torch.Tensor:
    """A fresh copy of tensor ``name`` (or of ``t[index]``, slices of its leading dims), digest checked first.

    The copy is made on raw bytes with numpy — shape ``(*shape, itemsize)`` so every dtype,
    bfloat16 included, slices the same way — which touches only the selected bytes and avoids
    torch's threaded copy (slow on a contended 2-core box).
    """
    e = h.tensors[name]
    raw = buf[h.data_start + e.begin:h.data_start + e.end]
    if verify:
        got = _tensor_digest(name, e.dtype, e.shape, raw)
        if got != h.digests[name]:
            raise CorruptPayload(f"tensor {name!r}: sha256 mismatch (header says {h.digests[name]}, bytes hash to {got})")
    itemsize = e.torch_dtype.itemsize
    u8 = np.frombuffer(raw, dtype=np.uint8).reshape(*e.shape, itemsize)  # (*shape, itemsize)
    if e.torch_dtype == torch.bool and bool((u8 > 1).any()):
        raise CorruptPayload(f"tensor {name!r}: bool tensor holds bytes other than 0 and 1")
    picked = u8[index].copy(order="C")  # (*shape', itemsize): always a copy, never a view of buf
    if picked.size == 0:
        return torch.empty(picked.shape[:-1], dtype=e.torch_dtype)
    return torch.from_numpy(picked).view(e.torch_dtype).reshape(picked.shape[:-1])


Names = Collection[str] | Callable[[str], bool] | None


def _pick(h: Header, names: Names) -> list[str]:
    if names is None:
        return sorted(h.tensors)
    if isinstance(names, str):
        names = (names,)
    if callable(names):
        return sorted(n for n in h.tensors if names(n))
    missing = sorted(set(names) - set(h.tensors))
    if missing:
        raise CorruptPayload(f"payload lacks tensors {missing}; it holds {sorted(h.tensors)}")
    return sorted(set(names))


def unpack(data: Source, *, names: Names = None, max_header_bytes: int = MAX_HEADER_BYTES,
           max_total_bytes: int = MAX_TOTAL_BYTES, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read kvrelay/1 bytes into ``(tensors, metadata)``; ``names`` (a set or a predicate) limits what is read.

    The metadata returned excludes the integrity fields. Tensors are fresh copies.
    """
    buf = memoryview(data).cast("B")
    h = _parse_header(_reader(buf), buf.nbytes, max_header_bytes=max_header_bytes, max_total_bytes=max_total_bytes)
    return {n: _read(buf, h, n, verify) for n in _pick(h, names)}, dict(h.meta)


def read_meta(source: Source | str | os.PathLike, *, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, str]:
    """The validated metadata of a payload (bytes or a file), reading only its header."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        buf = memoryview(source).cast("B")
        return _parse_header(_reader(buf), buf.nbytes, max_header_bytes=max_header_bytes,
                             max_total_bytes=MAX_TOTAL_BYTES).meta
    with open(source, "rb") as f:
        return _file_header(f, max_header_bytes).meta


def read_header(data: Source, *, max_header_bytes: int = MAX_HEADER_BYTES) -> Header:
    """The validated header of kvrelay/1 bytes (root checksum checked; tensors not read)."""
    buf = memoryview(data).cast("B")
    return _parse_header(_reader(buf), buf.nbytes, max_header_bytes=max_header_bytes, max_total_bytes=MAX_TOTAL_BYTES)


def tensor_intact(data: Source, h: Header, name: str) -> bool:
    """Whether tensor ``name``'s bytes still hash to the digest its header records."""
    e, buf = h.tensors[name], memoryview(data).cast("B")
    raw = buf[h.data_start + e.begin:h.data_start + e.end]
    return _tensor_digest(name, e.dtype, e.shape, raw) == h.digests[name]


def _file_header(f, max_header_bytes: int) -> Header:
    def read(off: int, n: int) -> bytes:
        f.seek(off)
        return f.read(n)

    return _parse_header(read, os.fstat(f.fileno()).st_size, max_header_bytes=max_header_bytes,
                         max_total_bytes=MAX_TOTAL_BYTES)


# -- high level: KVPayload <-> bytes / files ---------------------------------------------------
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


def _payload_meta(h: Header) -> PayloadMeta:
    try:  # from_strings type-checks every field itself (CorruptPayload naming it)
        return PayloadMeta.from_strings(h.meta)
    except ValueError as e:  # what the dataclass invariants still refuse
        raise CorruptPayload(f"kvrelay metadata does not describe a payload: {e}") from None


def _check_expected(m: PayloadMeta, expect: ModelIdentity | None) -> None:
    if expect is not None:
        check_meta(m, expect)


def _held(m: PayloadMeta, j: int, T: int) -> int:
    """Slots held by held layer ``j`` of a ``T``-slot payload."""
    return held_tokens(m.layer_types[j], m.sliding_window, T)


def _check_layout(h: Header, m: PayloadMeta) -> tuple[int, int]:
    """Shapes and dtypes in the header against the metadata, before reading anything; returns (B, T)."""
    t = h.tensors
    need = [*TOKEN_TENSORS, *kv_tensor_names(len(m.layer_indices))]
    missing = [n for n in need if n not in t]
    if missing:
        raise CorruptPayload(f"payload lacks tensors {missing} (metadata lists {len(m.layer_indices)} layers)")
    ids = t["token_ids"]
    if len(ids.shape) != 2:
        raise CorruptPayload(f"token_ids has shape {list(ids.shape)}, expected (B, T)")
    B, T = ids.shape
    if B == 0 or T == 0:
        raise CorruptPayload(f"token_ids has shape {[B, T]}: a payload holds at least one row of one token")
    for name, code in (("token_ids", "I64"), ("positions", "I64"), ("mask", "BOOL")):
        if t[name].dtype != code or t[name].shape != (B, T):
            raise CorruptPayload(f"{name} is {t[name].dtype} {list(t[name].shape)}, expected {code} {[B, T]}")
    want = _PAYLOAD_DTYPE_CODES[m.dtype]
    for j in range(len(m.layer_indices)):
        k, v = t[tensor_name(j, "k")], t[tensor_name(j, "v")]
        for name, e in ((tensor_name(j, "k"), k), (tensor_name(j, "v"), v)):
            if e.dtype != want:
                raise CorruptPayload(f"{name} is stored as {e.dtype} but the metadata declares dtype {m.dtype} ({want})")
        held = _held(m, j, T)
        if len(k.shape) != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[2] != held:
            raise CorruptPayload(f"layer {j} ({m.layer_types[j]}): k {list(k.shape)} / v {list(v.shape)}, "
                                 f"expected equal (B={B}, H, T_l={held}, D)")
    return B, T


def _layer_positions(m: PayloadMeta, layers: range | slice | None) -> list[int]:
    """Held-layer positions ``j`` for a selection of *model* layer indices (like ``select_layers``)."""
    if layers is None:
        return list(range(len(m.layer_indices)))
    wanted = sorted(set(range(m.num_model_layers)[layers] if isinstance(layers, slice) else layers))
    pos = {li: j for j, li in enumerate(m.layer_indices)}
    missing = [i for i in wanted if i not in pos]
    if missing or not wanted:
        raise ValueError(f"layers {missing or wanted} are not held by this payload (holds {list(m.layer_indices)})")
    return [pos[i] for i in wanted]


def _token_range(T: int, tokens: slice | None) -> range:
    r = range(T)[tokens] if tokens is not None else range(T)
    if r.step != 1 or len(r) == 0:
        raise ValueError(f"tokens must select a non-empty contiguous slot range of [0, {T}), got {tokens}")
    return r


def _slots(m: PayloadMeta, j: int, T: int, r: range) -> slice:
    """Which of layer ``j``'s held slots a token range keeps (the rules of ``select_tokens``)."""
    held = _held(m, j, T)
    if held == T:
        return slice(r.start, r.stop)
    keep = held_tokens(m.layer_types[j], m.sliding_window, len(r))
    start = T - held  # slot of the layer's first held token
    if r.stop - keep < start:
        raise ValueError(f"layer {m.layer_indices[j]} is a sliding-window layer holding slots {start}..{T - 1}; "
                         f"the selection needs slot {r.stop - keep}, which it never cached")
    return slice(r.stop - keep - start, r.stop - start)


def _decode(buf: memoryview, h: Header, expect, layers, tokens, verify: bool) -> KVPayload:
    m = _payload_meta(h)
    _check_expected(m, expect)
    B, T = _check_layout(h, m)
    js = _layer_positions(m, layers)
    r = _token_range(T, tokens)

    def read(name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        return _read(buf, h, name, verify, index)

    cols = (slice(None), slice(r.start, r.stop))
    keys, values = [], []
    for j in js:
        sl = (slice(None), slice(None), _slots(m, j, T, r))  # (B, H, T_l, D) -> (B, H, T'_l, D)
        keys.append(read(tensor_name(j, "k"), sl))
        values.append(read(tensor_name(j, "v"), sl))
    meta = replace(m, layer_indices=tuple(m.layer_indices[j] for j in js),
                   layer_types=tuple(m.layer_types[j] for j in js))
    try:
        return KVPayload(tuple(keys), tuple(values), read("token_ids", cols), read("positions", cols),
                         read("mask", cols), meta)
    except ValueError as e:
        raise CorruptPayload(f"tensors violate the payload invariants: {e}") from None


def decode(data: Source, *, expect: ModelIdentity | None = None, layers: range | slice | None = None,
           tokens: slice | None = None, max_header_bytes: int = MAX_HEADER_BYTES,
           max_total_bytes: int = MAX_TOTAL_BYTES) -> KVPayload:
    """kvrelay/1 bytes -> ``KVPayload``, optionally only model ``layers`` and a contiguous ``tokens`` range.

    A partial decode equals ``select_tokens(select_layers(full, layers), range(T)[tokens])``.
    """
    buf = memoryview(data).cast("B")
    h = _parse_header(_reader(buf), buf.nbytes, max_header_bytes=max_header_bytes, max_total_bytes=max_total_bytes)
    return _decode(buf, h, expect, layers, tokens, verify=True)


def load(path: str | os.PathLike, *, expect: ModelIdentity | None = None, layers: range | slice | None = None,
         tokens: slice | None = None, max_header_bytes: int = MAX_HEADER_BYTES) -> KVPayload:
    """Read a payload file; a partial load copies only the selected tensors / slices.

    The file is memory-mapped once and everything is read through that one mapping, so a writer
    replacing the path meanwhile (``save`` renames over it) can never mix two versions. Each
    tensor read is verified against its own digest (the whole tensor is hashed in place through
    the mapping; only the selected slice is copied out).
    """
    with open(path, "rb") as f:
        h = _file_header(f, max_header_bytes)
        if h.data_start == os.fstat(f.fileno()).st_size:  # no tensor bytes at all: nothing to map
            return _decode(memoryview(b""), h, expect, layers, tokens, verify=True)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _decode(memoryview(mm), h, expect, layers, tokens, verify=True)
        finally:
            try:
                mm.close()
            except BufferError:  # a traceback still holds a view of it; it closes when that dies
                pass


def atomic_write(path: str | os.PathLike, data: Source | Sequence[Source], *, fsync: bool = True) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``.

    Readers see the old file or the new one, never a partial one (rename is atomic on POSIX).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            for part in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                f.write(part)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(p: KVPayload, path: str | os.PathLike, *, extra_meta: Mapping[str, str] | None = None,
         fsync: bool = True) -> None:
    """Write ``p`` to ``path`` atomically (temporary file + rename)."""
    atomic_write(path, encode_parts(p, extra_meta=extra_meta), fsync=fsync)
