"""Statistics of the causal audit: paired effects, equivalence, CATE, dose-response, cost-benefit.

Entry point: :func:`summarize` turns trial records (``records.jsonl``) into the body of
``summary.json`` (fields in docs/json.md); :func:`verdict` phrases it in plain language.

Conventions, stated once:
- Every effect is a paired difference ``arm A − arm B`` (contrasts in
  :data:`~kvrelay.audit.paired.CONTRASTS`, plus per adapter arm ``adapter_pairing:NAME`` and
  ``adapter_vs_none:NAME``: :func:`~kvrelay.audit.vocab.adapter_contrasts`), matched on ``(task_id, seed)``.
- ``success`` effects are in POINTS (score × 100, so +4.1 means 4.1 percentage points);
  ``latency_s`` in seconds, ``relay_bytes`` in bytes, ``prefill_tokens`` in tokens.
- Estimate = mean of the paired differences; CI = BCa bootstrap (95% by default), a cluster
  bootstrap over tasks when tasks have several seeds (:mod:`kvrelay.audit.bootstrap`): a task's
  seeds are resampled together, so the variation its seeds create (option order, mismatch
  partner, sampling: :mod:`kvrelay.audit.seeding`) enters within the cluster, never as extra tasks.
- p-values: exact McNemar for binary success with one seed; Wilcoxon signed-rank otherwise (on
  per-task mean differences with several seeds) (:func:`~kvrelay.audit.hypothesis.paired_test`).
- Holm families: all ``success`` effects reported (every regime, task set, pooled ``ALL`` cell
  and contrast) form one family; each other outcome forms its own family. All equivalence
  tests form one family. When a regime has a single task set its ``ALL`` cell is the same
  hypothesis as that task set's and is counted once.
- TOST: paired t with a cluster-robust SE (:func:`~kvrelay.audit.hypothesis.tost_paired`) on
  success in points, margin ±2.8 points by default (the paper's), α = 0.05, so the reported
  interval is the 90% CI; ``equivalent`` means Holm-adjusted ``p_tost < 0.05``.
- No NaN or infinity ever leaves this module: undefined numbers are None.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvrelay.audit.bootstrap import BootstrapCI, bca_ci, bca_test
from kvrelay.audit.hypothesis import (
    TOSTResult,
    benjamini_hochberg,
    cluster_mean_se,
    holm,
    mcnemar_exact,
    paired_test,
    tost_paired,
)
from kvrelay.audit.paired import (
    ALL,
    CONTRASTS,
    OUTCOMES,
    Paired,
    Trial,
    TrialIndex,
    dial_family,
    parse_arm,
    validate_records,
)
from kvrelay.audit.seeding import seed_report
from kvrelay.audit.subgroups import cate_regression, cate_subgroups
from kvrelay.audit.verdict import verdict
from kvrelay.audit.vocab import ALPHA, contrasts_for

__all__ = [
    "ALL", "CONTRASTS", "OUTCOMES", "BootstrapCI", "Paired", "TOSTResult", "Trial", "TrialIndex",
    "bca_ci", "benjamini_hochberg", "cluster_mean_se", "cost_benefit", "dose_response", "holm",
    "mcnemar_exact", "pair_trials", "paired_effect", "paired_test", "parse_arm", "summarize",
    "tost_paired", "validate_records", "verdict",
]  # fmt: skip

REFERENCES = ("none", "text_full")  # cost-benefit baselines


def pair_trials(records: Iterable[Mapping[str, object]], arm_a: str, arm_b: str, outcome: str = "success",
                *, regime: str, task: str = ALL) -> Paired:  # fmt: skip
    """Validate ``records`` and pair ``arm_a`` with ``arm_b`` in one cell (``task="ALL"``: pooled regime)."""
    return TrialIndex(validate_records(records)).pair(regime, task, arm_a, arm_b, outcome)


def paired_effect(p: Paired, *, confidence: float = 0.95, n_boot: int = 2000, seed: int = 0) -> dict:
    """Effect ``A − B`` of a :class:`Paired`: ``estimate, ci_low, ci_high, p_value, test, n, n_clusters``.

    Success: McNemar or Wilcoxon p-values (``hypothesis.paired_test``). Cost outcomes: the p-value
    inverts the same BCa bootstrap as the CI (``bootstrap.bca_test``), so "p < 0.05" and "the 95% CI
    excludes 0" never disagree.

    Success estimates are in points (×100). With no pairs everything but ``n`` is None.
    """
    if p.n == 0:
        return {"estimate": None, "ci_low": None, "ci_high": None, "p_value": None, "test": None,
                "n": 0, "n_clusters": 0}  # fmt: skip
    if p.outcome == "success":
        ci = bca_ci(p.diff, p.clusters, confidence=confidence, n_boot=n_boot, seed=seed)
        pv, test = paired_test(p.a, p.b, p.clusters, binary=p.binary)
    else:  # costs (skewed latencies, bytes, tokens): the p-value from the very draws of the CI, so they agree
        ci, pv = bca_test(p.diff, p.clusters, confidence=confidence, n_boot=n_boot, seed=seed)
        test = "bca_bootstrap"
    return {"estimate": ci.estimate, "ci_low": ci.low, "ci_high": ci.high, "p_value": pv, "test": test,
            "n": p.n, "n_clusters": p.n_clusters}  # fmt: skip


class _Audit:
    """Validated trials plus a memo of paired effects (several sections reuse the same pairs)."""

    def __init__(self, records: Iterable[Mapping[str, object]], *, confidence: float, n_boot: int, seed: int):
        self.trials = validate_records(records)
        self.index = TrialIndex(self.trials)
        self.opts = {"confidence": confidence, "n_boot": n_boot, "seed": seed}
        self._memo: dict[tuple[str, str, str, str, str], tuple[Paired, dict]] = {}

    def cells(self) -> list[tuple[str, str]]:
        return [(r, t) for r in self.index.regimes() for t in [*self.index.tasks(r), ALL]]

    def effect(self, regime: str, task: str, arm_a: str, arm_b: str, outcome: str) -> tuple[Paired, dict]:
        key = (regime, task, arm_a, arm_b, outcome)
        if key not in self._memo:
            p = self.index.pair(regime, task, arm_a, arm_b, outcome)
            self._memo[key] = (p, paired_effect(p, **self.opts))
        return self._memo[key]

    def hypothesis(self, regime: str, task: str) -> str:
        """The task set a cell's hypotheses are about: ALL of a one-task-set regime is that task set."""
        tasks = self.index.tasks(regime)
        return tasks[0] if task == ALL and len(tasks) == 1 else task


