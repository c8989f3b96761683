"""Where payloads wait between agents: one small protocol, three stores (memory, disk, Redis).

Stores only move bytes and keep time (TTL); they never decide what to relay. Keys are usually
content addresses (``keys.payload_key``: model fingerprint + chained hash of the tokens), and
every store keeps a prefix index so ``longest_prefix`` finds the longest stored payload that a
query's tokens start with, in one probe per 16-token block. The receiver then cuts that payload
to the shared prefix (``prefix_payload`` does it with ``select_tokens``) and prefills only the rest.

Index entries are hints: each lookup re-checks that the entry's key still holds a live payload
with the same whole-sequence hash, and forgets the entry otherwise. Deleting or expiring a
payload therefore never needs to find its index entries.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv import wire
from kvrelay.kv.payload import KVPayload
from kvrelay.kv.transforms import select_tokens
from kvrelay.transport.keys import (
    BLOCK_TOKENS,
    PrefixEntry,
    Tokens,
    match,
    parse_key,
    payload_key,
    prefix_entries,
    query_boundaries,
    sequence_hash,
    single_sequence,
)


@runtime_checkable
class PayloadStore(Protocol):
    def put(self, key: str, payload: KVPayload, ttl_s: float | None = None) -> None:
        """Store ``payload`` under ``key`` (replacing any), expiring after ``ttl_s`` seconds if given."""

    def get(self, key: str) -> KVPayload:
        """The payload under ``key``; ``KeyError`` when absent or expired."""

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; True when something was removed."""

    def longest_prefix(self, fingerprint: str, token_ids: Tokens) -> tuple[str, int] | None:
        """``(key, n)``: the stored payload of model ``fingerprint`` whose first ``n`` tokens are the
        query's first ``n``, with ``n`` as large as possible; None when nothing matches."""


def put_payload(store: PayloadStore, p: KVPayload, ttl_s: float | None = None) -> str:
    """Store a single-sequence payload under its content key and return the key."""
    key = payload_key(p)
    store.put(key, p, ttl_s)
    return key


def prefix_payload(store: PayloadStore, fingerprint: str, token_ids: Tokens) -> KVPayload | None:
    """The longest stored prefix of ``token_ids``, cut to exactly the shared tokens; None if none.

    The caller prefills ``token_ids[result.num_tokens:]`` on top of it. When the whole query is
    stored there is nothing left to prefill; callers that need logits cut one token less.
    """
    hit = store.longest_prefix(fingerprint, token_ids)
    if hit is None:
        return None
    key, n = hit
    try:
        p = store.get(key)
    except KeyError:  # expired or deleted since the lookup
        return None
    return p if n == p.num_tokens else select_tokens(p, range(n))


def _check_ttl(ttl_s: float | None) -> None:
    if ttl_s is not None and not ttl_s > 0:
        raise ValueError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")


def _full_hash(p: KVPayload) -> str:
    ids = single_sequence(p)
    return sequence_hash(p.meta.model_fingerprint, ids) if ids is not None else ""


