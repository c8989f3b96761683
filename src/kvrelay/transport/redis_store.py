"""``RedisStore``: kvrelay/1 bytes in Redis (``redis://host:port/db``), cut into chunks behind a manifest."""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from kvrelay.core.errors import CorruptPayload, PayloadNotFound, StoreError, UnknownStore
from kvrelay.kv.wire import MAX_HEADER_BYTES, MAX_TOTAL_BYTES
from kvrelay.transport.budget import ByteBudget, from_query
from kvrelay.transport.bytestore import IndexEntries, Parts, as_parts, check_ttl, chunks
from kvrelay.transport.keys import PrefixEntry, Tokens, match, query_boundaries
from kvrelay.transport.payloads import PayloadMethods

# The most bytes a manifest may declare (the largest kvrelay/1 file a reader accepts) and the most chunks
# (a 64 GiB payload in 8 MiB chunks is 8,192): a hostile manifest costs at most a bounded read.
MAX_MANIFEST_BYTES = 8 + MAX_HEADER_BYTES + MAX_TOTAL_BYTES
MAX_MANIFEST_CHUNKS = 65_536
_GET_BATCH = 64  # chunks fetched per round trip: memory grows with what the manifest's size allows, no more
# A lost connection (a server restarting, a dropped link, a server still loading its data) is retried with
# exponential backoff from RETRY_FIRST_S up to RETRY_MAX_WAIT_S between tries, for at most ``retry_s`` seconds
# and RETRY_ATTEMPTS tries; every other Redis error fails at once.
RETRY_S = 5.0
RETRY_ATTEMPTS = 20
RETRY_FIRST_S = 0.05
RETRY_MAX_WAIT_S = 1.0
R = TypeVar("R")
BUDGET_LOCK_S = 60.0  # a budgeted put holds the namespace's budget lock at most this long (a crashed writer's expires)

