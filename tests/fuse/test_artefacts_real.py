"""The committed ridge artefacts match today's zoo models and map a real payload into the receiver's geometry."""

from __future__ import annotations

import pytest

from kvrelay.agents.agent import Agent
from kvrelay.core.errors import AdapterMismatch
from kvrelay.fuse import artefact
from kvrelay.fuse.ridge import RidgeAdapter

pytestmark = pytest.mark.integration
PAIR = ("qwen2.5-coder-0.5b", "smollm2-135m")


def test_committed_cross_tokenizer_artefact_maps_a_real_payload():
    from kvrelay.models.loader import load_model

    receiver, sharer = (load_model(n) for n in PAIR)
    folder = artefact.default_dir(*PAIR, "ridge")
    config, _ = artefact.load(folder)
    assert config.receiver.fingerprint == receiver.identity.fingerprint
    assert config.sharer.fingerprint == sharer.identity.fingerprint
    assert set(config.training["datasets"]) <= {"boolq", "sciq", "csqa", "trivia", "gen"}
    adapter = RidgeAdapter.load(folder, sharer.tokenizer, receiver.tokenizer)
    payload = Agent(sharer, "sharer").read("The access code for the blue vault is 4812.")
    usable = Agent(receiver, "receiver", adapter=adapter).check(payload)
    text = receiver.tokenizer.decode(usable.token_ids[0].tolist())
    assert "The access code for the blue vault is 4812." in text and text.startswith("<|im_start|>user")
    assert len(usable.keys) == receiver.identity.num_layers
    assert usable.keys[0].shape[1:] == (receiver.identity.num_kv_heads, usable.num_tokens, receiver.identity.head_dim)
    with pytest.raises(AdapterMismatch):
        adapter.adapt(Agent(receiver).read("hello"), receiver.identity)  # a receiver payload is not the sharer's
