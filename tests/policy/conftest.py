"""Fixtures for the policy tests: the synthetic cost profile and a value model fitted on the synthetic audit
observations of ``tests/policy/synthetic.py`` (relay worth +80 points without the context, nothing with it)."""

from __future__ import annotations

import pytest

from kvrelay.policy.cost import CostProfile
from kvrelay.policy.value import ValueModel

from .synthetic import synthetic, synthetic_profile


@pytest.fixture(scope="session")
def profile() -> CostProfile:
    return synthetic_profile()


@pytest.fixture(scope="session")
def value() -> ValueModel:
    return ValueModel.fit(synthetic(), n_boot=100, seed=0)
