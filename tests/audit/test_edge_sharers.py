"""Adapter and variant arms on a workflow edge (tiny random models): the receiver reads another model's
cache of the sender's whole turn through the adapter (or a fine-tuned sibling's through the named repair),
and the control reads that model's cache of the mismatch partner's turn, labelled with this turn's tokens.

Each record's input is rebuilt here from the public parts (the sharer prefilling the turn, the adapter,
``channels.relabelled``), not from the audit's own helpers, and the record's answer must be the one the
receiver gives over it; the matched and control caches must differ from each other and from the sender's."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.audit.channels import relabelled
from kvrelay.audit.edge import EdgeAudit, EdgeInput, check_arms, run_edge_audit
from kvrelay.audit.partners import mismatch_partners
from kvrelay.core.errors import InvalidInput
from kvrelay.fuse import artefact, ridge
from kvrelay.models.loader import load_model
from kvrelay.models.tiny import WORDS
from kvrelay.workflows.spec import AgentSpec, Edge, Workflow
from tests.conftest import random_ids

RECEIVER, SHARER = "tiny:qwen2", "tiny:llama"  # the audited model (sender and receiver) and the sharer
WF = Workflow("pair", (AgentSpec("reader", "read", "what is the code", max_new_tokens=5),
                       AgentSpec("final", "answer", "what is the key", max_new_tokens=5)),
              (Edge("reader", "final"),))
EDGE = "reader->final"
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def models():
    return load_model(RECEIVER), load_model(SHARER)  # what the audit loads by the artefact's sharer name


@pytest.fixture(scope="module")
def folder(models, tmp_path_factory):
    receiver, sharer = models
    state = ridge.fit(sharer, receiver, [random_ids(48, 300 + i) for i in range(10)], ridge.candidate_layers(4, 4))
    config, tensors = ridge.to_artefact(state, (RECEIVER, receiver.identity), (SHARER, sharer.identity),
                                        {"datasets": {"random token ids": 10}})
    return artefact.save(tmp_path_factory.mktemp("adapter") / "tiny__ridge", config, tensors)


def _inputs(n: int) -> list[EdgeInput]:
    rng = random.Random(3)
    return [EdgeInput(str(i), " ".join(rng.choices(WORDS, k=8 + 3 * i)), ("blue",)) for i in range(n)]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True))


def _control(sharer_agent: Agent, mine_ids: list[int], partner_ids: list[int], tail: list[int]):
    """The sharer's cache of the partner's turn, cut or extended to this turn's length, ending with the
    end-of-turn marker, under this turn's tokens: built here, not by the audit."""
    matched = sharer_agent.prefill(mine_ids)
    body = partner_ids[: len(partner_ids) - len(tail)]
    while len(body) < len(mine_ids) - len(tail):
        body = body + body
    return relabelled(sharer_agent.prefill(body[: len(mine_ids) - len(tail)] + tail), matched), matched


def test_adapter_arms_on_an_edge_read_the_sharers_cache_and_the_control_another_inputs(models, folder, tmp_path):
    receiver, sharer = models
    inputs = _inputs(4)
    arm, ctl = f"kv_adapter:{folder}", f"kv_adapter_mismatched:{folder}"
    arms = ("kv", "kv_mismatched", arm, ctl)
    summary = run_edge_audit(WF, EDGE, inputs, "contains", tmp_path, receiver, arms=arms, seeds=SEEDS, n_boot=100)
    rows = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    by = {(r["task_id"], r["arm"], r["seed"]): r for r in rows}
    assert len(rows) == len(by) == len(inputs) * len(arms) * len(SEEDS)
    assert f"adapter_pairing:{folder}" in {e["contrast"] for e in summary["effects"]}

    audit = EdgeAudit(WF, EDGE, inputs, "contains", arms, SEEDS, receiver, tmp_path / "check")
    adapter = ridge.RidgeAdapter.load(folder)
    reader = Agent(sharer, "sharer")
    tail = receiver.tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    order = sorted(range(len(inputs)), key=lambda i: (len(inputs[i].context), i))
    partners = {s: mismatch_partners(order, s) for s in SEEDS}
    pres = [audit.prefix(x) for x in inputs]
    controls_move = False
    for i, x in enumerate(inputs):
        pre = pres[i]
        assert pre.ids[-len(tail):] == tail  # a whole turn ends with the end-of-turn marker
        want = adapter.adapt(reader.prefill(pre.ids), receiver.identity)
        for s in SEEDS:
            j = partners[s][i]
            assert j != i
            got = by[(f"{EDGE}/{x.id}", arm, s)]
            assert "partner" not in got and got["relay_bytes"] == reader.prefill(pre.ids).nbytes
            assert audit.run_arm(audit.arms[2], x, pre, None, s)["answer"] == got["answer"]
            cache, base, *_ = audit._arm_input(audit.arms[2], pre, None, s)
            assert _equal(cache, want) and base == want.token_ids[0].tolist()
            assert not _equal(cache, pre.payload)  # the sharer's cache, not the sender's own

            other, matched = _control(reader, pre.ids, pres[j].ids, tail)
            row = by[(f"{EDGE}/{x.id}", ctl, s)]
            assert row["partner"] == f"{EDGE}/{inputs[j].id}" == by[(f"{EDGE}/{x.id}", "kv_mismatched", s)]["partner"]
            assert torch.equal(other.token_ids, matched.token_ids) and not _equal(other, matched)
            assert audit.run_arm(audit.arms[3], x, pre, other, s)["answer"] == row["answer"]
            cache, base, *_ = audit._arm_input(audit.arms[3], pre, other, s)
            assert _equal(cache, adapter.adapt(other, receiver.identity)) and base == want.token_ids[0].tolist()
            controls_move |= row["answer"] != got["answer"]
    assert controls_move  # another input's sharer cache changes some answer: the control is not the matched arm


