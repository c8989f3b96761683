"""Byte budgets: how much a store may hold, and what it drops (by a named policy) to take a new payload.

``ByteBudget`` is the mechanism: it counts the bytes held under each key in the order the policy
needs and says, for a new put, which keys must go first (or refuses). The policy is a name:

    refuse   a put that would exceed the budget raises OverBudget; nothing held is dropped
    oldest   drop the payloads put longest ago until the new one fits
    lru      drop the payloads read (or put) longest ago until the new one fits

A payload larger than the whole budget is refused under every policy. The store deletes what the
budget names, so released payloads free their memory (``MemoryStore`` holds one ``bytes`` per key).

Every store takes one in its URL, ``?max_bytes=N[&evict=refuse|oldest|lru]`` (``from_query``). A
memory store keeps its ``ByteBudget``; a disk or Redis store, shared by processes, rebuilds one for each
put from what the store holds (``ByteBudget.holding``), so the rule stays here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvrelay.core.errors import OverBudget, UnknownStore

POLICIES = ("refuse", "oldest", "lru")


@dataclass
class ByteBudget:
    max_bytes: int
    policy: str = "refuse"
    _sizes: OrderedDict = field(default_factory=OrderedDict, repr=False)  # key -> bytes, eviction order first

    def __post_init__(self):
        if type(self.max_bytes) is not int or self.max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1, got {self.max_bytes!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"budget policy must be one of {POLICIES}, got {self.policy!r}")

    @classmethod
    def holding(cls, max_bytes: int, policy: str, held) -> ByteBudget:
        """A budget already holding ``held`` ((key, nbytes) pairs, the first to go first under ``policy``),
        even beyond ``max_bytes`` (another opener may have had a larger budget): the next ``admit`` drops
        what it must."""
        b = cls(max_bytes, policy)
        for key, nbytes in held:
            b._sizes[key] = nbytes
        return b

    @property
    def used(self) -> int:
        return sum(self._sizes.values())

    def admit(self, key: str, nbytes: int, where: str = "") -> list[str]:
        """Record ``nbytes`` under ``key`` (replacing what it held); returns the keys to delete first.
        ``OverBudget`` (nothing changed) when it cannot fit under the policy."""
        held = self.used - self._sizes.get(key, 0)
        if nbytes > self.max_bytes or (self.policy == "refuse" and held + nbytes > self.max_bytes):
            raise OverBudget(where, nbytes, held, self.max_bytes, self.policy)
        drop = []
        for k in self._sizes:
            if held + nbytes <= self.max_bytes:
                break
            if k != key:
                drop.append(k)
                held -= self._sizes[k]
        for k in drop:
            del self._sizes[k]
        self._sizes.pop(key, None)
        self._sizes[key] = nbytes
        return drop

    def touch(self, key: str) -> None:
        """A read: under ``lru`` the key becomes the most recently used."""
        if self.policy == "lru" and key in self._sizes:
            self._sizes.move_to_end(key)

    def release(self, key: str) -> None:
        self._sizes.pop(key, None)


PARAMS = ("max_bytes", "evict")


def from_query(url: str, query: dict[str, list[str]]) -> ByteBudget | None:
    """The budget in a store URL's parsed query (``urllib.parse.parse_qs``), which loses ``max_bytes`` and
    ``evict``; None without ``max_bytes``. ``UnknownStore`` naming the URL for a bad count or policy."""
    if "evict" in query and "max_bytes" not in query:
        raise UnknownStore(f"{url!r}: evict= needs max_bytes=N (a byte budget)")
    if "max_bytes" not in query:
        return None
    raw, policy = query.pop("max_bytes")[-1], query.pop("evict", ["refuse"])[-1]
    try:
        return ByteBudget(int(raw) if raw.isdigit() else raw, policy)
    except ValueError as e:
        raise UnknownStore(f"{url!r}: {e}; expected ?max_bytes=N[&evict={'|'.join(POLICIES)}]") from None
