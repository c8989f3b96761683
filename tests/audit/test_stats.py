"""Audit statistics against known answers: hand-computed tests, scipy/statsmodels, planted effects."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from kvrelay.audit.bootstrap import bca_ci
from kvrelay.audit.hypothesis import (
    benjamini_hochberg,
    cluster_mean_se,
    holm,
    mcnemar_exact,
    paired_test,
    tost_paired,
    wilcoxon_p,
)
from kvrelay.audit.paired import dial_family, parse_arm
from kvrelay.audit.stats import cost_benefit, dose_response, pair_trials, summarize, verdict

EFFECT_FIELDS = {"regime", "task", "contrast", "outcome", "estimate", "ci_low", "ci_high", "p_value", "p_holm", "n"}
EQUIV_FIELDS = {"regime", "task", "contrast", "estimate", "ci90_low", "ci90_high", "margin", "p_tost", "p_holm",
                "equivalent"}  # fmt: skip


def make_records(
    rng: np.random.Generator,
    cells: dict[tuple[str, str], int],
    success: dict[str, float],
    seeds: tuple[int, ...] = (0,),
    modifier=None,
) -> list[dict]:
    """Synthetic trials: ``success[arm]`` is P(score=1); ``modifier(arm, covariates) -> prob`` overrides it.

    A shared uniform per (task, seed) couples the arms, so pairs are positively correlated as real
    paired trials are; latency grows with prefill tokens; only kv-like arms relay bytes.
    """
    records = []
    for (regime, task), n_tasks in cells.items():
        for i in range(n_tasks):
            covs = {"doc_tokens": int(rng.integers(100, 4000)), "kind": "hop" if i % 3 == 0 else "lookup"}
            for seed in seeds:
                u = rng.random()
                for arm, prob in success.items():
                    p = modifier(arm, covs) if modifier is not None else prob
                    prefill = covs["doc_tokens"] + 30 if arm == "text_full" else 30
                    records.append({
                        "task_id": f"{task}-{i}", "task": task, "regime": regime, "arm": arm, "seed": seed,
                        "score": float(u < p), "latency_s": 0.1 + prefill * 1e-4 + 0.01 * rng.random(),
                        "relay_bytes": 12_000 * covs["doc_tokens"] if arm.startswith("kv") else 0,
                        "prefill_tokens": prefill, "covariates": covs,
                    })  # fmt: skip
    return records


# ---------------------------------------------------------------- arms


def test_parse_arm_and_dial_family():
    assert parse_arm("kv_noise:0.5") == ("kv_noise", "0.5")
    assert parse_arm("kv") == ("kv", None)
    assert parse_arm("kv_tokens:last:0.2") == ("kv_tokens", "last:0.2")
    assert parse_arm("kv_codec:int8") == ("kv_codec", "int8")
    assert dial_family("kv_tokens:last:0.2") == ("kv_tokens:last", "0.2", 0.2)
    assert dial_family("kv_codec:int8") == ("kv_codec", "int8", None)
    assert dial_family("kv_mismatched") is None
    for bad in ("kv_noise", "kv_noise:-1", "kv_noise:abc", "kv:0.5", "Kv", "kv_tokens:last:", "", "kv_layers:"):
        with pytest.raises(ValueError):
            parse_arm(bad)


# ---------------------------------------------------------------- tests against hand-computed answers


def test_mcnemar_exact_by_hand():
    # b=10, c=2: two-sided binomial(12, 1/2) tail = 2 * (C(12,0)+C(12,1)+C(12,2)) / 2^12
    hand = 2 * (math.comb(12, 0) + math.comb(12, 1) + math.comb(12, 2)) / 2**12
    assert mcnemar_exact(10, 2) == pytest.approx(hand, rel=1e-12)
    assert hand == pytest.approx(0.03857421875)
    assert mcnemar_exact(5, 0) == pytest.approx(2 / 2**5)
    assert mcnemar_exact(4, 4) == 1.0 and mcnemar_exact(0, 0) == 1.0
    # the same counts from paired 0/1 outcomes (plus concordant pairs, which do not matter)
    a = np.array([1] * 10 + [0] * 2 + [1] * 7 + [0] * 5)
    b = np.array([0] * 10 + [1] * 2 + [1] * 7 + [0] * 5)
    p, test = paired_test(a, b, binary=True)
    assert test == "mcnemar_exact" and p == pytest.approx(hand)
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def test_tost_by_hand():
    d = np.array([1.0, 2.0, 3.0, 4.0, 5.0])  # mean 3, sd sqrt(2.5), se = sqrt(2.5/5) = sqrt(0.5)
    se = math.sqrt(0.5)
    t_upper = (3.0 - 5.0) / se  # -2*sqrt(2)
    # Student t CDF with 4 df in closed form: F(t) = 1/2 + 3/8 * u * (1 - t^2 / (12 (1 + t^2/4))), u = t / sqrt(1 + t^2/4)
    u = t_upper / math.sqrt(1 + t_upper**2 / 4)
    p_upper_hand = 0.5 + 3 / 8 * u * (1 - t_upper**2 / (12 * (1 + t_upper**2 / 4)))
    assert p_upper_hand == pytest.approx(0.0237103, abs=1e-6)
    r = tost_paired(d, margin=5.0)
    assert r.estimate == 3.0 and r.se == pytest.approx(se) and r.df == 4
    assert r.p_upper == pytest.approx(p_upper_hand, rel=1e-9)
    assert r.p_tost == pytest.approx(p_upper_hand, rel=1e-9)  # the upper test is the binding one
    assert r.ci_low == pytest.approx(3.0 - 2.1318468 * se, abs=1e-6)  # t_{0.95, 4} = 2.1318468
    assert r.ci_high == pytest.approx(3.0 + 2.1318468 * se, abs=1e-6)
    # margin 2.8 (the paper's): 3.0 lies outside, so not equivalent
    assert tost_paired(d, margin=2.8).p_tost > 0.5
    # every difference equal: SE 0, decided by whether the mean lies inside the margin
    assert tost_paired(np.ones(6), margin=2.8).p_tost == 0.0
    assert tost_paired(np.full(6, 3.0), margin=2.8).p_tost == 1.0


def test_cluster_se_matches_statsmodels_and_paired_t():
    import statsmodels.api as sm

    rng = np.random.default_rng(3)
    d = rng.normal(size=40)
    _, se, df = cluster_mean_se(d)
    assert se == pytest.approx(d.std(ddof=1) / math.sqrt(40)) and df == 39
    groups = np.repeat(np.arange(10), 4)
    _, se_c, df_c = cluster_mean_se(d, groups)
    fit = sm.OLS(d, np.ones(40)).fit(cov_type="cluster", cov_kwds={"groups": groups})
    assert se_c == pytest.approx(float(fit.bse[0]), rel=1e-9) and df_c == 9


def test_holm_and_bh_match_statsmodels():
    rng = np.random.default_rng(0)
    p = np.concatenate([rng.uniform(0, 0.05, 8), rng.uniform(0, 1, 12), [0.01, 0.01, 1.0]])
    assert holm(list(p)) == pytest.approx(list(multipletests(p, method="holm")[1]), abs=1e-12)
    assert benjamini_hochberg(list(p)) == pytest.approx(list(multipletests(p, method="fdr_bh")[1]), abs=1e-12)
    with_none = [0.01, None, 0.04, 0.03, None]
    expected = multipletests([0.01, 0.04, 0.03], method="holm")[1]
    got = holm(with_none)
    assert got[1] is None and got[4] is None
    assert [got[0], got[2], got[3]] == pytest.approx(list(expected))
    with pytest.raises(ValueError):
        holm([0.1, float("nan")])


def test_wilcoxon_matches_scipy():
    rng = np.random.default_rng(5)
    for n in (6, 11, 30):
        d = rng.normal(0.4, 1, n)
        assert wilcoxon_p(d) == pytest.approx(stats.wilcoxon(d).pvalue, rel=1e-9)
    tied = np.array([1.0, 1.0, 2.0, -1.0, 3.0, 0.0, 2.0, 1.0])  # ties and a zero: exact permutation
    assert wilcoxon_p(tied) == pytest.approx(stats.wilcoxon(tied).pvalue)
    assert wilcoxon_p(np.zeros(5)) == 1.0


# ---------------------------------------------------------------- bootstrap


def test_bca_matches_scipy_on_skewed_data():
    rng = np.random.default_rng(11)
    x = rng.lognormal(0.0, 1.0, size=40)
    ours = bca_ci(x, n_boot=20_000, seed=1)
    ref = stats.bootstrap((x,), np.mean, method="BCa", n_resamples=20_000, rng=np.random.default_rng(2))
    se = x.std(ddof=1) / math.sqrt(x.size)
    assert ours.method == "bca"
    assert ours.low == pytest.approx(ref.confidence_interval.low, abs=0.08 * se)
    assert ours.high == pytest.approx(ref.confidence_interval.high, abs=0.08 * se)
    # BCa on right-skewed data leans right of the symmetric interval
    assert ours.high - ours.estimate > ours.estimate - ours.low


def test_bca_degenerate_and_unavailable():
    same = bca_ci(np.full(12, 100.0))
    assert same.method == "degenerate" and same.low == same.high == same.estimate == 100.0
    one = bca_ci([1.0, 0.0, 1.0], clusters=["t", "t", "t"])
    assert one.method == "unavailable" and one.low is None and one.n_clusters == 1
    with pytest.raises(ValueError):
        bca_ci([1.0, float("nan")])
    with pytest.raises(ValueError):
        bca_ci([1.0, 2.0], clusters=["a"])


def test_bca_coverage_of_planted_effect():
    """200 simulated paired binary data sets with a planted +15-point effect: the 95% CI covers it ~95%."""
    rng = np.random.default_rng(2024)
    true_effect, covered = 15.0, 0
    for sim in range(200):
        u = rng.random(80)  # shared latent per task couples the two arms
        a = 100.0 * (u < 0.65)
        b = 100.0 * (u < 0.50)
        flip = rng.random(80) < 0.3  # independent noise so pairs are not perfectly nested
        b = np.where(flip, 100.0 * (rng.random(80) < 0.5), b)
        a = np.where(flip, 100.0 * (rng.random(80) < 0.65), a)
        ci = bca_ci(a - b, n_boot=400, seed=sim)
        covered += ci.low <= true_effect <= ci.high
    assert 0.90 <= covered / 200 <= 0.99


def test_cluster_bootstrap_wider_when_seeds_correlated():
    rng = np.random.default_rng(8)
    n_tasks, n_seeds = 40, 5
    task_effect = rng.normal(10.0, 20.0, n_tasks)  # strong per-task effect: seeds of a task agree
    d = (task_effect[:, None] + rng.normal(0.0, 3.0, (n_tasks, n_seeds))).reshape(-1)  # (tasks*seeds,)
    clusters = np.repeat([f"t{i}" for i in range(n_tasks)], n_seeds)
    naive = bca_ci(d, n_boot=1000, seed=0)
    clustered = bca_ci(d, clusters, n_boot=1000, seed=0)
    assert clustered.estimate == pytest.approx(naive.estimate)
    assert clustered.n_clusters == n_tasks and naive.n_clusters == n_tasks * n_seeds
    # design effect ~ 1 + (m-1) * ICC ~ 5 here, so the width ratio should be near sqrt(5)
    assert (clustered.high - clustered.low) > 1.6 * (naive.high - naive.low)


# ---------------------------------------------------------------- summarize and friends

ARMS_PRIVATE = {"none": 0.2, "text_message": 0.5, "text_full": 0.9, "kv": 0.9, "kv_mismatched": 0.2,
                "kv_noise:0.5": 0.7, "kv_noise:2.0": 0.3, "kv_codec:int8": 0.88}  # fmt: skip


@pytest.fixture(scope="module")
def summary():
    rng = np.random.default_rng(7)
    cells = {("private", "gen_kv"): 30, ("private", "squad"): 25, ("shared", "arc_challenge"): 40}
    records = make_records(rng, cells, ARMS_PRIVATE, seeds=(0, 1))
    # shared regime: matched and mismatched equally good (content does not matter)
    for r in records:
        if r["regime"] == "shared" and r["arm"] in ("kv", "kv_mismatched"):
            r["score"] = float(r["covariates"]["doc_tokens"] % 2 == 0)
    return summarize(records, n_boot=500, seed=0)


def test_summarize_contract_and_no_nan(summary):
    text = json.dumps(summary, allow_nan=False)  # raises on NaN/inf
    assert "NaN" not in text
    for key in ("n_tasks", "seeds", "effects", "equivalence", "cate", "dose_response", "cost_benefit", "verdict"):
        assert key in summary
    assert summary["n_tasks"] == 95 and summary["seeds"] == [0, 1]
    assert all(EFFECT_FIELDS <= row.keys() for row in summary["effects"])
    assert all(EQUIV_FIELDS <= row.keys() for row in summary["equivalence"])
    cells = {(r["regime"], r["task"]) for r in summary["effects"]}
    assert cells == {("private", "gen_kv"), ("private", "squad"), ("private", "ALL"), ("shared", "arc_challenge"),
                     ("shared", "ALL")}  # fmt: skip
    contrasts = {r["contrast"] for r in summary["effects"]}
    assert contrasts == {"pairing", "presence", "kv_vs_text_message", "kv_vs_text_full", "kv_vs_none"}
    assert {r["outcome"] for r in summary["effects"]} == {"success", "latency_s", "relay_bytes", "prefill_tokens"}


def test_summarize_recovers_planted_effects(summary):
    def row(regime, task, contrast, outcome="success"):
        (r,) = [e for e in summary["effects"] if (e["regime"], e["task"], e["contrast"], e["outcome"])
                == (regime, task, contrast, outcome)]  # fmt: skip
        return r

    pairing = row("private", "ALL", "pairing")  # planted: 0.9 - 0.2 = +70 points
    assert pairing["n"] == 110 and pairing["ci_low"] <= 70 <= pairing["ci_high"] and pairing["ci_low"] > 50
    assert pairing["p_holm"] < 1e-6 and pairing["p_holm"] >= pairing["p_value"]
    shared = row("shared", "ALL", "pairing")
    assert shared["estimate"] == 0.0 and shared["ci_low"] == shared["ci_high"] == 0.0
    # a regime with one task set: its ALL cell is the same hypothesis, counted once in Holm
    assert shared["p_holm"] == row("shared", "arc_challenge", "pairing")["p_holm"]
    eq = [e for e in summary["equivalence"] if e["regime"] == "shared" and e["task"] == "ALL"][0]
    assert eq["equivalent"] is True and eq["margin"] == 2.8
    assert row("private", "ALL", "kv_vs_text_full", "prefill_tokens")["estimate"] < -100
    assert "agrees with the paper" in summary["verdict"]
    assert "equivalent to 0 at ±2.8" in summary["verdict"]


def test_dose_response_and_cost_benefit(summary):
    noise = [r for r in summary["dose_response"] if (r["regime"], r["task"], r["family"]) == ("private", "ALL", "kv_noise")]
    assert [r["dose_value"] for r in noise] == [0.0, 0.5, 2.0] and noise[0]["reference"]
    assert noise[0]["mean"] > noise[1]["mean"] > noise[2]["mean"]
    assert noise[2]["effect_vs_kv"] < -40 and noise[2]["effect_ci_high"] < 0
    cb = {(r["arm"], r["reference"]): r for r in summary["cost_benefit"] if (r["regime"], r["task"]) == ("private", "ALL")}
    kv_none = cb[("kv", "none")]
    assert kv_none["gain_points"] > 50
    assert kv_none["bytes_per_point"] == pytest.approx(kv_none["extra_relay_bytes"] / kv_none["gain_points"])
    mism = cb[("kv_mismatched", "none")]  # no gain: no cost per point, and a note that says why
    assert mism["gain_points"] == 0.0 and mism["latency_s_per_point"] is None and "no accuracy gain" in mism["note"]


def test_missing_arm_drops_contrast_not_error():
    rng = np.random.default_rng(1)
    arms = {"none": 0.3, "kv": 0.8, "text_full": 0.8}  # no kv_mismatched, no text_message
    records = make_records(rng, {("private", "gen_kv"): 20}, arms)
    s = summarize(records, n_boot=200)
    assert {r["contrast"] for r in s["effects"]} == {"kv_vs_none", "kv_vs_text_full"}
    assert s["equivalence"] == []
    assert "not measured" in s["verdict"]
    assert dose_response(records, n_boot=200) == []
    assert len(cost_benefit(records, n_boot=200)) == 2 * 2 + 2 * 2  # 2 cells x (2 arms vs none + 2 vs text_full)


def test_unmatched_trials_are_reported():
    rng = np.random.default_rng(2)
    records = make_records(rng, {("private", "gen_kv"): 20}, {"kv": 0.9, "kv_mismatched": 0.2})
    records = [r for r in records if not (r["arm"] == "kv" and r["task_id"] in ("gen_kv-0", "gen_kv-1", "gen_kv-2"))]
    p = pair_trials(records, "kv", "kv_mismatched", regime="private", task="gen_kv")
    assert p.n == 17 and p.only_a == 0 and p.only_b == 3
    s = summarize(records, n_boot=200)
    assert {"regime": "private", "task": "gen_kv", "contrast": "pairing", "arm_a": "kv", "arm_b": "kv_mismatched",
            "only_a": 0, "only_b": 3, "missing_outcome": {}} in s["unmatched"]  # fmt: skip
    assert all(r["n"] == 17 for r in s["effects"] if r["task"] == "gen_kv")


def test_cate_finds_planted_effect_modification():
    """The content helps only when the document is long (doc_tokens >= 2000)."""
    rng = np.random.default_rng(3)

    def modifier(arm, covs):
        return 0.9 if arm == "kv" and covs["doc_tokens"] >= 2000 else 0.3

    records = make_records(rng, {("private", "gen_kv"): 160}, {"kv": 0, "kv_mismatched": 0}, modifier=modifier)
    s = summarize(records, n_boot=300)
    doc = [r for r in s["cate"] if r["task"] == "gen_kv" and r["contrast"] == "pairing" and r["covariate"] == "doc_tokens"]
    assert len(doc) == 4
    low, high = doc[0], doc[-1]  # quartile bins; the lowest is all < 2000, the highest all >= 2000
    assert low["hi"] < 2000 and high["lo"] >= 2000
    assert high["p_fdr"] < 0.01 and high["ci_low"] <= 60 <= high["ci_high"]
    assert low["p_fdr"] > 0.05 and low["ci_low"] <= 0 <= low["ci_high"]
    assert all(r["p_fdr"] >= r["p_value"] for r in doc)
    reg = {r["term"]: r for r in s["cate_regression"] if r["task"] == "gen_kv" and r["contrast"] == "pairing"}
    assert reg["doc_tokens"]["coef"] > 0 and reg["doc_tokens"]["p_value"] < 1e-3
    assert reg["doc_tokens"]["cov_type"] == "HC1" and "kind=lookup" in reg


def test_verdict_says_when_the_model_disagrees():
    rng = np.random.default_rng(4)
    arms = {"none": 0.3, "kv": 0.75, "kv_mismatched": 0.4}  # shared-regime content effect: +35 points
    s = summarize(make_records(rng, {("shared", "arc_challenge"): 80}, arms), n_boot=300)
    assert "shared regime" in s["verdict"] and "not equivalent to 0 at ±2.8" in s["verdict"]
    assert "disagrees with the paper" in s["verdict"]
    assert verdict(s) == s["verdict"]
    rng = np.random.default_rng(5)
    s = summarize(make_records(rng, {("private", "gen_kv"): 30}, {"kv": 0.3, "kv_mismatched": 0.3}), n_boot=300)
    assert "private regime" in s["verdict"] and "disagrees with the paper" in s["verdict"]


def test_contradictory_records_raise():
    base = {"task_id": "a", "task": "gen_kv", "regime": "private", "arm": "kv", "seed": 0, "score": 1.0,
            "latency_s": 0.1, "relay_bytes": 10, "prefill_tokens": 5, "covariates": {}}  # fmt: skip
    with pytest.raises(ValueError, match="duplicate"):
        summarize([base, dict(base)])
    with pytest.raises(ValueError, match="regimes"):
        summarize([base, {**base, "arm": "none", "regime": "shared"}])
    with pytest.raises(ValueError, match="score"):
        summarize([{**base, "score": 1.5}])
    with pytest.raises(ValueError, match="record 0: missing"):
        summarize([{k: v for k, v in base.items() if k != "seed"}])
    with pytest.raises(ValueError, match="dial"):
        summarize([{**base, "arm": "kv_noise"}])
    with pytest.raises(ValueError, match="no trial"):
        summarize([])
    with pytest.raises(ValueError, match="equivalence contrast"):
        summarize([base], equivalence_contrasts=("bogus",))


def test_one_task_gives_no_interval_and_says_so():
    base = {"task_id": "a", "task": "gen_kv", "regime": "private", "arm": "kv", "seed": 0, "score": 1.0,
            "latency_s": None, "relay_bytes": 10, "prefill_tokens": 5, "covariates": {"k": "x"}}  # fmt: skip
    records = [base, {**base, "arm": "kv_mismatched", "score": 0.0, "latency_s": 0.2},
               {**base, "seed": 1}, {**base, "seed": 1, "arm": "kv_mismatched", "score": 0.5}]  # fmt: skip
    s = summarize(records, n_boot=200)
    json.dumps(s, allow_nan=False)
    (row,) = [e for e in s["effects"] if e["task"] == "gen_kv" and e["outcome"] == "success"]
    assert row["estimate"] == 75.0 and row["ci_low"] is None and row["p_value"] is None and row["n"] == 2
    assert s["unmatched"][0]["missing_outcome"] == {"latency_s": 2}  # latency None in the kv arm
    assert "too few tasks" in s["verdict"]


# ---------------------------------------------------------------- TOST: both one-sided tests bind
def _t4_cdf(t: float) -> float:
    """Student t CDF with 4 df, closed form (no scipy): 1/2 + 3/8 u (1 - t^2 / (12 (1 + t^2/4))), u = t / sqrt(1 + t^2/4)."""
    u = t / math.sqrt(1 + t**2 / 4)
    return 0.5 + 3 / 8 * u * (1 - t**2 / (12 * (1 + t**2 / 4)))


@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_tost_a_ten_point_effect_is_not_equivalent(sign):
    """Asymmetric, non-zero differences: a -10-point effect must fail the *lower* test (and +10 the upper)."""
    d = sign * np.array([7.0, 9.0, 10.0, 11.0, 13.0])  # mean 10*sign, sd sqrt(5), se 1
    r = tost_paired(d, margin=2.8)
    assert r.estimate == pytest.approx(10.0 * sign) and r.se == pytest.approx(1.0)
    lower, upper = 1.0 - _t4_cdf((r.estimate + 2.8) / 1.0), _t4_cdf((r.estimate - 2.8) / 1.0)
    assert r.p_lower == pytest.approx(lower, rel=1e-9) and r.p_upper == pytest.approx(upper, rel=1e-9)
    binding = lower if sign < 0 else upper
    assert binding > 0.99 and r.p_tost == pytest.approx(binding, rel=1e-9)
    assert r.p_tost == max(r.p_lower, r.p_upper)
    assert not (r.ci_low >= -2.8 and r.ci_high <= 2.8)


def test_tost_small_asymmetric_effect_is_equivalent_and_uses_both_sides():
    d = np.array([-0.5, 0.2, 0.3, 0.6, 0.9])  # mean 0.3, inside +-2.8
    r = tost_paired(d, margin=2.8)
    se = float(np.std(d, ddof=1) / math.sqrt(5))
    assert r.se == pytest.approx(se)
    assert r.p_lower == pytest.approx(1.0 - _t4_cdf((0.3 + 2.8) / se), rel=1e-9)
    assert r.p_upper == pytest.approx(_t4_cdf((0.3 - 2.8) / se), rel=1e-9)
    assert r.p_lower != r.p_upper and r.p_tost == max(r.p_lower, r.p_upper) < 0.05


def test_tost_zero_se_just_outside_below_is_not_equivalent():
    assert tost_paired(np.full(6, -3.0), margin=2.8).p_tost == 1.0
    assert tost_paired(np.full(6, -2.0), margin=2.8).p_tost == 0.0


def test_summary_does_not_call_a_minus_ten_point_pairing_effect_equivalent():
    """Shared regime where the mismatched payload does 10 points *better* (kv - kv_mismatched = -10)."""
    rng = np.random.default_rng(3)
    records = make_records(rng, {("shared", "arc_challenge"): 60}, {"kv": 0.5, "kv_mismatched": 0.5, "none": 0.3})
    by_task: dict[str, dict[str, dict]] = {}
    for r in records:
        by_task.setdefault(r["task_id"], {})[r["arm"]] = r
    for i, arms in enumerate(by_task.values()):  # 6 of 60 tasks flip to mismatched-only success: -10 points
        arms["kv"]["score"] = float(i % 2)
        arms["kv_mismatched"]["score"] = float(i % 2 or i < 12)
    s = summarize(records, n_boot=200, seed=0)
    eq = [e for e in s["equivalence"] if e["task"] == "ALL" and e["contrast"] == "pairing"][0]
    assert eq["estimate"] == pytest.approx(-10.0)
    assert eq["equivalent"] is False and eq["p_tost"] > 0.05
    assert "not equivalent to 0 at ±2.8" in s["verdict"] and "disagrees with the paper" in s["verdict"]


# ---------------------------------------------------------------- paired_test and McNemar inputs
def test_mcnemar_refuses_what_is_not_a_count():
    for b, c, who, got in ((-1, 2, "b", "-1"), (2, 1.5, "c", "1.5"), (True, 2, "b", "True"), (3, -2, "c", "-2")):
        with pytest.raises(ValueError, match=rf"^{who} must be a non-negative integer count, got {got}$"):
            mcnemar_exact(b, c)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(2.0, 0) == pytest.approx(0.5)


def test_paired_test_picks_its_test_and_validates():
    a, b = [1, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0]
    assert paired_test(a, b, binary=True) == (mcnemar_exact(3, 0), "mcnemar_exact")
    p, name = paired_test(a, b)  # not declared binary: the signed-rank test
    assert name == "wilcoxon" and p == wilcoxon_p(np.subtract(a, b))
    x, y = np.array([[3.0, 1.0], [4.0, 1.5]]), np.array([[1.0, 2.0], [0.5, 0.25]])  # 2-D: flattened
    assert paired_test(x, y) == (wilcoxon_p((x - y).reshape(-1)), "wilcoxon")
    assert paired_test([5.0, 1.0, 2.0, 7.0], [1.0, 3.0, 1.0, 1.0])[0] == wilcoxon_p([4.0, -2.0, 1.0, 6.0])
    clustered = paired_test([1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 5.0], clusters=["t1", "t1", "t2", "t2"])
    assert clustered == (wilcoxon_p([1.5, 1.0]), "wilcoxon_cluster_means")
    assert paired_test([1.0], [0.0]) == (None, "wilcoxon")  # one cluster: no p-value
    with pytest.raises(ValueError, match=r"^a and b must be non-empty and of equal length, got 2 and 3$"):
        paired_test([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match=r"^a and b must be non-empty and of equal length, got 0 and 0$"):
        paired_test([], [])
    for bad in (([1.0, np.nan], [1.0, 2.0]), ([1.0, 2.0], [np.inf, 2.0])):
        with pytest.raises(ValueError, match=r"^a and b must be finite$"):
            paired_test(*bad)
    with pytest.raises(ValueError, match="binary=True but the outcomes take 3 distinct values"):
        paired_test([0, 1, 2], [0, 0, 0], binary=True)


def test_tost_defaults_bounds_and_degenerate_result():
    from kvrelay.audit.hypothesis import TOSTResult

    d = np.array([-0.5, 0.2, 0.3, 0.6, 0.9])
    assert tost_paired(d) == tost_paired(d, margin=2.8, alpha=0.05) and tost_paired(d).margin == 2.8
    assert tost_paired(d, margin=0.5).margin == 0.5 and tost_paired(d, margin=5.0).margin == 5.0
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match=rf"^margin must be positive, got {bad}$"):
            tost_paired(d, margin=bad)
    for bad in (0, 0.5, 0.7):
        with pytest.raises(ValueError, match=rf"^alpha must be in \(0, 0.5\), got {bad}$"):
            tost_paired(d, alpha=bad)
    assert tost_paired(d, alpha=0.49).ci_high < tost_paired(d, alpha=0.05).ci_high
    assert tost_paired(np.ones(6)) == TOSTResult(1.0, 0.0, 5, 1.0, 1.0, 2.8, 0.0, 0.0, 0.0)
    at_lower, at_upper = tost_paired(np.full(6, -2.5), margin=2.5), tost_paired(np.full(6, 2.5), margin=2.5)
    assert (at_lower.p_lower, at_lower.p_upper, at_lower.p_tost) == (1.0, 0.0, 1.0)
    assert (at_upper.p_lower, at_upper.p_upper, at_upper.p_tost) == (0.0, 1.0, 1.0)


def test_tost_uses_the_cluster_robust_se():
    d = np.array([1.0, 1.2, -0.4, -0.2, 0.5, 0.7])
    clusters = ["a", "a", "b", "b", "c", "c"]
    r = tost_paired(d, clusters, margin=2.8)
    mean, se, df = cluster_mean_se(d, clusters)
    assert (r.estimate, r.se, r.df) == (mean, se, 2) and r.se != tost_paired(d, margin=2.8).se


def test_wilcoxon_paths_and_boundaries_match_scipy():
    rng = np.random.default_rng(11)
    for n, method in ((13, "exact"), (50, "exact"), (51, "approx")):
        d = rng.normal(0.3, 1.0, n)  # untied
        assert wilcoxon_p(d) == pytest.approx(stats.wilcoxon(d, method=method).pvalue, rel=1e-9), n
    tied = rng.integers(-2, 5, 40).astype(float)
    tied = tied[tied != 0]  # > 13 non-zero differences, many tied: the normal approximation with tie correction
    assert tied.size > 13
    assert wilcoxon_p(tied) == pytest.approx(stats.wilcoxon(tied, method="approx").pvalue, rel=1e-9)
    assert wilcoxon_p([[1.0, 2.0], [3.0, -1.5]]) == wilcoxon_p([1.0, 2.0, 3.0, -1.5])  # any shape: flattened
    assert wilcoxon_p([0.0, 0.0]) == 1.0 and wilcoxon_p([]) == 1.0


def test_holm_and_bh_refuse_p_values_outside_0_1():
    assert holm([0.0, 1.0]) == [0.0, 1.0] and benjamini_hochberg([0.0, 1.0]) == [0.0, 1.0]
    for bad in ([0.5, 1.2], [-0.1], [1.5], [float("nan")]):
        for fn in (holm, benjamini_hochberg):
            with pytest.raises(ValueError, match=r"^p-values must lie in \[0, 1\] \(use None for a missing p-value, "
                                                 r"not NaN\)$"):
                fn(bad)


def test_cluster_mean_se_edges():
    assert cluster_mean_se([1.0, 3.0]) == (2.0, pytest.approx(1.0), 1)  # two clusters: the smallest allowed
    assert cluster_mean_se([[1.0, 3.0], [5.0, 7.0]])[0] == 4.0  # any shape: flattened
    for bad in ([], [1.0, float("nan")]):
        with pytest.raises(ValueError, match=r"^diffs must be non-empty and finite$"):
            cluster_mean_se(bad)
    with pytest.raises(ValueError, match=r"^need at least two clusters \(tasks\) for a standard error$"):
        cluster_mean_se([1.0])
    with pytest.raises(ValueError, match=r"^need at least two clusters"):
        cluster_mean_se([1.0, 2.0], ["t", "t"])


def test_bca_inputs_fields_and_clusters():
    from kvrelay.audit.bootstrap import cluster_codes

    for bad, msg in (([], r"^values is empty: need at least one value$"),
                     ([1.0, float("inf")], r"^values contains NaN or infinite entries$")):
        with pytest.raises(ValueError, match=msg):
            bca_ci(bad)
    for c in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=rf"^confidence must be in \(0, 1\), got {c}$"):
            bca_ci([1.0, 2.0, 4.0], confidence=c)
    with pytest.raises(ValueError, match=r"^n_boot must be at least 100 for a BCa interval, got 99$"):
        bca_ci([1.0, 2.0, 4.0], n_boot=99)
    assert bca_ci([1.0, 2.0, 4.0], n_boot=100).method in ("bca", "percentile")
    with pytest.raises(ValueError, match=r"^clusters must have one label per value: got \(1,\) labels for \(2,\) values$"):
        bca_ci([1.0, 2.0], clusters=["a"])
    assert cluster_codes(np.zeros(3), ["b", "a", "b"]).tolist() == [1, 0, 1]
    assert cluster_codes(np.zeros(3), None).tolist() == [0, 1, 2]
    x = np.array([1.0, 2.0, 0.5, 4.0, 3.0, 9.0])
    ci = bca_ci(x, ["a", "a", "b", "b", "c", "c"], confidence=0.9, n_boot=400, seed=3)
    assert (ci.estimate, ci.confidence, ci.n, ci.n_clusters) == (pytest.approx(19.5 / 6), 0.9, 6, 3)
    assert ci.low < ci.estimate < ci.high and ci == bca_ci(x, ["a", "a", "b", "b", "c", "c"], confidence=0.9,
                                                             n_boot=400, seed=3)
    assert bca_ci(x, n_boot=400, seed=4) != bca_ci(x, n_boot=400, seed=5)
    assert bca_ci([1.0, 3.0], n_boot=200).n_clusters == 2  # two clusters are enough for an interval
    flat = bca_ci([2.0, 2.0, 2.0, 2.0], ["a", "a", "b", "b"])
    assert (flat.method, flat.low, flat.high, flat.n, flat.n_clusters) == ("degenerate", 2.0, 2.0, 4, 2)


def test_paired_test_refuses_a_missing_outcome_with_a_value_error():
    # None (a trial with no score) must be a ValueError naming the problem, not a TypeError from numpy
    for bad in (([1.0, None, 0.0], [0.0, 1.0, 1.0]), ([1.0, 0.0, 1.0], [0.0, None, 1.0])):
        with pytest.raises(ValueError, match=r"^a and b must be finite$"):
            paired_test(*bad)
    with pytest.raises(ValueError, match=r"^diffs must be non-empty and finite$"):
        cluster_mean_se([1.0, None, 2.0])


def test_paired_test_names_mcnemar_even_without_a_p_value():
    assert paired_test([1], [0], binary=True) == (None, "mcnemar_exact")  # one pair: no p, but the test it would run


def test_paired_test_cluster_means_with_unequal_sizes_and_mixed_signs():
    # cluster means 1 (3 pairs), -2 (1), 3 (1), -1.5 (2): the signed-rank test runs on those means
    a = [1.0, 2.0, 0.0, 0.0, 3.0, 0.0, 1.0]
    b = [0.0, 1.0, -1.0, 2.0, 0.0, 1.0, 3.0]
    clusters = ["a", "a", "a", "b", "c", "d", "d"]
    p, name = paired_test(a, b, clusters=clusters)
    assert name == "wilcoxon_cluster_means" and p == wilcoxon_p([1.0, -2.0, 3.0, -1.5])


# ---------------------------------------------------------------- bca_ci: defaults, fields and the BCa map itself
def test_bca_defaults_fields_and_input_checks():
    x = np.random.default_rng(4).lognormal(size=30)
    assert bca_ci(x) == bca_ci(x, n_boot=2000, seed=0)  # the documented defaults
    assert bca_ci(x) != bca_ci(x, n_boot=2001, seed=0)
    assert bca_ci(x.reshape(5, 6), n_boot=200) == bca_ci(x, n_boot=200)  # any shape: flattened
    with pytest.raises(ValueError, match=r"^values contains NaN or infinite entries$"):
        bca_ci([1.0, None, 2.0])  # a missing value is a ValueError, not a TypeError from numpy
    one = bca_ci([1.0, 0.0, 1.0], clusters=["t", "t", "t"])
    assert (one.estimate, one.confidence, one.n) == (pytest.approx(2 / 3), 0.95, 3)
    same = bca_ci(np.full(4, 3.0), confidence=0.8)
    assert (same.confidence, same.n, same.method) == (0.8, 4, "degenerate")


def test_bca_cluster_means_without_spread_are_degenerate():
    # the values differ, but every cluster has mean 2: every resample's mean is 2
    ci = bca_ci([1.0, 3.0, 3.0, 1.0], ["a", "a", "b", "b"], n_boot=200)
    assert (ci.method, ci.low, ci.high, ci.estimate) == ("degenerate", 2.0, 2.0, 2.0)


def test_bca_jackknife_leaves_one_cluster_out():
    from kvrelay.audit.bootstrap import _bca_interval, _cluster_boot_means

    x = np.array([1.0, 2.0, 0.5, 4.0, 3.0, 9.0, 0.0])
    labels = np.array(["a", "a", "b", "b", "b", "c", "d"])
    ci = bca_ci(x, labels, n_boot=500, seed=3)
    sums = np.array([x[labels == g].sum() for g in "abcd"])
    counts = np.array([float((labels == g).sum()) for g in "abcd"])
    boot = _cluster_boot_means(sums, counts, 500, np.random.default_rng(3))
    jack = np.array([x[labels != g].mean() for g in "abcd"])  # the mean without cluster g
    assert (ci.low, ci.high, ci.method) == _bca_interval(float(x.mean()), boot, jack, 0.95)


def test_bca_resampling_in_chunks_equals_one_draw():
    from kvrelay.audit.bootstrap import _MAX_DRAWS_PER_CHUNK, _cluster_boot_means

    G = _MAX_DRAWS_PER_CHUNK // 100  # 100 resamples per chunk: 250 resamples take three chunks (100, 100, 50)
    rng = np.random.default_rng(5)
    sums, counts = rng.normal(size=G), rng.integers(1, 4, size=G).astype(float)
    got = _cluster_boot_means(sums, counts, 250, np.random.default_rng(9))
    ref_rng = np.random.default_rng(9)
    idx = np.concatenate([ref_rng.integers(0, G, size=(m, G)) for m in (100, 100, 50)])  # (250, G)
    assert np.array_equal(got, sums[idx].sum(axis=1) / counts[idx].sum(axis=1))


def test_bca_interval_mid_rank_ties_and_zero_acceleration():
    from kvrelay.audit.bootstrap import _bca_interval

    boot = np.array([0.0] * 10 + [0.5] * 30 + [1.0] * 10)  # half the ties count as below: z0 = 0
    expected = tuple(np.percentile(boot, [2.5, 97.5]))
    for jack in (np.ones(3), np.array([-1.0, 0.0, 1.0])):  # no spread / no skew: acceleration 0
        low, high, method = _bca_interval(0.5, boot, jack, 0.95)
        assert method == "bca" and (low, high) == pytest.approx(expected)


def test_bca_interval_acceleration_and_clipped_bias():
    from scipy.special import ndtr, ndtri

    from kvrelay.audit.bootstrap import _bca_interval

    boot, z = np.arange(1.0, 101.0), ndtri(np.array([0.025, 0.975]))
    jack = np.array([0.0, 0.0, 3.0])
    dev = jack.mean() - jack
    a = np.sum(dev**3) / (6.0 * np.sum(dev**2) ** 1.5)  # Efron & Tibshirani (14.15)
    low, high, _ = _bca_interval(50.5, boot, jack, 0.95)  # z0 = 0
    assert (low, high) == pytest.approx(tuple(np.percentile(boot, 100 * ndtr(z / (1 - a * z)))))
    flat = np.ones(3)
    for theta, share in ((0.0, 0.5 / 100), (1000.0, 1 - 0.5 / 100)):  # outside the bootstrap range: clipped
        z0 = ndtri(share)
        low, high, _ = _bca_interval(theta, boot, flat, 0.95)
        assert (low, high) == pytest.approx(tuple(np.percentile(boot, 100 * ndtr(2 * z0 + z))))


def test_bca_interval_falls_back_to_percentiles_when_the_map_is_not_monotone():
    from kvrelay.audit.bootstrap import _bca_interval

    boot = np.linspace(1.0, 2.0, 1_000_000)  # theta below all of it: z0 = ndtri(0.5e-6)
    jack = np.r_[np.zeros(99), 10.0]  # one far cluster: acceleration ~ -1/6
    low, high, method = _bca_interval(0.0, boot, jack, 0.95)
    assert method == "percentile" and (low, high) == pytest.approx(tuple(np.percentile(boot, [2.5, 97.5])))


# ---------------------------------------------------------------- cost p-values from the CI's own draws

def test_cost_p_value_agrees_with_its_ci_on_skewed_latencies():
    """Skewed latency differences (many small savings, a few large losses): a signed-rank test and a BCa
    interval of the mean can disagree; the cost p-value inverts the same bootstrap, so they cannot."""
    from kvrelay.audit.bootstrap import bca_test
    from kvrelay.audit.hypothesis import wilcoxon_p

    rng = np.random.default_rng(7)
    disagreed = 0
    for trial in range(40):
        n = 30
        diff = np.where(rng.random(n) < 0.85, -rng.exponential(0.05, n), rng.exponential(0.6 + 0.02 * trial, n))
        ci, p = bca_test(diff, n_boot=2000, seed=trial)
        excludes = ci.low > 0 or ci.high < 0
        margin = min(abs(ci.low), abs(ci.high))
        if margin > 1e-3:  # 0 not on an interval end (where the percentile resolution decides)
            assert (p < 0.05) == excludes, (trial, p, ci)
        disagreed += (wilcoxon_p(diff) < 0.05) != excludes
    assert disagreed > 0  # the case this guards against happens on such data


def test_cost_effects_use_the_bootstrap_p_value():
    from kvrelay.audit.paired import Paired
    from kvrelay.audit.stats import paired_effect

    rng = np.random.default_rng(1)
    a, b = rng.exponential(1.0, 40), rng.exponential(1.0, 40) + 0.3
    p = Paired("private", "t", "kv", "text_full", "latency_s", a, b, np.arange(40), np.zeros(40), [{}] * 40, 0, 0, 0)
    e = paired_effect(p, n_boot=1000)
    assert e["test"] == "bca_bootstrap" and (e["p_value"] < 0.05) == (e["ci_high"] < 0 or e["ci_low"] > 0)
    s = paired_effect(replace(p, outcome="success", a=(a > 1) * 100.0, b=(b > 1) * 100.0), n_boot=1000)
    assert s["test"] == "mcnemar_exact"


def test_bca_test_p_value_edges():
    from kvrelay.audit.bootstrap import bca_test

    assert bca_test([0.0, 0.0, 0.0])[1] == 1.0
    assert bca_test([2.0, 2.0, 2.0], n_boot=200)[1] == 1 / 200
    assert bca_test([1.0], n_boot=200)[1] is None
    ci, p = bca_test(np.r_[np.ones(20), -np.ones(20)], n_boot=500)
    assert p > 0.5 and ci.low < 0 < ci.high
