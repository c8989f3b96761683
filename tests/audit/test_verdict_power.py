"""The verdict knows its power: small or imprecise samples say "too few tasks to tell", never agree/disagree."""

from __future__ import annotations

from kvrelay.audit.verdict import MAX_TOST_HALF_WIDTH, MIN_TASKS, verdict


def pairing(regime: str, est: float, lo: float, hi: float, n_tasks: int, p_holm: float) -> dict:
    return {"regime": regime, "task": "ALL", "contrast": "pairing", "outcome": "success", "estimate": est,
            "ci_low": lo, "ci_high": hi, "p_holm": p_holm, "n": 5 * n_tasks, "n_clusters": n_tasks}


def summary(*effects: dict, equivalence: tuple = ()) -> dict:
    return {"effects": list(effects), "equivalence": list(equivalence), "settings": {"margin": 2.8}}


def tost(lo: float, hi: float, equivalent: bool = False) -> dict:
    return {"regime": "shared", "task": "ALL", "contrast": "pairing", "ci90_low": lo, "ci90_high": hi,
            "p_tost": 0.4, "p_holm": 0.9, "equivalent": equivalent}


def test_two_tasks_never_disagree_with_the_paper():
    # the issue's `--tasks gen_easy:2`: a null private effect on 2 tasks
    text = verdict(summary(pairing("private", 0.0, 0.0, 0.0, n_tasks=2, p_holm=1.0)))
    assert "too few tasks to tell" in text and "disagrees" not in text and "agrees" not in text


def test_below_the_floor_a_large_effect_does_not_agree_either():
    text = verdict(summary(pairing("private", 70.0, 50.0, 90.0, n_tasks=MIN_TASKS - 1, p_holm=0.001)))
    assert "too few tasks to tell" in text and "agrees" not in text


def test_at_the_floor_a_clear_effect_agrees():
    text = verdict(summary(pairing("private", 70.0, 60.0, 80.0, n_tasks=MIN_TASKS, p_holm=0.001)))
    assert "agrees with the paper" in text


def test_a_private_ci_that_reaches_the_paper_cannot_disagree():
    text = verdict(summary(pairing("private", 20.0, -5.0, 65.0, n_tasks=30, p_holm=0.2)))
    assert "too few tasks to tell" in text and "disagrees" not in text
    text = verdict(summary(pairing("private", 0.0, -10.0, 10.0, n_tasks=30, p_holm=1.0)))
    assert "disagrees with the paper" in text  # the CI excludes +61..+77: a real disagreement


def test_a_tost_ci_wider_than_the_bound_is_too_few_tasks():
    # the dose run: TOST 90% CI -265.7 to +365.7 points
    text = verdict(summary(pairing("shared", 50.0, -200.0, 300.0, n_tasks=24, p_holm=0.6),
                           equivalence=(tost(-265.7, 365.7),)))
    assert "too few tasks to tell" in text and "inconclusive" not in text and "disagrees" not in text
    w = MAX_TOST_HALF_WIDTH - 1  # narrower than the bound but not within the margin: inconclusive at this size
    text = verdict(summary(pairing("shared", 1.0, -w, w, n_tasks=24, p_holm=0.6), equivalence=(tost(-w, w),)))
    assert "inconclusive" in text and "too few tasks" not in text
