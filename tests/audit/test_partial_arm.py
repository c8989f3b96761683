"""The partial-relay arms on a tiny random model: the receiver's own prompt chooses the positions of the
matched payload (``kv_partial:F``) and of another task's length-matched payload (``kv_partial_mismatched:F``)."""

from __future__ import annotations

import json

import pytest
import torch

from kvrelay.audit.arms import parse_arm
from kvrelay.audit.partners import mismatch_partners, run_order
from kvrelay.audit.runner import AuditConfig, AuditRunner
from kvrelay.audit.stats import summarize
from kvrelay.audit.tasks import generate
from kvrelay.audit.vocab import contrast_arms, contrasts_for, dial_family
from kvrelay.kv.partial import Budget, PartialRequest, select


def test_partial_arm_names_and_contrasts():
    a = parse_arm("kv_partial:0.25")
    assert (a.base, a.dial, a.needs_mismatch) == ("kv_partial", "0.25", False)
    assert parse_arm("kv_partial_mismatched:0.25").needs_mismatch
    for bad in ("kv_partial", "kv_partial:0", "kv_partial:1.5", "kv_partial:x", "kv_partial_mismatched:2"):
        with pytest.raises(ValueError):
            parse_arm(bad)
    assert contrast_arms("partial_pairing:0.25") == ("kv_partial:0.25", "kv_partial_mismatched:0.25")
    assert contrast_arms("partial_vs_kv:0.25") == ("kv_partial:0.25", "kv")
    assert "partial_pairing:0.25" in contrasts_for(["kv", "kv_partial:0.25", "kv_partial_mismatched:0.25"])
    assert dial_family("kv_partial:0.25") == ("kv_partial", "0.25", 0.25)


def test_partial_arms_select_by_the_receivers_prompt(tiny_by_arch, tmp_path):
    lm = tiny_by_arch["qwen2"]
    tasks = generate(4, seed=3, n_distractors=0, doc_tokens=48)
    arms = ("kv_partial:0.5", "kv_partial_mismatched:0.5")
    runner = AuditRunner(AuditConfig(model="tiny:qwen2", tasks=("gen",), arms=("kv", *arms)), lm, tmp_path)
    states = runner.read_batch(tasks, [0, 1], mismatch_partners(run_order(tasks)))
    got, sizes, _ = runner._contexts(parse_arm(arms[0]), states, 0)
    ctl, ctl_sizes, _ = runner._contexts(parse_arm(arms[1]), states, 0)
    for st, g, c, n in zip(states, got, ctl, sizes, strict=True):
        q = tuple(runner.receiver.prompt_ids(st.task.prompt))
        want = select(st.payload, PartialRequest(q, Budget(fraction=0.5)), model=lm.model)
        assert n == want.compressed.nbytes < st.payload.nbytes
        assert all(torch.equal(a, b) for a, b in zip(g.keys, want.compressed.decompress().keys, strict=True))
        assert c.num_tokens == g.num_tokens and not torch.equal(c.keys[0], g.keys[0])  # another task's cache
    assert ctl_sizes == sizes


def test_partial_arms_run_and_pairing_is_reported(tiny_by_arch, tmp_path):
    cfg = AuditConfig(model="tiny:qwen2", tasks=("gen_easy",), arms=("kv", "kv_partial:0.5",
                                                                     "kv_partial_mismatched:0.5"),
                      limit=3, batch_size=2)
    AuditRunner(cfg, tiny_by_arch["qwen2"], tmp_path).run()
    rows = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(rows) == 9
    kv = {r["task_id"]: r["relay_bytes"] for r in rows if r["arm"] == "kv"}
    assert all(r["relay_bytes"] < kv[r["task_id"]] for r in rows if r["arm"].startswith("kv_partial"))
    got = {e["contrast"] for e in summarize(rows, n_boot=200)["effects"] if e["outcome"] == "success"}
    assert {"partial_pairing:0.5", "partial_vs_kv:0.5"} <= got