# -- memory --------------------------------------------------------------------------------------
class MemoryStore:
    """A dict with expiry times, for agents in one process. Payloads are shared, not copied: treat them as read-only."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[KVPayload, float | None, str]] = {}  # key -> (payload, expires_at, full hash)
        self._index: dict[str, dict[str, PrefixEntry]] = {}  # boundary hash -> key -> entry
        self._lock = threading.Lock()

    def put(self, key: str, payload: KVPayload, ttl_s: float | None = None) -> None:
        _check_ttl(ttl_s)
        expires = time.monotonic() + ttl_s if ttl_s is not None else None
        entries = prefix_entries(key, payload)
        with self._lock:
            self._items[key] = (payload, expires, _full_hash(payload))
            for boundary, e in entries:
                self._index.setdefault(boundary, {})[key] = e

    def _live(self, key: str):
        item = self._items.get(key)
        if item is not None and item[1] is not None and time.monotonic() >= item[1]:
            del self._items[key]
            return None
        return item

    def get(self, key: str) -> KVPayload:
        with self._lock:
            item = self._live(key)
        if item is None:
            raise KeyError(key)
        return item[0]

    def contains(self, key: str) -> bool:
        with self._lock:
            return self._live(key) is not None

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._items.pop(key, None) is not None

    def longest_prefix(self, fingerprint: str, token_ids: Tokens) -> tuple[str, int] | None:
        bounds = query_boundaries(fingerprint, token_ids)
        with self._lock:
            found = [list(self._index.get(b, {}).values()) for b in bounds]
            for e, n in match(token_ids, found):
                item = self._live(e.key)
                if item is not None and item[2] == e.full_hash:
                    return e.key, n
                # a stale hint: the payload is gone or was replaced by other tokens under that key
                self._index[bounds[e.start // BLOCK_TOKENS]].pop(e.key, None)
        return None

    def __len__(self) -> int:
        with self._lock:
            return sum(self._live(k) is not None for k in list(self._items))


# -- disk ----------------------------------------------------------------------------------------
class DiskStore:
    """One kvrelay/1 file per key under ``root``, written to a temporary name and renamed into place.

    Readers see the old file or the new one, never a partial one, and a reader that has opened a
    file keeps reading that version even if a writer replaces it meanwhile (``wire.load`` maps it
    once). The expiry time travels inside the file's checksummed metadata, so a payload and its
    TTL change together. Safe for many processes on one machine (a local filesystem).

    Layout::

        root/payloads/<fp[:16]>/<hash>.safetensors       content keys (others: payloads/_/<sha256(key)>)
        root/prefix/<b[:2]>/<b>/<sha256(key)[:32]>.json   prefix index entries under boundary hash b

    ``fsync=False`` (default) trades durability across a machine crash for speed; a file torn by
    a crash is refused by its checksum (``CorruptPayload``), never used.
    """

    def __init__(self, root: str | os.PathLike, *, fsync: bool = False):
        self.root = Path(root)
        self.fsync = fsync
        (self.root / "payloads").mkdir(parents=True, exist_ok=True)
        (self.root / "prefix").mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        try:
            k = parse_key(key)
            return self.root / "payloads" / k.fingerprint_prefix / f"{k.chain_hash}.safetensors"
        except ValueError:
            return self.root / "payloads" / "_" / f"{hashlib.sha256(key.encode()).hexdigest()}.safetensors"

    def put(self, key: str, payload: KVPayload, ttl_s: float | None = None) -> None:
        _check_ttl(ttl_s)
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        expires = repr(time.time() + ttl_s) if ttl_s is not None else ""
        extra = {"store_key": key, "expires_at": expires, "chain_hash": _full_hash(payload)}
        wire.save(payload, path, extra_meta=extra, fsync=self.fsync)
        name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".json"
        for boundary, e in prefix_entries(key, payload):
            folder = self._index_dir(boundary)
            try:
                wire.atomic_write(folder / name, e.to_json().encode(), fsync=False)
            except FileNotFoundError:  # first entry under this boundary
                folder.mkdir(parents=True, exist_ok=True)
                wire.atomic_write(folder / name, e.to_json().encode(), fsync=False)

    def _index_dir(self, boundary: str) -> Path:
        return self.root / "prefix" / boundary[:2] / boundary

    def _meta(self, key: str) -> dict[str, str] | None:
        """The live file's metadata, or None when absent or expired."""
        try:
            meta = wire.read_meta(self.path(key))
        except FileNotFoundError:
            return None
        if meta.get("expires_at") and time.time() >= float(meta["expires_at"]):
            return None
        return meta

    def get(self, key: str) -> KVPayload:
        if self._meta(key) is None:
            raise KeyError(key)
        try:
            return wire.load(self.path(key))
        except FileNotFoundError:  # deleted between the two reads
            raise KeyError(key) from None

    def contains(self, key: str) -> bool:
        try:
            return self._meta(key) is not None
        except CorruptPayload:
            return False

    def delete(self, key: str) -> bool:
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def longest_prefix(self, fingerprint: str, token_ids: Tokens) -> tuple[str, int] | None:
        found: list[list[PrefixEntry]] = []
        files: dict[PrefixEntry, Path] = {}
        for b in query_boundaries(fingerprint, token_ids):
            entries = []
            folder = self._index_dir(b)
            for f in (folder.iterdir() if folder.is_dir() else ()):
                if f.suffix != ".json":
                    continue
                try:
                    e = PrefixEntry.from_json(f.read_bytes())
                except (FileNotFoundError, ValueError, KeyError):
                    continue
                entries.append(e)
                files[e] = f
            found.append(entries)
        for e, n in match(token_ids, found):
            try:
                meta = self._meta(e.key)
            except CorruptPayload:
                meta = None
            if meta is not None and meta.get("chain_hash") == e.full_hash:
                return e.key, n
            files[e].unlink(missing_ok=True)  # stale hint (an entry is rewritten only by a put of the same key)
        return None

    def sweep(self) -> int:
        """Delete expired payload files; returns how many. (Index entries go lazily, on lookup.)"""
        n = 0
        for f in (self.root / "payloads").glob("*/*.safetensors"):
            try:
                meta = wire.read_meta(f)
            except (FileNotFoundError, CorruptPayload):
                continue
            if meta.get("expires_at") and time.time() >= float(meta["expires_at"]):
                f.unlink(missing_ok=True)
                n += 1
        return n


