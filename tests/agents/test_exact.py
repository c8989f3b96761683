"""Relay exactness on tiny random llama / qwen2 / gemma3 models (fp32, ≤ 1e-4)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.kv.cache import to_cache
from kvrelay.kv.transforms import pad_batch, shift_positions, unpad_row
from kvrelay.models.generate import forward_all
from tests.conftest import random_ids

TOL = 1e-4


def logits_after(lm, payload, new_ids, start):
    cache = to_cache(payload, lm.model.config)
    ids = torch.tensor([new_ids])
    pos = torch.arange(start, start + len(new_ids))[None]
    return forward_all(lm.model, ids, pos, cache, None)[0]


def full_logits(lm, ids, start=0):
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    pos = torch.arange(start, start + len(ids))[None]
    return forward_all(lm.model, torch.tensor([ids]), pos, cache, None)[0]


@pytest.mark.parametrize("T", [5, 23])  # 23 crosses gemma3's sliding window of 8
def test_relayed_payload_logits_equal_prefill(tiny, T):
    agent = Agent(tiny, "sender")
    ctx, new = random_ids(T, 1), random_ids(7, 2)
    payload = agent.prefill(ctx)
    relayed = logits_after(tiny, payload, new, T)
    reference = full_logits(tiny, ctx + new)[T:]
    assert (relayed - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("delta", [3, 17, 250])
def test_shift_positions_equals_payload_computed_at_offset(tiny, delta):
    agent = Agent(tiny, "sender")
    ctx = random_ids(21, 3)
    moved = shift_positions(agent.prefill(ctx, start=0), delta)
    direct = agent.prefill(ctx, start=delta)
    assert torch.equal(moved.positions, direct.positions)
    for km, kd, vm, vd in zip(moved.keys, direct.keys, moved.values, direct.values, strict=True):
        assert km.shape == kd.shape  # sliding layers keep their tail through the shift
        assert (km - kd).abs().max().item() <= TOL
        assert (vm - vd).abs().max().item() <= TOL  # equal up to float rounding of deeper layers
    # and the receiver continues identically from either
    new = random_ids(6, 4)
    a = logits_after(tiny, moved, new, delta + 21)
    b = logits_after(tiny, direct, new, delta + 21)
    assert (a - b).abs().max().item() <= TOL


def test_shift_roundtrip_and_negative_guard(tiny):
    p = Agent(tiny, "s").prefill(random_ids(9, 5), start=10)
    back = shift_positions(shift_positions(p, 40), -40)
    assert all((a - b).abs().max() <= TOL for a, b in zip(back.keys, p.keys, strict=True))
    with pytest.raises(ValueError, match="negative"):
        shift_positions(p, -11)


def test_padded_batch_matches_each_payload_alone(tiny):
    agent = Agent(tiny, "receiver", max_new_tokens=8)
    sender = Agent(tiny, "sender")
    payloads = [sender.prefill(random_ids(n, 10 + n)) for n in (4, 13, 22)]
    prompts = ["what is the code", "which vault is blue and what is the key", "how many"]
    batched = agent.respond_batch(prompts, payloads)
    for p, prompt, got in zip(payloads, prompts, batched, strict=True):
        alone = agent.respond(prompt, p, max_new_tokens=8)
        assert got.token_ids == alone.token_ids
    # pad_batch then unpad_row gives back each payload exactly
    batch = pad_batch(payloads)
    for i, p in enumerate(payloads):
        row = unpad_row(batch, i)
        assert torch.equal(row.token_ids, p.token_ids) and torch.equal(row.positions, p.positions)
        assert all(torch.equal(a, b) for a, b in zip(row.keys, p.keys, strict=True))


def test_continue_layout_kv_equals_text_reencode(tiny):
    sender, receiver = Agent(tiny, "sender", role="read the report"), Agent(tiny, "receiver", max_new_tokens=10)
    payload = sender.read("the bug is in line seven of the file")
    kv = receiver.respond("what is the fix", payload)
    text = receiver.respond("what is the fix", payload.token_ids)
    assert kv.token_ids == text.token_ids
    assert kv.relayed_tokens == payload.num_tokens and text.relayed_tokens == 0
    assert text.prefill_tokens == kv.prefill_tokens + payload.num_tokens


def test_returned_payload_continues_the_conversation(tiny):
    """A turn's returned payload (context + prompt + answer) equals prefilling that whole sequence."""
    sender, receiver = Agent(tiny, "a"), Agent(tiny, "b", max_new_tokens=5)
    first = sender.read("the code of the blue vault is seven")
    r = receiver.respond("what is the code", first, return_payload=True)
    state = r.payload
    assert torch.equal(state.positions[0], torch.arange(state.num_tokens))
    ref = Agent(tiny, "ref").prefill(state.token_ids[0].tolist())
    for a, b in zip(state.keys, ref.keys, strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() <= TOL


def test_padded_batch_same_prompt_crosses_sliding_window(tiny):
    """One padded batch (no grouping): payloads of 3, 11 and 26 tokens, gemma3's window is 8."""
    agent = Agent(tiny, "receiver", max_new_tokens=12)
    sender = Agent(tiny, "sender")
    payloads = [sender.prefill(random_ids(n, 30 + n)) for n in (3, 11, 26)]
    batched = agent.respond_batch(["what is the code"] * 3, payloads)
    for p, got in zip(payloads, batched, strict=True):
        assert got.token_ids == agent.respond("what is the code", p, max_new_tokens=12).token_ids


def test_text_batch_matches_each_alone(tiny):
    """The text channel batched (left-padded full prefill) gives each row's solo answer."""
    agent = Agent(tiny, "receiver", max_new_tokens=8)
    ctxs = [random_ids(n, 50 + n) for n in (2, 9, 17)]
    prompts = ["what is the code"] * 3 if tiny.identity.sliding_window else ["what", "which vault is blue", "how"]
    batched = agent.respond_batch(prompts, ctxs)
    for c, prompt, got in zip(ctxs, prompts, batched, strict=True):
        assert got.token_ids == agent.respond(prompt, c, max_new_tokens=8).token_ids
    with pytest.raises(ValueError, match="mixes"):
        agent.respond_batch(["a", "b"], [Agent(tiny, "s").prefill(ctxs[0]), ctxs[1]])


def test_relaying_leaves_the_payload_untouched(tiny):
    """Zero-copy hand-over: generation after to_cache never writes into the payload's tensors."""
    sender, receiver = Agent(tiny, "s"), Agent(tiny, "r", max_new_tokens=6)
    p = sender.prefill(random_ids(15, 7))
    before = [k.clone() for k in p.keys] + [v.clone() for v in p.values]
    first = receiver.respond("what is the code", p)
    after = list(p.keys) + list(p.values)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert receiver.respond("what is the code", p).token_ids == first.token_ids
