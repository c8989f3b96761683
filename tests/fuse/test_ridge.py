"""The ridge adapter and its artefact on tiny random models: a known exact map, round trips, refusals."""

from __future__ import annotations

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.core.errors import AdapterMismatch, ArtefactError, IncompatiblePayload
from kvrelay.fuse import artefact, ridge
from kvrelay.fuse.bridge import TokenBridge
from kvrelay.kv.cache import to_cache
from kvrelay.models.generate import forward_all
from kvrelay.models.tiny import tiny_lm
from tests.conftest import random_ids

TRAINING = {"datasets": ["random token ids"], "seed": 0}


def test_ridge_recovers_an_exact_head_map(pair, fitted):
    sharer, receiver = pair
    config, tensors = fitted
    assert min(config.metrics["r2_k"] + config.metrics["r2_v"]) > 0.999
    assert config.alignment["anchor_ids"] == [2, 6, 8]
    assert config.metrics["candidates"][1] == [0, 1, 2] and config.layer_map == (0, 1, 2, 3)  # learned: the exact map
    adapter = ridge.RidgeAdapter(config, tensors)
    ctx, new = [2, 6, 8] + random_ids(15, 7), random_ids(5, 8)
    usable = Agent(receiver, adapter=adapter).check(Agent(sharer).prefill(ctx))
    assert usable.meta.adapter.startswith("ridge@") and usable.meta.model_fingerprint == receiver.identity.fingerprint
    own = Agent(receiver).prefill(ctx)
    for a, b in zip(usable.keys + usable.values, own.keys + own.values, strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-2
    pos = torch.arange(18, 23)[None]
    got = forward_all(receiver.model, torch.tensor([new]), pos, to_cache(usable, receiver.model.config), None)
    ref = forward_all(receiver.model, torch.tensor([new]), pos, to_cache(own, receiver.model.config), None)
    assert (got - ref).abs().max().item() < 1e-2


def test_artefact_round_trip_and_fingerprint_refusal(tmp_path, pair, fitted):
    sharer, receiver = pair
    config, tensors = fitted
    folder = artefact.save(tmp_path / "a", config, tensors)
    config2, tensors2 = artefact.load(folder)
    assert config2 == config and set(tensors2) == set(tensors)
    assert all(torch.allclose(tensors2[k], tensors[k], atol=1e-2, rtol=1e-3) for k in tensors)
    adapter = ridge.RidgeAdapter.load(folder)
    assert adapter.fingerprint == ridge.RidgeAdapter.load(folder).fingerprint
    other = tiny_lm("llama", seed=3)
    with pytest.raises(AdapterMismatch, match="receiver"):
        adapter.adapt(Agent(sharer).prefill(random_ids(6, 1)), other.identity)
    with pytest.raises(AdapterMismatch, match="sharer") as e:
        adapter.adapt(Agent(other).prefill(random_ids(6, 1)), receiver.identity)
    assert isinstance(e.value, IncompatiblePayload)
    with pytest.raises(ArtefactError):
        artefact.load(tmp_path / "missing")
    (folder / artefact.CONFIG).write_text('{"format": "other"}')
    with pytest.raises(ArtefactError, match="format"):
        artefact.load(folder)


def test_an_encoded_or_partial_reading_is_refused(pair, fitted):
    from kvrelay.kv.transforms import select_layers

    sharer, receiver = pair
    adapter = ridge.RidgeAdapter(*fitted)
    reading = Agent(sharer).prefill([2, 6, 8] + random_ids(6, 1))
    with pytest.raises(IncompatiblePayload, match="decode the payload with its codec first") as e:
        adapter.adapt(reading.with_meta(codec="int8"), receiver.identity)
    assert e.value.field == "codec"
    with pytest.raises(IncompatiblePayload) as e:
        adapter.adapt(select_layers(reading, [1]), receiver.identity)
    assert e.value.field == "layer_indices"


def test_config_rejects_a_layer_map_of_the_wrong_length(fitted):
    config, _ = fitted
    with pytest.raises(ValueError, match="layer_map"):
        artefact.ArtefactConfig("ridge", config.receiver, config.sharer, (0, 1))


def _shuffled_tokenizer():
    """The tiny word-level tokenizer with another id for every word: a second vocabulary over the same text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvrelay.models.tiny import SPECIALS, WORDS

    vocab = {w: i for i, w in enumerate(SPECIALS + list(reversed(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


def test_bridge_maps_a_reading_into_another_vocabulary():
    a = tiny_lm("llama").tokenizer
    b = _shuffled_tokenizer()
    text = "the blue vault code is seven"
    ids = a(text, add_special_tokens=False)["input_ids"]
    r_ids, index = TokenBridge(a, b).receiver_reading(ids)
    assert b.decode(r_ids) == text and r_ids != ids
    assert index.tolist() == list(range(len(ids)))
    same_ids, same_index = TokenBridge().receiver_reading(ids)
    assert same_ids == ids and same_index.tolist() == list(range(len(ids)))


def test_bridge_between_is_none_for_one_tokenizer_and_refuses_a_crossing_without_both():
    a, b = tiny_lm("llama").tokenizer, _shuffled_tokenizer()
    assert TokenBridge.between("h", "h").same
    assert not TokenBridge.between("h1", "h2", a, b).same
    with pytest.raises(ValueError, match="this adapter crosses tokenizers"):
        TokenBridge.between("h1", "h2", a, None, what="this adapter")
