"""Synthetic inputs for the policy tests: a cost profile with the shape of a 0.5B model on a CPU, and audit
observations with a known answer — relay (and re-reading the text) is worth +80 points when the receiver
lacks the context (overlap near 0) and nothing when it has it (overlap near 1)."""

from __future__ import annotations

import numpy as np

from kvrelay.policy.cost import CodecCost, CostProfile, StoreCost
from kvrelay.policy.features import Features
from kvrelay.policy.value import Observation


def synthetic_profile() -> CostProfile:
    return CostProfile(
        model="synthetic-0.5b", prefill_fixed_s=0.5, prefill_s_per_token=0.006, decode_s_per_token=0.03,
        raw_bytes_per_token=24_576.0, text_bytes_per_token=4.5,
        codecs=(CodecCost("raw", 1.0, 2e-10, 3e-10, lossless=True), CodecCost("int8-g32", 3.5, 3e-9, 1e-9)),
        stores=(StoreCost("memory", 1e-10, 1e-10),))


def synthetic(seed: int = 0, n: int = 60, prefix: str = "t", *, private_overlap: tuple[float, float] = (0.0, 0.1),
              shared_overlap: tuple[float, float] = (0.9, 1.0), tokens: tuple[int, int] = (100, 2000),
              labels: tuple[str, str] = ("priv", "shared")) -> list[Observation]:
    """Even tasks are private (overlap drawn from ``private_overlap``): none fails, kv / text_full / kv+int8
    succeed on exactly 80% of every 10 tasks; odd tasks are shared (``shared_overlap``): every channel 50%,
    the same answer per task (a shared receiver sees the problem anyway). ``labels`` name the two task sets."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        private = i % 2 == 0
        lo, hi = private_overlap if private else shared_overlap
        f = Features(float(rng.uniform(lo, hi)), int(rng.integers(*tokens)))
        tid, ts = f"{prefix}{i}", labels[0] if private else labels[1]
        j = i // 2
        hit = float(j % 5 != 0) if private else float(j % 2 == 0)
        for key in ("kv", "text_full", "kv+int8"):
            out.append(Observation(tid, ts, key, f, hit))
        out.append(Observation(tid, ts, "none", f, 0.0 if private else hit))
    return out