def _holm_by_key(rows: list[dict], keys: list[tuple], p_field: str) -> list[float | None]:
    """Holm over distinct hypotheses: rows sharing a key share one test and one adjusted p."""
    first: dict[tuple, float | None] = {}
    for row, key in zip(rows, keys, strict=True):
        first.setdefault(key, row[p_field])
    adjusted = dict(zip(first, holm(list(first.values())), strict=True))
    return [adjusted[k] for k in keys]


def _effects(audit: _Audit) -> tuple[list[dict], list[dict]]:
    rows, keys = [], []
    gaps: dict[tuple[str, str, str], dict] = {}
    missing: dict[tuple[str, str, str], dict[str, int]] = defaultdict(dict)
    for regime, task in audit.cells():
        for contrast, (arm_a, arm_b) in contrasts_for(audit.index.arms(regime, task)).items():
            if not (audit.index.has(regime, task, arm_a) and audit.index.has(regime, task, arm_b)):
                continue  # a contrast whose arm was not run is absent, not an error
            for outcome in OUTCOMES:
                p, eff = audit.effect(regime, task, arm_a, arm_b, outcome)
                rows.append({"regime": regime, "task": task, "contrast": contrast, "outcome": outcome, **eff})
                keys.append((outcome, regime, audit.hypothesis(regime, task), contrast))
                if p.only_a or p.only_b or p.missing_outcome:
                    missing[(regime, task, contrast)][outcome] = p.missing_outcome
                    gaps[(regime, task, contrast)] = {"regime": regime, "task": task, "contrast": contrast,
                                                      "arm_a": arm_a, "arm_b": arm_b, "only_a": p.only_a,
                                                      "only_b": p.only_b}  # fmt: skip
    for outcome in OUTCOMES:  # one Holm family per outcome; success is the headline family
        idx = [i for i, k in enumerate(keys) if k[0] == outcome]
        adj = _holm_by_key([rows[i] for i in idx], [keys[i] for i in idx], "p_value")
        for i, q in zip(idx, adj, strict=True):
            rows[i]["p_holm"] = q
    unmatched = [{**row, "missing_outcome": {o: n for o, n in missing[key].items() if n}} for key, row in gaps.items()]
    return rows, unmatched


def _equivalence(audit: _Audit, margin: float, contrasts: Sequence[str]) -> list[dict]:
    rows, keys = [], []
    for regime, task in audit.cells():
        for contrast in contrasts:
            arm_a, arm_b = CONTRASTS[contrast]
            if not (audit.index.has(regime, task, arm_a) and audit.index.has(regime, task, arm_b)):
                continue
            p, _ = audit.effect(regime, task, arm_a, arm_b, "success")
            row = {"regime": regime, "task": task, "contrast": contrast, "estimate": None, "ci90_low": None,
                   "ci90_high": None, "margin": margin, "p_tost": None, "se": None, "df": None,
                   "n": p.n, "n_clusters": p.n_clusters}  # fmt: skip
            if p.n_clusters >= 2:
                t = tost_paired(p.diff, p.clusters, margin=margin, alpha=ALPHA)
                row.update(estimate=t.estimate, ci90_low=t.ci_low, ci90_high=t.ci_high, p_tost=t.p_tost,
                           se=t.se, df=t.df)  # fmt: skip
            rows.append(row)
            keys.append((regime, audit.hypothesis(regime, task), contrast))
    for row, q in zip(rows, _holm_by_key(rows, keys, "p_tost"), strict=True):
        row["p_holm"] = q
        row["equivalent"] = q is not None and q < ALPHA
    return rows