def test_the_control_the_audit_builds_is_the_partners_sharer_cache(models, folder, tmp_path):
    receiver, sharer = models
    inputs = _inputs(3)
    audit = EdgeAudit(WF, EDGE, inputs, "contains", (f"kv_adapter_mismatched:{folder}",), (0,), receiver, tmp_path)
    reader = Agent(sharer, "sharer")
    tail = receiver.tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    pres = [audit.prefix(x) for x in inputs]
    for i, j in ((0, 1), (1, 2), (2, 0)):  # shorter and longer partners: cut and extended
        got = audit.shared_mismatched(str(folder), pres[i], pres[j])
        want, _ = _control(reader, pres[i].ids, pres[j].ids, tail)
        assert torch.equal(got.token_ids, want.token_ids)
        assert all((a - b).abs().max() < 1e-4 for a, b in zip(got.keys + got.values, want.keys + want.values,
                                                               strict=True))


def test_sharer_arms_are_refused_clearly_where_they_cannot_run(models, folder, tmp_path):
    receiver, _ = models
    with pytest.raises(InvalidInput, match="the sender's turn is the message"):
        check_arms(("kv", "text_message"))
    for partial in ("kv_partial:0.25", "kv_partial_mismatched:0.25"):  # refused up front, not failing mid-run
        with pytest.raises(InvalidInput, match="driven by the receiver's prompt"):
            check_arms(("kv", partial))
    with pytest.raises(InvalidInput, match="neither a folder"):
        EdgeAudit(WF, EDGE, _inputs(2), "contains", ("kv_adapter:no-such-adapter",), (0,), receiver, tmp_path)
    mine = load_model("tiny:llama")  # an artefact made for another receiver is refused before any trial
    with pytest.raises(Exception, match="adapter artefact"):
        EdgeAudit(WF, EDGE, _inputs(2), "contains", (f"kv_adapter:{folder}",), (0,), mine, tmp_path)


@pytest.fixture(scope="module")
def variant_pair(tmp_path_factory):
    """(base folder, LoRA folder, base model, variant model): a LoRA on q/k/v/up of a tiny llama, as in
    tests/audit/test_variant_arm.py."""
    peft = pytest.importorskip("peft")
    from kvrelay.models.loader import clear_model_cache
    from kvrelay.models.tiny import tiny_lm

    root = tmp_path_factory.mktemp("variant")
    tiny = tiny_lm("llama", seed=0)
    tiny.model.save_pretrained(root / "base")
    tiny.tokenizer.save_pretrained(root / "base")
    torch.manual_seed(5)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"],
                          init_lora_weights=False)
    peft.get_peft_model(tiny_lm("llama", seed=0).model, cfg).save_pretrained(str(root / "ad"))
    clear_model_cache()
    yield root / "base", root / "ad", load_model(str(root / "base")), load_model(f"{root / 'base'}+{root / 'ad'}")
    clear_model_cache()


