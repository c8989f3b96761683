"""Payload stores (memory, disk, a real Redis), content keys and prefix reuse."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import threading
import time

import pytest
import torch

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.models.identity import RopeSpec
from kvrelay.transport.keys import BLOCK_TOKENS, block_hashes, key_for, parse_key, payload_key
from kvrelay.transport.stores import (
    DiskStore,
    MemoryStore,
    PayloadStore,
    RedisStore,
    prefix_payload,
    put_payload,
)
from tests.conftest import missing_service, random_ids

FP = "f0" * 32  # fingerprint of the made-up model of the synthetic payloads


def fake_payload(seed: int, T: int = 20, layers: int = 2, heads: int = 2, dim: int = 8) -> KVPayload:
    """A deterministic payload from a seed, without any model (cheap in worker processes)."""
    g = torch.Generator().manual_seed(seed)
    meta = PayloadMeta(model_fingerprint=FP, tokenizer_hash="tok", arch="llama", num_model_layers=layers,
                       layer_indices=tuple(range(layers)), layer_types=("full_attention",) * layers,
                       sliding_window=None, rope=(RopeSpec("full_attention", tuple(0.5 ** i for i in range(dim // 2))),),
                       producer=f"seed-{seed}", created_at=float(seed))
    kv = [torch.randn(1, heads, T, dim, generator=g) for _ in range(2 * layers)]  # (1, H, T, D)
    ids = torch.randint(9, 30000, (1, T), generator=g)
    return KVPayload(tuple(kv[:layers]), tuple(kv[layers:]), ids, torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool),
                     meta)


def same(a: KVPayload, b: KVPayload) -> bool:
    return a.meta == b.meta and all(
        torch.equal(x, y) for x, y in zip((*a.keys, *a.values, a.token_ids, a.positions, a.mask),
                                          (*b.keys, *b.values, b.token_ids, b.positions, b.mask), strict=True))


def seed_of(p: KVPayload) -> int:
    return int(p.meta.producer.removeprefix("seed-"))


@pytest.fixture(params=["memory", "disk", "redis"])
def store(request, tmp_path):
    if request.param == "memory":
        return MemoryStore()
    if request.param == "disk":
        return DiskStore(tmp_path / "store")
    return request.getfixturevalue("redis_store")


# -- keys ----------------------------------------------------------------------------------------
def test_content_keys():
    ids = random_ids(40, 1)
    key = key_for(FP, ids)
    k = parse_key(key)
    assert str(k) == key and key.startswith(f"kvrelay/1:{FP[:16]}:") and len(k.chain_hash) == 64
    assert key_for(FP, ids) == key and key_for("ab" * 32, ids) != key and key_for(FP, ids[:-1]) != key
    # a prefix's block chain is a prefix of the longer sequence's chain
    assert block_hashes(FP, ids)[:2] == block_hashes(FP, ids[:BLOCK_TOKENS + 3])
    assert key_for(FP, ids[:32]) == "kvrelay/1:" + FP[:16] + ":" + block_hashes(FP, ids)[2]
    p = fake_payload(3)
    assert payload_key(p) == key_for(FP, p.token_ids[0].tolist())
    for bad in ("kvrelay/1:abc:def", "kvrelay/2:" + "0" * 16 + ":" + "0" * 64, "x"):
        with pytest.raises(ValueError, match="not a payload key"):
            parse_key(bad)


# -- the protocol, on every store ----------------------------------------------------------------
def test_put_get_contains_delete(store):
    assert isinstance(store, PayloadStore)
    p, q = fake_payload(1), fake_payload(2, T=37)
    key = put_payload(store, p)
    assert store.contains(key) and same(store.get(key), p)
    store.put("my/own key", q)  # keys need not be content addresses
    assert same(store.get("my/own key"), q)
    r = dataclasses.replace(fake_payload(3), token_ids=p.token_ids)  # p's tokens, other K/V: the same content key
    store.put(key, r)  # replace (bytes of another payload under a content key are refused: test_store_faults.py)
    assert same(store.get(key), r)
    assert store.delete(key) and not store.contains(key) and not store.delete(key)
    with pytest.raises(KeyError):
        store.get(key)
    with pytest.raises(ValueError, match="ttl_s"):
        store.put(key, p, ttl_s=0)


class Clock:
    """A clock the test moves by hand: expiry is decided by it, never by sleeping."""

    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def wait_until(cond, timeout_s: float = 30.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout_s`` passes (a bounded wait for server-side expiry)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_ttl_expiry_follows_the_clock(kind, tmp_path):
    clock = Clock()
    store = MemoryStore(clock=clock) if kind == "memory" else DiskStore(tmp_path / "s", clock=clock)
    keep = put_payload(store, fake_payload(5))
    key = put_payload(store, fake_payload(4), ttl_s=10.0)
    clock.t += 9.999
    assert store.contains(key) and same(store.get(key), fake_payload(4))
    clock.t += 0.001  # expiry is inclusive: at exactly ttl_s it is gone
    assert not store.contains(key) and store.contains(keep)
    with pytest.raises(KeyError):
        store.get(key)
    assert store.longest_prefix(FP, fake_payload(4).token_ids[0]) is None
    assert store.longest_prefix(FP, fake_payload(5).token_ids[0]) is not None


@pytest.mark.redis
def test_redis_ttl_expiry(redis_store):
    keep = put_payload(redis_store, fake_payload(5))
    key = put_payload(redis_store, fake_payload(4), ttl_s=0.05)
    assert 0 < redis_store.client.pttl(f"{redis_store.namespace}:m:{key}") <= 50
    assert wait_until(lambda: not redis_store.contains(key)), "Redis never expired a 50 ms payload"
    assert redis_store.contains(keep)
    with pytest.raises(KeyError):
        redis_store.get(key)
    assert redis_store.longest_prefix(FP, fake_payload(4).token_ids[0]) is None


@pytest.mark.redis
def test_redis_prefix_index_ttl_never_shortens(redis_store):
    """Every payload shares the index hash of the empty prefix; a short-lived put must not expire it."""
    r, ns = redis_store.client, redis_store.namespace

    def index_ttls() -> list[int]:
        return [r.pttl(k) for k in r.scan_iter(match=f"{ns}:p:*", count=1000)]

    forever = fake_payload(6, T=50)
    k_forever = put_payload(redis_store, forever)
    assert index_ttls() and all(t == -1 for t in index_ttls())
    short = put_payload(redis_store, fake_payload(7, T=40), ttl_s=0.05)
    shared = f"{ns}:p:{block_hashes(FP, [])[0]}"
    assert r.pttl(shared) == -1  # the long-lived payload's index stays forever
    assert wait_until(lambda: not redis_store.contains(short))
    assert redis_store.longest_prefix(FP, forever.token_ids[0].tolist() + [1]) == (k_forever, 50)

    redis_store.clear()
    k_long = put_payload(redis_store, forever, ttl_s=1000)
    put_payload(redis_store, fake_payload(8, T=40), ttl_s=5)
    assert 900_000 < r.pttl(shared) <= 1_000_000  # kept at the longest entry's TTL, not the newest
    put_payload(redis_store, fake_payload(9, T=40), ttl_s=2000)
    assert 1_900_000 < r.pttl(shared) <= 2_000_000  # a longer one lengthens it
    put_payload(redis_store, fake_payload(10, T=40))
    assert r.pttl(shared) == -1  # one without TTL makes it permanent
    assert redis_store.longest_prefix(FP, forever.token_ids[0]) == (k_long, 50)


def test_longest_prefix_lookup(store):
    long, short = fake_payload(6, T=50), fake_payload(7, T=12)
    k_long, k_short = put_payload(store, long), put_payload(store, short)
    ids = long.token_ids[0].tolist()
    assert store.longest_prefix(FP, ids + [5, 6, 7]) == (k_long, 50)
    assert store.longest_prefix(FP, ids[:37] + [1, 2]) == (k_long, 37)  # full-attention payloads cut anywhere
    assert store.longest_prefix(FP, ids[:37]) == (k_long, 37)
    assert store.longest_prefix(FP, short.token_ids[0].tolist() + ids) == (k_short, 12)
    assert store.longest_prefix(FP, [1, 2, 3] + ids) is None
    assert store.longest_prefix("ab" * 32, ids) is None  # another model's tokens never match
    cut = prefix_payload(store, FP, ids[:37] + [1, 2])
    assert cut.num_tokens == 37 and torch.equal(cut.keys[1], long.keys[1][:, :, :37])
    store.delete(k_long)  # stale index entries are skipped (and forgotten)
    assert store.longest_prefix(FP, ids + [5]) is None
    store.put(k_short, long)  # a key reused for other tokens invalidates its old entries
    assert store.longest_prefix(FP, short.token_ids[0].tolist()) is None
    assert store.longest_prefix(FP, ids) == (k_short, 50)


def test_receiver_reuses_stored_prefix_and_prefills_the_rest(tiny, tmp_path, redis_store):
    """Logits from (stored prefix cache + prefill of the remainder) equal those of a full prefill."""
    from transformers import DynamicCache

    from kvrelay.agents.agent import Agent
    from kvrelay.kv.cache import to_cache
    from kvrelay.models.generate import forward_all

    sender = Agent(tiny, "sender")
    ctx, new = random_ids(40, 11), random_ids(9, 12)
    query = ctx[:35] + new
    full = forward_all(tiny.model, torch.tensor([query]), torch.arange(len(query))[None],
                       DynamicCache(config=tiny.model.config), None)[0]  # (q, V)
    fp = tiny.identity.fingerprint
    sliding = "sliding_attention" in tiny.identity.layer_types
    for store in (MemoryStore(), DiskStore(tmp_path / tiny.name), redis_store):
        put_payload(store, sender.prefill(ctx[:20]))
        put_payload(store, sender.prefill(ctx))
        reused = prefix_payload(store, fp, query)
        # gemma3's sliding layers hold only their last tokens: the 40-token cache cannot be cut to 35
        assert reused.num_tokens == (20 if sliding else 35)
        n = reused.num_tokens
        cache = to_cache(reused, tiny.model.config)
        rest = forward_all(tiny.model, torch.tensor([query[n:]]), torch.arange(n, len(query))[None], cache, None)[0]
        assert (rest - full[n:]).abs().max().item() <= 1e-4
        assert prefix_payload(store, fp, ctx + new).num_tokens == 40


# -- Redis specifics -----------------------------------------------------------------------------
@pytest.mark.redis
def test_redis_large_payload_is_chunked(redis_store):
    big = fake_payload(8, T=2304, layers=1, heads=8, dim=128)  # K and V of 9 MiB each, over the 8 MiB chunk
    assert big.nbytes > 16 << 20
    key = put_payload(redis_store, big, ttl_s=60)
    r, ns = redis_store.client, redis_store.namespace
    chunks = list(r.scan_iter(match=f"{ns}:c:*", count=1000))
    assert len(chunks) == json.loads(r.get(f"{ns}:m:{key}"))["chunks"] >= 5
    assert max(r.strlen(k) for k in chunks) == 8 << 20
    assert all(0 < r.pttl(k) <= 60_000 for k in [*chunks, f"{ns}:m:{key}".encode()])  # TTL on every piece
    assert same(redis_store.get(key), big)
    put_payload(redis_store, big)  # replacing frees the old version's chunks
    assert len(list(r.scan_iter(match=f"{ns}:c:*", count=1000))) == len(chunks)
    assert all(r.pttl(k) == -1 for k in r.scan_iter(match=f"{ns}:c:*", count=1000))


@pytest.mark.redis
def test_redis_corrupt_chunk_is_refused(redis_store):
    store = RedisStore(redis_store.url, namespace=redis_store.namespace, chunk_bytes=1024)
    key = put_payload(store, fake_payload(9))
    chunk = max(store.client.scan_iter(match=f"{store.namespace}:c:*"), key=lambda k: int(k.rsplit(b":", 1)[1]))
    data = bytearray(store.client.get(chunk))
    data[len(data) // 2] ^= 0xFF
    store.client.set(chunk, bytes(data))
    with pytest.raises(CorruptPayload, match="sha256 mismatch"):
        store.get(key)
    store.client.set(chunk, b"short")
    with pytest.raises(CorruptPayload):
        store.get(key)


N_PROCS, N_PAYLOADS = 8, 50
HOT_KEY = "hot"  # every worker keeps replacing this one key


def _redis_worker(url: str, namespace: str, w: int) -> tuple[int, list[str]]:
    """Write this worker's payloads, replace the hot key, read other workers' payloads back."""
    store = RedisStore(url, namespace=namespace, chunk_bytes=1024)  # ~5 KB payloads: several chunks each
    seed = lambda worker, i: 1000 * (worker + 1) + i  # noqa: E731
    checked, errors = 0, []

    def check(key: str, want_seed: int | None) -> None:
        nonlocal checked
        p = store.get(key)
        want = fake_payload(want_seed if want_seed is not None else seed_of(p))
        if not same(p, want):
            errors.append(f"worker {w}: {key} holds a payload that is not seed {seed_of(want)}'s")
        if want_seed is not None and payload_key(p) != key:
            errors.append(f"worker {w}: {key} holds tokens of another key")
        checked += 1

    for i in range(N_PAYLOADS):
        put_payload(store, fake_payload(seed(w, i)))
        store.put(HOT_KEY, fake_payload(seed(w, i)))
        check(HOT_KEY, None)  # whichever worker wrote it last: it must be whole and self-consistent
        other = (w + 1 + i) % N_PROCS
        key = payload_key(fake_payload(seed(other, i)))
        if store.contains(key):
            check(key, seed(other, i))
    nxt = (w + 1) % N_PROCS
    for i in range(N_PAYLOADS):  # every payload of the next worker, once it is there
        key = payload_key(fake_payload(seed(nxt, i)))
        deadline = time.monotonic() + 60
        while not store.contains(key) and time.monotonic() < deadline:
            time.sleep(0.01)
        check(key, seed(nxt, i))
    store.close()
    return checked, errors


@pytest.fixture(scope="module")
def pool():
    with mp.get_context("spawn").Pool(N_PROCS) as p:
        yield p


@pytest.mark.redis
def test_redis_concurrent_writers_and_readers(redis_store, pool):
    jobs = [(redis_store.url, redis_store.namespace, w) for w in range(N_PROCS)]
    results = pool.starmap_async(_redis_worker, jobs).get(timeout=150)
    errors = [e for _, errs in results for e in errs]
    assert not errors, errors[:5]
    assert all(checked >= 2 * N_PAYLOADS for checked, _ in results)
    for w in range(N_PROCS):
        for i in (0, N_PAYLOADS - 1):
            p = fake_payload(1000 * (w + 1) + i)
            assert same(redis_store.get(payload_key(p)), p)


# -- disk specifics ------------------------------------------------------------------------------
def _disk_writer(root: str, writer: int, rounds: int) -> int:
    store = DiskStore(root)
    for r in range(rounds):
        store.put(HOT_KEY, fake_payload(100 * writer + r, T=20 + (7 * r) % 60))
    return rounds


def _disk_reader(root: str, rounds: int) -> list[str]:
    store = DiskStore(root)
    errors = []
    for _ in range(rounds):
        p = store.get(HOT_KEY)
        want = fake_payload(seed_of(p), T=p.num_tokens)
        if not same(p, want):
            errors.append(f"read a payload that is not seed {seed_of(p)}'s")
    return errors


def test_disk_readers_always_see_complete_payloads(tmp_path, pool):
    root = str(tmp_path / "store")
    DiskStore(root).put(HOT_KEY, fake_payload(0, T=20))
    writes = [pool.apply_async(_disk_writer, (root, w, 40)) for w in range(3)]
    reads = [pool.apply_async(_disk_reader, (root, 60)) for _ in range(5)]
    assert sum(w.get(timeout=120) for w in writes) == 120
    errors = [e for r in reads for e in r.get(timeout=120)]
    assert not errors, errors[:5]
    leftovers = [f for f in os.listdir(DiskStore(root).path(HOT_KEY).parent) if f.endswith(".tmp")]
    assert not leftovers  # every temporary file was renamed into place


def test_disk_store_threads_and_sweep(tmp_path):
    clock = Clock()
    store = DiskStore(tmp_path / "s", clock=clock)
    keys = [put_payload(store, fake_payload(s), ttl_s=0.2 if s % 2 else None) for s in range(6)]
    errors: list[str] = []

    def read(key, seed):
        for _ in range(20):
            if not same(store.get(key), fake_payload(seed)):
                errors.append(key)

    threads = [threading.Thread(target=read, args=(keys[s], s)) for s in (0, 2, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.sweep() == 0  # nothing has expired yet
    clock.t += 0.2
    assert store.sweep() == 3 and [store.contains(k) for k in keys] == [True, False] * 3
    assert sorted(p.name for p in (tmp_path / "s" / "payloads").rglob("*.safetensors")) == sorted(
        store.path(k).name for k in keys[::2])  # the sweep removed the expired files themselves


def test_disk_store_refuses_a_damaged_file(tmp_path):
    store = DiskStore(tmp_path / "s")
    key = put_payload(store, fake_payload(1))
    path = store.path(key)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPayload):
        store.get(key)


# -- private redis-server ------------------------------------------------------------------------
def test_private_redis_server_starts_and_stops(monkeypatch):
    import redis

    from kvrelay.transport.redis_server import RedisServer, RedisServerError, redis_url_or_private

    if shutil.which("redis-server") is None:
        missing_service("redis-server", "not on PATH (apt-get install redis-server)")
    with redis_url_or_private(None) as url:
        client = redis.Redis.from_url(url)
        assert client.ping() and client.config_get("save")["save"] == ""
        client.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
    with redis_url_or_private("redis://example:1/0") as given:
        assert given == "redis://example:1/0"
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RedisServerError, match="apt-get install redis-server"):
        RedisServer()
