"""Fixtures shared by the adapter tests: a tiny GQA model, its exactly equivalent MHA copy, and a ridge fit between them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.fuse import ridge
from kvrelay.fuse.adapter import mha_from_gqa
from kvrelay.models.identity import model_identity
from kvrelay.models.tiny import tiny_lm
from tests.conftest import random_ids

TRAINING = {"datasets": ["random token ids"], "seed": 0}


@pytest.fixture(scope="module")
def pair():
    """Sharer: tiny GQA llama. Receiver: its exactly equivalent MHA copy (a known linear map exists)."""
    gqa = tiny_lm("llama")
    mha = mha_from_gqa(gqa.model)
    return gqa, replace(gqa, name="tiny-llama-mha", model=mha, identity=model_identity(mha, gqa.tokenizer))


@pytest.fixture(scope="module")
def fitted(pair):
    sharer, receiver = pair
    readings = [[2, 6, 8] + random_ids(40, 100 + i) for i in range(16)]  # a shared 3-token opening (anchor)
    state = ridge.fit(sharer, receiver, readings, ridge.candidate_layers(4, 4))
    return ridge.to_artefact(state, ("receiver", receiver.identity), ("sharer", sharer.identity), TRAINING)
