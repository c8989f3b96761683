"""What every store has in common: it moves ``kvrelay/1`` bytes under a key, keeps time, and indexes prefixes.

A store's own API is bytes (``put_bytes`` / ``get_bytes``); ``put`` / ``get`` of a ``KVPayload``
and every codec sit on top of it in ``transport.payloads``. The bytes are always one kvrelay/1
file (``kv.wire``): a raw payload (``wire.encode_parts``) or a codec's output
(``Compressed.to_wire`` -> ``wire.pack_parts``), so integrity is the wire checksum, checked by
whoever decodes them.

``put_bytes`` also takes the prefix-index entries of the payload the bytes encode
(``keys.prefix_entries``) and its whole-sequence hash; index entries are hints that each lookup
re-checks against the hash the key holds now, so deleting or expiring a payload never needs to
find its index entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvrelay.transport.keys import PrefixEntry, Tokens

Buffer = bytes | bytearray | memoryview
Parts = Buffer | Sequence[Buffer]
IndexEntries = Sequence[tuple[str, PrefixEntry]]


@runtime_checkable
class ByteStore(Protocol):
    """The byte-level protocol every store implements (``MemoryStore``, ``DiskStore``, ``RedisStore``)."""

    url: str

    def put_bytes(self, key: str, data: Parts, ttl_s: float | None = None, *, index: IndexEntries = (),
                  full_hash: str = "") -> None:
        """Store the kvrelay/1 bytes ``data`` (one buffer or parts to concatenate) under ``key``, replacing
        any, expiring after ``ttl_s`` seconds if given; ``index``: prefix entries to add for them."""

    def get_bytes(self, key: str) -> memoryview:
        """The bytes under ``key``; ``PayloadNotFound`` when absent or expired."""

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; True when something was removed."""

    def longest_prefix(self, fingerprint: str, token_ids: Tokens) -> tuple[str, int] | None:
        """``(key, n)``: the stored payload of model ``fingerprint`` whose first ``n`` tokens are the
        query's first ``n``, with ``n`` as large as possible; None when nothing matches."""

    def check(self, *, write: bool = False) -> None:
        """Raise ``StoreError`` now when the store cannot be reached (or, with ``write``, written): a
        command checks this before it loads a model."""


def check_ttl(ttl_s: float | None) -> None:
    if ttl_s is not None and not ttl_s > 0:
        raise ValueError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")


def as_parts(data: Parts) -> list[memoryview]:
    """``data`` as a list of flat byte views (no copy)."""
    if isinstance(data, bytes | bytearray | memoryview):
        data = [data]
    return [memoryview(d).cast("B") for d in data]


def header_bytes(parts: Sequence[memoryview]) -> bytes:
    """The kvrelay/1 length prefix + JSON header at the start of ``parts`` (it names the version: every
    tensor digest is in it). Raises ``CorruptPayload`` when the bytes cannot start a kvrelay/1 file."""
    from kvrelay.core.errors import CorruptPayload
    from kvrelay.kv.wire_header import PREFIX_BYTES, header_length

    head = bytearray()
    for p in parts:
        off = 0
        while True:
            want = PREFIX_BYTES if len(head) < PREFIX_BYTES else PREFIX_BYTES + header_length(head)
            if len(head) >= want:
                return bytes(head)
            if off >= p.nbytes:
                break
            take = min(want - len(head), p.nbytes - off)
            head += p[off:off + take]
            off += take
    raise CorruptPayload(f"not kvrelay/1 bytes: {sum(p.nbytes for p in parts)} bytes, shorter than their header")


def chunks(parts: Sequence[Buffer], size: int):
    """Cut buffers into values of at most ``size`` bytes without copying big ones: a large part is sliced,
    and only runs of small parts are joined."""
    run: list = []
    run_bytes = 0
    for part in parts:
        mv = memoryview(part).cast("B")
        if run and run_bytes + mv.nbytes > min(size, 1 << 20):
            yield b"".join(run)
            run, run_bytes = [], 0
        if mv.nbytes >= 1 << 20 or mv.nbytes >= size:
            for start in range(0, mv.nbytes, size):
                yield mv[start:start + size]
        else:
            run.append(mv)
            run_bytes += mv.nbytes
    if run:
        yield b"".join(run)
