"""The receive path without a model: compatible payloads pass as is, others only through an adapter whose
output is compatible, the geometry and codec are checked, and rounds never go backwards."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvrelay.agents.receive import RoundBook, RoundRules, adapt_if_needed, check_geometry, compatible, receive
from kvrelay.core.errors import (
    ExpiredPayload,
    IncompatiblePayload,
    MissingRound,
    ProducerModelChanged,
    StalePayload,
)
from kvrelay.fuse.adapter import IdentityAdapter
from kvrelay.kv.layout import FULL
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.kv.transforms import select_layers
from kvrelay.models.identity import ModelIdentity, RopeSpec

IDENT = ModelIdentity(fingerprint="a" * 64, tokenizer_hash="t" * 64, arch="llama", num_layers=2, num_kv_heads=2,
                      head_dim=4, layer_types=(FULL, FULL), sliding_window=None, rope=(RopeSpec(FULL, (1.0, 0.5)),))
OTHER = replace(IDENT, fingerprint="b" * 64)


def payload(ident: ModelIdentity = IDENT, *, heads: int = 2, dim: int = 4, producer: str = "p", round_: int = 0):
    g = torch.Generator().manual_seed(round_)
    m = PayloadMeta.from_identity(ident, producer=producer, round=round_)
    kv = [torch.randn(1, heads, 5, dim, generator=g) for _ in range(4)]  # (1, H, T, D)
    return KVPayload(tuple(kv[:2]), tuple(kv[2:]), torch.arange(9, 14)[None], torch.arange(5)[None],
                     torch.ones(1, 5, dtype=torch.bool), m)


def test_compatible_means_same_model_and_every_layer():
    assert compatible(payload(), IDENT)
    assert not compatible(payload(OTHER), IDENT)
    assert not compatible(select_layers(payload(), [0]), IDENT)


def test_a_compatible_payload_is_used_as_is():
    p = payload()
    assert adapt_if_needed(p, IDENT, None) is p
    assert adapt_if_needed(p, IDENT, IdentityAdapter(source=OTHER.fingerprint, target=IDENT.fingerprint)) is p


def test_a_partial_own_payload_is_not_used_as_is():
    part = select_layers(payload(), [0])
    with pytest.raises(IncompatiblePayload, match="a receiver needs every layer") as e:
        adapt_if_needed(part, IDENT, None)
    assert e.value.field == "layer_indices"


def test_every_layer_must_have_the_receivers_geometry():
    p = payload()
    odd = KVPayload((p.keys[0], torch.zeros(1, 1, 5, 4)), (p.values[0], torch.zeros(1, 1, 5, 4)), p.token_ids,
                    p.positions, p.mask, p.meta)  # layer 1 has one KV head, layer 0 the right two
    with pytest.raises(IncompatiblePayload) as e:
        check_geometry(odd, IDENT)
    assert (e.value.field, e.value.expected, e.value.got) == ("kv_shape", (2, 4), (1, 4))
    odd = KVPayload((p.keys[0], torch.zeros(1, 2, 5, 8)), (p.values[0], torch.zeros(1, 2, 5, 8)), p.token_ids,
                    p.positions, p.mask, p.meta)  # layer 1 has head_dim 8
    with pytest.raises(IncompatiblePayload) as e:
        check_geometry(odd, IDENT)
    assert e.value.got == (2, 8)


def test_another_models_payload_needs_an_adapter():
    p = payload(OTHER)
    with pytest.raises(IncompatiblePayload) as e:
        adapt_if_needed(p, IDENT, None)
    assert e.value.field == "model_fingerprint"
    out = adapt_if_needed(p, IDENT, IdentityAdapter(source=OTHER.fingerprint, target=IDENT.fingerprint))
    assert out.meta.model_fingerprint == IDENT.fingerprint and out.meta.adapter.startswith("identity@")
    assert all(torch.equal(a, b) for a, b in zip(out.keys, p.keys, strict=True))


class LeavesItAlone:
    """An adapter that forgets to stamp its output: the receive path must still refuse the result."""

    name = "lazy"
    fingerprint = "c" * 64

    def adapt(self, p: KVPayload, receiver: ModelIdentity) -> KVPayload:
        return p


def test_an_adapters_output_must_itself_be_compatible():
    with pytest.raises(IncompatiblePayload) as e:
        adapt_if_needed(payload(OTHER), IDENT, LeavesItAlone())
    assert e.value.field == "model_fingerprint"
    with pytest.raises(IncompatiblePayload, match="layer_indices"):  # partial after adapting: refused too
        adapt_if_needed(select_layers(payload(OTHER), [1]), IDENT,
                        IdentityAdapter(source=OTHER.fingerprint, target=IDENT.fingerprint))


def test_geometry_and_codec():
    check_geometry(payload(), IDENT)
    with pytest.raises(IncompatiblePayload, match="decode the payload with its codec first") as e:
        check_geometry(payload().with_meta(codec="int8-g32"), IDENT)
    assert (e.value.field, e.value.expected, e.value.got) == ("codec", "raw", "int8-g32")
    for heads, dim in ((1, 4), (2, 8), (4, 2)):
        with pytest.raises(IncompatiblePayload) as e:
            check_geometry(payload(heads=heads, dim=dim), IDENT)
        assert (e.value.field, e.value.expected, e.value.got) == ("kv_shape", (2, 4), (heads, dim))


def test_round_book_never_goes_backwards():
    book = RoundBook()
    book.check("a", 0)  # nothing held yet: anything goes
    book.record("a", 3)
    book.check("a", 3)  # the same round again is fine
    book.check("a", 4)  # and the next one
    with pytest.raises(StalePayload) as e:
        book.check("a", 2)
    assert (e.value.payload_round, e.value.held_round, e.value.producer) == (2, 3, "a")
    book.record("a", 1)  # recording an older round keeps the newest
    assert book.held == {"a": 3}
    book.check("b", 0)  # producers are independent
    book.record("b", 0)
    assert book.held == {"a": 3, "b": 0}
    with pytest.raises(StalePayload):
        book.check("a", 0)


def test_receive_records_the_round_and_refuses_stale_without_recording():
    book = RoundBook()
    assert receive(payload(round_=2), IDENT, book).meta.round == 2
    assert book.held == {"p": 2}
    with pytest.raises(StalePayload):
        receive(payload(round_=1), IDENT, book)
    assert book.held == {"p": 2}
    receive(payload(round_=3), IDENT, book)
    assert book.held == {"p": 3}
    with pytest.raises(IncompatiblePayload):
        receive(payload(OTHER, producer="r", round_=9), IDENT, book)
    assert book.held == {"p": 3}  # a refused payload records nothing
    adapted = receive(payload(OTHER, producer="q", round_=1), IDENT, book,
                      IdentityAdapter(source=OTHER.fingerprint, target=IDENT.fingerprint))
    assert adapted.meta.model_fingerprint == IDENT.fingerprint and book.held == {"p": 3, "q": 1}


def test_a_skipped_round_is_a_missing_round_naming_the_producer_and_the_rounds():
    book = RoundBook()
    book.record("planner", 2)
    with pytest.raises(MissingRound) as e:
        book.check("planner", 5)
    assert (e.value.producer, e.value.missing, e.value.held_round, e.value.payload_round) == ("planner", (3, 4), 2, 5)
    assert "'planner'" in str(e.value) and "3, 4" in str(e.value)
    book.check("planner", 3)  # no gap
    book.check("other", 7)  # nothing held from that producer yet: any round opens it
    RoundBook(RoundRules(continuity=False), held={"planner": 2}).check("planner", 5)  # gaps allowed when asked


def test_receive_refuses_a_gap_and_records_nothing():
    book = RoundBook()
    receive(payload(round_=0), IDENT, book)
    with pytest.raises(MissingRound) as e:
        receive(payload(round_=2), IDENT, book)
    assert e.value.missing == (1,) and book.held == {"p": 0}
    receive(payload(round_=1), IDENT, book)
    receive(payload(round_=2), IDENT, book)
    assert book.held == {"p": 2}


def test_expiry_by_rounds_counts_the_receivers_own_round():
    book = RoundBook(RoundRules(max_rounds=2))
    book.check("p", 3, now_round=5)  # 2 rounds behind: still fresh
    with pytest.raises(ExpiredPayload) as e:
        book.check("p", 2, now_round=5)
    assert (e.value.producer, e.value.age, e.value.limit, e.value.unit) == ("p", 3, 2, "rounds")
    book.check("p", 0)  # without the receiver's round there is nothing to count against
    with pytest.raises(ExpiredPayload):
        receive(payload(round_=0), IDENT, book, now_round=3)
    assert book.held == {}


def test_expiry_by_seconds_uses_the_payloads_creation_time():
    book = RoundBook(RoundRules(max_age_s=10.0))
    p = payload()
    receive(p, IDENT, book, now_s=p.meta.created_at + 9.5)
    with pytest.raises(ExpiredPayload) as e:
        receive(p, IDENT, book, now_s=p.meta.created_at + 10.5)
    assert e.value.unit == "seconds" and e.value.age == 10.5 and e.value.limit == 10.0
    with pytest.raises(ExpiredPayload):  # the real clock: a payload made an hour ago
        receive(p.with_meta(created_at=p.meta.created_at - 3600), IDENT, book)


@pytest.mark.parametrize("bad", [{"max_rounds": -1}, {"max_rounds": 1.5}, {"max_rounds": True}, {"max_age_s": 0},
                                 {"max_age_s": float("inf")}, {"max_age_s": float("nan")}, {"max_age_s": "10"}])
def test_round_rules_refuse_nonsense_limits(bad):
    with pytest.raises(ValueError):
        RoundRules(**bad)


def test_a_producer_whose_model_changed_has_every_old_payload_refused():
    book = RoundBook()
    receive(payload(round_=0), IDENT, book)
    receive(payload(round_=1), IDENT, book)
    # the producer now runs other weights: its new payload is not usable here, but the book learns of the change
    with pytest.raises(IncompatiblePayload):
        receive(payload(OTHER, round_=2), IDENT, book)
    assert book.models == {"p": OTHER.fingerprint} and book.retired == {"p": {IDENT.fingerprint}}
    for r in (1, 2, 3):  # every payload of its old weights is refused, whatever its round
        with pytest.raises(ProducerModelChanged) as e:
            receive(payload(round_=r), IDENT, book)
        assert (e.value.producer, e.value.payload_fingerprint, e.value.current_fingerprint) == (
            "p", IDENT.fingerprint, OTHER.fingerprint)
    # through an adapter, the new model's payloads are used, their rounds counted afresh
    adapter = IdentityAdapter(source=OTHER.fingerprint, target=IDENT.fingerprint)
    assert receive(payload(OTHER, round_=0), IDENT, book, adapter).meta.round == 0
    receive(payload(round_=0, producer="q"), IDENT, book)  # another producer is not affected
