"""Seeded temperature sampling: a token chooser for ``generate`` with one generator per batch row.

Greedy decoding (the default everywhere) takes the argmax; ``Sampler`` draws each row's next token
from ``softmax(logits / temperature)`` with that row's own ``torch.Generator``, so a row's draws
depend on its seed alone — not on which other rows shared its padded batch.

    >>> import torch
    >>> s = Sampler(0.7, [1, 2])
    >>> s(torch.zeros(2, 5)).shape
    torch.Size([2])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class Sampler:
    """Chooses one token per row from (B, V) logits at ``temperature`` > 0, row ``b`` drawing from the
    generator seeded with ``seeds[b]``. Call order matters (one call per decode step), so a fresh
    ``Sampler`` per generation reproduces its draws."""

    def __init__(self, temperature: float, seeds: Sequence[int]):
        if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0 for sampling, got {temperature!r}")
        if not seeds:
            raise ValueError("a Sampler needs one seed per batch row, got none")
        self.temperature = float(temperature)
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits -> (B,) int64 tokens."""
        if logits.shape[0] != len(self.generators):
            raise ValueError(f"sampler has {len(self.generators)} row seeds, the batch has {logits.shape[0]} rows")
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)  # (B, V); -inf logits get 0
        return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(self.generators)])
