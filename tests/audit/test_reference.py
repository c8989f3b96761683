"""The committed audits are the reference: recomputing their statistics from their records must give
the very numbers they report (a refactor of arms, pairing or statistics that changes them fails here)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvrelay.audit.report import read_records
from kvrelay.audit.stats import summarize

AUDITS = Path(__file__).resolve().parents[2] / "docs" / "audit"
NUMBERS = ("estimate", "ci_low", "ci_high", "p_value", "p_holm", "n", "n_clusters")


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _keyed(rows, keys):
    return {tuple(r[k] for k in keys): r for r in rows}


@pytest.mark.parametrize("name", ["quick-qwen2.5-coder-0.5b", "codecs-qwen2.5-coder-0.5b"])
def test_committed_audit_effects_reproduce_from_records(name):
    folder = AUDITS / name
    ref = json.loads((folder / "summary.json").read_text())
    s = ref["settings"]
    got = summarize(read_records(folder), margin=s["margin"], n_boot=s["n_boot"], seed=s["seed"],
                    confidence=s["confidence"])
    for section, keys in (("effects", ("regime", "task", "contrast", "outcome")),
                          ("equivalence", ("regime", "task", "contrast"))):
        want, have = _keyed(ref[section], keys), _keyed(got[section], keys)
        assert set(have) == set(want), f"{section}: cells differ"
        for k, row in want.items():
            for f in NUMBERS + (("p_tost", "equivalent") if section == "equivalence" else ()):
                if f in row:
                    assert _same(have[k][f], row[f]), f"{name} {section} {k} {f}: {have[k][f]} != {row[f]}"
    assert got["n_tasks"] == ref["n_tasks"]
