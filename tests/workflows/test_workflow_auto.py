"""``channel = "auto"`` edges (``workflows.auto``), run end to end on tiny random models (and one zoo model):
the policy routes an edge kv where only the sender saw the facts and none/text where the receiver's prompt
already holds them, never kv between incompatible models, and text while the runtime switch holds relay off;
each route and its reason is in the trace JSON.

The value model is ``policy.value.ValueModel`` fitted on synthetic audit observations with a known answer
(relay and text worth +80 points over none when the receiver lacks the context, nothing when it has it);
the cost profile has the shape of a small model on a CPU. Everything else — decide, the switch, its probe,
the runner, the models — is the real code.
"""

from __future__ import annotations

import json

import pytest

from kvrelay.core.errors import InvalidWorkflow
from kvrelay.policy.cost import Link
from kvrelay.policy.switch import RelaySwitch
from kvrelay.policy.value import Observation, ValueModel
from kvrelay.workflows.auto import AutoPolicy
from kvrelay.workflows.executors import InProcessExecutor
from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.spec import AgentSpec, Edge, Workflow
from tests.policy.synthetic import synthetic, synthetic_profile

CONTEXT = ("the key of the blue vault is four and the bug is in line seven of the parser "
           "the report says the fix belongs in the header module ") * 3
READER = AgentSpec("reader", "read the report", "what is the bug", 6, 3)
# only the reader saw the facts: the fixer's prompt shares almost no word with the reader's turn
PRIVATE = AgentSpec("fixer", "fix the code", "where does it go", 6, 3)
# the fixer's prompt already holds the whole context (and the reader's role and question)
SHARED = AgentSpec("fixer", "fix the code", f"{CONTEXT} read the report what is the bug; where does it go", 6, 3)


def observations(n: int = 60) -> list[Observation]:
    """Private tasks (overlap < 0.2): none fails, kv / kv+int8 / text_full succeed 80%; shared tasks
    (overlap > 0.8): every channel 50%, the same answer per task."""
    return synthetic(0, n, "t", private_overlap=(0.0, 0.2), shared_overlap=(0.8, 1.0), tokens=(20, 2000),
                     labels=("private", "shared"))


@pytest.fixture(scope="module")
def value() -> ValueModel:
    return ValueModel.fit(observations(), n_boot=100, seed=0)


def policy(value, **kw) -> AutoPolicy:
    return AutoPolicy(value, synthetic_profile(), **kw)


def pair(receiver: AgentSpec, channel: str = "auto", layout: str = "continue") -> Workflow:
    return Workflow("pair", (READER, receiver), (Edge("reader", "fixer", channel),), layout=layout)


@pytest.mark.parametrize("layout", ["continue", "replace"])
def test_facts_only_the_sender_saw_route_kv_and_answer_as_a_kv_edge(tiny_by_arch, value, layout):
    lm = tiny_by_arch["qwen2"]
    auto = run_workflow(lm, pair(PRIVATE, layout=layout), CONTEXT, policy=policy(value))
    kv = run_workflow(lm, pair(PRIVATE, "kv", layout), CONTEXT)
    r, d = auto.agents[1], auto.agents[1].decision
    assert r.channel == "auto:kv" and d["channel"] == "kv" and d["codec"] == "raw"
    assert d["decision"]["channel"] == "kv" and d["reason"].startswith("kv: P(success)")
    assert r.relayed_tokens == kv.agents[1].relayed_tokens > 0 and r.relay_bytes == kv.agents[1].relay_bytes
    assert r.token_ids == kv.agents[1].token_ids  # the kv route is the kv edge: same answer
    if layout == "continue":
        text = run_workflow(lm, pair(PRIVATE), CONTEXT, mode="text")
        assert r.token_ids == text.agents[1].token_ids
    assert isinstance(d["probe"], float) and d["relay_on"] is True  # the warming switch sampled it


def test_a_receiver_that_holds_the_context_routes_none_and_reads_only_its_turn(tiny_by_arch, value):
    lm = tiny_by_arch["qwen2"]
    auto = run_workflow(lm, pair(SHARED), CONTEXT, policy=policy(value))
    text = run_workflow(lm, pair(SHARED), CONTEXT, mode="text")
    r, d = auto.agents[1], auto.agents[1].decision
    assert r.channel == "auto:none" and d["channel"] == "none" and d["codec"] is None
    assert r.relayed_tokens == 0 and r.relay_bytes == 0 and d["probe"] is None
    # it did not read the reader's turn (what the reader read and wrote): only its own
    assert r.input_tokens <= text.agents[1].input_tokens - text.agents[0].input_tokens - text.agents[0].decode_tokens
    overlap = float(d["reason"].split("(overlap ")[1].split(",")[0])
    assert overlap >= 0.8