# -- Redis ---------------------------------------------------------------------------------------
# Add one prefix-index entry; the index hash lives as long as its longest-lived entry (-1 = forever).
_INDEX_LUA = """
local existed = redis.call('EXISTS', KEYS[1])
local current = redis.call('PTTL', KEYS[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local ttl = tonumber(ARGV[3])
if ttl < 0 then
  redis.call('PERSIST', KEYS[1])
elseif existed == 0 or (current >= 0 and current < ttl) then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return 1
"""


class RedisStore:
    """Payloads in Redis as kvrelay/1 bytes cut into ``chunk_bytes`` pieces behind a manifest.

    Keys (``ns`` = namespace)::

        ns:m:<key>               manifest JSON {version, chunks, size, full}
        ns:c:<key>:<version>:<i> chunk i of that version
        ns:p:<boundary hash>     HASH key -> prefix-index entry JSON

    A put writes the chunks under a fresh version and flips the manifest in one MULTI/EXEC, so a
    reader sees the old payload or the new one, whole. The replaced version's chunks are deleted
    afterwards; a reader caught mid-way finds a chunk missing, sees the manifest moved on and
    reads again. TTL is set on the manifest and on every chunk. Integrity is the wire checksum,
    checked on every get (``CorruptPayload``).
    """

    def __init__(self, url: str, *, namespace: str = "kvrelay", chunk_bytes: int = 8 << 20, max_retries: int = 8):
        import redis

        if chunk_bytes <= 0 or chunk_bytes > 256 << 20:
            raise ValueError(f"chunk_bytes must be in (0, 256 MiB] (Redis' bulk limit is 512 MB), got {chunk_bytes}")
        self.url = url
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self.max_retries = max_retries
        self.client = redis.Redis.from_url(url, socket_read_size=1 << 20)  # big replies: fewer recv calls
        self._add_index = self.client.register_script(_INDEX_LUA)

    def _m(self, key: str) -> str:
        return f"{self.namespace}:m:{key}"

    def _c(self, key: str, version: str, i: int) -> str:
        return f"{self.namespace}:c:{key}:{version}:{i}"

    def _p(self, boundary: str) -> str:
        return f"{self.namespace}:p:{boundary}"

    def _chunk_keys(self, key: str, manifest: dict) -> list[str]:
        return [self._c(key, manifest["version"], i) for i in range(int(manifest["chunks"]))]

    def put(self, key: str, payload: KVPayload, ttl_s: float | None = None) -> None:
        _check_ttl(ttl_s)
        chunks = list(_chunks(wire.encode_parts(payload), self.chunk_bytes))
        px = max(1, math.ceil(ttl_s * 1000)) if ttl_s is not None else None
        version = secrets.token_hex(8)
        n = len(chunks)
        size = sum(memoryview(c).nbytes for c in chunks)
        manifest = {"version": version, "chunks": n, "size": size, "full": _full_hash(payload)}
        pipe = self.client.pipeline(transaction=True)
        for i, chunk in enumerate(chunks):
            pipe.set(self._c(key, version, i), chunk, px=px)
        pipe.set(self._m(key), json.dumps(manifest), px=px, get=True)
        for boundary, e in prefix_entries(key, payload):
            self._add_index(keys=[self._p(boundary)], args=[key, e.to_json(), px or -1], client=pipe)
        old = pipe.execute()[n]
        if old is not None:
            old_manifest = self._parse_manifest(key, old)
            if old_manifest["version"] != version:
                self.client.delete(*self._chunk_keys(key, old_manifest))

    def _parse_manifest(self, key: str, raw: bytes) -> dict:
        try:
            m = json.loads(raw)
            if not isinstance(m, dict) or int(m["chunks"]) < 1 or int(m["size"]) < 0:
                raise ValueError(m)
            return m
        except (ValueError, KeyError, TypeError):
            raise CorruptPayload(f"manifest of {key!r} is not a kvrelay manifest: {raw[:200]!r}") from None

    def get(self, key: str) -> KVPayload:
        for _ in range(self.max_retries):
            raw = self.client.get(self._m(key))
            if raw is None:
                raise KeyError(key)
            m = self._parse_manifest(key, raw)
            pipe = self.client.pipeline(transaction=False)
            for k in self._chunk_keys(key, m):
                pipe.get(k)
            parts = pipe.execute()
            if any(part is None for part in parts):
                if self.client.get(self._m(key)) == raw:  # same version, chunks gone: expired or deleted
                    raise KeyError(key)
                continue  # replaced while we read: read the new version
            data = b"".join(parts)
            if len(data) != int(m["size"]):
                raise CorruptPayload(f"payload {key!r}: chunks hold {len(data)} bytes, manifest says {m['size']}")
            return wire.decode(data)
        raise KeyError(f"{key} (replaced {self.max_retries} times while being read)")

    def contains(self, key: str) -> bool:
        return bool(self.client.exists(self._m(key)))

    def delete(self, key: str) -> bool:
        raw = self.client.getdel(self._m(key))
        if raw is None:
            return False
        try:
            self.client.delete(*self._chunk_keys(key, self._parse_manifest(key, raw)))
        except CorruptPayload:
            pass
        return True

    def longest_prefix(self, fingerprint: str, token_ids: Tokens) -> tuple[str, int] | None:
        bounds = query_boundaries(fingerprint, token_ids)
        pipe = self.client.pipeline(transaction=False)
        for b in bounds:
            pipe.hgetall(self._p(b))
        found = []
        where: dict[PrefixEntry, str] = {}
        for b, fields in zip(bounds, pipe.execute(), strict=True):
            entries = []
            for raw in fields.values():
                try:
                    e = PrefixEntry.from_json(raw)
                except (ValueError, KeyError):
                    continue
                entries.append(e)
                where[e] = b
            found.append(entries)
        for e, n in match(token_ids, found):
            raw = self.client.get(self._m(e.key))
            if raw is not None and json.loads(raw).get("full") == e.full_hash:
                return e.key, n
            self.client.hdel(self._p(where[e]), e.key)  # stale hint; a later put of the key re-adds it
        return None

    def clear(self) -> int:
        """Delete every key of this store's namespace; returns how many."""
        n = 0
        for batch in _batched(self.client.scan_iter(match=f"{self.namespace}:*", count=1000), 500):
            n += self.client.delete(*batch)
        return n

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chunks(parts, size: int):
    """Cut the encoded parts into Redis values of at most ``size`` bytes without copying big tensors:
    a large part is sliced, and only runs of small parts are joined."""
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


def _batched(it, n: int):
    batch: list = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


STORES: dict[str, type] = {"memory": MemoryStore, "disk": DiskStore, "redis": RedisStore}
