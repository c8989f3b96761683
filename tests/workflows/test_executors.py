"""One runner, several executors: in-process, in-process through a store, and one OS process per agent
exchanging payloads only through a real Redis or a shared disk folder (raw and int8)."""

from __future__ import annotations

import os

import pytest

from kvrelay.core.errors import WorkerError
from kvrelay.kv import codecs
from kvrelay.models.loader import load_model
from kvrelay.transport.bytestore import as_parts
from kvrelay.workflows.executors import InProcessExecutor
from kvrelay.workflows.process_executor import ProcessExecutor
from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.spec import AgentSpec, chain

MODEL = "tiny:qwen2:3"
CONTEXT = ("the report of the agent is in the file and the bug is in line seven of the code "
           "the key of the blue vault is four and the answer is not in the plan ") * 2


def _chain():
    specs = [AgentSpec("reader", "read the report", "what is the bug", 6, 6),
             AgentSpec("fixer", "fix the code", "where is the fix", 6, 6),
             AgentSpec("checker", "check the fix", "is the answer yes or no", 6, 6)]
    return chain("chain3", specs)


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def in_process(lm):
    """Reference outputs: raw in process (the object itself handed over) and int8 through a memory store."""
    wf = _chain()
    return {"raw": run_workflow(lm, wf, CONTEXT), "int8": run_workflow(InProcessExecutor(lm, codec="int8"), wf, CONTEXT),
            "fp16": run_workflow(InProcessExecutor(lm, codec="fp16"), wf, CONTEXT),
            "text": run_workflow(lm, wf, CONTEXT, mode="text")}


def test_in_process_codec_defaults_to_the_wire_codec_only_through_a_store(lm, tmp_path):
    assert InProcessExecutor(lm).codec == "raw" and InProcessExecutor(lm).store is None  # objects handed over
    assert InProcessExecutor(lm, store=str(tmp_path / "s")).codec == codecs.WIRE_CODEC


def test_in_process_store_edges_equal_direct_hand_over(lm, in_process, tmp_path):
    wf = _chain()
    raw = run_workflow(InProcessExecutor(lm, store=str(tmp_path / "s"), codec="raw"), wf, CONTEXT)
    assert raw.outputs() == in_process["raw"].outputs() == in_process["text"].outputs()
    kv = [a for a in raw.agents if a.channel == "kv"]
    assert len(kv) == 2 and all(a.relay_transfer_s > 0 and a.relayed_tokens > 0 for a in kv)
    assert all(a.relay_transfer_s == 0 for a in in_process["raw"].agents)  # the object itself, no store
    assert not any((tmp_path / "s" / "payloads").rglob("*.safetensors"))  # released once nobody needs them


class _Recorded:
    """The real store, noting how many bytes each put wrote and which keys were read."""

    def __init__(self, store):
        self.store, self.written, self.read = store, {}, []

    def put_bytes(self, key, data, ttl_s=None, **kw):
        self.written[key] = sum(p.nbytes for p in as_parts(data))
        return self.store.put_bytes(key, data, ttl_s, **kw)

    def get_bytes(self, key):
        self.read.append(key)
        return self.store.get_bytes(key)

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.mark.parametrize(("codec", "share"), [("raw", (1.0, 1.05)), ("fp16", (0.45, 0.6)), ("int8", (0.2, 0.4))])
def test_relay_bytes_are_what_the_put_wrote(lm, in_process, codec, share):
    """A pipeline through a store reports the bytes on the wire: fp16 and int8 sizes, not the decoded fp32 cache's."""
    ex = InProcessExecutor(lm, store=f"memory://relay-bytes-{codec}-{os.getpid()}", codec=codec)
    ex.store = recorded = _Recorded(ex.store)
    trace = run_workflow(ex, _chain(), CONTEXT)
    kv = [a for a in trace.agents if a.channel == "kv"]
    assert len(kv) == 2 and len(recorded.read) == 2
    assert [a.relay_bytes for a in kv] == [recorded.written[k] for k in recorded.read]
    assert trace.totals()["relay_bytes"] == sum(recorded.written[k] for k in recorded.read)
    fp32 = [a.relay_bytes for a in in_process["raw"].agents if a.channel == "kv"]  # the object itself: its nbytes
    assert all(share[0] * f < a.relay_bytes < share[1] * f for a, f in zip(kv, fp32, strict=True))
    if codec == "raw":
        assert all(a.relay_bytes > f for a, f in zip(kv, fp32, strict=True))  # kvrelay/1 header and checksums


def _check_against(trace, ref, *, same_bytes: bool = True) -> None:
    assert trace.outputs() == ref.outputs()
    if same_bytes:  # the same payloads through a store in this process: the same bytes on the wire, to the few
        # header bytes that differ between runs (the creation time's digits)
        assert all(abs(a.relay_bytes - b.relay_bytes) <= 64 for a, b in zip(trace.agents, ref.agents, strict=True))
    assert [a.channel for a in trace.agents] == ["root", "kv", "kv"]
    for a in trace.agents[1:]:  # each receiver continued a cache that came out of the store
        assert a.relayed_tokens > 0 and a.relay_bytes > 0 and a.relay_transfer_s > 0


@pytest.mark.parametrize("where", ["redis", "disk"])
def test_agents_in_separate_processes_exchange_payloads_only_through_a_store(where, in_process, tmp_path,
                                                                          request):
    url = (request.getfixturevalue("redis_url").rstrip("/") + f"?namespace=kvrelay-test-{os.getpid()}-{where}"
           if where == "redis" else f"file://{tmp_path}/store")
    wf = _chain()
    with ProcessExecutor(MODEL, wf, store=url) as ex:
        assert len(set(ex.pids.values())) == 3 and os.getpid() not in ex.pids.values()
        assert ex.codec == codecs.WIRE_CODEC == "fp16"  # across processes payloads go as fp16 unless told
        _check_against(run_workflow(ex, wf, CONTEXT), in_process["fp16"])
        ex.set_codec("raw")
        _check_against(run_workflow(ex, wf, CONTEXT), in_process["raw"], same_bytes=False)  # ref: handed over
        ex.set_codec("int8")
        _check_against(run_workflow(ex, wf, CONTEXT), in_process["int8"])
        assert run_workflow(ex, wf, CONTEXT, mode="text").outputs() == in_process["text"].outputs()


def test_process_executor_refuses_a_memory_store_and_reports_worker_failures(tmp_path):
    with pytest.raises(ValueError, match="one process"):
        ProcessExecutor(MODEL, _chain(), store="memory://x")
    with pytest.raises(WorkerError, match="tiny"):
        ProcessExecutor("tiny:gpt9", _chain(), store=str(tmp_path / "s"))


def test_worker_refuses_a_turn_request_that_does_not_name_its_codec():
    from kvrelay.workflows.worker import TURN_FIELDS, _turn

    req = {"op": "turn", **{f: None for f in TURN_FIELDS if f != "codec"}}
    with pytest.raises(ValueError, match=r"lacks codec; expected every one of prompt, base, .*codec"):
        _turn(req, None, None, None)  # refused before anything is read or written
