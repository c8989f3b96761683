"""Hypothesis tests for paired differences and multiplicity corrections.

- :func:`mcnemar_exact`: exact McNemar test for paired binary outcomes (two-sided binomial
  test on the discordant pairs).
- :func:`paired_test`: picks McNemar (binary, one pair per task) or the Wilcoxon signed-rank
  test (non-binary outcomes, or per-task mean differences when tasks have several seeds).
- :func:`tost_paired`: two one-sided paired t-tests for equivalence within ±margin, with a
  cluster-robust standard error when tasks have several seeds.
- :func:`holm` and :func:`benjamini_hochberg`: adjusted p-values (None entries pass through).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from kvrelay.audit.bootstrap import cluster_codes


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts.

    ``b`` = pairs where arm A succeeded and arm B failed, ``c`` = the reverse. Under H0 each
    discordant pair goes either way with probability 1/2, so the p-value is the two-sided
    binomial test of ``b`` successes in ``b + c`` trials. No discordant pairs gives p = 1.
    """
    for name, v in (("b", b), ("c", c)):
        if isinstance(v, bool) or int(v) != v or v < 0:
            raise ValueError(f"{name} must be a non-negative integer count, got {v!r}")
    b, c = int(b), int(c)
    if b + c == 0:
        return 1.0
    return float(stats.binomtest(b, b + c, 0.5, alternative="two-sided").pvalue)


def paired_test(
    a: object, b: object, clusters: object | None = None, *, binary: bool = False
) -> tuple[float | None, str]:
    """Two-sided p-value for "arm A and arm B have the same mean", and the test's name.

    - ``binary`` and one pair per cluster: exact McNemar (``"mcnemar_exact"``).
    - otherwise, one pair per cluster: Wilcoxon signed-rank on the differences (``"wilcoxon"``).
    - several pairs per cluster (seeds of one task are not independent): Wilcoxon signed-rank
      on the per-cluster mean differences (``"wilcoxon_cluster_means"``).

    Returns ``(None, test)`` when there is only one cluster. Zero differences are dropped by the
    signed-rank test (Wilcoxon's convention); all differences zero gives p = 1.
    """
    xa = np.asarray(a, dtype=float).reshape(-1)
    xb = np.asarray(b, dtype=float).reshape(-1)
    if xa.shape != xb.shape or xa.size == 0:
        raise ValueError(f"a and b must be non-empty and of equal length, got {xa.size} and {xb.size}")
    if not (np.all(np.isfinite(xa)) and np.all(np.isfinite(xb))):
        raise ValueError("a and b must be finite")
    diff = xa - xb
    codes = cluster_codes(diff, clusters)
    n_clusters = int(codes.max()) + 1
    clustered = n_clusters < diff.size
    test = "mcnemar_exact" if binary and not clustered else ("wilcoxon_cluster_means" if clustered else "wilcoxon")
    if n_clusters < 2:
        return None, test
    if binary and not clustered:
        levels = np.unique(np.concatenate([xa, xb]))
        if levels.size > 2:
            raise ValueError(f"binary=True but the outcomes take {levels.size} distinct values")
        return mcnemar_exact(int(np.sum(xa > xb)), int(np.sum(xa < xb))), "mcnemar_exact"
    if clustered:
        diff = np.bincount(codes, weights=diff) / np.bincount(codes)
    return wilcoxon_p(diff), test