def test_a_receiver_that_holds_the_context_routes_text_when_none_fails_and_kv_is_too_slow(tiny_by_arch):
    """The shared prompt again, but reading nothing fails (a value model whose ``none`` never succeeds) and a
    slow link puts every kv codec below its break-even: the edge re-encodes the reader's turn (text)."""
    obs = [o if o.key != "none" else Observation(o.task_id, o.task_set, "none", o.features, 0.0)
           for o in observations()]
    lm = tiny_by_arch["qwen2"]
    pol = AutoPolicy(ValueModel.fit(obs, n_boot=100, seed=0), synthetic_profile(), link=Link(mbps=0.01))
    auto = run_workflow(lm, pair(SHARED), CONTEXT, policy=pol)
    text = run_workflow(lm, pair(SHARED), CONTEXT, mode="text")
    r, d = auto.agents[1], auto.agents[1].decision
    assert r.channel == "auto:text" and d["channel"] == "text" and d["decision"]["channel"] == "text_full"
    assert "kv+raw off: link 0.01 Mbit/s < break-even" in d["reason"]
    assert r.relayed_tokens == 0 and r.token_ids == text.agents[1].token_ids


def test_an_incompatible_pair_never_routes_kv(tiny_by_arch, value):
    """The fixer runs another model (same tokenizer): kv is never a candidate, whatever the prompt."""
    qwen, llama = tiny_by_arch["qwen2"], tiny_by_arch["llama"]
    for receiver, want in ((PRIVATE, "text"), (SHARED, "none")):
        ex = InProcessExecutor(qwen, models={"fixer": llama})
        auto = run_workflow(ex, pair(receiver), CONTEXT, policy=policy(value))
        r, d = auto.agents[1], auto.agents[1].decision
        assert r.channel == f"auto:{want}" and d["channel"] == want and d["codec"] is None
        assert "no kv: the pair is not compatible" in d["reason"]
        assert r.relayed_tokens == 0 and d["probe"] is None
        if want == "text":  # the same answer the text channel gives on those two models
            text = run_workflow(InProcessExecutor(qwen, models={"fixer": llama}), pair(receiver), CONTEXT,
                                mode="text")
            assert r.token_ids == text.agents[1].token_ids
    same, other = InProcessExecutor(qwen), InProcessExecutor(qwen, models={"fixer": llama})
    for ex in (same, other):
        ex.start(pair(PRIVATE))
    assert same.compatible("reader", "fixer") and not other.compatible("reader", "fixer")


def test_the_switch_held_off_turns_a_kv_decision_into_text(tiny_by_arch, value):
    """A switch whose threshold no cache reaches: decide still says kv, the run re-encodes (text); the switch
    event and its evidence are in the trace; the state carries to the next run of the same policy."""
    lm = tiny_by_arch["qwen2"]
    pol = policy(value, switch=RelaySwitch(threshold=50.0, hysteresis=0.0, sample_rate=1.0, min_samples=2,
                                           window=4))
    first = run_workflow(lm, pair(PRIVATE), CONTEXT, policy=pol)  # one sample: still warming, relay on
    assert first.agents[1].channel == "auto:kv" and first.switch_events == ()
    second = run_workflow(lm, pair(PRIVATE), CONTEXT, policy=pol)
    r, d = second.agents[1], second.agents[1].decision
    assert d["decision"]["channel"] == "kv" and d["decision"]["codec"] == "raw"  # what decide wanted
    assert r.channel == "auto:text" and d["channel"] == "text" and d["relay_on"] is False
    assert d["reason"].startswith("relay switched off on reader->fixer") and "decide: kv: " in d["reason"]
    assert r.relayed_tokens == 0 and r.relay_bytes == 0
    text = run_workflow(lm, pair(PRIVATE), CONTEXT, mode="text")
    assert r.token_ids == text.agents[1].token_ids
    (ev,) = second.switch_events
    assert ev["edge"] == "reader->fixer" and ev["relay_on"] is False and ev["samples"] == 2
    assert ev["evidence"] == [first.agents[1].decision["probe"], d["probe"]]
    third = run_workflow(lm, pair(PRIVATE), CONTEXT, policy=pol)  # still off, no new switch
    assert third.agents[1].channel == "auto:text" and third.switch_events == ()
    # a switch every cache clears keeps relaying
    on = policy(value, switch=RelaySwitch(threshold=-50.0, sample_rate=1.0, min_samples=1))
    for _ in range(2):
        t = run_workflow(lm, pair(PRIVATE), CONTEXT, policy=on)
        assert t.agents[1].channel == "auto:kv" and t.switch_events == ()


def test_route_and_reason_are_in_the_trace_json(tiny_by_arch, value):
    lm = tiny_by_arch["qwen2"]
    wf = Workflow("chain", (READER, PRIVATE, AgentSpec("checker", "check the fix", "is it right", 6, 3)),
                  (Edge("reader", "fixer", "auto"), Edge("fixer", "checker", "kv")))
    trace = json.loads(json.dumps(run_workflow(lm, wf, CONTEXT, policy=policy(value)).to_dict()))
    root, fixer, checker = trace["agents"]
    assert root["decision"] is None and checker["decision"] is None and checker["channel"] == "kv"
    assert fixer["channel"] == "auto:kv"
    d = fixer["decision"]
    assert set(d) == {"edge", "channel", "codec", "relay_on", "probe", "reason", "decision"}
    assert d["edge"] == "reader->fixer" and d["reason"] and "\n" not in d["reason"]
    assert set(d["decision"]) == {"channel", "codec", "reason", "expected_success", "latency_s"}
    assert 0.0 <= d["decision"]["expected_success"] <= 1.0 and d["decision"]["latency_s"] > 0
    assert trace["switch_events"] == []


