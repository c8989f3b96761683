"""``RedisStore``: kvrelay/1 bytes in Redis (``redis://host:port/db``), cut into chunks behind a manifest."""

from __future__ import annotations

import json
import math
import secrets
from urllib.parse import parse_qs, urlsplit, urlunsplit

from kvrelay.core.errors import CorruptPayload, PayloadNotFound
from kvrelay.transport.bytestore import IndexEntries, Parts, as_parts, check_ttl, chunks
from kvrelay.transport.keys import PrefixEntry, Tokens, match, query_boundaries
from kvrelay.transport.payloads import PayloadMethods

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


class RedisStore(PayloadMethods):
    """Bytes in Redis cut into ``chunk_bytes`` pieces behind a manifest.

    The URL may carry credentials and TLS as redis-py reads them: ``redis://USER:PASSWORD@HOST:PORT/DB``
    (an ACL user; ``redis://:PASSWORD@...`` for the default user), ``rediss://...`` for TLS
    (``?ssl_cert_reqs=none``, ``ssl_ca_certs=PATH`` as redis-py takes them). ``url`` shows the
    password as ``***``.

    Keys (``ns`` = namespace)::

        ns:m:<key>               manifest JSON {version, chunks, size, full}
        ns:c:<key>:<version>:<i> chunk i of that version
        ns:p:<boundary hash>     HASH key -> prefix-index entry JSON

    A put writes the chunks under a fresh version and flips the manifest in one MULTI/EXEC, so a
    reader sees the old payload or the new one, whole. The replaced version's chunks are deleted
    afterwards; a reader caught mid-way finds a chunk missing, sees the manifest moved on and
    reads again. TTL is set on the manifest and on every chunk. Integrity is the wire checksum,
    checked by whoever decodes the bytes (``CorruptPayload``).
    """

    def __init__(self, url: str, *, namespace: str | None = None, chunk_bytes: int = 8 << 20, max_retries: int = 64):
        """``url``: ``redis://HOST:PORT/DB``, optionally ``?namespace=NS`` (``namespace=`` wins; default kvrelay).
        ``max_retries``: how often a get re-reads a key that writers keep replacing before it gives up."""
        import redis

        if chunk_bytes <= 0 or chunk_bytes > 256 << 20:
            raise ValueError(f"chunk_bytes must be in (0, 256 MiB] (Redis' bulk limit is 512 MB), got {chunk_bytes}")
        server, ns = _split_namespace(url)
        self.namespace = namespace or ns or "kvrelay"
        shown = _redacted(server)  # what messages and traces name: never the password
        self.url = shown if self.namespace == "kvrelay" else f"{shown}?namespace={self.namespace}"
        self.chunk_bytes = chunk_bytes
        self.max_retries = max_retries
        self.client = redis.Redis.from_url(server, socket_read_size=1 << 20)  # big replies: fewer recv calls
        self._add_index = self.client.register_script(_INDEX_LUA)

    def _m(self, key: str) -> str:
        return f"{self.namespace}:m:{key}"

    def _c(self, key: str, version: str, i: int) -> str:
        return f"{self.namespace}:c:{key}:{version}:{i}"

    def _p(self, boundary: str) -> str:
        return f"{self.namespace}:p:{boundary}"

    def _chunk_keys(self, key: str, manifest: dict) -> list[str]:
        return [self._c(key, manifest["version"], i) for i in range(int(manifest["chunks"]))]

    def put_bytes(self, key: str, data: Parts, ttl_s: float | None = None, *, index: IndexEntries = (),
                  full_hash: str = "") -> None:
        check_ttl(ttl_s)
        pieces = list(chunks(as_parts(data), self.chunk_bytes))
        px = max(1, math.ceil(ttl_s * 1000)) if ttl_s is not None else None
        version = secrets.token_hex(8)
        n = len(pieces)
        size = sum(memoryview(c).nbytes for c in pieces)
        manifest = {"version": version, "chunks": n, "size": size, "full": full_hash}
        pipe = self.client.pipeline(transaction=True)
        for i, chunk in enumerate(pieces):
            pipe.set(self._c(key, version, i), chunk, px=px)
        pipe.set(self._m(key), json.dumps(manifest), px=px, get=True)
        for boundary, e in index:
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

    def get_bytes(self, key: str) -> memoryview:
        for _ in range(self.max_retries):
            raw = self.client.get(self._m(key))
            if raw is None:
                raise PayloadNotFound(key, self.url)
            m = self._parse_manifest(key, raw)
            pipe = self.client.pipeline(transaction=False)
            for k in self._chunk_keys(key, m):
                pipe.get(k)
            parts = pipe.execute()
            if any(part is None for part in parts):
                if self.client.get(self._m(key)) == raw:  # same version, chunks gone: expired or deleted
                    raise PayloadNotFound(key, self.url)
                continue  # replaced while we read: read the new version
            data = b"".join(parts)
            if len(data) != int(m["size"]):
                raise CorruptPayload(f"payload {key!r}: chunks hold {len(data)} bytes, manifest says {m['size']}")
            return memoryview(data)
        raise PayloadNotFound(key, self.url, f"replaced {self.max_retries} times while being read")

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



def _redacted(url: str) -> str:
    """``redis://user:secret@host/0`` -> ``redis://user:***@host/0`` (unchanged without a password)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    name = user.partition(":")[0]
    return urlunsplit((parts.scheme, f"{name}:***@{host}", parts.path, parts.query, parts.fragment))


def _split_namespace(url: str) -> tuple[str, str | None]:
    """``redis://h:p/db?namespace=NS&x=y`` -> (``redis://h:p/db?x=y``, ``NS``)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    ns = query.pop("namespace", [None])[-1]
    rest = "&".join(f"{k}={v[-1]}" for k, v in query.items())
    return urlunsplit((parts.scheme, parts.netloc, parts.path, rest, "")), ns


def _batched(it, n: int):
    batch: list = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


