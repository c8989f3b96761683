"""The payload layer on the byte stores: every codec is storable, typed misses, store URLs."""

from __future__ import annotations

import pickle

import pytest
import torch

from kvrelay.core.errors import IncompatiblePayload, KVRelayError, PayloadNotFound, UnknownStore
from kvrelay.kv import codecs, wire
from kvrelay.transport.stores import (
    DiskStore,
    MemoryStore,
    RedisStore,
    get_compressed,
    get_payload,
    open_store,
    put_payload,
)
from tests.transport.test_stores import FP, fake_payload, same

CODECS = ("raw", "fp16", "bf16", "int8", "int4", "evict:0.5", "layers:0+int8-g16")


@pytest.fixture(params=["memory", "disk", "redis"])
def store(request, tmp_path):
    if request.param == "memory":
        return MemoryStore()
    if request.param == "disk":
        return DiskStore(tmp_path / "store")
    return request.getfixturevalue("redis_store")


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_round_trips_through_every_store(store, codec):
    p = fake_payload(3, T=40)
    key = put_payload(store, p, codec)
    want = codecs.apply(p, codec)  # what a receiver gets after this codec, without any store
    got = get_payload(store, key)
    assert same(got, want)
    assert get_compressed(store, key).name == codecs.parse(codec).name
    # the bytes a store holds are exactly one kvrelay/1 file of the codec's output
    assert wire.read_meta(store.get_bytes(key))["codec"] == codecs.parse(codec).name
    if codec != "raw":
        assert key.endswith("+" + codecs.parse(codec).name)
        assert store.longest_prefix(FP, p.token_ids[0]) is None  # lossy payloads are never reused as prefixes


def test_int_codecs_store_fewer_bytes(store):
    p = fake_payload(4, T=64, dim=32)
    sizes = {c: store.get_bytes(put_payload(store, p, c)).nbytes for c in ("raw", "fp16", "int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < sizes["fp16"] < sizes["raw"]


def test_missing_key_is_a_typed_error_naming_key_and_store(store):
    with pytest.raises(PayloadNotFound) as err:
        get_payload(store, "nope")
    e = err.value
    assert isinstance(e, KeyError) and isinstance(e, KVRelayError)
    assert e.key == "nope" and e.store == store.url
    assert "'nope'" in str(e) and store.url in str(e)
    back = pickle.loads(pickle.dumps(e))  # it crosses process pools and worker pipes
    assert (type(back), back.key, back.store, str(back)) == (PayloadNotFound, e.key, e.store, str(e))


def test_receiver_identity_is_checked(tiny_by_arch):
    from kvrelay.agents.agent import Agent

    store = MemoryStore()
    p = Agent(tiny_by_arch["llama"], "s").prefill(list(range(9, 30)))
    for codec in ("raw", "int8"):
        key = put_payload(store, p, codec)
        assert get_payload(store, key, expect=tiny_by_arch["llama"].identity).num_tokens == 21
        with pytest.raises(IncompatiblePayload, match="model_fingerprint"):
            get_payload(store, key, expect=tiny_by_arch["qwen2"].identity)


def test_open_store_urls(tmp_path, redis_url):
    m = open_store("memory://shared-a")
    assert open_store("memory://shared-a") is m and open_store("memory://other") is not m
    key = put_payload(m, fake_payload(1))
    assert same(get_payload(open_store(m.url), key), fake_payload(1))
    d = open_store(f"file://{tmp_path}/d")
    assert isinstance(d, DiskStore) and d.root == tmp_path / "d"
    key = put_payload(d, fake_payload(2), "int8")
    for url in (d.url, str(tmp_path / "d")):  # the same folder, by URL or by path
        assert same(get_payload(open_store(url), key), get_payload(d, key))
    r = open_store(redis_url.rstrip("/") + "?namespace=kvrelay-test-open")
    assert isinstance(r, RedisStore) and r.namespace == "kvrelay-test-open"
    try:
        key = put_payload(r, fake_payload(3))
        again = open_store(r.url)
        assert again.namespace == r.namespace and same(get_payload(again, key), fake_payload(3))
        again.close()
    finally:
        r.clear()
        r.close()
    for bad in ("ftp://x", "file://relative/dir", "", "s3://bucket"):
        with pytest.raises(UnknownStore, match="expected|absolute"):
            open_store(bad)


def test_compressed_key_and_batches(store):
    p = fake_payload(5)
    c = codecs.compress(p, "int8")
    key = put_payload(store, c)  # an already compressed payload is stored as it is
    assert key == put_payload(store, p, "int8")
    batch = fake_payload(6)
    two = type(batch)(tuple(torch.cat([k, k]) for k in batch.keys), tuple(torch.cat([v, v]) for v in batch.values),
                      torch.cat([batch.token_ids] * 2), torch.cat([batch.positions] * 2), torch.cat([batch.mask] * 2),
                      batch.meta)
    with pytest.raises(ValueError, match="key"):
        put_payload(store, two, "int8")
    put_payload(store, two, "int8", key="my batch")
    assert get_payload(store, "my batch").batch_size == 2


def test_a_put_hashes_each_block_of_its_tokens_once(monkeypatch):
    """The key, the prefix entries and the whole hash of a raw put come from one pass over the chain: as many
    sha256 as the chain has links (seed, 2 full blocks, the partial one for 40 tokens), the same key and entries."""
    import hashlib

    from kvrelay.transport import keys

    p, store = fake_payload(3, T=40), MemoryStore()
    want_key = keys.key_for(FP, p.token_ids[0])
    want_entries = keys.prefix_entries(want_key, p)
    calls = []

    class Counting:  # hashlib as keys.py sees it, counting its sha256 calls
        def sha256(self, data=b""):
            calls.append(len(data))
            return hashlib.sha256(data)

    monkeypatch.setattr(keys, "hashlib", Counting())
    assert put_payload(store, p) == want_key and len(calls) == 4
    monkeypatch.undo()
    assert same(get_payload(store, want_key), p)
    assert [(b, e) for b, e in want_entries] == keys.prefix_entries(want_key, p, hashes=keys.payload_chain(p))
    assert store.longest_prefix(FP, p.token_ids[0, :35]) == (want_key, 35)