def test_a_codec_route_relays_fewer_bytes(tiny_by_arch, value):
    lm = tiny_by_arch["qwen2"]
    raw = run_workflow(lm, pair(PRIVATE), CONTEXT, policy=policy(value))
    int8 = run_workflow(lm, pair(PRIVATE), CONTEXT, policy=policy(value, codecs=("int8",)))
    r = int8.agents[1]
    assert r.channel == "auto:kv+int8" and r.decision["codec"] == "int8"
    assert r.relayed_tokens == raw.agents[1].relayed_tokens and r.relay_bytes < raw.agents[1].relay_bytes / 2
    # through a store the edge relays under the store's codec
    ex = InProcessExecutor(lm, store="memory://auto-edge-test", codec="int8")
    stored = run_workflow(ex, pair(PRIVATE), CONTEXT, policy=policy(value))
    assert stored.agents[1].channel == "auto:kv+int8" and stored.agents[1].relayed_tokens > 0


def test_sliding_window_senders_route_without_a_probe(tiny_by_arch, value):
    """gemma3's sliding layers drop the head of a long turn: the probe cannot cut it, the route still runs."""
    lm = tiny_by_arch["gemma3"]
    auto = run_workflow(lm, pair(PRIVATE), CONTEXT * 3, policy=policy(value))
    kv = run_workflow(lm, pair(PRIVATE, "kv"), CONTEXT * 3)
    assert auto.agents[1].channel == "auto:kv" and auto.agents[1].decision["probe"] is None
    assert auto.agents[1].token_ids == kv.agents[1].token_ids


def test_auto_edges_in_the_spec(tiny_by_arch, value):
    wf = pair(PRIVATE)
    assert 'channel = "auto"' in wf.to_toml() and Workflow.from_toml(wf.to_toml()) == wf
    assert wf.with_channels("text").edges[0].channel == "text"
    with pytest.raises(InvalidWorkflow, match="expected a policy"):
        run_workflow(tiny_by_arch["qwen2"], wf, CONTEXT)
    # text mode re-encodes every edge: no policy needed, no decision recorded
    assert run_workflow(tiny_by_arch["qwen2"], wf, CONTEXT, mode="text").agents[1].decision is None
    a, b, c = (AgentSpec(n, "r", "p", 4) for n in ("a", "b", "c"))
    with pytest.raises(ValueError, match="several whole-turn caches"):
        Workflow("w", (a, b, c), (Edge("a", "c", "auto"), Edge("b", "c", "text")))
    with pytest.raises(ValueError, match="cannot be auto"):
        Workflow("w", (READER, a, b, c), (Edge("reader", "a", "auto"), Edge("reader", "b", "kv"),
                                          Edge("a", "c", "kv+text"), Edge("b", "c", "kv+text")))


@pytest.mark.integration
def test_auto_edges_on_a_real_model():
    """smollm2-135m: where only the sender read the text, kv, and its cache explains the sender's answer to the
    receiver (probe > 0); where the receiver's prompt holds the text, none."""
    from kvrelay.core.corpus import prose
    from kvrelay.models.loader import load_model

    lm = load_model("smollm2-135m")
    text = prose(3)[:600]
    value = ValueModel.fit(observations(), n_boot=100, seed=0)
    reader = AgentSpec("reader", "You read documents carefully.", "Summarise the text above in one sentence.", 16)
    private = AgentSpec("writer", "You write titles.", "Give it a short title.", 8)
    shared = AgentSpec("writer", "You write titles.", f"{text}\n\nSummarise the text above in one sentence, "
                       "then give it a short title.", 8)
    pol = policy(value)
    for receiver, want in ((private, "kv"), (shared, "none")):
        wf = Workflow("pair", (reader, receiver), (Edge("reader", "writer", "auto"),))
        trace = run_workflow(lm, wf, text, policy=pol)
        r = trace.agents[1]
        assert r.channel == f"auto:{want}", r.decision["reason"]
        if want == "kv":
            assert r.decision["probe"] > 0
            kv = run_workflow(lm, Workflow("pair", (reader, receiver), (Edge("reader", "writer", "kv"),)), text)
            assert r.token_ids == kv.agents[1].token_ids and r.relayed_tokens > 0
        else:
            text_run = run_workflow(lm, wf, text, mode="text")
            assert r.relayed_tokens == 0
            assert r.input_tokens <= text_run.agents[1].input_tokens - text_run.agents[0].input_tokens
