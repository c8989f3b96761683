"""A cost profile with the shape of a 0.5B model on a CPU, and a value model fitted on synthetic audit
observations with a known answer: relay is worth +80 points when the receiver lacks the context
(overlap 0) and nothing when it has it (overlap 1)."""

from __future__ import annotations

import numpy as np
import pytest

from kvrelay.policy.cost import CodecCost, CostProfile, StoreCost
from kvrelay.policy.features import Features
from kvrelay.policy.value import Observation, ValueModel


def synthetic_profile() -> CostProfile:
    return CostProfile(
        model="synthetic-0.5b", prefill_fixed_s=0.5, prefill_s_per_token=0.006, decode_s_per_token=0.03,
        raw_bytes_per_token=24_576.0, text_bytes_per_token=4.5,
        codecs=(CodecCost("raw", 1.0, 2e-10, 3e-10, lossless=True), CodecCost("int8-g32", 3.5, 3e-9, 1e-9)),
        stores=(StoreCost("memory", 1e-10, 1e-10),))


@pytest.fixture(scope="session")
def profile() -> CostProfile:
    return synthetic_profile()


def synthetic(seed: int = 0, n: int = 60, prefix: str = "t") -> list[Observation]:
    """Private tasks (overlap ~0): none fails, kv/text_full/kv+int8 succeed 80%; shared tasks (overlap ~1):
    every channel 50%, the same answer per task (a shared receiver sees the problem anyway)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        private = i % 2 == 0
        f = Features(float(rng.uniform(0.0, 0.1)) if private else float(rng.uniform(0.9, 1.0)),
                     int(rng.integers(100, 2000)))
        tid, ts = f"{prefix}{i}", "priv" if private else "shared"
        j = i // 2
        hit = float(j % 5 != 0) if private else float(j % 2 == 0)  # exactly 80% / 50% per 10 tasks
        for key in ("kv", "text_full", "kv+int8"):
            out.append(Observation(tid, ts, key, f, hit))
        out.append(Observation(tid, ts, "none", f, 0.0 if private else hit))
    return out


@pytest.fixture(scope="session")
def value() -> ValueModel:
    return ValueModel.fit(synthetic(), n_boot=100, seed=0)
