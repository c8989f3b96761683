"""Selective layer relay on tiny random models: layered caches, the tail-aligned attention, the
``layers`` adapter and its artefact, the layer choice."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvrelay.agents.agent import Agent
from kvrelay.core.errors import AdapterMismatch, IncompatiblePayload
from kvrelay.fuse import artefact, ridge
from kvrelay.fuse import layers as LY
from kvrelay.kv import transforms as T
from kvrelay.kv.cache import to_cache, to_layered_cache
from kvrelay.models.attention import tail_aligned_attention
from kvrelay.models.generate import forward_all
from kvrelay.models.tiny import tiny_lm
from tests.conftest import random_ids

HIDDEN: dict[int, int] = {}  # layer -> leading key slots the reference attention hides


def _hiding_sdpa(module, query, key, value, attention_mask, **kw):
    """Reference: every layer holds the same slots; a layer in HIDDEN masks its first slots out explicitly."""
    q, kv = query.shape[2], key.shape[2]
    mask = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)
    mask[:, : HIDDEN.get(module.layer_idx, 0)] = False
    return sdpa_attention_forward(module, query, key, value, mask[None, None], is_causal=False, **kw)


AttentionInterface.register("test_hiding", _hiding_sdpa)


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2")


def _logits(lm, cache, new, start):
    pos = torch.arange(start, start + len(new))[None]
    return forward_all(lm.model, torch.tensor([new]), pos, cache, None)


def test_tail_aligned_attention_equals_sdpa_on_a_uniform_cache(lm):
    p = Agent(lm).prefill(random_ids(20, 1))
    new = random_ids(6, 2)
    ref = _logits(lm, to_cache(p, lm.model.config), new, 20)
    with tail_aligned_attention(lm.model):
        got = _logits(lm, to_cache(p, lm.model.config), new, 20)
        layered = _logits(lm, to_layered_cache(p, lm.model.config), new, 20)
    assert lm.model.config._attn_implementation == "sdpa"  # restored
    assert torch.equal(got, ref) and torch.equal(layered, ref)


@pytest.mark.parametrize("held", [[1], [0, 3], [1, 2]])
def test_layers_without_the_prefix_never_see_it(lm, held):
    """A cache holding the prefix in ``held`` only = every layer holding it, the others masking it out."""
    p = Agent(lm).prefill(random_ids(12, 3))
    new = random_ids(5, 4)
    with tail_aligned_attention(lm.model):
        got = _logits(lm, to_layered_cache(T.select_layers(p, held), lm.model.config), new, 12)
    noisy = T.with_noise(p, 5.0, torch.Generator().manual_seed(0))  # garbage where the prefix must stay unseen
    mixed = replace(p, keys=tuple(k if i in held else n for i, (k, n) in enumerate(zip(p.keys, noisy.keys, strict=True))),
                    values=tuple(v if i in held else n for i, (v, n) in enumerate(zip(p.values, noisy.values, strict=True))))
    HIDDEN.clear()
    HIDDEN.update({i: 12 for i in range(4) if i not in held})
    lm.model.set_attn_implementation("test_hiding")
    try:
        ref = _logits(lm, to_cache(mixed, lm.model.config), new, 12)
    finally:
        lm.model.set_attn_implementation("sdpa")
    assert (got - ref).abs().max().item() < 1e-5
    full = _logits(lm, to_cache(p, lm.model.config), new, 12)
    assert (got - full).abs().max().item() > 1e-3  # holding fewer layers does change the answer


def test_layered_cache_refuses_what_it_cannot_hold(lm):
    p = Agent(lm).prefill(random_ids(5, 5))
    with pytest.raises(ValueError, match="layers"):
        to_layered_cache(replace(p, meta=replace(p.meta, num_model_layers=6)), lm.model.config)
    gemma = tiny_lm("gemma3")
    g = Agent(gemma).prefill(random_ids(5, 5))
    with pytest.raises(ValueError, match="sliding"):
        to_layered_cache(T.select_layers(g, [2]), gemma.model.config)


def test_choice_combines_attention_and_the_depth_prior():
    prior = LY.gaussian_prior(8)
    assert prior.argmax().item() in (3, 4) and prior[0] < prior[3] and torch.allclose(prior, prior.flip(0))
    imp = torch.tensor([0.9, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.8])
    assert LY.select(LY.scores(imp, alpha=1.0), 2) == (0, 7)  # attention alone
    assert LY.select(LY.scores(imp, alpha=0.0), 2) == (3, 4)  # the prior alone
    assert LY.n_chosen(0.3, 24) == 7 and LY.n_chosen(0.01, 24) == 1 and LY.n_chosen(1.0, 5) == 5
    with pytest.raises(ValueError):
        LY.n_chosen(0.0, 8)
    with pytest.raises(ValueError):
        LY.select(imp, 9)
    with pytest.raises(ValueError):
        LY.scores(imp, alpha=1.5)


@pytest.fixture(scope="module")
def rdg(fitted):
    """The ridge fit of the exact GQA -> MHA pair (tests/fuse/conftest.py) as an adapter."""
    return ridge.RidgeAdapter(*fitted)


def _layers_adapter(rdg, chosen):
    imp = torch.zeros(4)
    config, tensors = LY.to_artefact(rdg, chosen, imp, LY.scores(imp), LY.gaussian_prior(4), 0.5, 0.5,
                                     {"n_problems": 0})
    return LY.LayersAdapter(config, tensors)


def test_layers_adapter_relays_the_chosen_layers_only(pair, rdg):
    sharer, receiver = pair
    sent = Agent(sharer).prefill([2, 6, 8] + random_ids(15, 7))
    adapter = _layers_adapter(rdg, (1, 2))
    out = adapter.adapt(sent, receiver.identity)
    assert out.meta.layer_indices == (1, 2) and out.meta.adapter.startswith("layers@")
    full = rdg.adapt(sent, receiver.identity)
    for a, b in zip(out.keys + out.values, T.select_layers(full, [1, 2]).keys + T.select_layers(full, [1, 2]).values,
                    strict=True):
        assert torch.equal(a, b)  # the ridge map, exactly, in those layers
    assert out.nbytes < full.nbytes
    reader = Agent(receiver, max_new_tokens=4, adapter=adapter)
    layered = reader.respond("hi", sent, min_new_tokens=1)
    ids = Agent(receiver).prompt_ids("hi")
    with tail_aligned_attention(receiver.model):  # the first answer token is the argmax after the prompt
        ref = _logits(receiver, to_layered_cache(out, receiver.model.config), ids, out.num_tokens)
    last = ref[0, -1].clone()
    last[sorted(reader.stop_ids)] = float("-inf")
    assert layered.token_ids[0] == int(last.argmax())
    every = Agent(receiver, max_new_tokens=4, adapter=_layers_adapter(rdg, (0, 1, 2, 3))).respond("hi", sent)
    assert every.token_ids == Agent(receiver, max_new_tokens=4, adapter=rdg).respond("hi", sent).token_ids


def test_partial_payloads_need_a_partial_adapter(pair, rdg):
    sharer, receiver = pair
    sent = Agent(sharer).prefill(random_ids(10, 9))
    part = _layers_adapter(rdg, (1,)).adapt(sent, receiver.identity)
    with pytest.raises(IncompatiblePayload, match="layer_indices"):
        Agent(receiver).respond("hi", part)  # the receiver's own path needs every layer
    adapter = _layers_adapter(rdg, (1,))
    with pytest.raises(ValueError, match="continue layout"):
        Agent(receiver, adapter=adapter).respond("hi", sent, return_payload=True)
    with pytest.raises(ValueError, match="continue layout"):
        Agent(receiver, adapter=adapter).respond("hi", sent, layout="replace")
    with pytest.raises(AdapterMismatch, match="sharer"):
        adapter.adapt(Agent(tiny_lm("llama", seed=3)).prefill(random_ids(6, 1)), receiver.identity)


def test_layers_artefact_round_trips(tmp_path, rdg):
    adapter = _layers_adapter(rdg, (0, 3))
    folder = artefact.save(tmp_path / "l", adapter.config, adapter.tensors)
    back = LY.LayersAdapter.load(folder)
    assert back.chosen == (0, 3) and back.config == adapter.config
    assert set(back.tensors) == {"w_k.0", "w_v.0", "w_k.3", "w_v.3", "anchor_k.0", "anchor_v.0", "anchor_k.3",
                                 "anchor_v.3"}
    assert back.config.training["ridge_fingerprint"] == rdg.fingerprint
    with pytest.raises(ValueError, match="not layers"):
        LY.LayersAdapter.load(artefact.save(tmp_path / "r", rdg.config, rdg.tensors))


def test_importance_reads_the_attention_on_the_mapped_context(pair, rdg):
    sharer, receiver = pair
    pairs = [(Agent(sharer).prefill([2, 6, 8] + random_ids(12, 20 + i)), random_ids(4, 40 + i)) for i in range(3)]
    imp = LY.importance(receiver, rdg, pairs)
    assert imp.shape == (4,) and bool(((imp > 0) & (imp < 1)).all())
    mapped = rdg.adapt(pairs[0][0], receiver.identity)
    with_anchor = LY.prefix_attention(receiver.model, mapped, pairs[0][1], skip=0)
    content = LY.prefix_attention(receiver.model, mapped, pairs[0][1], skip=3)
    assert bool((with_anchor > content).all()) and float(with_anchor.max()) <= 1.0 + 1e-5
    assert receiver.model.config._attn_implementation == "sdpa"  # eager only for that forward
    with pytest.raises(ValueError, match="complete"):
        LY.prefix_attention(receiver.model, T.select_layers(mapped, [1]), pairs[0][1])
