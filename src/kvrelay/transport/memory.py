"""``MemoryStore``: kvrelay/1 bytes in a dict with expiry times, for agents in one process (``memory://``).

With a ``budget`` (``transport.budget.ByteBudget``) it holds at most that many bytes: a put that
would exceed it is refused or makes room by the budget's policy (oldest, lru)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvrelay.core.errors import PayloadNotFound
from kvrelay.transport.budget import ByteBudget
from kvrelay.transport.bytestore import IndexEntries, Parts, as_parts, check_ttl
from kvrelay.transport.keys import BLOCK_TOKENS, PrefixEntry, Tokens, match, query_boundaries
from kvrelay.transport.payloads import PayloadMethods


class MemoryStore(PayloadMethods):
    """Bytes under keys, in this process. A put joins the parts once; a get returns a view of them."""

    def __init__(self, name: str = "", *, clock: Callable[[], float] = time.monotonic,
                 budget: ByteBudget | None = None) -> None:
        self.clock = clock  # seconds, for expiry
        self.budget = budget
        self.url = f"memory://{name}"
        self._items: dict[str, tuple[bytes, float | None, str]] = {}  # key -> (bytes, expires_at, full hash)
        self._index: dict[str, dict[str, PrefixEntry]] = {}  # boundary hash -> key -> entry
        self._lock = threading.Lock()

    def put_bytes(self, key: str, data: Parts, ttl_s: float | None = None, *, index: IndexEntries = (),
                  full_hash: str = "") -> None:
        check_ttl(ttl_s)
        blob = b"".join(as_parts(data))
        expires = self.clock() + ttl_s if ttl_s is not None else None
        with self._lock:
            if self.budget is not None:
                for k in list(self._items):
                    self._live(k)  # expired payloads free their bytes before anything live is dropped
                for k in self.budget.admit(key, len(blob), self.url):
                    self._items.pop(k, None)
            self._items[key] = (blob, expires, full_hash)
            for boundary, e in index:
                self._index.setdefault(boundary, {})[key] = e

    def _live(self, key: str):
        item = self._items.get(key)
        if item is not None and item[1] is not None and self.clock() >= item[1]:
            del self._items[key]
            if self.budget is not None:
                self.budget.release(key)
            return None
        return item

    def get_bytes(self, key: str) -> memoryview:
        with self._lock:
            item = self._live(key)
            if item is not None and self.budget is not None:
                self.budget.touch(key)
        if item is None:
            raise PayloadNotFound(key, self.url)
        return memoryview(item[0])

    def contains(self, key: str) -> bool:
        with self._lock:
            return self._live(key) is not None

    def delete(self, key: str) -> bool:
        with self._lock:
            if self.budget is not None:
                self.budget.release(key)
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
