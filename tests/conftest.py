"""Shared fixtures: tiny random models (no download) and, for integration tests, zoo models."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)

ARCHS = ("llama", "qwen2", "gemma3")


@pytest.fixture(scope="session", params=ARCHS)
def tiny(request):
    from kvrelay.models.tiny import tiny_lm

    return tiny_lm(request.param)


@pytest.fixture(scope="session")
def tiny_by_arch():
    from kvrelay.models.tiny import tiny_lm

    return {a: tiny_lm(a) for a in ARCHS}


def random_ids(n: int, seed: int, vocab: int = 60, low: int = 9) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n,), generator=g).tolist()
