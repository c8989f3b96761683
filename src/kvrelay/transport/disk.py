"""``DiskStore``: one kvrelay/1 file per key under a folder (``file:///abs/dir`` or a plain path).

Files are written to a temporary name and renamed into place, so readers see the old file or the
new one, never a partial one, and a reader that has mapped a file keeps that version even if a
writer replaces it meanwhile. Safe for many processes sharing a folder on one machine (a local
filesystem). Every payload file is a plain kvrelay/1 file (``kvrelay inspect`` reads it)::

    root/payloads/<fp[:16]>/<hash>.safetensors       the bytes (content keys; others: payloads/_/<sha256(key)>)
    root/payloads/<fp[:16]>/<hash>.json              {key, expires_at, full, version}: written after the bytes
    root/prefix/<b[:2]>/<b>/<sha256(key)[:32]>.json   prefix index entries under boundary hash b

``version`` is the sha256 of the file's header (which holds every tensor digest), so a sidecar's
expiry applies to exactly the bytes it was written with; a reader that finds the two out of step
(a writer between its two renames) reads again. A put writes both files under temporary names
first and renames them into place only when both are whole, so a full or read-only disk fails the
put with ``StoreError`` and leaves what was there before; a put that fails after the renames (its
index entries) removes the payload it made visible. Every filesystem fault is a ``StoreError``
naming the folder. ``fsync=False`` (default) trades durability across
a machine crash for speed; a file torn by a crash is refused by its checksum, never used.

With a ``budget`` (``transport.budget.ByteBudget``: its bytes and policy) the payload files under the
folder hold at most that many bytes. A put takes ``root/budget.lock`` (``flock``, so every process
opening the folder with a budget waits its turn), deletes expired payloads, counts what the folder
holds, deletes what the policy names (oldest: by the time each file was put, its mtime; lru: by the
time it was last read, its atime, both set by the store in nanoseconds) or raises ``OverBudget``, then
writes. Payloads put by an opener without a budget are counted too.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from kvrelay.core.errors import PayloadNotFound, StoreError
from kvrelay.kv.wire import atomic_write, write_temp
from kvrelay.transport.budget import ByteBudget
from kvrelay.transport.bytestore import IndexEntries, Parts, as_parts, check_ttl, header_bytes
from kvrelay.transport.keys import PrefixEntry, Tokens, match, parse_key, query_boundaries
from kvrelay.transport.payloads import PayloadMethods

_RETRIES = 8


def _version(parts) -> str:
    return hashlib.sha256(header_bytes(parts)).hexdigest()[:32]


class DiskStore(PayloadMethods):
    def __init__(self, root: str | os.PathLike, *, fsync: bool = False, clock: Callable[[], float] = time.time,
                 budget: ByteBudget | None = None):
        """``clock``: seconds since the epoch for expiry times (the sidecars store absolute times).
        ``budget``: its ``max_bytes`` and ``policy`` bound the folder (see the module docstring)."""
        self.clock = clock
        self.budget = budget
        self.root = Path(root).expanduser().resolve()
        self.url = f"file://{self.root}"
        self.fsync = fsync
        with self._typed("open"):
            (self.root / "payloads").mkdir(parents=True, exist_ok=True)
            (self.root / "prefix").mkdir(parents=True, exist_ok=True)

    @contextmanager
    def _typed(self, doing: str):
        """Filesystem faults (a path under a file, a read-only or full disk, no permission) as ``StoreError``."""
        try:
            yield
        except (FileNotFoundError, PayloadNotFound):
            raise
        except OSError as e:
            raise StoreError(f"disk store {self.root}: cannot {doing}: {e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)}); "
                             "expected a writable folder on a filesystem with free space") from None

    def check(self, *, write: bool = False) -> None:
        """Raise ``StoreError`` now unless the folder can be read (and, with ``write``, written)."""
        with self._typed("write" if write else "read"):
            os.listdir(self.root / "payloads")
            if write:
                write_temp(self.root / "payloads" / "probe", b"kvrelay", fsync=False).unlink()

    def path(self, key: str) -> Path:
        """The payload file of ``key``."""
        try:
            k = parse_key(key)
            return self.root / "payloads" / k.fingerprint_prefix / f"{k.chain_hash}.safetensors"
        except ValueError:
            return self.root / "payloads" / "_" / f"{hashlib.sha256(key.encode()).hexdigest()}.safetensors"

    def _sidecar(self, key: str) -> Path:
        return self.path(key).with_suffix(".json")

    def _index_dir(self, boundary: str) -> Path:
        return self.root / "prefix" / boundary[:2] / boundary

    # -- bytes ---------------------------------------------------------------------------------
    def put_bytes(self, key: str, data: Parts, ttl_s: float | None = None, *, index: IndexEntries = (),
                  full_hash: str = "") -> None:
        check_ttl(ttl_s)
        parts = as_parts(data)
        side = {"key": key, "expires_at": self.clock() + ttl_s if ttl_s is not None else None, "full": full_hash,
                "version": _version(parts)}
        if self.budget is None:
            self._put(key, parts, side, index)
            return
        with self._budget_lock():
            for k in self._admit(key, sum(memoryview(p).nbytes for p in parts)):
                self.delete(k)
            self._put(key, parts, side, index)
            now = time.time_ns()
            with self._typed(f"stamp {key!r}"):
                os.utime(self.path(key), ns=(now, now))  # put (oldest) and last used (lru): now

    @contextmanager
    def _budget_lock(self):
        """Hold ``root/budget.lock`` exclusively (every budgeted put of every process takes it)."""
        path = self.root / "budget.lock"
        with self._typed(f"lock {path}"):
            lock = open(path, "ab")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except BaseException:
                lock.close()
                raise
        try:
            yield
        finally:
            lock.close()  # releases the lock

    def _admit(self, key: str, nbytes: int) -> list[str]:
        """The keys the budget drops to take ``nbytes`` under ``key`` (expired payloads deleted first);
        ``OverBudget`` when it cannot. Called under the budget lock."""
        self.sweep()
        held = []
        for f in (self.root / "payloads").glob("*/*.json"):
            try:
                k = json.loads(f.read_bytes())["key"]
                st = f.with_suffix(".safetensors").stat()
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a payload being deleted, or a sidecar that is not ours
            if isinstance(k, str):
                held.append((st.st_atime_ns if self.budget.policy == "lru" else st.st_mtime_ns, k, st.st_size))
        held.sort()
        budget = ByteBudget.holding(self.budget.max_bytes, self.budget.policy, [(k, n) for _, k, n in held])
        return budget.admit(key, nbytes, self.url)

    def _put(self, key: str, parts, side: dict, index: IndexEntries) -> None:
        path, sidecar = self.path(key), self._sidecar(key)
        staged: list[Path] = []
        with self._typed(f"write {key!r}"):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                staged.append(write_temp(path, parts, fsync=self.fsync))
                staged.append(write_temp(sidecar, json.dumps(side).encode(), fsync=self.fsync))
            except BaseException:
                for tmp in staged:
                    tmp.unlink(missing_ok=True)
                raise
            os.replace(staged[0], path)  # the bytes, then the sidecar that describes them
            os.replace(staged[1], sidecar)
            try:
                name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".json"
                for boundary, e in index:
                    folder = self._index_dir(boundary)
                    folder.mkdir(parents=True, exist_ok=True)
                    atomic_write(folder / name, e.to_json().encode(), fsync=False)
            except BaseException:
                sidecar.unlink(missing_ok=True)  # a failed put leaves no payload under the key
                path.unlink(missing_ok=True)
                raise

    def _read_sidecar(self, key: str) -> dict | None:
        try:
            d = json.loads(self._sidecar(key).read_bytes())
            return d if isinstance(d, dict) and d.get("key") == key else None
        except (FileNotFoundError, ValueError):
            return None

    def _expired(self, side: dict | None) -> bool:
        return side is not None and side.get("expires_at") is not None and self.clock() >= float(side["expires_at"])

    def get_bytes(self, key: str) -> memoryview:
        """A read-only view of the mapped file (the mapping lives as long as the view)."""
        for _ in range(_RETRIES):
            side = self._read_sidecar(key)
            try:
                with self._typed(f"read {key!r}"), open(self.path(key), "rb") as f:
                    view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            except (FileNotFoundError, ValueError):  # ValueError: an empty file cannot be mapped
                raise PayloadNotFound(key, self.url) from None
            if side is None or side.get("version") == _version([view]):
                break  # the sidecar describes these bytes (or there is none: no expiry)
        if self._expired(side):
            raise PayloadNotFound(key, self.url, "expired")
        if self.budget is not None and self.budget.policy == "lru":
            try:  # last used: now (after the mapping, so the kernel's own atime update comes before ours)
                os.utime(self.path(key), ns=(time.time_ns(), os.stat(self.path(key)).st_mtime_ns))
            except FileNotFoundError:
                pass  # deleted since: the view still holds the bytes
        return view

    def contains(self, key: str) -> bool:
        return self.path(key).is_file() and not self._expired(self._read_sidecar(key))

    def delete(self, key: str) -> bool:
        self._sidecar(key).unlink(missing_ok=True)
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    # -- prefixes ------------------------------------------------------------------------------
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
            side = self._read_sidecar(e.key)
            if side is not None and not self._expired(side) and side.get("full") == e.full_hash \
                    and self.path(e.key).is_file():
                return e.key, n
            files[e].unlink(missing_ok=True)  # stale hint (an entry is rewritten only by a put of the same key)
        return None

    def sweep(self) -> int:
        """Delete expired payload files; returns how many. (Index entries go lazily, on lookup.)"""
        n = 0
        for f in (self.root / "payloads").glob("*/*.json"):
            try:
                side = json.loads(f.read_bytes())
            except (FileNotFoundError, ValueError):
                continue
            if isinstance(side, dict) and self._expired(side):
                f.with_suffix(".safetensors").unlink(missing_ok=True)
                f.unlink(missing_ok=True)
                n += 1
        return n