def test_variant_arms_on_an_edge_relay_the_siblings_cache_through_the_named_repair(variant_pair, tmp_path):
    base_dir, ad, base, variant = variant_pair
    inputs = _inputs(3)
    raw, full, ctl = f"kv_variant:{ad}:raw", f"kv_variant:{ad}:tokens=1", f"kv_variant_mismatched:{ad}:raw"
    arms = ("kv", raw, full, ctl)
    run_edge_audit(WF, EDGE, inputs, "contains", tmp_path, base, arms=arms, seeds=(0,), n_boot=100,
                   model=str(base_dir))
    by = {(r["task_id"], r["arm"]): r for r in map(json.loads, (tmp_path / "records.jsonl").read_text().splitlines())}
    assert len(by) == len(inputs) * len(arms)
    audit = EdgeAudit(WF, EDGE, inputs, "contains", arms, (0,), base, tmp_path / "check", model=str(base_dir))
    sibling = Agent(variant, "sharer")
    tail = base.tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    order = sorted(range(len(inputs)), key=lambda i: (len(inputs[i].context), i))
    partner = mismatch_partners(order, 0)
    pres = [audit.prefix(x) for x in inputs]
    for i, x in enumerate(inputs):
        tid, pre = f"{EDGE}/{x.id}", pres[i]
        cache, *_ = audit._arm_input(audit.arms[1], pre, None, 0)  # raw: the sibling's cache itself
        assert _equal(cache, sibling.prefill(pre.ids)) and cache.meta.adapter.startswith("identity@")
        assert not _equal(cache, pre.payload)  # the fine-tune moved the cache
        assert by[(tid, full)]["answer"] == by[(tid, "kv")]["answer"]  # recomputing every token: the sender's own
        other, _ = _control(sibling, pre.ids, pres[partner[i]].ids, tail)
        assert by[(tid, ctl)]["partner"] == f"{EDGE}/{inputs[partner[i]].id}"
        got, *_ = audit._arm_input(audit.arms[3], pre, other, 0)
        assert _equal(got, other) and not _equal(got, cache)  # the partner's sibling cache, as it is (raw)
        assert audit.run_arm(audit.arms[3], x, pre, other, 0)["answer"] == by[(tid, ctl)]["answer"]
        assert audit.run_arm(audit.arms[1], x, pre, None, 0)["answer"] == by[(tid, raw)]["answer"]


def test_a_layers_adapter_is_read_by_the_receiver_and_refused_where_its_turn_is_passed_on(models, folder, tmp_path):
    """A ``layers`` adapter's output holds some layers only: the receiver maps the sharer's cache itself and
    answers in the continue layout; an edge whose receiver's turn a later agent continues from is refused."""
    from kvrelay.fuse import layers as LY

    receiver, sharer = models
    imp = torch.zeros(4)
    config, tensors = LY.to_artefact(ridge.RidgeAdapter.load(folder), (1, 2), imp, LY.scores(imp),
                                     LY.gaussian_prior(4), 0.5, 0.5, {"n_problems": 0})
    lfolder = artefact.save(tmp_path / "tiny__layers", config, tensors)
    inputs = _inputs(2)
    run_edge_audit(WF, EDGE, inputs, "contains", tmp_path / "out", receiver, arms=("kv", f"kv_adapter:{lfolder}"),
                   n_boot=100)
    by = {(r["task_id"], r["arm"]): r for r in map(json.loads, (tmp_path / "out" / "records.jsonl").read_text().splitlines())}
    audit = EdgeAudit(WF, EDGE, inputs, "contains", ("kv",), (0,), receiver, tmp_path / "check")
    adapter = LY.LayersAdapter.load(lfolder)
    for x in inputs:
        sent = Agent(sharer, "sharer").prefill(audit.prefix(x).ids)
        row = by[(f"{EDGE}/{x.id}", f"kv_adapter:{lfolder}")]
        assert row["relay_bytes"] == adapter.adapt(sent, receiver.identity).nbytes < sent.nbytes
        final = Agent(receiver, "final", role="answer", max_new_tokens=5, adapter=adapter)
        assert row["answer"] == final.respond("what is the key", sent).text
    chain = Workflow("chain", (*WF.agents, AgentSpec("extra", "check", "is it right", max_new_tokens=3)),
                     (*WF.edges, Edge("final", "extra")))
    with pytest.raises(InvalidInput, match="final's own turn is continued from as a cache"):
        EdgeAudit(chain, EDGE, inputs, "contains", (f"kv_adapter:{lfolder}",), (0,), receiver, tmp_path / "c")


def test_cli_refuses_a_missing_adapter_and_text_message_on_an_edge_before_loading(tmp_path):
    from typer.testing import CliRunner

    from kvrelay.cli.app import app

    wf, rows = tmp_path / "wf.toml", tmp_path / "in.jsonl"
    wf.write_text(WF.to_toml())
    rows.write_text("".join(json.dumps({"context": x.context, "reference": "blue"}) + "\n" for x in _inputs(2)))
    args = ["audit", "--workflow", str(wf), "--edge", EDGE, "--inputs", str(rows), "--score", "contains",
            "--model", "tiny:qwen2", "--out", str(tmp_path / "o")]
    for arms, says in (("kv,kv_adapter:no-such-adapter", "neither a folder"),
                       ("kv,text_message", "the sender's turn is the message")):
        res = CliRunner().invoke(app, [*args, "--arms", arms])
        assert res.exit_code == 2 and says in " ".join(res.output.split()), res.output
        assert not (tmp_path / "o").exists()