# A budgeted payload's turn in the eviction order: a counter shared by every process, so orders never tie.
_STAMP_LUA = """
local n = redis.call('INCR', KEYS[2])
if ARGV[2] == 'put' then
  redis.call('ZADD', KEYS[1], n, ARGV[1])
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
else
  redis.call('ZADD', KEYS[1], 'XX', n, ARGV[1])
end
return n
"""
_UNLOCK_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

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
    (an ACL user; ``redis://:PASSWORD@...`` for the default user), ``rediss://...`` for TLS with
    redis-py's parameters, paths percent-encoded: ``?ssl_ca_certs=PATH`` (the CA to trust),
    ``ssl_certfile=PATH&ssl_keyfile=PATH`` (a client certificate), ``ssl_cert_reqs=none`` (no
    verification; docs/trust.md). ``url`` shows the password as ``***``.

    Keys (``ns`` = namespace)::

        ns:m:<key>               manifest JSON {version, chunks, size, full}
        ns:c:<key>:<version>:<i> chunk i of that version
        ns:p:<boundary hash>     HASH key -> prefix-index entry JSON
        ns:b:sizes, ns:b:order   with a byte budget: HASH key -> bytes, ZSET key -> put (or, lru, read) order
        ns:b:seq, ns:b:lock      the order's counter; the lock a budgeted put holds (``BUDGET_LOCK_S`` at most)

    A put writes the chunks under a fresh version and flips the manifest in one MULTI/EXEC, so a
    reader sees the old payload or the new one, whole. The replaced version's chunks are deleted
    afterwards; a reader caught mid-way finds a chunk missing, sees the manifest moved on and
    reads again. TTL is set on the manifest and on every chunk. Integrity is the wire checksum,
    checked by whoever decodes the bytes (``CorruptPayload``).

    With a byte budget (``budget=`` or ``?max_bytes=N&evict=refuse|oldest|lru``) a put takes the
    namespace's budget lock, forgets ledger entries whose manifest is gone (expired or deleted), builds
    the budget from the ledger (``ByteBudget.holding``), deletes what it drops or raises ``OverBudget``,
    writes, and records the payload's bytes and turn. Every opener with a budget shares the ledger;
    payloads put without one are not in it.
    """

    def __init__(self, url: str, *, namespace: str | None = None, chunk_bytes: int = 8 << 20, max_retries: int = 64,
                 retry_s: float | None = None, budget: ByteBudget | None = None):
        """``url``: ``redis://HOST:PORT/DB``, optionally ``?namespace=NS`` (``namespace=`` wins; default kvrelay)
        and ``?retry_s=S`` (``retry_s=`` wins; default ``RETRY_S``): how long a call retries a lost connection,
        with backoff, before it raises ``StoreError`` (0: never).
        ``max_retries``: how often a get re-reads a key that writers keep replacing before it gives up."""
        import redis

        if chunk_bytes <= 0 or chunk_bytes > 256 << 20:
            raise ValueError(f"chunk_bytes must be in (0, 256 MiB] (Redis' bulk limit is 512 MB), got {chunk_bytes}")
        server, ns, url_retry, url_budget = _split_params(url)
        self.budget = budget if budget is not None else url_budget
        self.namespace = namespace or ns or "kvrelay"
        shown = _redacted(server)  # what messages and traces name: never the password
        self.url = shown if self.namespace == "kvrelay" else \
            f"{shown}{'&' if urlsplit(shown).query else '?'}namespace={self.namespace}"
        self.chunk_bytes = chunk_bytes
        self.max_retries = max_retries
        self.retry_s = _retry_seconds(retry_s if retry_s is not None else url_retry if url_retry is not None else RETRY_S,
                                      url)
        _check_url(server)
        try:
            self.client = redis.Redis.from_url(server, socket_read_size=1 << 20,  # big replies: fewer recv calls
                                               socket_connect_timeout=10)
        except ValueError:  # what _check_url does not catch (redis-py's message may quote the password)
            raise UnknownStore(f"{self.url!r} is not a Redis URL redis-py accepts; expected "
                               "redis://HOST:PORT/DB with DB a number") from None
        self._add_index = self.client.register_script(_INDEX_LUA)
        self._stamp = self.client.register_script(_STAMP_LUA)
        self._unlock = self.client.register_script(_UNLOCK_LUA)

    def _call(self, fn: Callable[[], R]) -> R:
        """``fn()``, a lost connection retried with backoff (bounded by ``retry_s``); Redis' own errors (no
        server, a database out of range, out of memory, ...) as ``StoreError``. Every call it wraps may be
        repeated whole: a put writes a fresh version and flips the manifest in one transaction."""
        import redis
        import tenacity

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((redis.ConnectionError, redis.TimeoutError)),
            stop=tenacity.stop_after_delay(self.retry_s) | tenacity.stop_after_attempt(RETRY_ATTEMPTS),
            wait=tenacity.wait_exponential(multiplier=RETRY_FIRST_S, max=RETRY_MAX_WAIT_S), reraise=True)
        try:
            return retrying(fn)
        except redis.RedisError as e:
            tries = retrying.statistics.get("attempt_number", 1)
            after = f" (after {tries} tries over {self.retry_s:g} s)" if tries > 1 else ""
            raise StoreError(f"redis store {self.url}: {type(e).__name__}: {e}{after}; expected a Redis server "
                             "answering at that address with that database") from None

    def check(self, *, write: bool = False) -> None:
        """Raise ``StoreError`` now unless the server answers (PING, on the database of the URL)."""
        self._call(self.client.ping)

    def _m(self, key: str) -> str:
        return f"{self.namespace}:m:{key}"

    def _c(self, key: str, version: str, i: int) -> str:
        return f"{self.namespace}:c:{key}:{version}:{i}"

    def _p(self, boundary: str) -> str:
        return f"{self.namespace}:p:{boundary}"

    def _chunk_keys(self, key: str, manifest: dict) -> list[str]:
        return [self._c(key, manifest["version"], i) for i in range(manifest["chunks"])]

    def put_bytes(self, key: str, data: Parts, ttl_s: float | None = None, *, index: IndexEntries = (),
                  full_hash: str = "") -> None:
        check_ttl(ttl_s)
        data = as_parts(data)
        if self.budget is None:
            self._call(lambda: self._put(key, data, ttl_s, index, full_hash))
        else:
            token = secrets.token_hex(8)  # one per put: a retried put knows the lock it took before
            self._call(lambda: self._put_budgeted(key, data, ttl_s, index, full_hash, token))

    def _b(self, what: str) -> str:
        return f"{self.namespace}:b:{what}"

    def _put_budgeted(self, key: str, data: Parts, ttl_s: float | None, index: IndexEntries, full_hash: str,
                      token: str) -> None:
        wait = 0.01
        while not (self.client.set(self._b("lock"), token, nx=True, px=int(BUDGET_LOCK_S * 1000))
                   or self.client.get(self._b("lock")) == token.encode()):
            time.sleep(wait)  # another process is putting under the budget
            wait = min(2 * wait, 0.5)
        try:
            for k in self._admit(key, sum(memoryview(c).nbytes for c in data)):
                self._delete(k)
                self.client.hdel(self._b("sizes"), k)
                self.client.zrem(self._b("order"), k)
            self._put(key, data, ttl_s, index, full_hash)
            self._stamp(keys=[self._b("order"), self._b("seq"), self._b("sizes")],
                        args=[key, "put", sum(memoryview(c).nbytes for c in data)])
        finally:
            self._unlock(keys=[self._b("lock")], args=[token])

    def _admit(self, key: str, nbytes: int) -> list[str]:
        """The keys the budget drops to take ``nbytes`` under ``key``; ``OverBudget`` when it cannot. Ledger
        entries of payloads that are gone free their bytes first. Called under the budget lock."""
        order = [k.decode() for k in self.client.zrange(self._b("order"), 0, -1)]
        sizes = {k.decode(): int(v) for k, v in self.client.hgetall(self._b("sizes")).items()}
        pipe = self.client.pipeline(transaction=False)
        for k in order:
            pipe.exists(self._m(k))
        live = dict(zip(order, pipe.execute(), strict=True))
        gone = [k for k in set(order) | set(sizes) if not live.get(k)]
        if gone:
            self.client.zrem(self._b("order"), *gone)
            self.client.hdel(self._b("sizes"), *gone)
        held = [(k, sizes[k]) for k in order if live[k] and k in sizes]
        return ByteBudget.holding(self.budget.max_bytes, self.budget.policy, held).admit(key, nbytes, self.url)

    def _put(self, key: str, data: Parts, ttl_s: float | None, index: IndexEntries, full_hash: str) -> None:
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
        """The manifest's fields, bounded: chunks in [1, MAX_MANIFEST_CHUNKS] and no more than the bytes
        (but one), size at most MAX_MANIFEST_BYTES, version a hex string."""
        try:
            m = json.loads(raw)
        except (ValueError, RecursionError):
            m = None
        ok = (isinstance(m, dict) and type(m.get("chunks")) is int and type(m.get("size")) is int
              and isinstance(m.get("version"), str) and m["version"].isalnum() and len(m["version"]) <= 64
              and 0 <= m["size"] <= MAX_MANIFEST_BYTES and 1 <= m["chunks"] <= min(MAX_MANIFEST_CHUNKS, max(1, m["size"])))
        if not ok:
            raise CorruptPayload(f"manifest of {key!r} is not a kvrelay manifest: {bytes(raw[:200])!r}; expected "
                                 f"{{version, chunks (1..{MAX_MANIFEST_CHUNKS}), size (<= {MAX_MANIFEST_BYTES})}}")
        return m

    def get_bytes(self, key: str) -> memoryview:
        view = self._call(lambda: self._get(key))
        if self.budget is not None and self.budget.policy == "lru":  # last used: now
            self._call(lambda: self._stamp(keys=[self._b("order"), self._b("seq"), self._b("sizes")],
                                           args=[key, "read", 0]))
        return view

    def _get(self, key: str) -> memoryview:
        for _ in range(self.max_retries):
            raw = self.client.get(self._m(key))
            if raw is None:
                raise PayloadNotFound(key, self.url)
            m = self._parse_manifest(key, raw)
            parts = self._chunks(key, m)
            if parts is None:
                if self.client.get(self._m(key)) == raw:  # same version, chunks gone: expired or deleted
                    raise PayloadNotFound(key, self.url)
                continue  # replaced while we read: read the new version
            data = b"".join(parts)
            if len(data) != m["size"]:
                raise CorruptPayload(f"payload {key!r}: chunks hold {len(data)} bytes, manifest says {m['size']}")
            return memoryview(data)
        raise PayloadNotFound(key, self.url, f"replaced {self.max_retries} times while being read")

    def _chunks(self, key: str, m: dict) -> list[bytes] | None:
        """The manifest's chunks, fetched a batch at a time; None at the first one missing. Stops as soon
        as they hold more bytes than the manifest declares."""
        names, parts, got = self._chunk_keys(key, m), [], 0
        for start in range(0, len(names), _GET_BATCH):
            pipe = self.client.pipeline(transaction=False)
            for k in names[start:start + _GET_BATCH]:
                pipe.get(k)
            batch = pipe.execute()
            if any(part is None for part in batch):
                return None
            got += sum(len(part) for part in batch)
            if got > m["size"]:
                raise CorruptPayload(f"payload {key!r}: chunks hold more than the {m['size']} bytes the manifest says")
            parts.extend(batch)
        return parts

    def contains(self, key: str) -> bool:
        return self._call(lambda: bool(self.client.exists(self._m(key))))

    def delete(self, key: str) -> bool:
        return self._call(lambda: self._delete(key))

    def _delete(self, key: str) -> bool:
        raw = self.client.getdel(self._m(key))
        if raw is None:
            return False
        try:
            self.client.delete(*self._chunk_keys(key, self._parse_manifest(key, raw)))
        except CorruptPayload:
            pass
        return True

    def longest_prefix(self, fingerprint: str, token_ids: Tokens) -> tuple[str, int] | None:
        return self._call(lambda: self._longest_prefix(fingerprint, token_ids))

    def _longest_prefix(self, fingerprint: str, token_ids: Tokens) -> tuple[str, int] | None:
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
            if raw is not None and _full_hash(raw) == e.full_hash:
                return e.key, n
            self.client.hdel(self._p(where[e]), e.key)  # stale hint; a later put of the key re-adds it
        return None

    def clear(self) -> int:
        """Delete every key of this store's namespace; returns how many."""
        def clear() -> int:
            n = 0
            for batch in _batched(self.client.scan_iter(match=f"{self.namespace}:*", count=1000), 500):
                n += self.client.delete(*batch)
            return n

        return self._call(clear)

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


