"""From trial records to paired arrays: validation, arm names, contrasts, matching.

A trial record (one line of ``records.jsonl``) has at least ``task_id``, ``task`` (task-set
name), ``regime`` (``private`` | ``shared``), ``arm``, ``seed``, ``score`` (0..1),
``latency_s``, ``relay_bytes``, ``prefill_tokens`` and ``covariates``. Two arms are paired by
``(task_id, seed)`` inside one ``(regime, task)`` cell; the pooled cell ``task="ALL"`` pairs by
``(task, task_id, seed)`` and clusters by ``task/task_id``. Trials present in only one arm are
counted (``only_a``/``only_b``), never silently dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvrelay.audit.vocab import CONTRASTS, OUTCOMES, REGIMES, dial_family  # noqa: F401 - re-exported
from kvrelay.audit.vocab import parse_arm as _parse

ALL = "ALL"


def parse_arm(arm: str) -> tuple[str, str | None]:
    """``(base, dial)`` of a record's arm name (lenient: arms added later still load; see ``vocab``)."""
    a = _parse(arm, strict=False)
    return a.base, a.dial


@dataclass(frozen=True, slots=True)
class Trial:
    """One validated trial. ``outcome("success")`` is the score in points (×100)."""

    task: str
    task_id: str
    regime: str
    arm: str
    seed: int
    score: float
    latency_s: float | None
    relay_bytes: float | None
    prefill_tokens: float | None
    covariates: Mapping[str, object] = field(default_factory=dict)

    def outcome(self, name: str) -> float | None:
        if name == "success":
            return 100.0 * self.score
        if name in OUTCOMES:
            return getattr(self, name)
        raise ValueError(f"unknown outcome {name!r}; expected one of {OUTCOMES}")


def validate_records(records: Iterable[Mapping[str, object]]) -> list[Trial]:
    """Check every record and return :class:`Trial` objects; raise ValueError naming the record.

    Contradictions that raise: a duplicate ``(regime, task, arm, task_id, seed)``; the same
    ``(task, task_id)`` under two regimes; a score outside [0, 1]; a negative cost.
    """
    trials: list[Trial] = []
    seen: set[tuple[str, str, str, str, int]] = set()
    regime_of: dict[tuple[str, str], str] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, Mapping):
            raise ValueError(f"record {i}: expected a dict, got {type(rec).__name__}")
        t = _trial(i, rec)
        key = (t.regime, t.task, t.arm, t.task_id, t.seed)
        if key in seen:
            raise ValueError(f"record {i}: duplicate trial {key} (regime, task, arm, task_id, seed)")
        seen.add(key)
        prev = regime_of.setdefault((t.task, t.task_id), t.regime)
        if prev != t.regime:
            raise ValueError(f"record {i}: task {t.task}/{t.task_id} appears under regimes {prev!r} and {t.regime!r}")
        trials.append(t)
    if not trials:
        raise ValueError("no trial records")
    return trials


