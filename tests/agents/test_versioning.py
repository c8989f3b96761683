"""A receiver never uses a payload it cannot prove compatible, nor one older than what it holds."""

from __future__ import annotations

import pytest

from kvrelay.agents.agent import Agent
from kvrelay.agents.receive import RoundRules
from kvrelay.core.errors import (
    ExpiredPayload,
    IncompatiblePayload,
    MissingRound,
    ProducerModelChanged,
    StalePayload,
)
from kvrelay.kv.transforms import select_layers
from kvrelay.models.tiny import tiny_lm
from tests.conftest import random_ids


@pytest.fixture(scope="module")
def llama():
    return tiny_lm("llama", seed=0)


def test_payload_carries_versioning_fields(llama):
    a = Agent(llama, "planner")
    a.round = 3
    p = a.prefill(random_ids(6, 0))
    assert p.meta.producer == "planner" and p.meta.round == 3 and p.meta.created_at > 0
    assert p.meta.model_fingerprint == llama.identity.fingerprint
    assert p.meta.tokenizer_hash == llama.identity.tokenizer_hash and p.meta.format == "kvrelay/1"


def test_other_weights_are_refused_naming_the_field(llama):
    other = tiny_lm("llama", seed=1)  # same architecture and tokenizer, different weights
    p = Agent(other, "sender").prefill(random_ids(6, 0))
    with pytest.raises(IncompatiblePayload) as e:
        Agent(llama, "receiver").respond("what", p)
    assert e.value.field == "model_fingerprint"


def test_other_architecture_and_tokenizer_are_refused(llama):
    p = Agent(tiny_lm("gemma3"), "sender").prefill(random_ids(6, 0))
    with pytest.raises(IncompatiblePayload, match="model_fingerprint"):
        Agent(llama, "receiver").check(p)
    q = Agent(llama, "sender").prefill(random_ids(6, 0)).with_meta(tokenizer_hash="0" * 64)
    with pytest.raises(IncompatiblePayload) as e:
        Agent(llama, "receiver").check(q)
    assert e.value.field == "tokenizer_hash"


def test_partial_and_encoded_payloads_are_refused(llama):
    p = Agent(llama, "sender").prefill(random_ids(6, 0))
    with pytest.raises(IncompatiblePayload, match="layer_indices"):
        Agent(llama, "receiver").check(select_layers(p, [0, 1]))
    with pytest.raises(IncompatiblePayload, match="codec"):
        Agent(llama, "receiver").check(p.with_meta(codec="int8-g32"))


def test_stale_rounds_are_refused(llama):
    sender, receiver = Agent(llama, "planner"), Agent(llama, "worker", max_new_tokens=2)
    old = sender.prefill(random_ids(6, 0))
    sender.round = 2
    new = sender.prefill(random_ids(6, 1))
    receiver.respond("what", new)
    with pytest.raises(StalePayload) as e:
        receiver.respond("what", old)
    assert (e.value.payload_round, e.value.held_round, e.value.producer) == (0, 2, "planner")
    receiver.respond("what", new)  # the same round again is fine


def test_a_receiver_in_a_multi_round_exchange_sees_gaps_expiry_and_model_changes(llama):
    """Rounds as an exchange produces them: the sender's round advances with each answer it writes."""
    sender = Agent(llama, "planner", max_new_tokens=2)
    receiver = Agent(llama, "worker", max_new_tokens=2, round_rules=RoundRules(max_rounds=1))
    made = []
    for i in range(4):
        made.append(sender.prefill(random_ids(6, i)))
        sender.respond("go on")  # its round advances
    assert [p.meta.round for p in made] == [0, 1, 2, 3]
    receiver.respond("what", made[0])
    with pytest.raises(MissingRound) as e:  # round 1 was lost on the way
        receiver.respond("what", made[2])
    assert (e.value.producer, e.value.missing) == ("planner", (1,))
    receiver.respond("what", made[1])
    receiver.respond("what", made[2])
    receiver.round = 5  # the receiver moved on: a round-3 payload trails it by 2 > max_rounds
    with pytest.raises(ExpiredPayload, match="2 rounds old"):
        receiver.respond("what", made[3])
    receiver.round = 4
    receiver.respond("what", made[3])
    # the sender's weights change: its new payloads are another model's, and its old ones are refused now
    changed = Agent(tiny_lm("llama", seed=1), "planner").prefill(random_ids(6, 9))
    with pytest.raises(IncompatiblePayload):
        receiver.respond("what", changed)
    with pytest.raises(ProducerModelChanged):
        receiver.respond("what", made[3])
