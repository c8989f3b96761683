"""Adapter arms on tiny random models: the receiver gets the sharer's cache through the adapter, the
control gets the sharer's length-matched cache of another task, and the summary pairs them."""

from __future__ import annotations

import json

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.audit.arms import parse_arm
from kvrelay.audit.channels import relabelled, resolve
from kvrelay.audit.partners import mismatch_partners, run_order
from kvrelay.audit.runner import SENDER_ROLE, AuditConfig, AuditRunner, length_matched
from kvrelay.audit.stats import summarize
from kvrelay.audit.tasks import generate
from kvrelay.audit.vocab import contrast_arms, contrasts_for, dial_family
from kvrelay.core.errors import AdapterMismatch
from kvrelay.fuse import artefact, ridge
from kvrelay.models.loader import load_model
from tests.conftest import random_ids

RECEIVER, SHARER = "tiny:llama", "tiny:qwen2:1"


@pytest.fixture(scope="module")
def models():
    return load_model(RECEIVER), load_model(SHARER)  # what the runner loads by the artefact's sharer name


@pytest.fixture(scope="module")
def folder(models, tmp_path_factory):
    receiver, sharer = models
    readings = [random_ids(48, 300 + i) for i in range(10)]
    state = ridge.fit(sharer, receiver, readings, ridge.candidate_layers(4, 4))
    config, tensors = ridge.to_artefact(state, (RECEIVER, receiver.identity), (SHARER, sharer.identity),
                                        {"datasets": {"random token ids": 10}})
    return artefact.save(tmp_path_factory.mktemp("adapter") / "tiny__ridge", config, tensors)


def test_adapter_arm_names_and_contrasts():
    a = parse_arm("kv_adapter:pair__ridge")
    assert (a.base, a.adapter, a.needs_mismatch) == ("kv_adapter", "pair__ridge", False)
    assert parse_arm("kv_adapter_mismatched:pair__ridge").adapter == "pair__ridge"
    assert parse_arm("kv").adapter is None and dial_family("kv_adapter:pair__ridge") is None
    for bad in ("kv_adapter", "kv_adapter_mismatched", "kv_adapter:"):
        with pytest.raises(ValueError):
            parse_arm(bad)
    assert contrast_arms("adapter_pairing:X") == ("kv_adapter:X", "kv_adapter_mismatched:X")
    assert contrast_arms("adapter_vs_none:X") == ("kv_adapter:X", "none")
    assert contrast_arms("pairing") == ("kv", "kv_mismatched") and contrast_arms("telepathy:X") is None
    got = contrasts_for(["kv", "kv_adapter:X", "kv_adapter_mismatched:X"])
    assert got["adapter_pairing:X"] == ("kv_adapter:X", "kv_adapter_mismatched:X") and "pairing" in got
    with pytest.raises(ValueError, match="committed"):
        resolve("no-such-adapter")


def test_adapter_arm_sends_the_sharers_cache_through_the_adapter(models, folder, tmp_path):
    receiver, sharer = models
    tasks = generate(4, seed=3, n_distractors=0, doc_tokens=48)
    arms = (f"kv_adapter:{folder}", f"kv_adapter_mismatched:{folder}")
    runner = AuditRunner(AuditConfig(model=RECEIVER, tasks=("gen",), arms=("kv", *arms)), receiver, tmp_path)
    partners = mismatch_partners(run_order(tasks))
    states = runner.read_batch(tasks, [0, 1], partners)
    matched, sizes, _ = runner._contexts(parse_arm(arms[0]), states, 0)
    control, _, _ = runner._contexts(parse_arm(arms[1]), states, 0)
    adapter = ridge.RidgeAdapter.load(folder)
    reader = Agent(sharer, "sharer", role=SENDER_ROLE)
    for st, got, ctl, nbytes in zip(states, matched, control, sizes, strict=True):
        sent = reader.read(st.task.context)
        want = adapter.adapt(sent, receiver.identity)
        assert got.meta.adapter.startswith("ridge@") and nbytes == sent.nbytes
        assert all(torch.equal(a, b) for a, b in zip(got.keys + got.values, want.keys + want.values, strict=True))
        own = st.payload  # the receiver's own reading of the same text: not what the arm relays
        assert got.keys[2].shape == own.keys[2].shape and not torch.allclose(got.keys[2], own.keys[2], atol=1e-3)
        other = relabelled(length_matched(reader, tasks, partners[st.index], sent.num_tokens), sent)
        want_ctl = adapter.adapt(other, receiver.identity)
        assert ctl.num_tokens == got.num_tokens and torch.equal(ctl.token_ids, got.token_ids)
        assert all((a - b).abs().max() < 1e-4 for a, b in zip(ctl.keys, want_ctl.keys, strict=True))  # partner cache reused
        assert not torch.allclose(ctl.keys[2], got.keys[2], atol=1e-3)


