"""Alignment functions: shapes, exact head mapping against an equivalent MHA model, RoPE round trips, token spans."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.core.errors import IncompatiblePayload
from kvrelay.fuse import align
from kvrelay.fuse.adapter import HeadMapAdapter, mha_from_gqa
from kvrelay.kv.cache import to_cache
from kvrelay.models.generate import forward_all
from kvrelay.models.identity import RopeSpec, model_identity
from kvrelay.models.loaded import LoadedModel
from kvrelay.models.tiny import tiny_lm
from tests.conftest import random_ids


def test_last_aligned_lines_up_the_last_layers():
    m = align.last_aligned(24, 28)
    assert len(m) == 24 and m[-1] == 27 and m[0] == 4
    assert align.last_aligned(30, 24) == tuple([0] * 6 + list(range(24)))  # clamped when the sharer is shallower


def test_depth_proportional_spans_both_ends():
    m = align.depth_proportional(24, 28)
    assert len(m) == 24 and m[0] == 0 and m[-1] == 27
    assert list(m) == sorted(m)
    assert align.depth_proportional(1, 5) == (4,)
    with pytest.raises(ValueError):
        align.depth_proportional(0, 5)


def test_learned_map_recovers_a_planted_monotone_map():
    torch.manual_seed(0)
    n, T, S = 400, 5, 8
    sharer = [torch.randn(n, 6) for _ in range(S)]
    planted = (0, 2, 3, 5, 7)
    receiver = [sharer[s] @ torch.randn(6, 4) + 0.05 * torch.randn(n, 4) for s in planted]
    sim = align.similarity_matrix(receiver, sharer)
    assert sim.shape == (T, S)
    assert align.learned_layer_map(sim) == planted
    assert align.learned_layer_map(sim, monotone=False) == planted
    # the monotone path never goes back even when the argmax would
    sim2 = torch.tensor([[0.0, 1.0], [1.0, 0.9]])
    assert align.learned_layer_map(sim2, monotone=False) == (1, 0)
    assert align.learned_layer_map(sim2) == (1, 1)


def test_map_kv_heads_replicates_and_groups():
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)  # (B, H, T, D)
    up = align.map_kv_heads(x, 6)
    assert up.shape == (2, 6, 4, 5)
    assert torch.equal(up[:, 0], x[:, 0]) and torch.equal(up[:, 1], x[:, 0]) and torch.equal(up[:, 5], x[:, 2])
    down = align.map_kv_heads(up, 3)
    assert torch.equal(down, x)  # grouping undoes replication
    assert align.map_kv_heads(x, 3) is x
    with pytest.raises(ValueError, match="multiple"):
        align.map_kv_heads(x, 2)


def test_head_dim_projection_and_padding_shapes():
    x = torch.randn(1, 2, 7, 128)
    w = torch.randn(128, 64)
    assert align.project_head_dim(x, w).shape == (1, 2, 7, 64)
    assert align.project_head_dim(x, torch.randn(2, 128, 64), torch.zeros(2, 64)).shape == (1, 2, 7, 64)
    assert torch.allclose(align.project_head_dim(x, torch.eye(128)), x)
    with pytest.raises(ValueError):
        align.project_head_dim(x, torch.randn(64, 64))
    assert align.pad_head_dim(x, 64).shape == (1, 2, 7, 64)
    padded = align.pad_head_dim(x[..., :64], 128)
    assert padded.shape == (1, 2, 7, 128) and torch.equal(padded[..., 64:], torch.zeros(1, 2, 7, 64))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_strip_then_apply_rope_is_identity_on_a_real_cache(arch):
    lm = tiny_lm(arch)
    p = Agent(lm).prefill(random_ids(11, 3), start=5)
    for i, k in enumerate(p.keys):
        spec = lm.identity.rope_for(lm.identity.layer_types[i])
        pos = align.held_positions(p.positions, k.shape[2])
        pre = align.strip_rope(k, pos, spec)
        assert not torch.allclose(pre, k)  # un-rotating changes the keys (positions are not 0)
        assert (align.apply_rope(pre, pos, spec) - k).abs().max().item() < 1e-5


def test_apply_rope_moves_keys_to_another_base_and_back():
    torch.manual_seed(1)
    a = RopeSpec("full_attention", tuple(10000.0 ** (-i / 8) for i in range(8)))
    b = RopeSpec("full_attention", tuple(1e6 ** (-i / 8) for i in range(8)))
    pre = torch.randn(1, 2, 6, 16)
    pos = torch.arange(6)[None] + 3
    at_b = align.apply_rope(align.strip_rope(align.apply_rope(pre, pos, a), pos, a), pos + 10, b)
    assert (align.strip_rope(at_b, pos + 10, b) - pre).abs().max().item() < 1e-5
    assert align.apply_rope(pre, torch.zeros(1, 6, dtype=torch.long), a).equal(pre)  # position 0: no rotation
    with pytest.raises(ValueError):
        align.apply_rope(pre, pos[:, :3], a)


def _mha_lm(lm) -> LoadedModel:
    mha = mha_from_gqa(lm.model)
    return replace(lm, name=lm.name + "-mha", model=mha, identity=model_identity(mha, lm.tokenizer))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_mha_from_gqa_head_map_reproduces_receiver_logits(arch):
    gqa = tiny_lm(arch)
    mha = _mha_lm(gqa)
    assert mha.identity.num_kv_heads == 2 * gqa.identity.num_kv_heads
    ctx, new = random_ids(19, 4), random_ids(6, 5)  # 19 crosses gemma3's window of 8
    payload = Agent(gqa, "sharer").prefill(ctx)
    receiver = Agent(mha, "receiver", adapter=HeadMapAdapter(gqa.identity, mha.identity))
    usable = receiver.check(payload)
    assert usable.meta.model_fingerprint == mha.identity.fingerprint and usable.meta.adapter.startswith("heads@")
    ids, pos = torch.tensor([new]), torch.arange(19, 25)[None]
    relayed = forward_all(mha.model, ids, pos, to_cache(usable, mha.model.config), None)[0]
    from transformers import DynamicCache

    own = forward_all(mha.model, torch.tensor([ctx + new]), torch.arange(25)[None],
                      DynamicCache(config=mha.model.config), None)[0][19:]
    assert (relayed - own).abs().max().item() <= 1e-4
    # a receiver without the adapter refuses the GQA payload
    with pytest.raises(IncompatiblePayload):
        Agent(mha, "plain").check(payload)


def test_head_map_adapter_refuses_another_source():
    gqa = tiny_lm("qwen2")
    other = tiny_lm("qwen2", seed=1)
    mha = _mha_lm(gqa)
    payload = Agent(other).prefill(random_ids(5, 1))
    with pytest.raises(IncompatiblePayload, match="model_fingerprint"):
        HeadMapAdapter(gqa.identity, mha.identity).adapt(payload, mha.identity)
    with pytest.raises(ValueError):
        HeadMapAdapter(gqa.identity, replace(mha.identity, num_kv_heads=3))


def test_span_alignment_on_two_real_tokenizations():
    from kvrelay.models.tiny import tiny_tokenizer

    text = "the blue vault code is seven"
    ids, offs = align.token_offsets(tiny_tokenizer(), text)
    assert len(ids) == 6 and offs[1] == (4, 8)
    chars = [(i, i + 1) for i in range(len(text)) if text[i] != " "]  # a character-level "sharer"
    spans = align.span_alignment(offs, chars)
    assert len(spans) == len(ids)
    assert [len(s) for s in spans] == [len(w) for w in text.split()]
    assert spans[1] == (3, 4, 5, 6)  # "blue" = the 4th..7th non-space characters
    assert align.last_of_spans(spans).tolist() == [s[-1] for s in spans]
    # a receiver token no sharer token overlaps takes the nearest earlier one
    assert align.span_alignment([(0, 3), (3, 3), (4, 6)], [(0, 3), (4, 6)]) == ((0,), (0,), (1,))
    with pytest.raises(ValueError):
        align.span_alignment([(0, 1)], [])
