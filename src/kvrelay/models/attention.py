"""Switching a model's attention implementation for a block, through its public API."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def eager_attention(model) -> Iterator[None]:
    """Eager attention inside the block (the only kind that returns attention weights), then back.

    Not thread-safe: do not share ``model`` with another thread meanwhile.
    """
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)
