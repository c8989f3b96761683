"""Selective recompute on the receive path: the two ends are exact, the middle is a real repair, nothing silent."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.core.errors import IncompatiblePayload
from kvrelay.fuse.adapter import IdentityAdapter
from kvrelay.fuse.profile import DeviationProfile, load_profile, profile_pair
from kvrelay.fuse.repair import RecomputePlan, parse_repair, repair_adapter, selective_recompute
from kvrelay.models.tiny import tiny_lm

TEXT = "the code of the vault is blue red green one two three and the answer is five " * 3
PROMPT = "what is the code of the vault"


@pytest.fixture(scope="module", params=("llama", "qwen2"))
def pair(request):
    """A receiver and a sibling sender: same tokenizer and geometry, other weights (other fingerprint)."""
    return tiny_lm(request.param, seed=0), tiny_lm(request.param, seed=1)


def _max_err(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True))


def _sq_err(a, b, layer: int) -> float:
    return float(((a.keys[layer] - b.keys[layer]) ** 2).sum() + ((a.values[layer] - b.values[layer]) ** 2).sum())


@pytest.mark.parametrize("spec", ["recompute:tokens=1", "recompute:layers=0-3", "recompute:layers=2-3,tokens=1"])
def test_full_recompute_is_the_receivers_own_prefill(pair, spec):
    receiver, sender = pair
    ids = Agent(receiver).reading_ids(TEXT)
    relayed = Agent(sender, "planner").prefill(ids)
    own = Agent(receiver).prefill(ids)
    agent = Agent(receiver, "worker", max_new_tokens=6, adapter=repair_adapter(receiver, spec))
    repaired = agent.check(relayed)
    assert _max_err(repaired, own) == 0.0  # the decoder's own forward: bit for bit
    assert repaired.meta.model_fingerprint == receiver.identity.fingerprint
    assert repaired.meta.adapter.startswith("recompute@")
    text = Agent(receiver, "worker", max_new_tokens=6).respond(PROMPT, relayed.token_ids)
    assert agent.respond(PROMPT, relayed).token_ids == text.token_ids


def test_zero_recompute_is_raw_reuse(pair):
    receiver, sender = pair
    relayed = Agent(sender, "planner").prefill(Agent(receiver).reading_ids(TEXT))
    repaired = Agent(receiver, adapter=repair_adapter(receiver, "recompute:tokens=0")).check(relayed)
    assert _max_err(repaired, relayed) == 0.0
    raw = Agent(receiver, max_new_tokens=6,
                adapter=IdentityAdapter(sender.identity.fingerprint, receiver.identity.fingerprint))
    rep = Agent(receiver, max_new_tokens=6, adapter=repair_adapter(receiver, "recompute:tokens=0"))
    assert rep.respond(PROMPT, relayed).token_ids == raw.respond(PROMPT, relayed).token_ids


def test_partial_recompute_fixes_the_check_layers_and_shrinks_the_rest(pair):
    receiver, sender = pair
    ids = Agent(receiver).reading_ids(TEXT)
    relayed, own = Agent(sender).prefill(ids), Agent(receiver).prefill(ids)
    repaired, stats = selective_recompute(receiver.model, relayed, RecomputePlan(2, 0.3))
    assert _sq_err(repaired, own, 0) == 0.0 and _sq_err(repaired, own, 1) == 0.0
    assert all(_sq_err(repaired, own, lay) < _sq_err(relayed, own, lay) for lay in (2, 3))
    n = relayed.num_tokens
    assert len(stats.chosen) == -(-3 * n // 10)
    assert stats.budget == pytest.approx((2 * n + 2 * len(stats.chosen)) / (4 * n))
    untouched = sorted(set(range(n)) - set(stats.chosen))
    assert torch.equal(repaired.keys[3][:, :, untouched], relayed.keys[3][:, :, untouched])
    assert stats.cost == pytest.approx((2 * n + 4 * len(stats.chosen)) / (4 * n), abs=1e-6)  # chosen: every layer


def test_a_prefix_that_is_not_the_receivers_own_cache_is_refused(pair):
    receiver, sender = pair
    ids = Agent(receiver).reading_ids(TEXT)
    foreign = Agent(sender).prefill(ids)
    with pytest.raises(ValueError, match="not the receiver's own cache"):
        selective_recompute(receiver.model, foreign, RecomputePlan(2, 0.3), exact_prefix=5)
    gapped = replace(foreign, positions=foreign.positions + (torch.arange(foreign.num_tokens) >= 4).long())
    with pytest.raises(ValueError, match="consecutive"):
        selective_recompute(receiver.model, gapped, RecomputePlan(2, 0.3))


def test_a_sibling_payload_without_a_named_repair_is_refused(pair):
    receiver, sender = pair
    relayed = Agent(sender, "planner").prefill(Agent(receiver).reading_ids(TEXT))
    with pytest.raises(IncompatiblePayload) as err:
        Agent(receiver, "worker").respond(PROMPT, relayed)
    assert err.value.field == "model_fingerprint"


def test_repair_refuses_senders_it_was_not_told_to_accept(pair):
    receiver, sender = pair
    relayed = Agent(sender).prefill(Agent(receiver).reading_ids(TEXT))
    named = repair_adapter(receiver, "recompute:tokens=0.5", sources=("someone-else",))
    with pytest.raises(IncompatiblePayload, match="named senders"):
        Agent(receiver, adapter=named).check(relayed)
    other_arch = tiny_lm("llama" if receiver.identity.arch == "qwen2" else "qwen2", seed=2)
    foreign = Agent(other_arch).prefill(Agent(receiver).reading_ids(TEXT))
    with pytest.raises(IncompatiblePayload):
        Agent(receiver, adapter=repair_adapter(receiver, "recompute:tokens=0.5")).check(foreign)


def test_sliding_window_models_are_refused():
    gemma, sibling = tiny_lm("gemma3", seed=0), tiny_lm("gemma3", seed=1)
    relayed = Agent(sibling).prefill(Agent(gemma).reading_ids("the code is blue"))
    with pytest.raises(IncompatiblePayload, match="full-attention"):
        Agent(gemma, adapter=repair_adapter(gemma, "recompute:tokens=0.5")).check(relayed)


@pytest.mark.parametrize("text", ["recompute:", "recompute:tokens=2", "tokens=x", "recompute:layers=a-b",
                                  "recompute:heads=3", "recompute:tokens=0.1,check=0"])
def test_bad_specs_say_what_is_expected(text):
    with pytest.raises(ValueError, match="expected|fraction|check"):
        parse_repair(text)


def test_spec_plans():
    assert parse_repair("recompute:tokens=0.15").plan(24) == RecomputePlan(2, 0.15)
    assert parse_repair("tokens=0.15,check=4").plan(24) == RecomputePlan(4, 0.15)
    assert parse_repair("recompute:layers=3-5").plan(24) == RecomputePlan(6, 0.0)
    assert parse_repair("recompute:layers=0-3,tokens=0.1").plan(24) == RecomputePlan(4, 0.1)
    assert parse_repair("recompute:tokens=0").plan(24) == RecomputePlan(0, 0.0)
    with pytest.raises(ValueError, match="profile"):
        parse_repair("recompute:layers=auto:4").plan(24)
    assert parse_repair("recompute:layers=auto:2").plan(24, block=(5, 6)) == RecomputePlan(7, 0.0)


def test_replace_layout_with_full_repair_equals_text_mode(pair):
    receiver, _ = pair
    sender = Agent(receiver, "planner")
    worker = Agent(receiver, "worker, answer briefly", max_new_tokens=6)
    relayed = sender.read(TEXT)
    text = worker.respond(PROMPT, relayed.token_ids, layout="replace")
    fixed = worker.respond(PROMPT, relayed, layout="replace", repair="recompute:tokens=1")
    assert fixed.token_ids == text.token_ids
    with pytest.raises(ValueError, match="replace layout"):
        worker.respond(PROMPT, relayed, repair="recompute:tokens=1")


def test_profile_artefact_and_block_choice(pair, tmp_path):
    receiver, sender = pair
    seqs = [Agent(receiver).reading_ids(TEXT)]
    same = profile_pair(receiver, receiver, seqs)
    assert max(same.deviation) == 0.0
    prof = profile_pair(sender, receiver, seqs)
    assert min(prof.deviation) > 0.0
    again = load_profile(prof.save(tmp_path / "p.json"))
    assert again == prof and again.digest == prof.digest
    made = DeviationProfile("s", "r", (0.1, 0.2, 0.9, 1.0), (0.1, 0.2, 0.9, 1.0), 1, 10)
    assert made.block(1) == (2, 2) and made.block(2) == (1, 2)
    with pytest.raises(IncompatiblePayload):
        made.require_pair("s", "other")
    relayed = Agent(sender).prefill(seqs[0])
    auto = repair_adapter(receiver, "recompute:layers=auto:2", profile=prof)
    assert auto.plan(relayed).full_layers == prof.block(2)[1] + 1
    with pytest.raises(IncompatiblePayload, match="profile"):
        repair_adapter(receiver, "recompute:layers=auto:2", profile=made).plan(relayed)


@pytest.mark.parametrize("plan,prefix", [(RecomputePlan(2, 0.3), 0), (RecomputePlan(1, 0.5), 7), (RecomputePlan(3, 0.0), 4)])
def test_recomputing_the_receivers_own_cache_changes_nothing(pair, plan, prefix):
    """A fixpoint: chosen tokens attend to exact K/V of the others, before them only, so nothing moves."""
    receiver, _ = pair
    own = Agent(receiver).prefill(Agent(receiver).reading_ids(TEXT))
    again, stats = selective_recompute(receiver.model, own, plan, exact_prefix=prefix)
    assert _max_err(again, own) < 1e-5
    assert all(s >= prefix for s in stats.chosen)
