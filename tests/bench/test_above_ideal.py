"""A speedup above its ideal is flagged as noise, with the spread of the repeats."""

from __future__ import annotations

from kvrelay.bench.pipeline import NOISE_TOLERANCE, above_ideal


def test_the_issue_case_is_flagged_with_the_spread():
    note = above_ideal(1.93, 1.08, [1.41, 1.93, 2.31])
    assert note is not None and "above its ideal 1.08x" in note and "noise" in note
    assert "1.41x to 2.31x over 3 repeat(s)" in note


def test_a_ratio_at_or_below_its_ideal_is_not_flagged():
    assert above_ideal(1.05, 1.08, [1.05]) is None
    assert above_ideal(1.08 * (1 + NOISE_TOLERANCE), 1.08, [1.1]) is None  # within tolerance
    assert above_ideal(1.08 * (1 + 2 * NOISE_TOLERANCE), 1.08, [1.1]) is not None