def wilcoxon_p(diffs: object) -> float | None:
    """Two-sided Wilcoxon signed-rank p-value; zero differences are dropped (Wilcoxon's convention).

    Exact: by enumerating all sign flips of the (tie-averaged) ranks when at most 13 differences
    are non-zero, from scipy's exact null distribution up to 50 untied differences; beyond that
    the normal approximation with tie correction. All differences zero gives p = 1.
    """
    d = np.asarray(diffs, dtype=float).reshape(-1)
    d = d[d != 0]
    n = d.size
    if n == 0:
        return 1.0
    ranks = stats.rankdata(np.abs(d))  # (n,)
    if n <= 13:
        flips = (np.arange(2**n)[:, None] >> np.arange(n)) & 1  # (2^n, n): every sign pattern
        null = flips @ ranks  # (2^n,) T+ under H0
        center = ranks.sum() / 2.0
        observed = abs(ranks[d > 0].sum() - center)
        return float(np.mean(np.abs(null - center) >= observed - 1e-9))
    tied = np.unique(ranks).size < n
    method = "approx" if tied or n > 50 else "exact"
    p = float(stats.wilcoxon(d, zero_method="wilcox", method=method).pvalue)
    return p if math.isfinite(p) else None


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm step-down adjusted p-values; None entries are not part of the family and stay None."""
    return _adjust(pvalues, _holm_valid)


def benjamini_hochberg(pvalues: Sequence[float | None]) -> list[float | None]:
    """Benjamini–Hochberg (FDR) adjusted p-values; None entries stay None."""
    return _adjust(pvalues, _bh_valid)


def _adjust(pvalues: Sequence[float | None], fn) -> list[float | None]:
    idx = [i for i, p in enumerate(pvalues) if p is not None]
    p = np.array([pvalues[i] for i in idx], dtype=float)
    if np.any(~np.isfinite(p)) or np.any((p < 0) | (p > 1)):
        raise ValueError("p-values must lie in [0, 1] (use None for a missing p-value, not NaN)")
    out: list[float | None] = [None] * len(pvalues)
    if p.size:
        for i, q in zip(idx, fn(p), strict=True):
            out[i] = float(q)
    return out


def _holm_valid(p: np.ndarray) -> np.ndarray:
    m = p.size
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate((m - np.arange(m)) * p[order])
    adj = np.empty(m)
    adj[order] = np.minimum(stepped, 1.0)
    return adj


def _bh_valid(p: np.ndarray) -> np.ndarray:
    m = p.size
    order = np.argsort(p, kind="stable")
    ranked = p[order] * m / np.arange(1, m + 1)
    stepped = np.minimum.accumulate(ranked[::-1])[::-1]
    adj = np.empty(m)
    adj[order] = np.minimum(stepped, 1.0)
    return adj


@dataclass(frozen=True, slots=True)
class TOSTResult:
    """Equivalence test of a paired mean difference against ``[-margin, +margin]``.

    ``p_tost = max(p_lower, p_upper)``; equivalence is claimed when ``p_tost < alpha``, which is
    the same as the ``1 - 2*alpha`` (90%) confidence interval lying inside the margins.
    ``df`` is n - 1 (one pair per task) or G - 1 (G tasks, cluster-robust SE).
    """

    estimate: float
    se: float
    df: int
    ci_low: float
    ci_high: float
    margin: float
    p_lower: float
    p_upper: float
    p_tost: float


def cluster_mean_se(diffs: object, clusters: object | None = None) -> tuple[float, float, int]:
    """Mean of ``diffs``, its standard error and degrees of freedom.

    The SE is the cluster-robust (CR1) sandwich SE of an intercept-only regression:
    ``sqrt(G/(G-1) * sum_g (sum_{i in g} (d_i - mean))^2) / N`` with ``df = G - 1``. With one
    entry per cluster it equals the ordinary paired-t SE ``sd / sqrt(n)``.
    """
    d = np.asarray(diffs, dtype=float).reshape(-1)
    if d.size == 0 or not np.all(np.isfinite(d)):
        raise ValueError("diffs must be non-empty and finite")
    codes = cluster_codes(d, clusters)
    g = int(codes.max()) + 1
    mean = float(d.mean())
    if g < 2:
        raise ValueError("need at least two clusters (tasks) for a standard error")
    resid_sums = np.bincount(codes, weights=d - mean)  # (G,)
    se = math.sqrt(g / (g - 1) * float(np.sum(resid_sums**2))) / d.size
    return mean, se, g - 1


def tost_paired(
    diffs: object, clusters: object | None = None, *, margin: float = 2.8, alpha: float = 0.05
) -> TOSTResult:
    """TOST equivalence test for a paired mean difference (paired t, cluster-robust SE).

    H0a: mean <= -margin, rejected by ``t = (mean + margin) / se`` large (``p_lower``);
    H0b: mean >= +margin, rejected by ``t = (mean - margin) / se`` small (``p_upper``).
    Both use Student's t with ``df`` from :func:`cluster_mean_se`. When the SE is 0 (every
    difference equal) the p-value is 0 if the mean is strictly inside the margins, else 1.
    Units are those of ``diffs`` (points for success); ``margin`` must be in the same units.
    """
    if not margin > 0:
        raise ValueError(f"margin must be positive, got {margin}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    mean, se, df = cluster_mean_se(diffs, clusters)
    if se == 0.0:
        p_lo = 0.0 if mean > -margin else 1.0
        p_hi = 0.0 if mean < margin else 1.0
        return TOSTResult(mean, 0.0, df, mean, mean, margin, p_lo, p_hi, max(p_lo, p_hi))
    p_lo = float(stats.t.sf((mean + margin) / se, df))
    p_hi = float(stats.t.cdf((mean - margin) / se, df))
    half = float(stats.t.ppf(1.0 - alpha, df)) * se
    return TOSTResult(mean, se, df, mean - half, mean + half, margin, p_lo, p_hi, max(p_lo, p_hi))