def _trial(i: int, rec: Mapping[str, object]) -> Trial:
    missing = [k for k in ("task_id", "task", "regime", "arm", "seed", "score") if k not in rec]
    if missing:
        raise ValueError(f"record {i}: missing field(s) {missing}")
    task_id, task = rec["task_id"], rec["task"]
    if isinstance(task_id, bool) or not isinstance(task_id, str | int) or str(task_id) == "":
        raise ValueError(f"record {i}: task_id must be a non-empty string, got {task_id!r}")
    if not isinstance(task, str) or not task or task == ALL:
        raise ValueError(f"record {i}: task must be a task-set name other than {ALL!r}, got {task!r}")
    regime = rec["regime"]
    if regime not in REGIMES:
        raise ValueError(f"record {i}: regime must be one of {REGIMES}, got {regime!r}")
    arm = rec["arm"]
    try:
        parse_arm(arm)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"record {i}: {e}") from None
    seed = rec["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"record {i}: seed must be an integer, got {seed!r}")
    score = _number(i, "score", rec["score"], required=True)
    if not 0.0 <= score <= 1.0:  # type: ignore[operator]
        raise ValueError(f"record {i}: score must be in [0, 1], got {score}")
    costs = {k: _number(i, k, rec.get(k), required=False) for k in ("latency_s", "relay_bytes", "prefill_tokens")}
    for k, v in costs.items():
        if v is not None and v < 0:
            raise ValueError(f"record {i}: {k} must be non-negative, got {v}")
    covs = rec.get("covariates") or {}
    if not isinstance(covs, Mapping) or not all(isinstance(k, str) for k in covs):
        raise ValueError(f"record {i}: covariates must be a dict with string keys")
    for k, v in covs.items():
        if v is not None and not isinstance(v, str | int | float | bool | np.number):
            raise ValueError(f"record {i}: covariate {k!r} must be a number or string, got {type(v).__name__}")
    return Trial(task, str(task_id), regime, arm.strip(), int(seed), float(score), **costs, covariates=dict(covs))  # type: ignore[arg-type]


def _number(i: int, name: str, v: object, *, required: bool) -> float | None:
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float | np.number) or not math.isfinite(float(v)):
        raise ValueError(f"record {i}: {name} must be a finite number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Paired:
    """Paired outcomes of arm A and arm B in one ``(regime, task)`` cell.

    ``a``, ``b``: (n,) outcome per pair (success in points ×100); ``clusters``: (n,) task label
    per pair; ``covariates``: per pair, from arm A's trial. ``only_a``/``only_b``: trials with
    no partner in the other arm; ``missing_outcome``: matched pairs dropped because the outcome
    was None in either arm. ``n`` is the number of pairs used.
    """

    regime: str
    task: str
    arm_a: str
    arm_b: str
    outcome: str
    a: np.ndarray
    b: np.ndarray
    clusters: np.ndarray
    seeds: np.ndarray
    covariates: list[Mapping[str, object]]
    only_a: int
    only_b: int
    missing_outcome: int

    @property
    def diff(self) -> np.ndarray:
        return self.a - self.b

    @property
    def n(self) -> int:
        return int(self.a.size)

    @property
    def n_clusters(self) -> int:
        return int(np.unique(self.clusters).size)

    @property
    def binary(self) -> bool:
        """True for success outcomes that are all 0 or 100 points (then McNemar applies)."""
        vals = np.concatenate([self.a, self.b])
        return self.outcome == "success" and bool(np.all((vals == 0.0) | (vals == 100.0)))


class TrialIndex:
    """Trials indexed by cell and arm: ``cells[(regime, task)][arm][(task, task_id, seed)]``."""

    def __init__(self, trials: Iterable[Trial]):
        self.cells: dict[tuple[str, str], dict[str, dict[tuple[str, str, int], Trial]]] = {}
        for t in trials:
            key = (t.task, t.task_id, t.seed)
            for cell in ((t.regime, t.task), (t.regime, ALL)):
                self.cells.setdefault(cell, {}).setdefault(t.arm, {})[key] = t

    def regimes(self) -> list[str]:
        return [r for r in REGIMES if (r, ALL) in self.cells]

    def tasks(self, regime: str) -> list[str]:
        """Task sets of a regime, sorted, without ALL."""
        return sorted(task for (r, task) in self.cells if r == regime and task != ALL)

    def arms(self, regime: str, task: str) -> list[str]:
        return sorted(self.cells.get((regime, task), {}))

    def has(self, regime: str, task: str, arm: str) -> bool:
        return arm in self.cells.get((regime, task), {})

    def pair(self, regime: str, task: str, arm_a: str, arm_b: str, outcome: str) -> Paired:
        """Pair arm A with arm B on ``outcome`` in a cell (``task`` may be ``"ALL"``)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        cell = self.cells.get((regime, task), {})
        if arm_a not in cell or arm_b not in cell:
            absent = [a for a in (arm_a, arm_b) if a not in cell]
            raise ValueError(f"arm(s) {absent} have no trials in regime={regime!r}, task={task!r}")
        ta, tb = cell[arm_a], cell[arm_b]
        keys = sorted(ta.keys() & tb.keys())
        a, b, clusters, seeds, covs = [], [], [], [], []
        missing = 0
        for key in keys:
            va, vb = ta[key].outcome(outcome), tb[key].outcome(outcome)
            if va is None or vb is None:
                missing += 1
                continue
            a.append(va)
            b.append(vb)
            clusters.append(f"{key[0]}/{key[1]}")
            seeds.append(key[2])
            covs.append(ta[key].covariates)
        return Paired(
            regime, task, arm_a, arm_b, outcome,
            np.asarray(a, dtype=float), np.asarray(b, dtype=float),
            np.asarray(clusters, dtype=object), np.asarray(seeds, dtype=int), covs,
            only_a=len(ta.keys() - tb.keys()), only_b=len(tb.keys() - ta.keys()), missing_outcome=missing,
        )  # fmt: skip
