"""Reading ``kvrelay/1``: named tensors (``unpack``) or a ``KVPayload`` (``decode``, ``load``), whole or in part.

Validation order (``kv.wire``): the header first (``kv.wire_header``), then the tensors' names,
shapes and dtypes against the metadata and its codec (``kv.wire_layout``), then each tensor read
against its own digest, then the payload invariants (``KVPayload``). Only the selected bytes are
copied; nothing is a view of the source. ``decode`` and ``load`` read any codec's output: a raw
payload directly, anything else (``fp16``, ``int8``, ``evict:F+…``) through ``codecs.decompress``,
so what comes back is always a float payload with codec ``raw``.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Collection
from dataclasses import replace

import numpy as np
import torch

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv.codecs import Compressed, codec_of, decompress
from kvrelay.kv.compat import check_meta
from kvrelay.kv.layout import held_tokens, tensor_name
from kvrelay.kv.payload import DTYPES, RAW, KVPayload, PayloadMeta, check_tokens
from kvrelay.kv.transforms import select_layers, select_tokens
from kvrelay.kv.wire_header import (
    MAX_HEADER_BYTES,
    MAX_TOTAL_BYTES,
    Header,
    Source,
    buffer_reader,
    file_header,
    parse_header,
    tensor_digest,
)
from kvrelay.kv.wire_layout import check_layout
from kvrelay.models.identity import ModelIdentity


def _read(buf: memoryview, h: Header, name: str, verify: bool, index: tuple[slice, ...] = ()) -> torch.Tensor:
    """A fresh copy of tensor ``name`` (or of ``t[index]``, slices of its leading dims), digest checked first.

    The copy is made on raw bytes with numpy — shape ``(*shape, itemsize)`` so every dtype,
    bfloat16 included, slices the same way — which touches only the selected bytes and avoids
    torch's threaded copy (slow on a contended 2-core box).
    """
    e = h.tensors[name]
    raw = buf[h.data_start + e.begin:h.data_start + e.end]
    if verify:
        got = tensor_digest(name, e.dtype, e.shape, raw)
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
    h = parse_header(buffer_reader(buf), buf.nbytes, max_header_bytes=max_header_bytes, max_total_bytes=max_total_bytes)
    return {n: _read(buf, h, n, verify) for n in _pick(h, names)}, dict(h.meta)


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


def _specs(h: Header) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (e.dtype, e.shape) for n, e in h.tensors.items()}


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


def _invariants(e: ValueError) -> CorruptPayload:
    return CorruptPayload(f"tensors violate the payload invariants: {e}")


def _decode(buf: memoryview, h: Header, expect, layers, tokens, verify: bool) -> KVPayload:
    m = _payload_meta(h)
    _check_expected(m, expect)
    B, T = check_layout(_specs(h), m)  # every codec's tensors, before a byte is read
    js = _layer_positions(m, layers)
    r = _token_range(T, tokens)
    if m.codec != RAW:
        return _decode_codec(buf, h, m, js, r, verify)

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
        raise _invariants(e) from None


def _compressed(buf: memoryview, h: Header, verify: bool) -> Compressed:
    """A codec's output, every tensor read (and verified), its token tensors checked (``check_tokens``);
    the layout was checked by the caller."""
    t = {n: _read(buf, h, n, verify) for n in sorted(h.tensors)}
    try:
        check_tokens(t["token_ids"], t["positions"], t["mask"])
    except ValueError as e:
        raise _invariants(e) from None
    return Compressed.from_wire(t, h.meta)


def _decode_codec(buf: memoryview, h: Header, m: PayloadMeta, js: list[int], r: range, verify: bool) -> KVPayload:
    """Decompress a codec's output to a raw payload, then keep held layers ``js`` and slots ``r``."""
    try:
        p = decompress(_compressed(buf, h, verify))
    except ValueError as e:  # the payload invariants of what the codec restored
        raise _invariants(e) from None
    if len(js) != len(m.layer_indices):
        p = select_layers(p, [m.layer_indices[j] for j in js])
    return p if len(r) == p.num_tokens else select_tokens(p, list(r))


def decode(data: Source, *, expect: ModelIdentity | None = None, layers: range | slice | None = None,
           tokens: slice | None = None, max_header_bytes: int = MAX_HEADER_BYTES,
           max_total_bytes: int = MAX_TOTAL_BYTES) -> KVPayload:
    """kvrelay/1 bytes -> ``KVPayload``, optionally only model ``layers`` and a contiguous ``tokens`` range.

    A partial decode equals ``select_tokens(select_layers(full, layers), range(T)[tokens])``.
    """
    buf = memoryview(data).cast("B")
    h = parse_header(buffer_reader(buf), buf.nbytes, max_header_bytes=max_header_bytes, max_total_bytes=max_total_bytes)
    return _decode(buf, h, expect, layers, tokens, verify=True)


def decode_compressed(data: Source, *, expect: ModelIdentity | None = None,
                      max_header_bytes: int = MAX_HEADER_BYTES) -> Compressed:
    """kvrelay/1 bytes of any codec's output -> ``Compressed`` (not decompressed), checked like ``decode``."""
    buf = memoryview(data).cast("B")
    h = parse_header(buffer_reader(buf), buf.nbytes, max_header_bytes=max_header_bytes, max_total_bytes=MAX_TOTAL_BYTES)
    m = _payload_meta(h)
    _check_expected(m, expect)
    check_layout(_specs(h), m)
    return _compressed(buf, h, verify=True)


def decoded_nbytes(data: Source, *, max_header_bytes: int = MAX_HEADER_BYTES) -> int:
    """The bytes ``decode`` allocates for the payload in ``data`` (``KVPayload.nbytes`` of what it returns), from
    the header alone: no tensor byte is read. A receiver with a byte budget refuses on it before decoding.

    The header, the metadata and the codec's tensor layout are checked as ``decode`` checks them (the shapes
    it counts are the ones ``decode`` would accept, so a header cannot declare one size and decode to
    another); the tensors' digests are not, since no tensor is read."""
    buf = memoryview(data).cast("B")
    h = parse_header(buffer_reader(buf), buf.nbytes, max_header_bytes=max_header_bytes, max_total_bytes=MAX_TOTAL_BYTES)
    m = _payload_meta(h)
    B, T = check_layout(_specs(h), m)
    itemsize = DTYPES[m.dtype].itemsize  # every codec decodes to the metadata's float dtype
    part = None if m.codec == "raw" or codec_of(m).encoding.kind != "int" else "scale"
    kv = 0
    for j in range(len(m.layer_indices)):
        shape = h.tensors[tensor_name(j, "k", part)].shape  # (B, H, T_l, D), or the int scale (B, H, groups, D)
        kv += 2 * B * shape[1] * _held(m, j, T) * shape[3] * itemsize
    return kv + B * T * (2 * torch.int64.itemsize + torch.bool.itemsize)  # token_ids, positions, mask


def load(path: str | os.PathLike, *, expect: ModelIdentity | None = None, layers: range | slice | None = None,
         tokens: slice | None = None, max_header_bytes: int = MAX_HEADER_BYTES) -> KVPayload:
    """Read a payload file; a partial load copies only the selected tensors / slices.

    The file is memory-mapped once and everything is read through that one mapping, so a writer
    replacing the path meanwhile (``save`` renames over it) can never mix two versions. Each
    tensor read is verified against its own digest (the whole tensor is hashed in place through
    the mapping; only the selected slice is copied out).
    """
    with open(path, "rb") as f:
        h = file_header(f, max_header_bytes)
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
