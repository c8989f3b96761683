"""The runtime switch's state machine: off when the sampled signal's estimate falls below the threshold, on
again above threshold + hysteresis, every switch logged with its evidence; sampling is seeded."""

from __future__ import annotations

import pytest

from kvrelay.core.errors import InvalidInput
from kvrelay.policy.switch import RelaySwitch


def test_turns_off_where_the_cache_stops_paying_and_back_on():
    sw = RelaySwitch(threshold=0.05, hysteresis=0.05, min_samples=3, window=4)
    for x in (0.3, 0.25, 0.28):  # the cache explains the sender's text: relay stays on
        assert sw.observe("a->b", x) is None
    assert sw.relay_on("a->b")
    events = [sw.observe("a->b", x) for x in (0.0, -0.02, 0.01, 0.0)]  # another task's cache, say
    off = [e for e in events if e is not None]
    assert len(off) == 1 and off[0].relay_on is False and not sw.relay_on("a->b")
    assert off[0].estimate < 0.05 and off[0].samples == 4 and len(off[0].evidence) == 4
    assert "relay off on a->b" in off[0].reason
    for x in (0.08, 0.08, 0.08, 0.08):  # above the threshold but inside the hysteresis band: stays off
        sw.observe("a->b", x)
    assert not sw.relay_on("a->b")
    on = [e for e in (sw.observe("a->b", 0.3) for _ in range(3)) if e is not None]
    assert len(on) == 1 and on[0].relay_on and sw.relay_on("a->b")
    assert [e.relay_on for e in sw.log] == [False, True]


def test_edges_are_independent_and_sampling_is_seeded():
    sw = RelaySwitch(min_samples=2)
    for _ in range(3):
        sw.observe("x->y", 0.0)
    assert not sw.relay_on("x->y") and sw.relay_on("p->q")
    a = [RelaySwitch(seed=3, sample_rate=0.3) for _ in range(2)]
    for s in a:
        for _ in range(3):
            s.observe("e", 0.5)
    draws = [[s.should_sample("e") for _ in range(50)] for s in a]
    assert draws[0] == draws[1] and 5 <= sum(draws[0]) <= 25
    assert RelaySwitch().should_sample("new edge")  # warming up: always sampled


def test_bad_settings_are_refused():
    with pytest.raises(InvalidInput, match="sample_rate"):
        RelaySwitch(sample_rate=0.0)
    with pytest.raises(InvalidInput, match="min_samples"):
        RelaySwitch(min_samples=5, window=3)
