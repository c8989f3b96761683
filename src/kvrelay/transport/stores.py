"""Where payloads wait between agents: three byte stores (memory, disk, Redis) and one way to open them.

Stores only move kvrelay/1 bytes and keep time (TTL); they never decide what to relay
(``transport.bytestore`` has the protocol). ``put_payload`` / ``get_payload``
(``transport.payloads``) put a ``KVPayload`` on top, under any codec. Keys are usually content
addresses (``keys.payload_key``: model fingerprint + chained hash of the tokens), and every store
keeps a prefix index so ``longest_prefix`` finds the longest stored payload that a query's tokens
start with, in one probe per 16-token block. The receiver then cuts that payload to the shared
prefix (``prefix_payload`` does it with ``select_tokens``) and prefills only the rest.

A store is named by a URL, so another process (or machine) can open the same one::

    memory://[NAME]          this process only (one store per NAME)
    file:///ABS/DIR          a folder (a plain directory path works too); shared by processes on a machine
    redis://HOST:PORT/DB     a Redis server (``?namespace=NS`` keeps several stores apart on one server);
                             redis://USER:PASSWORD@HOST:PORT/DB for an ACL user, rediss://... for TLS

Each takes ``?max_bytes=N&evict=refuse|oldest|lru``: a byte budget on what it holds (``transport.budget``;
a disk or Redis store's budget binds every process that opens it with one).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from urllib.parse import urlsplit

from kvrelay.core.errors import PayloadNotFound, UnknownStore
from kvrelay.kv.payload import KVPayload
from kvrelay.kv.transforms import select_tokens
from kvrelay.transport.budget import POLICIES, ByteBudget, from_query
from kvrelay.transport.bytestore import ByteStore
from kvrelay.transport.disk import DiskStore
from kvrelay.transport.keys import Tokens
from kvrelay.transport.memory import MemoryStore
from kvrelay.transport.payloads import get_compressed, get_payload, get_payload_sized, put_payload
from kvrelay.transport.redis_store import RedisStore

PayloadStore = ByteStore  # every store takes payloads too, through put_payload / get_payload
STORE_URLS = ("memory://[NAME]", "file:///ABS/DIR", "DIR", "redis[s]://[USER:PASSWORD@]HOST:PORT/DB[?namespace=NS]")

_memory: dict[str, MemoryStore] = {}
_memory_lock = threading.Lock()


def open_store(url: str | os.PathLike) -> MemoryStore | DiskStore | RedisStore:
    """The store a URL names (see the module docstring); ``UnknownStore`` saying what is accepted otherwise."""
    s = str(url).strip()
    if "://" not in s:
        if not s:
            raise UnknownStore(f"empty store URL; expected one of {', '.join(STORE_URLS)}")
        return DiskStore(Path(s))
    parts = urlsplit(s)
    if parts.scheme == "memory":
        name = parts.netloc + parts.path
        budget = _memory_budget(s, parts.query)
        with _memory_lock:
            if name not in _memory:
                _memory[name] = MemoryStore(name, budget=budget)
            elif budget is not None and _memory[name].budget != budget:
                raise UnknownStore(f"{s!r}: memory store {name!r} is open already with another byte budget")
            return _memory[name]
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise UnknownStore(f"{s!r}: a file store URL names an absolute folder, file:///ABS/DIR")
        return DiskStore(Path(parts.path), budget=_budget_only(s, parts.query, "a file store"))
    if parts.scheme in ("redis", "rediss", "unix"):
        return RedisStore(s)
    raise UnknownStore(f"unknown store URL {s!r}; expected one of {', '.join(STORE_URLS)}")


def _memory_budget(url: str, query: str) -> ByteBudget | None:
    """``?max_bytes=N[&evict=refuse|oldest|lru]`` of a memory store URL (no query: no budget)."""
    return _budget_only(url, query, "a memory store")


def _budget_only(url: str, query: str, what: str) -> ByteBudget | None:
    """The byte budget of a URL whose query may hold nothing else."""
    from urllib.parse import parse_qs

    q = parse_qs(query, keep_blank_values=True)
    if set(q) - {"max_bytes", "evict"}:
        raise UnknownStore(f"{url!r}: {what} takes ?max_bytes=N[&evict={'|'.join(POLICIES)}], not {sorted(q)}")
    return from_query(url, q)


def prefix_payload(store: ByteStore, fingerprint: str, token_ids: Tokens) -> KVPayload | None:
    """The longest stored prefix of ``token_ids``, cut to exactly the shared tokens; None if none.

    The caller prefills ``token_ids[result.num_tokens:]`` on top of it. When the whole query is
    stored there is nothing left to prefill; callers that need logits cut one token less.
    """
    hit = store.longest_prefix(fingerprint, token_ids)
    if hit is None:
        return None
    key, n = hit
    try:
        p = get_payload(store, key)
    except PayloadNotFound:  # expired or deleted since the lookup
        return None
    return p if n == p.num_tokens else select_tokens(p, range(n))


__all__ = ["ByteStore", "DiskStore", "MemoryStore", "PayloadStore", "RedisStore", "get_compressed", "get_payload",
           "get_payload_sized", "open_store", "prefix_payload", "put_payload"]
