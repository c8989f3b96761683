"""The three rules a user depends on: no kv for an incompatible pair without an adapter; text below the
break-even bandwidth; the best expected success within the SLO (and no latency paid for a gain the
audit cannot tell from zero)."""

from __future__ import annotations

import pytest

from kvrelay.core.errors import InvalidInput
from kvrelay.policy.cost import Link
from kvrelay.policy.decide import Decision, Request, Slo, decide
from kvrelay.policy.features import Features
from kvrelay.policy.value import Observation, ValueModel

from .synthetic import synthetic

PRIVATE, SHARED = Features(0.05, 1000), Features(0.95, 1000)
FAST, SLOW = Link(10_000.0), Link(1.0)


@pytest.fixture(scope="module")
def with_adapter():
    """The synthetic audit plus an adapter channel that carries the private facts like kv."""
    obs = synthetic()
    extra = [Observation(o.task_id, o.task_set, "adapter:a__b__ridge", o.features, o.success)
             for o in obs if o.key == "kv"]
    return ValueModel.fit(obs + extra, n_boot=50)


@pytest.mark.parametrize("features", [PRIVATE, SHARED])
@pytest.mark.parametrize("link", [None, FAST, SLOW])
def test_never_kv_for_an_incompatible_pair_without_an_adapter(value, profile, features, link):
    d = decide(Request(features, compatible=False, link=link), Slo(), value, profile)
    assert not d.relays_cache
    assert d.channel in ("none", "text_full")


def test_an_incompatible_pair_relays_through_its_adapter(with_adapter, profile):
    d = decide(Request(PRIVATE, compatible=False, adapters=("adapter:a__b__ridge",), link=FAST), Slo(),
               with_adapter, profile)
    assert d.channel == "adapter:a__b__ridge" and "not compatible" in d.reason


def test_kv_over_a_fast_link_text_below_the_break_even(value, profile):
    fast = decide(Request(PRIVATE, link=FAST), Slo(), value, profile)
    assert fast.channel == "kv"
    be = min(profile.break_even_mbps(c, PRIVATE.context_tokens, 16) for c in ("raw", "int8"))  # below every codec
    slow = decide(Request(PRIVATE, link=Link(be * 0.9)), Slo(), value, profile)
    assert (slow.channel, slow.codec) == ("text_full", None)
    assert "break-even" in slow.reason


def test_between_the_break_evens_the_compressed_payload_is_sent(value, profile):
    raw = profile.break_even_mbps("raw", 1000, 16)
    int8 = profile.break_even_mbps("int8", 1000, 16)
    d = decide(Request(PRIVATE, link=Link((raw + int8) / 2)), Slo(), value, profile)
    assert (d.channel, d.codec) == ("kv", "int8")


def test_no_latency_paid_for_a_gain_that_is_not_there(value, profile):
    d = decide(Request(SHARED, link=FAST), Slo(), value, profile)
    assert d.channel == "none"  # every channel is worth the same when the receiver sees the problem
    p = decide(Request(PRIVATE, link=FAST), Slo(), value, profile)
    assert p.expected_success > 0.7 and p.channel != "none"


def test_the_slo_excludes_slow_channels(value, profile):
    req = Request(PRIVATE, link=None)
    text_s = profile.latency_s("text_full", None, context_tokens=1000, prompt_tokens=16)
    kv_s = profile.latency_s("kv", "raw", context_tokens=1000, prompt_tokens=16)
    assert kv_s < text_s
    d = decide(Request(PRIVATE, compatible=False), Slo(latency_s=(kv_s + text_s) / 2), value, profile)
    assert d.channel == "none"  # text does not fit the budget and kv is not allowed
    assert decide(req, Slo(latency_s=(kv_s + text_s) / 2), value, profile).channel == "kv"
    tight = decide(req, Slo(latency_s=1e-3), value, profile)
    assert "no channel meets the SLO" in tight.reason and tight.channel == "none"


def test_the_decision_is_one_line_and_validated(value, profile):
    d = decide(Request(PRIVATE, link=FAST), Slo(), value, profile)
    assert "\n" not in d.reason and d.reason.startswith("kv")
    with pytest.raises(InvalidInput, match="one non-empty line"):
        Decision("kv", "raw", "two\nlines")
    with pytest.raises(InvalidInput, match="latency SLO"):
        Slo(latency_s=0.0)
    with pytest.raises(InvalidInput, match="adapter channel"):
        Request(PRIVATE, adapters=("kv",))
