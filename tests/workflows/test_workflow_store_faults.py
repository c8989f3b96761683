"""A workflow whose store fails under it: every agent in its own OS process (``ProcessExecutor``), payloads
through a real ``redis-server`` (killed with SIGKILL between two turns, restarted with or without its data,
or never, or reached only over a rate-limited link: ``transport.netem``) or a disk store on a full
filesystem, or a store holding half a payload. The run either completes
with payloads its receivers verified (the store's retries with backoff carry it over a restart), rebuilds
the edge from text and says why in its trace (``on_refused = "text"``), or stops with ``EdgeRefused`` naming
the edge. A lost, partial or corrupt payload is never used."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from kvrelay.agents.verify import VerifySpec
from kvrelay.core.errors import EdgeRefused
from kvrelay.models.loader import load_model
from kvrelay.workflows.process_executor import ProcessExecutor
from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.spec import AgentSpec, Workflow, chain
from tests.conftest import missing_service
from tests.transport.test_store_faults import in_small_fs

MODEL = "tiny:qwen2:3"
CONTEXT = "the key of the blue vault is four and the bug is in line seven of the code " * 3
pytestmark = pytest.mark.redis


def _chain(on_refused: str = "stop") -> Workflow:
    """reader -> fixer -> checker over kv edges, each receiver verifying what it gets (k = 4)."""
    specs = [AgentSpec("reader", "read the report", "what is the bug", 5, 5),
             AgentSpec("fixer", "fix the code", "where is the fix", 5, 5),
             AgentSpec("checker", "check the fix", "is it right", 5, 5)]
    wf = chain("chain3", specs)
    return replace(wf, edges=tuple(replace(e, on_refused=on_refused, verify=VerifySpec(k=4)) for e in wf.edges))


@pytest.fixture(scope="module")
def reference():
    """The same workflow with every edge re-encoded from text: what any fallback must reproduce."""
    return run_workflow(load_model(MODEL), _chain(), CONTEXT, mode="text")


def redis_server(persist: bool):
    from kvrelay.transport.redis_server import RedisServer, RedisServerError

    try:
        return RedisServer(persist=persist).start()
    except RedisServerError as e:
        missing_service("redis-server", str(e))


class FaultBefore(ProcessExecutor):
    """The process executor, with ``fault()`` run in the driver just before ``victim``'s turn."""

    def __init__(self, *a, victim: str, fault, **kw):
        super().__init__(*a, **kw)
        self.victim, self.fault = victim, fault

    def turn(self, agent, prompt, base, cache, **kw):
        if agent == self.victim and self.fault is not None:
            fault, self.fault = self.fault, None
            fault(self, cache)
        return super().turn(agent, prompt, base, cache, **kw)


def killed_and_restarted(server, after_s: float):
    """SIGKILL the server now and start it again ``after_s`` seconds later, while a worker is retrying."""

    def fault(ex, cache):
        server.kill()
        t = threading.Timer(after_s, server.start)
        t.start()
        ex.restarts.append(t)

    return fault


def test_redis_killed_and_restarted_mid_workflow_the_run_completes_verified(reference):
    server = redis_server(persist=True)
    try:
        ex = FaultBefore(MODEL, _chain("stop"), store=f"{server.url}?retry_s=30", codec="fp16",
                         victim="fixer", fault=killed_and_restarted(server, 1.5))
        ex.restarts = []
        with ex:
            first_pid = server._proc.pid
            trace = ex.run(CONTEXT)
            for t in ex.restarts:
                t.join()
        assert server._proc.pid != first_pid  # it really was killed and started again
        # the fixer's read waited for the restarted server and got the reader's payload back whole
        assert [a.channel for a in trace.agents] == ["root", "kv", "kv"]
        assert [a.fallback for a in trace.agents] == ["", "", ""]
        assert all(a.relayed_tokens > 0 for a in trace.agents[1:])
        assert trace.outputs() == reference.outputs()
    finally:
        server.stop()


@pytest.mark.parametrize("on_refused", ["stop", "text"])
def test_redis_restarted_empty_the_lost_payload_is_never_used(reference, on_refused):
    server = redis_server(persist=False)  # the restarted server holds nothing: the reader's payload is gone
    try:
        ex = FaultBefore(MODEL, _chain(on_refused), store=f"{server.url}?retry_s=30", codec="fp16",
                         victim="fixer", fault=killed_and_restarted(server, 1.0))
        ex.restarts = []
        with ex:
            if on_refused == "stop":
                with pytest.raises(EdgeRefused) as e:
                    ex.run(CONTEXT)
                assert (e.value.src, e.value.dst, e.value.kind) == ("reader", "fixer", "PayloadNotFound")
                return
            trace = ex.run(CONTEXT)
        by = {a.name: a for a in trace.agents}
        assert by["fixer"].channel == "kv->text" and by["fixer"].relayed_tokens == 0
        assert by["fixer"].fallback.startswith("PayloadNotFound: ")
        assert by["checker"].channel == "kv" and by["checker"].fallback == ""  # the fixer's own payload relays
        assert trace.outputs() == reference.outputs()
    finally:
        server.stop()