def _cate(audit: _Audit, n_bins: int, max_distinct: int) -> tuple[list[dict], list[dict]]:
    subgroup_rows, regression_rows = [], []
    for regime, task in audit.cells():
        for contrast, (arm_a, arm_b) in contrasts_for(audit.index.arms(regime, task)).items():
            if not (audit.index.has(regime, task, arm_a) and audit.index.has(regime, task, arm_b)):
                continue
            p, _ = audit.effect(regime, task, arm_a, arm_b, "success")
            if p.n == 0:
                continue
            head = {"regime": regime, "task": task, "contrast": contrast, "outcome": "success"}
            for row in cate_subgroups(p, n_bins=n_bins, max_distinct=max_distinct, **audit.opts):
                subgroup_rows.append({**head, **row})
            for row in cate_regression(p):
                regression_rows.append({**head, **row})
    return subgroup_rows, regression_rows


def _dose_response(audit: _Audit) -> list[dict]:
    rows = []
    for regime, task in audit.cells():
        families: dict[str, list[tuple[str, str, float | None]]] = {}
        for arm in audit.index.arms(regime, task):
            fam = dial_family(arm)
            if fam is not None:
                families.setdefault(fam[0], []).append((arm, fam[1], fam[2]))
        has_kv = audit.index.has(regime, task, "kv")
        for family, doses in sorted(families.items()):
            numeric = all(v is not None for _, _, v in doses)
            doses.sort(key=lambda d: (d[2], d[1]) if numeric else (0.0, d[1]))
            if has_kv:
                ref = (0.0 if family == "kv_noise" else 1.0) if numeric else None
                doses.insert(0, ("kv", "reference", ref))
            for arm, dose, value in doses:
                cell = audit.index.cells[(regime, task)][arm]
                scores = [100.0 * t.score for t in cell.values()]
                labels = [f"{t.task}/{t.task_id}" for t in cell.values()]
                ci = bca_ci(scores, labels, **audit.opts)
                row = {"regime": regime, "task": task, "family": family, "arm": arm, "dose": dose,
                       "dose_value": value, "reference": arm == "kv", "mean": ci.estimate, "ci_low": ci.low,
                       "ci_high": ci.high, "n": ci.n, "effect_vs_kv": None, "effect_ci_low": None,
                       "effect_ci_high": None, "p_value": None, "n_pairs": None}  # fmt: skip
                if has_kv and arm != "kv":
                    _, eff = audit.effect(regime, task, arm, "kv", "success")
                    row.update(effect_vs_kv=eff["estimate"], effect_ci_low=eff["ci_low"],
                               effect_ci_high=eff["ci_high"], p_value=eff["p_value"], n_pairs=eff["n"])  # fmt: skip
                rows.append(row)
    return rows


def _cost_benefit(audit: _Audit) -> list[dict]:
    rows = []
    for regime, task in audit.cells():
        arms = audit.index.arms(regime, task)
        for ref in REFERENCES:
            if ref not in arms:
                continue
            for arm in arms:
                if arm == ref:
                    continue
                _, gain = audit.effect(regime, task, arm, ref, "success")
                extra = {o: audit.effect(regime, task, arm, ref, o)[1]["estimate"] for o in OUTCOMES[1:]}
                row = {"regime": regime, "task": task, "arm": arm, "reference": ref,
                       "gain_points": gain["estimate"], "gain_ci_low": gain["ci_low"],
                       "gain_ci_high": gain["ci_high"], "gain_p_value": gain["p_value"],
                       "extra_latency_s": extra["latency_s"], "extra_relay_bytes": extra["relay_bytes"],
                       "extra_prefill_tokens": extra["prefill_tokens"], "latency_s_per_point": None,
                       "bytes_per_point": None, "n": gain["n"], "note": ""}  # fmt: skip
                g = gain["estimate"]
                if g is None:
                    row["note"] = f"no trial of {arm} pairs with {ref}"
                elif g <= 0:
                    row["note"] = f"no accuracy gain over {ref} ({g:+.1f} points): cost per point undefined"
                else:
                    if extra["latency_s"] is not None:
                        row["latency_s_per_point"] = extra["latency_s"] / g
                    if extra["relay_bytes"] is not None:
                        row["bytes_per_point"] = extra["relay_bytes"] / g
                    lo = gain["ci_low"]
                    if lo is None or lo <= 0:
                        row["note"] = "gain not significant (CI includes 0): cost per point is unreliable"
                rows.append(row)
    return rows