def test_adapter_arm_runs_and_its_pairing_is_reported(models, folder, tmp_path):
    receiver, _ = models
    name = str(folder)
    cfg = AuditConfig(model=RECEIVER, tasks=("gen_easy",), arms=("none", f"kv_adapter:{name}",
                                                                  f"kv_adapter_mismatched:{name}"),
                      limit=3, batch_size=2)
    AuditRunner(cfg, receiver, tmp_path).run()
    rows = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(rows) == 9 and {r["arm"] for r in rows} == set(cfg.arms)
    assert all(r["relay_bytes"] > 0 and r["sender_s"] > 0 for r in rows if r["arm"] != "none")
    summary = summarize(rows, n_boot=200)
    got = {e["contrast"] for e in summary["effects"] if e["outcome"] == "success"}
    assert {f"adapter_pairing:{name}", f"adapter_vs_none:{name}"} <= got


def test_an_adapter_for_another_receiver_is_refused_before_any_trial(folder, tmp_path):
    other = load_model("tiny:qwen2")
    with pytest.raises(AdapterMismatch, match="receiver"):
        AuditRunner(AuditConfig(model="tiny:qwen2", tasks=("gen",), arms=(f"kv_adapter:{folder}",)), other, tmp_path)


def test_a_layers_adapter_arm_reads_each_row_through_its_chosen_layers(models, folder, tmp_path):
    """``layers`` output holds some layers only: the runner hands the sharer's cache to a receiver with the adapter."""
    from kvrelay.fuse import layers as LY

    receiver, sharer = models
    rdg = ridge.RidgeAdapter.load(folder)
    imp = torch.zeros(4)
    config, tensors = LY.to_artefact(rdg, (1, 2), imp, LY.scores(imp), LY.gaussian_prior(4), 0.5, 0.5, {})
    lfolder = artefact.save(tmp_path / "tiny__layers", config, tensors)
    name = str(lfolder)
    cfg = AuditConfig(model=RECEIVER, tasks=("gen_easy",), arms=(f"kv_adapter:{name}", f"kv_adapter:{folder}"),
                      limit=2, batch_size=2)
    AuditRunner(cfg, receiver, tmp_path / "run").run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    by = {(r["arm"], r["task_id"]): r for r in rows}
    tasks = sorted({r["task_id"] for r in rows})
    layers_rows = [by[(f"kv_adapter:{name}", t)] for t in tasks]
    assert all(r["batch"] == 1 for r in layers_rows)
    assert all(r["relay_bytes"] < by[(f"kv_adapter:{folder}", r["task_id"])]["relay_bytes"] for r in layers_rows)
    # the same answer as a receiver given the sharer's reading through that adapter, row by row
    from kvrelay.audit.runner import MAX_NEW, RECEIVER_ROLE
    from kvrelay.audit.tasks.datasets import load_tasks

    adapter = LY.LayersAdapter.load(lfolder)
    reader = Agent(sharer, "sharer", role=SENDER_ROLE)
    chosen = {t.id: t for t in load_tasks("gen_easy", 2)}
    assert set(chosen) == set(tasks)
    for t in chosen.values():
        want = Agent(receiver, "receiver", role=RECEIVER_ROLE, adapter=adapter).respond(
            t.prompt, reader.read(t.context), max_new_tokens=MAX_NEW.get(t.scorer, 16))
        assert by[(f"kv_adapter:{name}", t.id)]["answer"] == want.text