@pytest.mark.parametrize("on_refused", ["stop", "text"])
def test_redis_killed_for_good_stops_naming_the_edge_or_falls_back(reference, on_refused):
    server = redis_server(persist=False)
    try:
        def kill(ex, cache):
            server.kill()

        with FaultBefore(MODEL, _chain(on_refused), store=f"{server.url}?retry_s=1", codec="fp16",
                         victim="fixer", fault=kill) as ex:
            if on_refused == "stop":
                with pytest.raises(EdgeRefused) as e:
                    ex.run(CONTEXT)
                assert (e.value.src, e.value.dst, e.value.kind) == ("reader", "fixer", "StoreError")
                assert "tries over 1 s" in e.value.reason and "expected a Redis server" in e.value.reason
                return
            trace = ex.run(CONTEXT)
            assert ex.unreleased  # the driver could not delete the reader's payload: the run went on
        by = {a.name: a for a in trace.agents}
        # the fixer could not read (after its retries), then could not store its own payload either
        assert by["fixer"].channel == "kv->text" and by["fixer"].fallback.startswith("StoreError: redis store")
        assert by["checker"].channel == "kv->text" and by["checker"].fallback.startswith("StoreError: redis store")
        assert trace.outputs() == reference.outputs()
    finally:
        server.stop()


def drop_the_chunks(ex, cache):
    """A half-written payload: its manifest stays, its chunks are gone (a writer that died mid-way)."""
    store = ex.store
    names = list(store.client.scan_iter(match=f"{store.namespace}:c:{cache}:*"))
    assert names and store.client.exists(store._m(cache))
    store.client.delete(*names)


@pytest.mark.parametrize("on_refused", ["stop", "text"])
def test_a_manifest_without_its_chunks_is_never_used(redis_url, redis_namespace, reference, on_refused):
    url = f"{redis_url}?namespace={redis_namespace}"
    with FaultBefore(MODEL, _chain(on_refused), store=url, codec="fp16", victim="checker",
                     fault=drop_the_chunks) as ex:
        try:
            if on_refused == "stop":
                with pytest.raises(EdgeRefused) as e:
                    ex.run(CONTEXT)
                assert (e.value.src, e.value.dst, e.value.kind) == ("fixer", "checker", "PayloadNotFound")
                return
            trace = ex.run(CONTEXT)
        finally:
            ex.store.clear()
    assert [a.channel for a in trace.agents] == ["root", "kv", "kv->text"]
    assert trace.agents[2].fallback.startswith("PayloadNotFound: ")
    assert trace.outputs() == reference.outputs()


def test_a_truncated_payload_file_in_a_disk_store_is_never_used(tmp_path, reference):
    def truncate(ex, cache):
        path = ex.store.path(cache)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    with FaultBefore(MODEL, _chain("text"), store=str(tmp_path / "store"), codec="fp16", victim="checker",
                     fault=truncate) as ex:
        trace = ex.run(CONTEXT)
    assert [a.channel for a in trace.agents] == ["root", "kv", "kv->text"]
    assert trace.agents[2].fallback.startswith("CorruptPayload: ")
    assert trace.outputs() == reference.outputs()


@pytest.mark.parametrize("on_refused", ["stop", "text"])
def test_a_full_disk_under_the_disk_store_stops_naming_the_edge_or_falls_back(on_refused, reference):
    """The reader's payload does not fit on a 64 KiB filesystem; the workers run in its mount namespace."""
    want = [list(v) for v in reference.outputs().values()]
    r = in_small_fs(f"""
        import os
        from dataclasses import replace
        from kvrelay.core.errors import EdgeRefused
        from tests.workflows.test_workflow_store_faults import CONTEXT, MODEL, _chain
        from kvrelay.workflows.process_executor import ProcessExecutor
        root = os.environ["MNT"] + "/store"
        with ProcessExecutor(MODEL, _chain({on_refused!r}), store=root, codec="raw") as ex:
            try:
                trace = ex.run(CONTEXT)
            except EdgeRefused as e:
                assert (e.src, e.dst, e.kind) == ("reader", "fixer", "StoreError"), e
                assert "ENOSPC" in e.reason, e
                print("refused")
            else:
                assert [a.channel for a in trace.agents] == ["root", "kv->text", "kv->text"], trace.agents
                assert all("ENOSPC" in a.fallback for a in trace.agents[1:]), trace.agents
                assert [list(v) for v in trace.outputs().values()] == {want!r}
                print("fell back")
        left = [n for _, _, fs in os.walk(root) for n in fs if not n.startswith(".")]
        assert not left, left  # no payload, whole or partial, was left behind
        print("ok")
    """, size="64k")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["refused" if on_refused == "stop" else "fell back", "ok"], r.stdout + r.stderr