def dose_response(records: Iterable[Mapping[str, object]], *, confidence: float = 0.95, n_boot: int = 2000,
                  seed: int = 0) -> list[dict]:  # fmt: skip
    """Per cell and dial family (``kv_noise``, ``kv_layers``, ``kv_tokens:KIND``, ``kv_codec``): one row per
    dose with the success mean in points + CI, and the paired effect vs ``kv`` (points) + CI + p.
    ``kv`` itself is the ``reference`` row (dose_value 0 for noise, 1 for fractions)."""
    return _dose_response(_Audit(records, confidence=confidence, n_boot=n_boot, seed=seed))


def cost_benefit(records: Iterable[Mapping[str, object]], *, confidence: float = 0.95, n_boot: int = 2000,
                 seed: int = 0) -> list[dict]:  # fmt: skip
    """Per cell, every arm vs ``none`` and vs ``text_full``: accuracy gained (points, CI), extra latency (s),
    bytes and prefill tokens (paired means), and latency/bytes per point gained. Per-point costs are None
    when there is no gain (``note`` says why) — never a division by zero or an infinity."""
    return _cost_benefit(_Audit(records, confidence=confidence, n_boot=n_boot, seed=seed))


def summarize(
    records: Iterable[Mapping[str, object]],
    margin: float = 2.8,
    n_boot: int = 2000,
    seed: int = 0,
    *,
    confidence: float = 0.95,
    equivalence_contrasts: Sequence[str] = ("pairing",),
    n_bins: int = 4,
    max_distinct: int = 6,
) -> dict:
    """The ``summary.json`` body (docs/json.md; the caller adds ``model``).

    Keys: ``n_tasks`` (distinct task-set/task_id pairs), ``tasks`` (per task set), ``seeds``,
    ``seed_design`` (what the seeds varied and how often a task's success moved with them: ``seeding.seed_report``),
    ``effects`` (per regime × task set and pooled ``ALL`` × present contrast × outcome; success in
    points), ``equivalence`` (TOST for ``equivalence_contrasts`` on success), ``cate`` (subgroup
    effects, BH-corrected ``p_fdr``), ``cate_regression``, ``dose_response``, ``cost_benefit``,
    ``unmatched`` (per cell and contrast: trials without a partner in
    the other arm, ``only_a``/``only_b``, and per outcome the matched pairs whose value was None), ``settings`` and ``verdict``.
    JSON-serialisable: plain floats/ints/strings, None for undefined numbers.
    """
    unknown = [c for c in equivalence_contrasts if c not in CONTRASTS]
    if unknown:
        raise ValueError(f"unknown equivalence contrast(s) {unknown}; expected some of {list(CONTRASTS)}")
    if not (isinstance(margin, int | float) and math.isfinite(margin) and margin > 0):
        raise ValueError(f"margin must be a positive number of points, got {margin!r}")
    records = list(records)
    audit = _Audit(records, confidence=confidence, n_boot=n_boot, seed=seed)
    effects, unmatched = _effects(audit)
    cate, cate_reg = _cate(audit, n_bins, max_distinct)
    tasks: dict[str, set[str]] = {}
    for t in audit.trials:
        tasks.setdefault(t.task, set()).add(t.task_id)
    summary = {
        "n_tasks": sum(len(v) for v in tasks.values()),
        "tasks": {k: len(v) for k, v in sorted(tasks.items())},
        "seeds": sorted({t.seed for t in audit.trials}),
        "seed_design": seed_report(records),
        "effects": effects,
        "equivalence": _equivalence(audit, float(margin), equivalence_contrasts),
        "cate": cate,
        "cate_regression": cate_reg,
        "dose_response": _dose_response(audit),
        "cost_benefit": _cost_benefit(audit),
        "unmatched": unmatched,
        "settings": {"margin": float(margin), "n_boot": n_boot, "seed": seed, "confidence": confidence,
                     "tost_alpha": ALPHA, "success_units": "points (score x 100)",
                     "holm_family": "all success effects reported (one family); each other outcome its own",
                     "equivalence_family": "all equivalence tests reported"},  # fmt: skip
    }
    summary = _jsonable(summary)
    summary["verdict"] = verdict(summary)
    return summary


def _jsonable(obj: object) -> object:
    """Plain Python types only; NaN and infinities become None."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool | np.bool_):
        return bool(obj)
    if isinstance(obj, int | np.integer):
        return int(obj)
    if isinstance(obj, float | np.floating):
        return float(obj) if math.isfinite(obj) else None
    return obj
