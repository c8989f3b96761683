"""Stores under hostile or broken conditions: a manifest that lies, bytes under another payload's key, no
server, a bad database, a full or read-only disk, a path under a file. Each is a typed error (``StoreError``,
``CorruptPayload``, ``UnknownStore``), bounded in cost, and a failed put leaves no payload behind.

The full and read-only disks are real: a small tmpfs mounted in a private mount namespace (``unshare -rm``);
those tests skip where user namespaces are not available.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvrelay.core.errors import CorruptPayload, StoreError, UnknownStore
from kvrelay.transport.keys import payload_key
from kvrelay.transport.redis_store import MAX_MANIFEST_CHUNKS
from kvrelay.transport.stores import DiskStore, MemoryStore, RedisStore, get_payload, open_store, put_payload
from tests.transport.test_stores import fake_payload

ROOT = Path(__file__).resolve().parents[2]


# -- a manifest that lies -------------------------------------------------------------------------------
@pytest.mark.redis
@pytest.mark.parametrize("manifest, match", [
    ({"version": "ab", "chunks": 3_000_000, "size": 3_000_000, "full": ""}, "chunks \\(1..65536\\)"),
    ({"version": "ab", "chunks": 2, "size": 1 << 50, "full": ""}, "size \\(<= "),
    ({"version": "ab", "chunks": 0, "size": 0, "full": ""}, "not a kvrelay manifest"),
    ({"version": "ab", "chunks": 5, "size": 2, "full": ""}, "not a kvrelay manifest"),  # more chunks than bytes
    ({"version": "ab", "chunks": "3", "size": 10, "full": ""}, "not a kvrelay manifest"),
    ({"version": "ab", "chunks": True, "size": 10, "full": ""}, "not a kvrelay manifest"),
    ({"version": "a:b", "chunks": 1, "size": 10, "full": ""}, "not a kvrelay manifest"),
    ({"version": ["x"], "chunks": 1, "size": 10, "full": ""}, "not a kvrelay manifest"),
    ([1, 2], "not a kvrelay manifest"),
    ("[" * 100_000, "not a kvrelay manifest"),
])
def test_a_lying_manifest_is_refused_before_its_chunks_are_read(redis_store, manifest, match):
    raw = manifest if isinstance(manifest, str) else json.dumps(manifest)
    redis_store.client.set(f"{redis_store.namespace}:m:k", raw)
    with pytest.raises(CorruptPayload, match=match):
        redis_store.get_bytes("k")
    assert MAX_MANIFEST_CHUNKS == 65_536


@pytest.mark.redis
def test_chunks_larger_than_the_manifest_declares_are_refused(redis_store):
    store = RedisStore(redis_store.url, namespace=redis_store.namespace, chunk_bytes=512)
    key = put_payload(store, fake_payload(3))
    m = json.loads(store.client.get(f"{store.namespace}:m:{key}"))
    store.client.set(f"{store.namespace}:m:{key}", json.dumps({**m, "size": m["size"] - 100}))
    with pytest.raises(CorruptPayload, match="more than the"):
        store.get_bytes(key)


# -- bytes under another payload's content key ----------------------------------------------------------
@pytest.fixture(params=["memory", "disk", "redis"])
def store(request, tmp_path):
    if request.param == "memory":
        return MemoryStore()
    if request.param == "disk":
        return DiskStore(tmp_path / "store")
    return request.getfixturevalue("redis_store")


@pytest.mark.parametrize("codec", ["raw", "fp16", "int8"])
def test_bytes_under_another_payloads_key_are_refused(store, codec):
    a, b = fake_payload(1), fake_payload(2)
    key_a = put_payload(store, a, codec)
    key_b = put_payload(store, b, codec)
    store.put_bytes(key_b, store.get_bytes(key_a))  # a's bytes now sit under b's content key
    with pytest.raises(CorruptPayload, match="other tokens than the key names"):
        get_payload(store, key_b)
    assert get_payload(store, key_a).token_ids.equal(a.token_ids)


def test_bytes_of_another_codec_under_a_content_key_are_refused(store):
    p = fake_payload(4)
    put_payload(store, p, "int8")
    store.put_bytes(payload_key(p), store.get_bytes(payload_key(p) + "+int8-g32"))
    with pytest.raises(CorruptPayload, match="output of codec 'int8-g32'; the key names codec 'raw'"):
        get_payload(store, payload_key(p))


def test_a_key_the_caller_chose_is_not_a_claim_about_the_content(store):
    p = fake_payload(5)
    put_payload(store, p, "fp16", key="my-run:agent-a")
    assert get_payload(store, "my-run:agent-a").num_tokens == p.num_tokens


# -- no server, a bad database ------------------------------------------------------------------------------
def test_no_redis_server_is_a_store_error_naming_the_url():
    store = open_store("redis://127.0.0.1:1/0?retry_s=0")  # nothing listens on port 1; fail at once
    for call in (store.check, lambda: store.get_bytes("k"), lambda: put_payload(store, fake_payload(1)),
                 lambda: store.contains("k")):
        with pytest.raises(StoreError, match=r"redis store redis://127\.0\.0\.1:1/0: .*expected a Redis server"):
            call()


def test_a_database_that_is_not_a_number_is_an_unknown_store():
    with pytest.raises(UnknownStore, match="is not a number"):
        open_store("redis://127.0.0.1:6379/abc")


@pytest.mark.redis
def test_a_database_out_of_range_is_a_store_error(redis_url):
    base = redis_url.rsplit("/", 1)[0]
    with pytest.raises(StoreError, match="DB index is out of range"):
        open_store(f"{base}/99999").check()


# -- the disk store: a path under a file, a read-only or full filesystem ---------------------------------------
def test_a_disk_store_under_a_file_is_a_store_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match="cannot open.*expected a writable folder"):
        open_store(str(tmp_path / "f" / "store"))


UNSHARE = shutil.which("unshare")


def in_small_fs(script: str, size: str = "256k", options: str = "") -> subprocess.CompletedProcess:
    """Run ``script`` (Python) with a fresh tmpfs of ``size`` at $MNT, in a private mount namespace."""
    if UNSHARE is None or subprocess.run([UNSHARE, "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rm (user + mount namespaces) is not available here")
    mnt = "/tmp/kvrelay-test-mnt"
    body = textwrap.dedent(script)
    cmd = (f"mkdir -p {mnt} && mount -t tmpfs -o size={size}{options} tmpfs {mnt} && "
           f"MNT={mnt} {shlex.quote(sys.executable)} -")
    return subprocess.run([UNSHARE, "-rm", "sh", "-c", cmd], input=body, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_a_full_disk_fails_the_put_and_leaves_no_payload():
    r = in_small_fs("""
        import os
        from kvrelay.core.errors import PayloadNotFound, StoreError
        from kvrelay.transport.keys import payload_key
        from kvrelay.transport.stores import DiskStore, put_payload
        from tests.transport.test_stores import fake_payload, same
        store = DiskStore(os.environ["MNT"] + "/store")
        small = fake_payload(1, T=20)
        key = put_payload(store, small)
        big = fake_payload(2, T=4000, layers=2, heads=4, dim=16)  # ~4 MB: does not fit in 256 KiB
        try:
            put_payload(store, big)
        except StoreError as e:
            assert "ENOSPC" in str(e) and "expected a writable folder" in str(e), e
        else:
            raise SystemExit("the put did not fail")
        try:
            store.get(payload_key(big))
        except PayloadNotFound:
            pass
        else:
            raise SystemExit("the failed put left a payload behind")
        left = [n for _, _, fs in os.walk(store.root) for n in fs if n.endswith(".tmp")]
        assert not left, left
        assert same(store.get(key), small)  # what was there before is intact
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_a_read_only_disk_is_refused_by_check_and_put():
    r = in_small_fs("""
        import os, subprocess
        from kvrelay.core.errors import StoreError
        from kvrelay.transport.stores import DiskStore, put_payload
        from tests.transport.test_stores import fake_payload
        root = os.environ["MNT"] + "/store"
        DiskStore(root)
        subprocess.run(["mount", "-o", "remount,ro", os.environ["MNT"]], check=True)
        store = DiskStore(root)  # its folders exist: opening works, writing cannot
        store.check()
        for call in (lambda: store.check(write=True), lambda: put_payload(store, fake_payload(1))):
            try:
                call()
            except StoreError as e:
                assert "EROFS" in str(e), e
            else:
                raise SystemExit("a write to a read-only disk did not fail")
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