# -- a slow link between the workers and Redis ----------------------------------------------------------------
SLOW_CONTEXT = CONTEXT * 20  # ~1,000 tokens: each raw payload of the tiny model is ~1 MB, 8x the link's burst


def _over_a_link(link, on_refused: str, query: str) -> dict:
    """The chain run by a ``ProcessExecutor`` in namespace a, its store a ``redis-server`` in namespace b that
    a reaches only over the rate-limited veth; the driver's report as a dict."""
    import json
    import shutil
    import subprocess
    import sys
    import tempfile
    import textwrap

    from kvrelay.transport import netem
    from tests.transport.test_store_faults import ROOT

    exe = shutil.which("redis-server")
    if exe is None:
        missing_service("redis-server", "redis-server is not on PATH")
    folder = tempfile.mkdtemp(prefix="kvrelay-redis-")
    server = subprocess.Popen(link.argv("b", exe, "--port", "6390", "--bind", netem.ADDR_B, "--save", "",
                                        "--appendonly", "no", "--dir", folder, "--protected-mode", "no"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    script = textwrap.dedent(f"""
        import json, time
        import redis
        from kvrelay.core.errors import EdgeRefused
        from kvrelay.workflows.process_executor import ProcessExecutor
        from tests.workflows.test_workflow_store_faults import MODEL, SLOW_CONTEXT, _chain
        url = "redis://{netem.ADDR_B}:6390/0"
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        for _ in range(200):  # the server in the other namespace is starting
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        with ProcessExecutor(MODEL, _chain({on_refused!r}), store=url + {query!r}, codec="raw") as ex:
            try:
                trace = ex.run(SLOW_CONTEXT)
            except EdgeRefused as e:
                print(json.dumps({{"refused": [e.src, e.dst, e.kind, e.reason]}}))
            else:
                print(json.dumps({{"agents": [[a.channel, a.fallback, a.relayed_tokens] for a in trace.agents],
                                  "outputs": [list(v) for v in trace.outputs().values()]}}))
    """)
    try:
        r = subprocess.run(link.argv("a", sys.executable, "-"), input=script, capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def slow_reference():
    return [list(v) for v in run_workflow(load_model(MODEL), _chain(), SLOW_CONTEXT, mode="text").outputs().values()]


def _link():
    from kvrelay.transport import netem

    ok, why = netem.available()
    if not ok:
        import os

        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root with iproute2, the link tests must run: {why}")
        pytest.skip(why)
    return netem.Link()


def test_a_slow_link_to_redis_the_run_completes_verified(slow_reference):
    """8 Mbit/s each way: every put and get waits on the token bucket, and the run still relays every edge."""
    with _link() as link:
        link.set_rate(8, both_ways=True)
        res = _over_a_link(link, "stop", "")
        puts, gets = link.shaped("a"), link.shaped("b")
    assert [a[:2] for a in res["agents"]] == [["root", ""], ["kv", ""], ["kv", ""]]
    assert all(a[2] > 0 for a in res["agents"][1:])
    assert res["outputs"] == slow_reference
    # both payloads went up and came back down through the limited link, held back by its bucket
    assert puts["sent_bytes"] > 2_000_000 and gets["sent_bytes"] > 2_000_000
    assert puts["overlimits"] > 0 and gets["overlimits"] > 0


@pytest.mark.parametrize("on_refused", ["stop", "text"])
def test_a_link_too_slow_for_the_store_timeout_stops_naming_the_edge_or_falls_back(slow_reference, on_refused):
    """1 Mbit/s with a 0.5 s socket timeout: a ~1 MB put needs at least 7 s on this link, so every try times
    out (a lower bound set by the rate, whatever the machine's load); the store gives up after its retries."""
    with _link() as link:
        link.set_rate(1)
        res = _over_a_link(link, on_refused, "?socket_timeout=0.5&retry_s=1")
    if on_refused == "stop":
        src, dst, kind, reason = res["refused"]
        assert (src, dst, kind) == ("reader", "fixer", "StoreError")
        assert "TimeoutError" in reason and "tries over 1 s" in reason
        return
    channels = [a[0] for a in res["agents"]]
    assert channels == ["root", "kv->text", "kv->text"]
    assert all(a[1].startswith("StoreError: redis store") and "TimeoutError" in a[1] for a in res["agents"][1:])
    assert res["outputs"] == slow_reference
