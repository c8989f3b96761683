from __future__ import annotations

import pytest

from kvrelay.core.errors import InvalidInput
from kvrelay.policy.features import Features, channel_of_arm, overlap
from kvrelay.policy.value import Observation, ValueModel, observations_from_records

from .synthetic import synthetic

PRIVATE, SHARED = Features(0.05, 500), Features(0.95, 500)


def test_relay_gain_where_only_the_sender_saw_the_facts(value):
    g = value.gain("kv", PRIVATE)
    assert g.mean == pytest.approx(0.8, abs=0.12)
    assert g.ci_low > 0.5  # clearly positive
    s = value.gain("kv", SHARED)
    assert abs(s.mean) < 0.05 and s.ci_low < 0 < s.ci_high  # nothing to tell from zero


def test_a_codec_with_the_same_answers_as_kv_is_kvs_curve_exactly(value):
    assert value.fits["kv+int8"].offset == 0.0
    for f in (PRIVATE, SHARED):
        assert value.predict("kv+int8", f).mean == pytest.approx(value.predict("kv", f).mean)
        d = value.difference("kv+int8", "kv", f)
        assert d.ci_low == pytest.approx(0.0) and d.ci_high == pytest.approx(0.0)  # paired draws


def test_a_lossy_codec_gets_a_negative_offset_to_kv():
    obs = synthetic()
    bad = [Observation(o.task_id, o.task_set, "kv+int4", o.features, 0.0) for o in obs if o.key == "kv"]
    vm = ValueModel.fit(obs + bad, n_boot=50)
    assert vm.fits["kv+int4"].offset < -2
    assert vm.difference("kv+int4", "kv", PRIVATE).ci_high < 0


def test_extrapolation_is_flagged():
    obs = [o for o in synthetic() if o.features.overlap < 0.5]  # private tasks only
    vm = ValueModel.fit(obs, n_boot=20)
    assert not vm.predict("kv", PRIVATE).extrapolated
    assert vm.predict("kv", SHARED).extrapolated


def test_held_out_calibration_beats_the_base_rate(value):
    cal = value.calibration(synthetic(seed=1, prefix="h"))
    none = next(r for r in cal["per_channel"] if r["channel"] == "none")
    assert none["brier"] < none["brier_base_rate"]  # overlap predicts none's success; the base rate cannot
    assert sum(b["n"] for b in cal["reliability"]) == sum(r["n"] for r in cal["per_channel"])


def test_unknown_channel_and_empty_fit_are_refused(value):
    with pytest.raises(InvalidInput, match="no audit records for channel 'text_message'"):
        value.predict("text_message", PRIVATE)
    with pytest.raises(InvalidInput, match="no observations"):
        ValueModel.fit([])
    with pytest.raises(InvalidInput, match="none for plain kv"):
        ValueModel.fit([Observation("a", "s", "kv+int8", PRIVATE, 1.0)])


def test_records_become_one_observation_per_task_and_channel():
    base = {"task": "squad", "regime": "private", "covariates": {"doc_tokens": 50}, "relayed_tokens": 0}
    recs = [dict(base, task_id="q1", arm="none", seed=0, score=0.0),
            dict(base, task_id="q1", arm="kv", seed=0, score=1.0, relayed_tokens=80),
            dict(base, task_id="q1", arm="kv", seed=1, score=0.0, relayed_tokens=80),
            dict(base, task_id="q1", arm="kv_mismatched", seed=0, score=0.0, relayed_tokens=80),
            dict(base, task_id="q1", arm="kv_codec:int8-g32", seed=0, score=1.0, relayed_tokens=80)]
    obs = {o.key: o for o in observations_from_records(recs, texts=lambda t: ("the passage says blue", "what?"))}
    assert set(obs) == {"none", "kv", "kv+int8"}  # the control is not a channel
    assert obs["kv"].success == 0.5 and obs["kv"].weight == 2.0
    assert obs["none"].features.context_tokens == 80 and obs["none"].features.overlap == 0.0
    shared = observations_from_records([dict(base, task_id="a", arm="none", seed=0, score=1.0, regime="shared")])
    assert shared[0].features.overlap == 1.0  # no texts: the regime stands in


def test_features_and_arm_names():
    assert overlap("Mercury is the closest planet to the Sun", "Which planet is the closest? Mercury, Venus") == 0.8
    assert channel_of_arm("kv_adapter:a__b__ridge") == "adapter:a__b__ridge"
    assert channel_of_arm("kv_variant:summarizer:raw") == "variant:summarizer:raw"
    assert channel_of_arm("kv_codec:raw") == "kv" and channel_of_arm("kv_zeroed") is None
    with pytest.raises(InvalidInput, match="overlap"):
        Features(1.5, 10)
