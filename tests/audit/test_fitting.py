"""Adapter fitting texts: deterministic, from the allowed sources only, disjoint from the evaluation pools."""

from __future__ import annotations

import pytest

from kvrelay.audit.tasks.fitting import SOURCES, fitting_texts
from kvrelay.audit.tasks.generated import generate


def test_fitting_texts_round_robin_and_disjoint_from_evaluation_records():
    texts = fitting_texts(15)
    assert [s for s, _ in texts[:5]] == list(SOURCES)
    assert texts == fitting_texts(15)
    eval_contexts = {t.context for t in generate(200, seed=0)}
    assert not eval_contexts & {t for _, t in texts}
    assert all(t.strip() for _, t in texts)
    with pytest.raises(ValueError, match="unknown"):
        fitting_texts(3, ("squad",))