def _check_url(url: str) -> None:
    """``redis[s]://[USER:PASS@]HOST[:PORT][/DB]`` with a numeric port and database: redis-py reads a database
    that is not a number as database 0, which would put payloads where the user did not ask."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return
    try:
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError:
        raise UnknownStore(f"{_redacted(url)!r}: the port is not a number; expected redis://HOST:PORT/DB") from None
    db = parts.path.strip("/")
    if db and not (db.isascii() and db.isdigit()):
        raise UnknownStore(f"{_redacted(url)!r}: database {db!r} is not a number; expected redis://HOST:PORT/DB with DB a "
                           "number (0 to 15 on a default server)")


def _full_hash(raw: bytes) -> str | None:
    """The ``full`` field of a manifest, None when it is not one."""
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return m.get("full") if isinstance(m, dict) else None


def _split_params(url: str) -> tuple[str, str | None, str | None, ByteBudget | None]:
    """``redis://h:p/db?namespace=NS&retry_s=S&max_bytes=N&evict=P&x=y`` -> (``redis://h:p/db?x=y``, ``NS``,
    ``S``, the budget): kvrelay's own parameters apart from redis-py's."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    ns = query.pop("namespace", [None])[-1]
    retry = query.pop("retry_s", [None])[-1]
    budget = from_query(_redacted(url), query)
    rest = urlencode([(k, v[-1]) for k, v in query.items()])  # re-encoded: a path may hold '+', '&' or '%'
    return urlunsplit((parts.scheme, parts.netloc, parts.path, rest, "")), ns, retry, budget


def _retry_seconds(value, url: str) -> float:
    try:
        s = float(value)
    except (TypeError, ValueError):
        s = math.nan
    if not (0 <= s <= 3600):
        raise UnknownStore(f"{_redacted(url)!r}: retry_s {value!r} is not a number of seconds in [0, 3600]; "
                           "expected ?retry_s=S")
    return s


def _batched(it, n: int):
    batch: list = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


