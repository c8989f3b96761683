"""The value model: P(success) per channel from request features, fitted on audit records, with uncertainty.

*Base* channels (``none``, ``text_message``, ``text_full``, ``kv``) each get a small logistic model::

    logit P(success | channel c, x) = b_c0 + b_c1·overlap + b_c2·sees_context + b_c3·z(log2 context tokens)
                                      + b_c4·quantized

fitted by ridge-penalised IRLS (numpy; the penalty ``RIDGE`` keeps a coefficient at 0 when a channel's
records never vary that feature). *Derived* channels — ``kv`` through a codec (``kv+int8``), another
model's cache through an adapter (``adapter:NAME``), a sibling's through a repair (``variant:V:R``) —
are audited on few task sets, whose difficulty the features do not capture; so they are fitted as a
logit *offset* ``d_c`` to ``kv``, paired on the same tasks: ``d_c = logit(mean success of c) −
logit(mean success of kv)`` over the tasks ``c`` ran on (kv's observed success on each task when the
records hold it, else kv's fitted curve; means clipped to [0.005, 0.995]). Identical answers give
``d_c = 0`` exactly. A prediction is ``sigmoid(kv curve(x) + d_c)``.

An observation is one task under one channel: the mean score over its seeds (greedy seeds repeat one
answer, so tasks, not trials, are the unit).

Uncertainty: a cluster bootstrap over tasks — each draw resamples task ids once and refits every
channel on its rows of those tasks, so draws are *paired* across channels and a gain
``P_c − P_none`` (or any difference) gets its interval from the same draws. A request whose features
lie outside the range a channel was fitted on is flagged ``extrapolated``.

``ValueModel.calibration(observations)`` scores held-out observations: Brier score and log loss per
channel against the fitted model and against the channel's base rate, and reliability bins.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvrelay.core.errors import InvalidInput
from kvrelay.policy.features import Features, check_channel, quantized_engine

RIDGE = 1.0  # L2 penalty on the non-intercept coefficients (features are standardised)
N_BOOT = 200
SUPPORT_OVERLAP = 0.15  # how far outside a channel's fitted overlap range a request may lie
SUPPORT_LOG2_TOKENS = 1.0  # ... and its log2 context length
FEATURES = ("overlap", "sees_context", "log2_context_tokens", "quantized")
BASE = ("none", "text_message", "text_full", "kv")  # channels with a curve of their own
CLIP = 0.005  # mean successes are clipped to [CLIP, 1 - CLIP] before a logit is taken


@dataclass(frozen=True, slots=True)
class Observation:
    """One task under one channel: ``success`` in [0, 1] (mean score over ``weight`` seeds)."""

    task_id: str
    task_set: str
    key: str
    features: Features
    success: float
    weight: float = 1.0
    source: str = ""  # the audit it came from: a derived channel is paired with kv of the same audit

    def __post_init__(self):
        check_channel(self.key.partition("+")[0])
        if not 0.0 <= self.success <= 1.0:
            raise InvalidInput(f"success {self.success!r} for {self.task_id}", "a score between 0 and 1")
        if not self.weight > 0:
            raise InvalidInput(f"weight {self.weight!r} for {self.task_id}", "a weight > 0")


@dataclass(frozen=True, slots=True)
class Prediction:
    mean: float
    ci_low: float
    ci_high: float
    extrapolated: bool = False


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))


def fit_logistic(X: np.ndarray, y: np.ndarray, w: np.ndarray, ridge: float = RIDGE, iters: int = 50) -> np.ndarray:
    """Ridge-penalised (intercept free) logistic regression on fractional ``y`` by Newton/IRLS.

    X: (n, k) with the intercept in column 0; y, w: (n,). Returns (k,)."""
    k = X.shape[1]
    pen = np.full(k, ridge)
    pen[0] = 1e-6  # a tiny pull on the intercept keeps all-0 / all-1 channels finite
    beta = np.zeros(k)
    for _ in range(iters):
        p = _sigmoid(X @ beta)
        grad = X.T @ (w * (y - p)) - pen * beta
        H = (X * (w * p * (1 - p))[:, None]).T @ X + np.diag(pen)
        step = np.linalg.solve(H, grad)
        beta = beta + step
        if np.max(np.abs(step)) < 1e-8:
            break
    return beta


@dataclass(frozen=True)
class ChannelFit:
    key: str
    coef: np.ndarray  # (k,) on the full data
    boots: np.ndarray  # (B, k), one per paired bootstrap draw
    n_obs: int
    n_tasks: int
    task_sets: tuple[str, ...]
    lo: np.ndarray  # (4,) per-feature minimum seen in fitting
    hi: np.ndarray  # (4,) per-feature maximum
    rate: float = 0.0  # mean success in fitting (the base-rate forecast calibration compares against)
    offset: float | None = None  # a derived channel's logit offset to kv (None: a base channel)


class ValueModel:
    """Fitted per-channel success models (``fit``); ``predict``, ``gain``, ``difference``, ``calibration``."""

    def __init__(self, fits: dict[str, ChannelFit], mu: np.ndarray, sd: np.ndarray, sources: tuple[str, ...] = (),
                 n_boot: int = N_BOOT, seed: int = 0):
        self.fits, self.mu, self.sd, self.sources, self.n_boot, self.seed = fits, mu, sd, tuple(sources), n_boot, seed

    # -- fitting -------------------------------------------------------------------------------
    @classmethod
    def fit(cls, observations: Iterable[Observation], *, n_boot: int = N_BOOT, seed: int = 0,
            sources: tuple[str, ...] = ()) -> ValueModel:
        obs = list(observations)
        if not obs:
            raise InvalidInput("no observations to fit the value model on", "audit records with channel arms")
        raw = np.array([o.features.vector() for o in obs])  # (n, 4)
        mu, sd = raw.mean(axis=0), raw.std(axis=0)
        mu[[1, 3]], sd[[1, 3]] = 0.0, 1.0  # the indicators stay 0/1
        sd[sd == 0] = 1.0
        X = np.column_stack([np.ones(len(obs)), (raw - mu) / sd])  # (n, 5)
        y = np.array([o.success for o in obs])
        w = np.array([o.weight for o in obs])
        keys = np.array([o.key for o in obs])
        tasks = sorted({o.task_id for o in obs})
        t_index = {t: i for i, t in enumerate(tasks)}
        tid = np.array([t_index[o.task_id] for o in obs])
        rng = np.random.default_rng(seed)
        draws = [np.bincount(rng.integers(0, len(tasks), len(tasks)), minlength=len(tasks)) for _ in range(n_boot)]
        fits = {}
        base_keys = [k for k in sorted(set(keys)) if k in BASE]
        derived = [k for k in sorted(set(keys)) if k not in BASE]
        if derived and "kv" not in base_keys:
            raise InvalidInput(f"records for {derived} but none for plain kv",
                               "the kv arm audited too (derived channels are fitted as offsets to kv)")
        for key in base_keys:
            m = keys == key
            Xk, yk, wk, tk = X[m], y[m], w[m], tid[m]
            coef = fit_logistic(Xk, yk, wk)
            boots = [fit_logistic(Xk, yk, wk * c[tk]) if (wk * c[tk]).sum() > 0 else coef for c in draws]
            fits[key] = _channel_fit(key, coef, boots, m, tk, obs, raw, rate=_wm(yk, wk))
        if derived:
            kv_obs = {}
            for o, yy in zip(obs, y, strict=True):
                if o.key == "kv":
                    kv_obs.setdefault((o.source, o.task_id), []).append(yy)
                    kv_obs.setdefault(("", o.task_id), []).append(yy)  # any audit, when c's own has no kv
            kv_seen = {t: float(np.mean(v)) for t, v in kv_obs.items()}
        for key in derived:
            m = keys == key
            Xk, yk, wk, tk = X[m], y[m], w[m], tid[m]
            src = [o.source for o, mm in zip(obs, m, strict=True) if mm]
            seen = np.array([kv_seen.get((sr, tasks[t]), kv_seen.get(("", tasks[t]), np.nan))
                             for sr, t in zip(src, tk, strict=True)])
            have = ~np.isnan(seen)

            def offset(kv_coef, wb, Xk=Xk, yk=yk, seen=seen, have=have):
                ref = _sigmoid(Xk @ kv_coef)
                ref[have] = seen[have]
                return _logit(_wm(yk, wb)) - _logit(_wm(ref, wb))

            kv = fits["kv"]
            d = offset(kv.coef, wk)
            boots = [offset(kb, wk * c[tk]) if (wk * c[tk]).sum() > 0 else d
                     for c, kb in zip(draws, kv.boots, strict=True)]
            # stored as full coefficient vectors: kv's curve (per draw) with the intercept moved by the offset
            coef = kv.coef + np.eye(len(kv.coef))[0] * d
            bvec = np.array([kb + np.eye(len(kb))[0] * db for kb, db in zip(kv.boots, boots, strict=True)])
            fits[key] = _channel_fit(key, coef, bvec, m, tk, obs, raw, rate=_wm(yk, wk), offset=d)
        return cls(fits, mu, sd, sources, n_boot, seed)

    # -- prediction ----------------------------------------------------------------------------
    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.fits)

    def _x(self, f: Features) -> np.ndarray:
        v = np.array(f.vector())
        return np.concatenate([[1.0], (v - self.mu) / self.sd])

    def _fit(self, key: str) -> ChannelFit:
        if key not in self.fits:
            raise InvalidInput(f"no audit records for channel {key!r}",
                               f"one of {sorted(self.fits)} (audit that arm to fit it)")
        return self.fits[key]

    def extrapolated(self, key: str, f: Features) -> bool:
        fit = self._fit(key)
        v = np.array(f.vector())
        slack = np.array([SUPPORT_OVERLAP, 1.0, SUPPORT_LOG2_TOKENS, 0.0])  # sees_context: follows overlap
        return bool(np.any(v < fit.lo - slack) or np.any(v > fit.hi + slack))

    def draws(self, key: str, f: Features) -> np.ndarray:
        """(B,) P(success) under each bootstrap draw."""
        return _sigmoid(self._fit(key).boots @ self._x(f))

    def predict(self, key: str, f: Features) -> Prediction:
        fit = self._fit(key)
        d = self.draws(key, f)
        return Prediction(float(_sigmoid(fit.coef @ self._x(f))), *_interval(d), extrapolated=self.extrapolated(key, f))

    def difference(self, a: str, b: str, f: Features) -> Prediction:
        """P_a − P_b with a paired bootstrap interval (both channels' draws resample the same tasks)."""
        return difference_of(self.predict(a, f), self.draws(a, f), self.predict(b, f), self.draws(b, f))

    def gain(self, key: str, f: Features) -> Prediction:
        """Predicted change in success of ``key`` over ``none`` (points are ×100 of this)."""
        return self.difference(key, "none", f)

    # -- held-out calibration ------------------------------------------------------------------
    def calibration(self, observations: Iterable[Observation], bins: int = 5) -> dict:
        """Brier score and log loss per channel on held-out observations, vs the channel's fitted base
        rate (its mean success in fitting); reliability bins pooled over channels."""
        per: dict[str, list] = defaultdict(list)
        for o in observations:
            if o.key in self.fits:
                per[o.key].append((self.predict(o.key, o.features).mean, o.success, o.weight))
        rows, pooled = [], []
        for key, xs in sorted(per.items()):
            p, y, w = (np.array(c) for c in zip(*xs, strict=True))
            base = self.fits[key].rate
            rows.append({"channel": key, "n": len(xs), "mean_predicted": _wm(p, w), "mean_observed": _wm(y, w),
                         "brier": _wm((p - y) ** 2, w), "brier_base_rate": _wm((base - y) ** 2, w),
                         "log_loss": _wm(_logloss(p, y), w)})
            pooled += xs
        rel = []
        if pooled:
            p, y, w = (np.array(c) for c in zip(*pooled, strict=True))
            edges = np.linspace(0, 1, bins + 1)
            for lo, hi in zip(edges, edges[1:], strict=False):
                m = (p >= lo) & ((p < hi) if hi < 1 else (p <= hi))
                if m.any():
                    rel.append({"bin": [float(lo), float(hi)], "n": int(m.sum()), "mean_predicted": _wm(p[m], w[m]),
                                "mean_observed": _wm(y[m], w[m])})
        return {"per_channel": rows, "reliability": rel}

    # -- report --------------------------------------------------------------------------------
    def summary(self) -> dict:
        return {"features": list(FEATURES), "scaling": {"mean": self.mu.tolist(), "sd": self.sd.tolist()},
                "ridge": RIDGE, "n_boot": self.n_boot, "seed": self.seed, "sources": list(self.sources),
                "channels": [{"channel": k, "n_obs": f.n_obs, "n_tasks": f.n_tasks, "fitted_rate": f.rate, "task_sets": list(f.task_sets),
                              "coef": dict(zip(("intercept", *FEATURES), map(float, f.coef), strict=True)),
                              "offset_to_kv": f.offset,
                              "support": {"low": f.lo.tolist(), "high": f.hi.tolist()}}
                             for k, f in self.fits.items()]}


def _channel_fit(key, coef, boots, m, tk, obs, raw, rate, offset=None) -> ChannelFit:
    return ChannelFit(key=key, coef=np.asarray(coef), boots=np.asarray(boots), n_obs=int(m.sum()),
                      n_tasks=len(set(tk.tolist())),
                      task_sets=tuple(sorted({o.task_set for o, mm in zip(obs, m, strict=True) if mm})),
                      lo=raw[m].min(axis=0), hi=raw[m].max(axis=0), rate=rate, offset=offset)


def _logit(p: float) -> float:
    p = min(max(p, CLIP), 1 - CLIP)
    return math.log(p / (1 - p))


def difference_of(a: Prediction, a_draws: np.ndarray, b: Prediction, b_draws: np.ndarray) -> Prediction:
    """P_a − P_b from two predictions and their bootstrap draws, paired draw by draw (the first ``min(len)``).
    Within one value model the draws resample the same tasks (``ValueModel.difference``); across two
    models' audits each resamples its own tasks independently, so any pairing is a draw of the difference."""
    n = min(len(a_draws), len(b_draws))
    return Prediction(a.mean - b.mean, *_interval(np.asarray(a_draws[:n]) - np.asarray(b_draws[:n])),
                      extrapolated=a.extrapolated or b.extrapolated)


def _interval(d: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    a = (1 - level) / 2
    return float(np.quantile(d, a)), float(np.quantile(d, 1 - a))


def _wm(x, w) -> float:
    return float(np.sum(x * w) / np.sum(w))


def _logloss(p, y):
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def observations_from_records(records: Iterable[dict], *, texts=None, engine: str = "fp32",
                              channel_of=None, source: str = "") -> list[Observation]:
    """``records.jsonl`` rows (docs/json.md) -> one ``Observation`` per (task, channel).

    ``texts(task_id) -> (context, prompt) | None`` gives the task's texts for the overlap feature; when it
    is None (or returns None) the record's regime stands in for it (shared -> 1, private -> 0).
    ``context_tokens``: the largest ``relayed_tokens`` of the task's rows (what its kv arms carried), else
    its ``doc_tokens`` covariate. Control arms are skipped (``features.channel_of_arm``)."""
    from kvrelay.policy.features import channel_of_arm, overlap

    channel_of = channel_of or channel_of_arm
    rows = list(records)
    ctx: dict[str, int] = defaultdict(int)
    for r in rows:
        ctx[r["task_id"]] = max(ctx[r["task_id"]], int(r.get("relayed_tokens") or 0))
    scores: dict[tuple[str, str], list[float]] = defaultdict(list)
    meta: dict[str, dict] = {}
    for r in rows:
        key = channel_of(r["arm"])
        if key is None:
            continue
        scores[(r["task_id"], key)].append(float(r["score"]))
        meta[r["task_id"]] = r
    out, cache = [], {}
    for (tid, key), s in scores.items():
        r = meta[tid]
        if tid not in cache:
            pair = texts(tid) if texts is not None else None
            ov = overlap(*pair) if pair is not None else (1.0 if r["regime"] == "shared" else 0.0)
            n = ctx[tid] or int(round(1.3 * float(r.get("covariates", {}).get("doc_tokens", 1)))) or 1
            cache[tid] = Features(ov, max(n, 1), quantized_engine(engine))
        out.append(Observation(tid, r["task"], key, cache[tid], float(np.mean(s)), float(len(s)), source))
    return out


def mean_ci(values, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean and 95% percentile bootstrap interval of ``values`` (one per task)."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, (n_boot, v.size))].mean(axis=1)
    return float(v.mean()), *_interval(means)
