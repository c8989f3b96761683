"""Variant arms on a tiny model folder and a LoRA adapter of it, loaded by the ``BASE+ADAPTER`` route: the
sibling's cache reaches the receiver only through the repair the arm names, and the control is the
sibling's length-matched cache of another task."""

from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402

from kvrelay.agents.agent import Agent  # noqa: E402
from kvrelay.audit.arms import parse_arm  # noqa: E402
from kvrelay.audit.channels import relabelled, variant_model  # noqa: E402
from kvrelay.audit.partners import mismatch_partners, run_order  # noqa: E402
from kvrelay.audit.runner import SENDER_ROLE, AuditConfig, AuditRunner, length_matched  # noqa: E402
from kvrelay.audit.stats import summarize  # noqa: E402
from kvrelay.audit.tasks import Task  # noqa: E402
from kvrelay.audit.vocab import contrast_arms, contrasts_for, dial_family  # noqa: E402
from kvrelay.core.errors import IncompatiblePayload  # noqa: E402
from kvrelay.models.loader import clear_model_cache, load_model  # noqa: E402
from kvrelay.models.tiny import WORDS, tiny_lm  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(base folder, adapter folder, base model, variant model): a LoRA on q/k/v/up of a tiny llama (a qwen2 folder would load a BPE tokenizer)."""
    root = tmp_path_factory.mktemp("variant")
    tiny = tiny_lm("llama", seed=0)
    tiny.model.save_pretrained(root / "base")
    tiny.tokenizer.save_pretrained(root / "base")
    torch.manual_seed(5)
    fresh = tiny_lm("llama", seed=0).model
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"], init_lora_weights=False)
    get_peft_model(fresh, cfg).save_pretrained(str(root / "ad"))
    clear_model_cache()
    base, variant = load_model(str(root / "base")), load_model(f"{root / 'base'}+{root / 'ad'}")
    yield root / "base", root / "ad", base, variant
    clear_model_cache()


def _tasks(n: int) -> list[Task]:
    """Contexts of the tiny tokenizer's own words (generated records would read as unknown tokens)."""
    rng = random.Random(7)
    return [Task(id=f"w/{i}", task="w", regime="private", context=" ".join(rng.choices(WORDS, k=40 + 3 * i)),
                 prompt="what is the code", answers=("blue",), scorer="contains") for i in range(n)]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True))


def test_variant_arm_names_repairs_and_contrasts():
    a = parse_arm("kv_variant:summarizer:tokens=0.1")
    assert (a.base, a.variant, a.repair, a.channel) == ("kv_variant", "summarizer", "tokens=0.1", "variant:summarizer")
    assert parse_arm("kv_variant:s:recompute:layers=0-1,tokens=0.05").repair == "recompute:layers=0-1,tokens=0.05"
    ctl = parse_arm("kv_variant_mismatched:s:raw")
    assert ctl.mismatched_control and ctl.repair == "raw" and not a.mismatched_control
    assert parse_arm("kv").variant is None and parse_arm("kv_adapter:x").variant is None
    assert dial_family("kv_variant:s:tokens=0.1") is None
    with pytest.raises(ValueError, match="named repair"):
        parse_arm("kv_variant:summarizer")
    for bad in ("kv_variant", "kv_variant:s:tokens=2", "kv_variant:s:heads=3", "kv_variant_mismatched:s"):
        with pytest.raises(ValueError, match="expected"):
            parse_arm(bad)
    with pytest.raises(ValueError, match="profile"):
        parse_arm("kv_variant:s:layers=auto:4")
    assert contrast_arms("variant_pairing:s:raw") == ("kv_variant:s:raw", "kv_variant_mismatched:s:raw")
    assert contrast_arms("variant_vs_kv:s:tokens=0.1") == ("kv_variant:s:tokens=0.1", "kv")
    got = contrasts_for(["kv", "kv_variant:s:raw", "kv_variant_mismatched:s:raw"])
    assert got["variant_vs_kv:s:raw"] == ("kv_variant:s:raw", "kv") and "variant_pairing:s:raw" in got
    assert variant_model("qwen2.5-coder-0.5b", "qa") == "qwen2.5-coder-0.5b+qa"
    assert variant_model("qwen2.5-coder-0.5b+summarizer", "qa") == "qwen2.5-coder-0.5b+qa"


def test_variant_arms_relay_the_siblings_cache_through_the_named_repair(pair, tmp_path):
    base_dir, ad, base, variant = pair
    tasks = _tasks(4)
    raw, full, ctl = f"kv_variant:{ad}:raw", f"kv_variant:{ad}:tokens=1", f"kv_variant_mismatched:{ad}:raw"
    runner = AuditRunner(AuditConfig(model=str(base_dir), tasks=("gen",), arms=("kv", raw, full, ctl)), base, tmp_path)
    assert runner.channels[f"variant:{ad}"].agent.lm.identity.fingerprint == variant.identity.fingerprint
    partners = mismatch_partners(run_order(tasks))
    states = runner.read_batch(tasks, [0, 1], partners)
    got_raw, sizes, _ = runner._contexts(parse_arm(raw), states, 0)
    got_full, _, _ = runner._contexts(parse_arm(full), states, 0)
    got_ctl, _, _ = runner._contexts(parse_arm(ctl), states, 0)
    reader = Agent(variant, "sharer", role=SENDER_ROLE)
    for st, r, f, c, nbytes in zip(states, got_raw, got_full, got_ctl, sizes, strict=True):
        sent = reader.read(st.task.context)
        with pytest.raises(IncompatiblePayload):  # unrepaired, the receive path refuses the sibling's cache
            Agent(base, "receiver").check(sent)
        assert _equal(r, sent) and r.meta.adapter.startswith("identity@") and nbytes == sent.nbytes
        assert not torch.allclose(r.keys[2], st.payload.keys[2], atol=1e-4)  # the fine-tune moved the cache
        assert _equal(f, st.payload) and f.meta.adapter.startswith("recompute@")  # 100%: the receiver's own
        other = relabelled(length_matched(reader, tasks, partners[st.index], sent.num_tokens), sent)
        assert torch.equal(c.token_ids, sent.token_ids) and not torch.allclose(c.keys[2], sent.keys[2], atol=1e-3)
        assert all((a - b).abs().max() < 1e-4 for a, b in zip(c.keys, other.keys, strict=True))


def test_a_variant_audit_reports_the_divergence_and_the_repair(pair, tmp_path):
    base_dir, ad, base, _ = pair
    arms = ("none", "kv", f"kv_variant:{ad}:raw", f"kv_variant:{ad}:tokens=1", f"kv_variant_mismatched:{ad}:raw")
    cfg = AuditConfig(model=str(base_dir), tasks=("gen",), arms=arms, seeds=(0,), limit=4, batch_size=2)
    records = [json.loads(line) for line in AuditRunner(cfg, base, tmp_path).run().read_text().splitlines()]
    by = {(r["task_id"], r["arm"]): r for r in records}
    assert len(records) == 4 * len(arms)
    for tid in {r["task_id"] for r in records}:  # full recompute answers like the receiver's own cache
        assert by[(tid, f"kv_variant:{ad}:tokens=1")]["answer"] == by[(tid, "kv")]["answer"]
    names = {e["contrast"] for e in summarize(records, n_boot=200)["effects"] if e["outcome"] == "success"}
    assert {f"variant_vs_kv:{ad}:raw", f"variant_vs_kv:{ad}:tokens=1", f"variant_pairing:{ad}:raw"} <= names
