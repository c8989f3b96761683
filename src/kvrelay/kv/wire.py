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
against the metadata and its codec (``kv.wire_layout``); then each tensor it reads against its
digest; then the payload invariants. Every failure is a ``CorruptPayload`` saying what was expected;
a payload for another model is ``IncompatiblePayload``.

The code is in four files: ``kv.wire_header`` (dtype tables, checksums, header validation),
``kv.wire_layout`` (which tensors each codec's output holds), ``kv.wire_encode`` (``pack``, ``encode``,
``save``) and ``kv.wire_decode`` (``unpack``, ``decode``, ``load``, ``decode_compressed``). This
module is the one to import: it holds every public name.
"""

from __future__ import annotations

from kvrelay.kv.payload import FORMAT, KVPayload, PayloadMeta, payload_tensors
from kvrelay.kv.wire_decode import Names, decode, decode_compressed, decoded_nbytes, load, unpack
from kvrelay.kv.wire_encode import atomic_write, encode, encode_parts, pack, pack_parts, save, write_temp
from kvrelay.kv.wire_header import (
    INTEGRITY_KEYS,
    MAX_HEADER_BYTES,
    MAX_TOTAL_BYTES,
    Header,
    Source,
    TensorEntry,
    read_header,
    read_meta,
    tensor_intact,
)

__all__ = [
    "FORMAT", "INTEGRITY_KEYS", "MAX_HEADER_BYTES", "MAX_TOTAL_BYTES", "Header", "KVPayload", "Names", "PayloadMeta",
    "Source", "TensorEntry", "atomic_write", "decode", "decode_compressed", "decoded_nbytes", "encode", "encode_parts", "load", "pack", "pack_parts",
    "payload_tensors", "read_header", "read_meta", "save", "tensor_intact", "unpack", "write_temp",
]
