"""BCa bootstrap confidence intervals for a mean, optionally clustered (by task).

Data layout, used throughout the audit statistics: ``values`` is a 1-D array with one entry
per paired trial (one ``(task_id, seed)``), and ``clusters`` a same-length array of labels
saying which task each entry belongs to. The statistic is always the mean over entries.

With one entry per cluster this is the ordinary BCa bootstrap (Efron & Tibshirani 1993,
§14.3): resample entries, bias-correction ``z0`` from the share of bootstrap means below the
estimate, acceleration ``a`` from the leave-one-out jackknife. With several entries per
cluster (several seeds of the same task, which are correlated) whole clusters are resampled,
keeping all their seeds, and the jackknife leaves one cluster out; the resampled statistic is
the pooled mean ``sum(values) / count`` over the drawn clusters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr, ndtri

# Upper bound on the number of int64 indices drawn at once (memory ~ 16 MB).
_MAX_DRAWS_PER_CHUNK = 2_000_000


@dataclass(frozen=True, slots=True)
class BootstrapCI:
    """A mean with its bootstrap interval.

    ``method`` is ``"bca"``; ``"degenerate"`` when the bootstrap distribution has no spread
    (e.g. every difference equal), in which case the interval is the point; or
    ``"unavailable"`` when there are fewer than two clusters (``low``/``high`` are None).
    """

    estimate: float
    low: float | None
    high: float | None
    confidence: float
    n: int
    n_clusters: int
    method: str


def cluster_codes(values: np.ndarray, clusters: object | None) -> np.ndarray:
    """Integer cluster code per entry (0..G-1); each entry its own cluster when ``clusters`` is None."""
    if clusters is None:
        return np.arange(values.size)
    labels = np.asarray(clusters)
    if labels.shape != values.shape:
        raise ValueError(f"clusters must have one label per value: got {labels.shape} labels for {values.shape} values")
    return np.unique(labels, return_inverse=True)[1].reshape(-1)


def bca_ci(
    values: object,
    clusters: object | None = None,
    *,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> BootstrapCI:
    """Mean of ``values`` with a two-sided BCa bootstrap interval at ``confidence``.

    ``clusters`` (one label per value) switches to the cluster bootstrap described in the module
    docstring. The generator is ``np.random.default_rng(seed)``, so the same inputs always give
    the same interval.
    """
    return bca_test(values, clusters, confidence=confidence, n_boot=n_boot, seed=seed)[0]


def bca_test(
    values: object,
    clusters: object | None = None,
    *,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[BootstrapCI, float | None]:
    """``bca_ci`` and, from the same bootstrap draws, the two-sided p-value for "the mean is 0".

    The p-value inverts the BCa map at 0: the share of bootstrap means below 0 is carried back
    through the bias correction and acceleration to the normal quantile ``z`` that the interval of
    level ``1 - p`` would put its end at, so ``p < 1 - confidence`` exactly when that interval
    excludes 0 (up to the resolution ``1 / n_boot``). None when the interval is unavailable; 1 when
    every value is 0; for a degenerate interval away from 0, the smallest p the draws resolve.
    """
    x = _finite_1d(values, "values")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_boot < 100:
        raise ValueError(f"n_boot must be at least 100 for a BCa interval, got {n_boot}")
    codes = cluster_codes(x, clusters)
    sums = np.bincount(codes, weights=x)  # (G,)
    counts = np.bincount(codes).astype(float)  # (G,)
    theta = float(x.mean())
    n_clusters = int(sums.size)
    if n_clusters < 2:
        return BootstrapCI(theta, None, None, confidence, int(x.size), n_clusters, "unavailable"), None
    floor = 1.0 / n_boot
    if np.all(x == x[0]):
        return (BootstrapCI(theta, theta, theta, confidence, int(x.size), n_clusters, "degenerate"),
                1.0 if theta == 0.0 else floor)
    rng = np.random.default_rng(seed)
    boot = _cluster_boot_means(sums, counts, n_boot, rng)  # (B,)
    jack = (sums.sum() - sums) / (counts.sum() - counts)  # (G,) leave-one-cluster-out means
    low, high, method = _bca_interval(theta, boot, jack, confidence)
    ci = BootstrapCI(theta, low, high, confidence, int(x.size), n_clusters, method)
    if method == "degenerate":
        return ci, 1.0 if theta == 0.0 else floor
    return ci, _bca_p_zero(theta, boot, jack, method)


def _z0_accel(theta: float, boot: np.ndarray, jack: np.ndarray) -> tuple[float, float]:
    """BCa bias correction ``z0`` and acceleration ``a``."""
    n_boot = boot.size
    # Mid-rank share of bootstrap statistics below the estimate (as scipy.stats.bootstrap does);
    # clipped so z0 stays finite when the estimate lies outside the bootstrap range.
    share = (np.count_nonzero(boot < theta) + np.count_nonzero(boot <= theta)) / (2.0 * n_boot)
    share = min(max(share, 0.5 / n_boot), 1.0 - 0.5 / n_boot)
    z0 = float(ndtri(share))
    dev = jack.mean() - jack
    ss = float(np.sum(dev**2))
    accel = float(np.sum(dev**3)) / (6.0 * ss**1.5) if ss > 0 else 0.0
    return z0, accel


def _bca_p_zero(theta: float, boot: np.ndarray, jack: np.ndarray, method: str) -> float:
    """Two-sided p-value of 0 under the interval construction ``method`` used on these draws."""
    n_boot = boot.size
    level = (np.count_nonzero(boot < 0.0) + np.count_nonzero(boot <= 0.0)) / (2.0 * n_boot)
    level = min(max(level, 0.5 / n_boot), 1.0 - 0.5 / n_boot)
    w = float(ndtri(level))
    if method == "bca":
        z0, accel = _z0_accel(theta, boot, jack)
        u = (w - z0) / (1.0 + accel * (w - z0))  # solves w = z0 + u / (1 - a u) for u = z0 + z
        z = u - z0
    else:  # percentile fallback: the level itself
        z = w
    return float(min(1.0, 2.0 * min(ndtr(z), 1.0 - ndtr(z))))


def _finite_1d(values: object, name: str) -> np.ndarray:
    x = np.asarray(values, dtype=float).reshape(-1)
    if x.size == 0:
        raise ValueError(f"{name} is empty: need at least one value")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains NaN or infinite entries")
    return x


def _cluster_boot_means(sums: np.ndarray, counts: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Pooled means of ``n_boot`` resamples of G clusters drawn with replacement."""
    n_clusters = sums.size
    out = np.empty(n_boot)
    step = max(1, _MAX_DRAWS_PER_CHUNK // n_clusters)
    for start in range(0, n_boot, step):
        m = min(step, n_boot - start)
        idx = rng.integers(0, n_clusters, size=(m, n_clusters))  # (m, G)
        out[start : start + m] = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    return out


def _bca_interval(theta: float, boot: np.ndarray, jack: np.ndarray, confidence: float) -> tuple[float, float, str]:
    if np.ptp(boot) == 0.0:
        return theta, theta, "degenerate"
    z0, accel = _z0_accel(theta, boot, jack)
    alpha = (1.0 - confidence) / 2.0
    z = ndtri(np.array([alpha, 1.0 - alpha]))
    shifted = z0 + z
    denom = 1.0 - accel * shifted
    if np.any(denom <= 0):  # acceleration so extreme the BCa map is not monotone: fall back to percentiles
        levels, method = np.array([alpha, 1.0 - alpha]), "percentile"
    else:
        levels, method = ndtr(z0 + shifted / denom), "bca"
    low, high = np.percentile(boot, levels * 100.0)
    return float(low), float(high), method
