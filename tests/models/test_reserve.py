"""The reserved decode cache: the same tokens and cache as concatenation, in place, never rewriting a view
handed out earlier, and a plain cache afterwards."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import kvrelay.models.generate as G
from kvrelay.models.generate import decode_n_tokens, forward_last
from kvrelay.models.reserve import ReservedLayer, reserved
from kvrelay.models.tiny import tiny_lm
from tests.conftest import random_ids


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2")


def _prefilled(lm, ids):
    cache = DynamicCache(config=lm.model.config)
    logits = forward_last(lm.model, ids, torch.arange(ids.shape[1])[None], cache, None)
    return cache, logits


def _decode(lm, ids, n, monkeypatch=None, plain=False):
    if plain:
        monkeypatch.setattr(G, "reserved", lambda cache, room: nullcontext(cache))
    cache, logits = _prefilled(lm, ids)
    toks, _, _ = decode_n_tokens(lm.model, cache, logits, torch.tensor([ids.shape[1]]), None, n, set())
    return toks, cache


def test_decoding_in_place_gives_the_tokens_and_cache_of_concatenation(lm, monkeypatch):
    ids = torch.tensor([random_ids(40, 7)])
    toks, cache = _decode(lm, ids, 12)
    with monkeypatch.context() as mp:
        ref_toks, ref = _decode(lm, ids, 12, mp, plain=True)
    assert torch.equal(toks, ref_toks)
    assert len(cache.layers) == len(ref.layers)
    for a, b in zip(cache.layers, ref.layers, strict=True):
        assert type(a) is DynamicLayer  # the reservation is gone after decoding
        assert a.keys.is_contiguous() and a.values.is_contiguous()
        assert a.keys.shape == b.keys.shape == (1, b.keys.shape[1], 40 + 11, b.keys.shape[3])
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_steps_write_in_place_and_an_earlier_view_never_changes(lm):
    cache, _ = _prefilled(lm, torch.tensor([random_ids(20, 3)]))
    layer = cache.layers[0]
    k, v = layer.keys, layer.values
    new = torch.randn(1, k.shape[1], 1, k.shape[3])
    with reserved(cache, 3):
        r = cache.layers[0]
        assert isinstance(r, ReservedLayer) and r.reserving
        seen = r.keys
        base = r.keys.untyped_storage().data_ptr()
        r.update(new, new)
        r.update(new + 1, new + 1)
        assert r.keys.untyped_storage().data_ptr() == base  # no new tensor: written into the reserved room
        assert seen.shape[2] == 20 and torch.equal(seen, k)  # the view taken before the writes is unchanged
        assert torch.equal(r.keys[:, :, 20], new[:, :, 0]) and torch.equal(r.keys[:, :, 21], new[:, :, 0] + 1)
        r.update(new, new)
        r.update(new, new)  # past the room: falls back to concatenation
        assert not r.reserving and r.keys.shape[2] == 24
        assert r.keys.untyped_storage().data_ptr() != base
    assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)  # the prefill's own tensors untouched
    assert type(cache.layers[0]) is DynamicLayer and cache.layers[0].keys.shape[2] == 24


def test_crop_gives_up_the_reservation_so_a_later_write_cannot_rewrite_a_view(lm):
    cache, _ = _prefilled(lm, torch.tensor([random_ids(16, 5)]))
    with reserved(cache, 8):
        r = cache.layers[0]
        r.update(torch.ones(1, r.keys.shape[1], 2, r.keys.shape[3]), torch.ones(1, r.values.shape[1], 2,
                                                                                 r.values.shape[3]))
        before = r.keys  # 18 slots, the last two ones
        r.crop(-2)
        assert not r.reserving
        r.update(torch.zeros(1, r.keys.shape[1], 2, r.keys.shape[3]), torch.zeros(1, r.values.shape[1], 2,
                                                                                  r.values.shape[3]))
        assert torch.equal(before[:, :, 16:], torch.ones_like(before[:, :, 16:]))  # not overwritten by the zeros
        assert torch.equal(r.keys[:, :, 16:], torch.zeros_like(r.keys[:, :, 16:]))


def test_short_decodes_and_empty_layers_are_left_alone(lm):
    cache = DynamicCache(config=lm.model.config)
    with reserved(cache, 4):
        assert not any(isinstance(layer, ReservedLayer) for layer in cache.layers)
    cache, _ = _prefilled(lm, torch.tensor([random_ids(8, 1)]))
    with reserved(cache, 0):
        assert not any(isinstance(layer, ReservedLayer) for layer in cache.layers)


def test_a_rollback_reservation_survives_crops_and_holds_what_concatenation_holds():
    """With ``rollback`` a crop moves the filled boundary back and keeps writing in place; the layer then
    holds exactly what a concatenating layer cropped the same way holds (the speculative verify path)."""
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(1, 2, n, 4, generator=g) for n in (5, 3, 2, 4)]  # (B, H, n, D)
    plain = DynamicLayer()
    plain.update(kv[0], kv[0] * 2)
    base = DynamicLayer()
    base.update(kv[0], kv[0] * 2)
    layer = ReservedLayer(base, room=10, rollback=True)
    for step, (new, cut) in enumerate(zip(kv[1:], (-2, 0, -3), strict=True)):
        for lay in (plain, layer):
            lay.update(new, new * 2)
            lay.crop(cut)
        assert layer.reserving, f"step {step}: the reservation was given up"
        assert torch.equal(layer.keys, plain.keys) and torch.equal(layer.values, plain.values)
    before = ReservedLayer(base, room=10)  # without rollback a crop gives the reservation up, as before
    before.crop(-1)
    assert not before.reserving
