"""Conditional effects (CATE) of one contrast by covariate subgroups, and a regression on covariates.

Both work on a :class:`~kvrelay.audit.paired.Paired` (one contrast, one outcome, one cell).
Subgroups: a numeric covariate with at most ``max_distinct`` distinct values is split by value,
otherwise into ``n_bins`` quantile bins; strings and booleans by value. Each subgroup gets the
paired effect, a BCa CI and a p-value (as for the main effects); p-values are then
Benjamini–Hochberg corrected across all subgroups of all covariates of the contrast.
Regression: OLS of the paired difference on the covariates (numeric as is, categorical one-hot
with the first sorted level as reference); standard errors are cluster-robust by task when
tasks have several seeds, heteroskedasticity-robust (HC1) otherwise.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import statsmodels.api as sm

from kvrelay.audit.bootstrap import bca_ci
from kvrelay.audit.hypothesis import benjamini_hochberg, paired_test
from kvrelay.audit.paired import Paired


def _is_numeric(v: object) -> bool:
    return isinstance(v, int | float | np.number) and not isinstance(v, bool | np.bool_)


def covariate_names(p: Paired) -> list[str]:
    return sorted({k for c in p.covariates for k, v in c.items() if v is not None})


def subgroups(values: list[object], *, n_bins: int = 4, max_distinct: int = 6) -> list[tuple[str, float | None, float | None, np.ndarray]]:
    """Split entries by a covariate: ``[(label, lo, hi, mask)]``; None values belong to no subgroup.

    Numeric with more than ``max_distinct`` values: quantile bins ``[lo, hi)`` (the last one
    closed); ties can merge bins, so fewer than ``n_bins`` may come back.
    """
    present = np.array([v is not None for v in values])
    if all(_is_numeric(v) for v in values if v is not None):
        x = np.array([float(v) if v is not None else np.nan for v in values])  # type: ignore[arg-type]
        distinct = np.unique(x[present])
        if distinct.size <= max_distinct:
            return [(f"{v:g}", float(v), float(v), present & (x == v)) for v in distinct]
        edges = np.unique(np.quantile(x[present], np.linspace(0.0, 1.0, n_bins + 1)))
        bins = np.searchsorted(edges[1:-1], np.where(present, x, edges[0]), side="right")
        out = []
        for k in range(edges.size - 1):
            lo, hi = float(edges[k]), float(edges[k + 1])
            closing = "]" if k == edges.size - 2 else ")"
            out.append((f"[{lo:g}, {hi:g}{closing}", lo, hi, present & (bins == k)))
        return out
    labels = np.array([str(v) if v is not None else "" for v in values], dtype=object)
    return [(str(v), None, None, present & (labels == v)) for v in sorted(set(labels[present]))]


def cate_subgroups(
    p: Paired, *, n_bins: int = 4, max_distinct: int = 6, confidence: float = 0.95, n_boot: int = 2000, seed: int = 0
) -> list[dict]:
    """One row per (covariate, subgroup) with the paired effect (A − B; success in points).

    Rows: ``covariate, subgroup, lo, hi, estimate, ci_low, ci_high, p_value, p_fdr, n,
    n_clusters``; ``p_fdr`` is Benjamini–Hochberg across every row returned here.
    Subgroups with fewer than two tasks get an estimate but no CI or p-value.
    """
    rows: list[dict] = []
    diff = p.diff
    for name in covariate_names(p):
        values = [c.get(name) for c in p.covariates]
        for label, lo, hi, mask in subgroups(values, n_bins=n_bins, max_distinct=max_distinct):
            if not mask.any():
                continue
            ci = bca_ci(diff[mask], p.clusters[mask], confidence=confidence, n_boot=n_boot, seed=seed)
            pv, test = paired_test(p.a[mask], p.b[mask], p.clusters[mask], binary=p.binary)
            rows.append({
                "covariate": name, "subgroup": label, "lo": lo, "hi": hi,
                "estimate": ci.estimate, "ci_low": ci.low, "ci_high": ci.high,
                "p_value": pv, "test": test, "n": ci.n, "n_clusters": ci.n_clusters,
            })  # fmt: skip
    for row, q in zip(rows, benjamini_hochberg([r["p_value"] for r in rows]), strict=True):
        row["p_fdr"] = q
    return rows


def cate_regression(p: Paired) -> list[dict]:
    """OLS of the paired difference on the covariates; one row per term (``const`` first).

    Rows: ``term, coef, se, p_value, n, n_clusters, cov_type``. Pairs missing any used covariate
    are left out (``n`` says how many were used); covariates that are constant, missing from
    every pair, or collinear with earlier ones are dropped. Returns [] when nothing is estimable.
    """
    names = [k for k in covariate_names(p) if all(c.get(k) is not None for c in p.covariates)]
    if not names or p.n < 3:
        return []
    columns: list[tuple[str, np.ndarray]] = []
    for name in names:
        values = [c[name] for c in p.covariates]
        if all(_is_numeric(v) for v in values):
            columns.append((name, np.array(values, dtype=float)))
        else:
            labels = np.array([str(v) for v in values], dtype=object)
            for level in sorted(set(labels))[1:]:
                columns.append((f"{name}={level}", (labels == level).astype(float)))
    terms, design = ["const"], [np.ones(p.n)]
    for term, col in columns:
        trial = np.column_stack([*design, col])  # (n, k+1)
        if np.ptp(col) > 0 and np.linalg.matrix_rank(trial) == trial.shape[1]:
            terms.append(term)
            design.append(col)
    x = np.column_stack(design)  # (n, k)
    if x.shape[1] < 2 or p.n <= x.shape[1]:
        return []
    _, codes = np.unique(p.clusters, return_inverse=True)
    clustered = p.n_clusters < p.n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = sm.OLS(p.diff, x)
        fit = model.fit(cov_type="cluster", cov_kwds={"groups": codes}) if clustered else model.fit(cov_type="HC1")
    cov_type = "cluster" if clustered else "HC1"
    return [
        {"term": term, "coef": _f(fit.params[j]), "se": _f(fit.bse[j]), "p_value": _f(fit.pvalues[j]),
         "n": p.n, "n_clusters": p.n_clusters, "cov_type": cov_type}
        for j, term in enumerate(terms)
    ]  # fmt: skip


def _f(v: object) -> float | None:
    v = float(v)  # type: ignore[arg-type]
    return v if math.isfinite(v) else None
