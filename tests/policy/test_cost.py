from __future__ import annotations

import math

import pytest

from kvrelay.core.errors import InvalidInput
from kvrelay.policy.cost import CodecCost, CostProfile, Link, closed_form_break_even_mbps


@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("n", [256, 2048])
def test_break_even_is_where_kv_and_text_latency_cross(profile, codec, n):
    be = profile.break_even_mbps(codec, n, prompt_tokens=16)
    assert 0 < be < math.inf

    def gap(mbps):
        kw = dict(context_tokens=n, prompt_tokens=16, link=Link(mbps))
        return profile.latency_s("kv", codec, **kw) - profile.latency_s("text_full", None, **kw)

    assert gap(be) == pytest.approx(0.0, abs=1e-9)
    assert gap(be * 0.8) > 0  # slower link: text is faster
    assert gap(be * 1.25) < 0  # faster link: kv is faster


def test_compression_lowers_the_break_even(profile):
    assert profile.break_even_mbps("int8", 2048) < profile.break_even_mbps("raw", 2048) / 2


def test_latency_of_each_channel(profile):
    kw = dict(context_tokens=1000, prompt_tokens=20, answer_tokens=10)
    none = profile.latency_s("none", None, **kw)
    assert none == pytest.approx(0.5 + 0.006 * 20 + 0.3)
    assert profile.latency_s("text_full", None, **kw) == pytest.approx(0.5 + 0.006 * 1020 + 0.3)
    kv = profile.latency_s("kv", "raw", **kw)  # in process: no link, nothing crosses
    assert kv == pytest.approx(none + 1000 * 24_576 * 5e-10)
    via_store = profile.latency_s("kv", "raw", store="memory", **kw)
    assert via_store == pytest.approx(kv + 1000 * 24_576 * 2e-10)
    with pytest.raises(InvalidInput, match="store 'redis' is not in the profile"):
        profile.latency_s("kv", "raw", store="redis", **kw)


def test_profile_round_trips_through_its_file(profile, tmp_path):
    p = profile.save(tmp_path / "p.json")
    back = CostProfile.load(p)
    assert back == profile
    assert back.break_even_mbps("int8", 512) == profile.break_even_mbps("int8", 512)


def test_bad_profiles_are_refused(tmp_path):
    with pytest.raises(InvalidInput, match="no cost profile"):
        CostProfile.load(tmp_path / "missing.json")
    (tmp_path / "old.json").write_text('{"version": 0}')
    with pytest.raises(InvalidInput, match="re-run kvrelay calibrate"):
        CostProfile.load(tmp_path / "old.json")
    with pytest.raises(InvalidInput, match="ratio"):
        CodecCost("int8", 0.0, 1e-9, 1e-9)
    with pytest.raises(InvalidInput, match="bandwidth"):
        Link(0.0)
    with pytest.raises(InvalidInput, match="codec 'int3' is not in the profile"):
        CostProfile("m", 0.1, 0.01, 0.01, 1000.0, 4.0, (CodecCost("raw", 1.0, 0, 0),)).codec("int3")


def test_closed_form_cases():
    assert closed_form_break_even_mbps(10_000_000 + 5000, 5000, 2.5, 0.5) == pytest.approx(40.0)
    assert math.isinf(closed_form_break_even_mbps(10_000_000, 0, 1.0, 1.0))
    assert closed_form_break_even_mbps(100, 200, 1.0, 0.5) == 0.0
