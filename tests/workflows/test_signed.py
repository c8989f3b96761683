"""A signed workflow across OS processes through a real Redis reached as an ACL user: it runs as the unsigned
one does; one forged (re-checksummed), unsigned or wrongly signed payload stops it with a typed error naming the
edge, or is rebuilt from text when the edge says so."""

from __future__ import annotations

import os
import secrets
from dataclasses import replace
from urllib.parse import urlsplit, urlunsplit

import pytest

from kvrelay.core.errors import EdgeRefused
from kvrelay.kv import wire
from kvrelay.kv.sign import Key, Keyring, sign_parts
from kvrelay.models.loader import load_model
from kvrelay.workflows.executors import InProcessExecutor
from kvrelay.workflows.process_executor import ProcessExecutor
from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.spec import AgentSpec, Workflow, chain

MODEL = "tiny:qwen2:3"
CONTEXT = "the key of the blue vault is four and the bug is in line seven of the code " * 3
TEAM = Key("hmac", "team", bytes(range(40, 72)))


def _chain(on_refused: str = "stop") -> Workflow:
    specs = [AgentSpec("reader", "read the report", "what is the bug", 5, 5),
             AgentSpec("fixer", "fix the code", "where is the fix", 5, 5),
             AgentSpec("checker", "check the fix", "is it right", 5, 5)]
    wf = chain("chain3", specs)
    return replace(wf, edges=tuple(replace(e, on_refused=on_refused) for e in wf.edges))


def forge(store, key: str) -> None:
    """Edit a tensor and recompute every checksum, keeping the producer's signature field."""
    tensors, meta = wire.unpack(store.get_bytes(key))
    name = next(n for n in sorted(tensors) if n.endswith(".k"))
    tensors[name] = tensors[name] * 1.01
    store.put_bytes(key, wire.pack(tensors, meta))


def strip_signature(store, key: str) -> None:
    tensors, meta = wire.unpack(store.get_bytes(key))
    meta.pop("signature")
    store.put_bytes(key, wire.pack(tensors, meta))


def resign_with_a_stranger(store, key: str) -> None:
    tensors, meta = wire.unpack(store.get_bytes(key))
    meta.pop("signature")
    store.put_bytes(key, sign_parts(wire.pack_parts(tensors, meta), Key("hmac", "team", b"\x07" * 32)))  # made-up secret


FAULTS = {"forged": (forge, "BadSignature"), "unsigned": (strip_signature, "UnsignedPayload"),
          "wrong-key": (resign_with_a_stranger, "BadSignature")}


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def reference(lm):
    return run_workflow(lm, _chain(), CONTEXT)


class Faulty(InProcessExecutor):
    fault = None

    def turn(self, agent, prompt, base, cache, **kw):
        if agent == "checker" and cache is not None and self.fault is not None:
            self.fault(self.store, cache)
        return super().turn(agent, prompt, base, cache, **kw)


def test_in_process_signed_edges_sign_verify_and_refuse(lm, reference):
    ex = Faulty(lm, keys=Keyring((TEAM,)), codec="raw")
    assert run_workflow(ex, _chain(), CONTEXT).outputs() == reference.outputs()
    for name, (fault, kind) in FAULTS.items():
        ex.fault = fault
        with pytest.raises(EdgeRefused) as e:
            run_workflow(ex, _chain(), CONTEXT)
        assert (e.value.src, e.value.dst, e.value.kind) == ("fixer", "checker", kind), name
        assert "'fixer'" in str(e.value)  # the producer is named
    trace = run_workflow(ex, _chain("text"), CONTEXT)
    assert trace.outputs() == reference.outputs() and trace.agents[2].channel == "kv->text"


@pytest.fixture
def acl_url(redis_url):
    """``redis://USER:PASSWORD@HOST:PORT/DB`` for a fresh ACL user of the test server (removed afterwards)."""
    import redis

    admin = redis.Redis.from_url(redis_url)
    user, password = f"kvrelay-{secrets.token_hex(4)}", secrets.token_hex(12)
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"])
    u = urlsplit(redis_url)
    yield urlunsplit((u.scheme, f"{user}:{password}@{u.hostname}:{u.port}", u.path or "/0",
                      f"namespace=kvrelay-test-{os.getpid()}-{secrets.token_hex(3)}", ""))
    admin.acl_deluser(user)
    admin.close()


@pytest.mark.redis
def test_a_signed_workflow_across_processes_through_redis_as_an_acl_user(acl_url, lm, tmp_path):
    import redis

    from kvrelay.transport.stores import open_store

    fp16_reference = run_workflow(InProcessExecutor(lm, codec="fp16"), _chain(), CONTEXT)
    store = open_store(acl_url)
    assert "***" in store.url and urlsplit(acl_url).password not in store.url  # never shown
    u = urlsplit(acl_url)
    with pytest.raises(redis.AuthenticationError):  # the password is what lets it in
        redis.Redis.from_url(urlunsplit((u.scheme, f"{u.username}:wrong@{u.hostname}:{u.port}", u.path, "", ""))).ping()
    keys = tmp_path / "keys"
    keys.write_text(TEAM.to_line() + "\n")

    class Tamper(ProcessExecutor):
        fault = None

        def turn(self, agent, prompt, base, cache, **kw):
            if agent == "checker" and cache is not None and self.fault is not None:
                self.fault(self.store, cache)
            return super().turn(agent, prompt, base, cache, **kw)

    with Tamper(MODEL, _chain(), store=acl_url, codec="fp16", keys_file=keys) as ex:
        trace = ex.run(CONTEXT)
        assert [a.channel for a in trace.agents] == ["root", "kv", "kv"] and trace.agents[2].relayed_tokens > 0
        assert trace.outputs() == fp16_reference.outputs()  # signing changes nothing a receiver attends to
        for fault, kind in FAULTS.values():
            ex.fault = fault
            with pytest.raises(EdgeRefused) as e:
                ex.run(CONTEXT)
            assert (e.value.src, e.value.dst, e.value.kind) == ("fixer", "checker", kind)
        ex.fault = forge
        fell_back = run_workflow(ex, _chain("text"), CONTEXT)
    assert fell_back.agents[2].channel == "kv->text" and fell_back.agents[2].fallback.startswith("BadSignature: ")
    assert "'fixer'" in fell_back.agents[2].fallback  # the producer is named
