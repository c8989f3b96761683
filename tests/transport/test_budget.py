"""Byte budgets on a store: refuse, or make room by dropping the oldest / least recently used payloads;
released payloads free their memory (RSS measured)."""

from __future__ import annotations

import gc

import pytest

from kvrelay.core.errors import OverBudget, PayloadNotFound, UnknownStore
from kvrelay.transport.budget import ByteBudget
from kvrelay.transport.memory import MemoryStore
from kvrelay.transport.stores import open_store

MB = 1 << 20


def store(policy: str, limit: int = 300) -> MemoryStore:
    return MemoryStore("budget", budget=ByteBudget(limit, policy))


def test_refuse_keeps_what_it_holds():
    s = store("refuse")
    for k in "abc":
        s.put_bytes(k, b"x" * 100)
    with pytest.raises(OverBudget, match="300") as e:
        s.put_bytes("d", b"x" * 100)
    assert (e.value.nbytes, e.value.held, e.value.limit) == (100, 300, 300)
    assert len(s) == 3 and not s.contains("d")
    s.put_bytes("a", b"y" * 100)  # replacing a key reuses its bytes
    s.delete("b")
    s.put_bytes("d", b"x" * 100)
    assert s.budget.used == 300


def test_oldest_drops_the_first_put_even_when_it_was_just_read():
    s = store("oldest")
    for k in "abc":
        s.put_bytes(k, b"x" * 100)
    s.get_bytes("a")
    s.put_bytes("d", b"x" * 150)  # needs 150: a and b go
    assert [k for k in "abcd" if s.contains(k)] == ["c", "d"]
    with pytest.raises(PayloadNotFound):
        s.get_bytes("a")


def test_lru_drops_the_least_recently_read():
    s = store("lru")
    for k in "abc":
        s.put_bytes(k, b"x" * 100)
    s.get_bytes("a")  # a is now the most recent
    s.put_bytes("d", b"x" * 100)
    assert [k for k in "abcd" if s.contains(k)] == ["a", "c", "d"]


@pytest.mark.parametrize("policy", ["refuse", "oldest", "lru"])
def test_a_payload_larger_than_the_budget_is_refused_under_every_policy(policy):
    s = store(policy)
    s.put_bytes("a", b"x" * 100)
    with pytest.raises(OverBudget):
        s.put_bytes("big", b"x" * 301)
    assert s.contains("a")


def test_expired_payloads_free_their_bytes_first():
    now = [0.0]
    s = MemoryStore("t", clock=lambda: now[0], budget=ByteBudget(200, "refuse"))
    s.put_bytes("a", b"x" * 100, ttl_s=1.0)
    s.put_bytes("b", b"x" * 100)
    now[0] = 2.0
    s.put_bytes("c", b"x" * 100)  # a expired: room without refusing
    assert not s.contains("a") and s.contains("c")


def test_memory_urls_take_a_budget_and_refuse_nonsense():
    s = open_store("memory://budgeted-url?max_bytes=1000&evict=lru")
    assert s.budget == ByteBudget(1000, "lru")
    assert open_store("memory://budgeted-url") is s
    for url in ("memory://x1?max_bytes=0", "memory://x2?evict=lru", "memory://x3?max_bytes=10&evict=random",
                "memory://x4?max_bytes=ten", "memory://x5?size=1"):
        with pytest.raises(UnknownStore):
            open_store(url)
    with pytest.raises(UnknownStore, match="another byte budget"):
        open_store("memory://budgeted-url?max_bytes=5")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_released_payloads_free_their_memory():
    s = store("oldest", 200 * MB)
    gc.collect()
    before = _rss()
    for i in range(3):
        s.put_bytes(f"p{i}", bytes(48 * MB))
    held = _rss()
    assert held - before > 120 * MB
    s.put_bytes("p3", bytes(48 * MB))
    s.put_bytes("p4", bytes(48 * MB))  # 240 MB put into 200: the oldest went
    assert not s.contains("p0") and _rss() - before < 200 * MB
    for i in range(5):
        s.delete(f"p{i}")
    gc.collect()
    assert _rss() - before < 16 * MB and s.budget.used == 0
