"""A receiver's byte budget: a payload that decodes to more bytes than it allows is ``OverBudget`` before it is
checked further, recorded or used (through a store: before a tensor byte is read), a batch counts its
payloads together, a payload that fits is used exactly as without a budget, and a receiver keeps no
payload between calls (so its budget has nothing to evict)."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvrelay.agents.agent import Agent
from kvrelay.agents.receive import RoundBook
from kvrelay.core.errors import CorruptPayload, InvalidInput, OverBudget
from kvrelay.kv import wire
from kvrelay.transport.budget import ByteBudget
from kvrelay.transport.memory import MemoryStore
from kvrelay.transport.payloads import get_payload, put_payload
from tests.conftest import random_ids

QUESTION = "what is the key"


def _payload(lm, n: int = 24, seed: int = 0):
    return Agent(lm, "sender").prefill(random_ids(n, seed))


def test_a_payload_over_the_budget_is_refused_before_it_is_recorded_or_used(tiny):
    p = _payload(tiny)
    receiver = Agent(tiny, "rx", budget=ByteBudget(p.nbytes - 1), max_new_tokens=4)
    book = RoundBook()
    with pytest.raises(OverBudget, match="receiver 'rx'") as e:
        receiver.check(p, book)
    assert (e.value.nbytes, e.value.held, e.value.limit, e.value.policy) == (p.nbytes, 0, p.nbytes - 1, "refuse")
    assert book.held == {} and book.models == {}  # not even its producer's model was observed
    with pytest.raises(OverBudget):
        receiver.respond(QUESTION, p)
    assert receiver.round == 0  # no turn was taken


def test_a_payload_that_fits_is_used_exactly_as_without_a_budget(tiny):
    p = _payload(tiny)
    free = Agent(tiny, "rx", max_new_tokens=4).respond(QUESTION, p)
    at_limit = Agent(tiny, "rx", budget=ByteBudget(p.nbytes), max_new_tokens=4).respond(QUESTION, p)
    assert at_limit.token_ids == free.token_ids and at_limit.relayed_tokens == p.num_tokens


def test_a_batch_counts_its_payloads_together(tiny_by_arch):
    lm = tiny_by_arch["llama"]
    a, b = _payload(lm, 20, 1), _payload(lm, 20, 2)
    receiver = Agent(lm, "rx", budget=ByteBudget(a.nbytes + b.nbytes - 1), max_new_tokens=3)
    assert receiver.respond(QUESTION, a).relayed_tokens == 20  # each fits alone
    with pytest.raises(OverBudget) as e:
        receiver.respond_batch([QUESTION, QUESTION], [a, b])
    assert (e.value.nbytes, e.value.held) == (b.nbytes, a.nbytes)
    wide = Agent(lm, "rx", budget=ByteBudget(a.nbytes + b.nbytes), max_new_tokens=3)
    assert [r.relayed_tokens for r in wide.respond_batch([QUESTION, QUESTION], [a, b])] == [20, 20]


@pytest.mark.parametrize("codec", ["raw", "fp16", "int8"])
def test_through_a_store_the_budget_refuses_from_the_header_before_any_tensor_is_read(tiny_by_arch, codec):
    """A tensor byte is flipped: decoding would find it (``CorruptPayload``); over the budget the payload is
    refused first (``OverBudget``), so no tensor was read. The count is the decoded payload's, not the wire's."""
    lm = tiny_by_arch["qwen2"]
    p = _payload(lm)
    store = MemoryStore(f"rx-budget-{codec}")
    key = put_payload(store, p, codec, key="k")
    data = bytearray(store.get_bytes("k"))
    assert wire.decoded_nbytes(bytes(data)) == p.nbytes
    if codec != "raw":
        assert len(data) < p.nbytes  # the wire bytes would fit a budget the decoded payload does not
    data[-3] ^= 0x40
    store.put_bytes(key, bytes(data))
    tight = Agent(lm, "rx", budget=ByteBudget(p.nbytes - 1))
    with pytest.raises(OverBudget, match="receiver 'rx'") as e:
        get_payload(store, key, expect=lm.identity, admit=tight.admit)
    assert e.value.nbytes == p.nbytes
    roomy = Agent(lm, "rx", budget=ByteBudget(p.nbytes))
    with pytest.raises(CorruptPayload):
        get_payload(store, key, expect=lm.identity, admit=roomy.admit)


def test_a_receiver_keeps_no_payload_between_calls(tiny_by_arch):
    """What the budget rests on: after a turn nothing of the relayed payload is referenced by the receiver."""
    lm = tiny_by_arch["gemma3"]
    receiver = Agent(lm, "rx", budget=ByteBudget(1 << 30), max_new_tokens=4)
    p = _payload(lm, 30)
    gone = [weakref.ref(t) for t in (*p.keys, *p.values)]
    r = receiver.respond(QUESTION, p, return_payload=True)
    assert r.payload is not None
    del p, r
    gc.collect()
    assert [ref() for ref in gone] == [None] * len(gone)


@pytest.mark.parametrize("policy", ["oldest", "lru"])
def test_an_evicting_policy_is_refused_with_the_reason(tiny_by_arch, policy):
    with pytest.raises(InvalidInput, match="nothing to evict"):
        Agent(tiny_by_arch["llama"], "rx", budget=ByteBudget(1000, policy))
