"""Run order and mismatch partners of an audit's task set (pure functions, no model).

Tasks run in batches of similar length; the ``kv_mismatched`` control of a task is the reading of
a task a few places after it in run order — a fixed shift per seed (``seeding.partner_shift``: the
next task under seed 0, as in the paper) — so it is another task's context of about the same
length, never the task's own, and another one under each seed.
"""

from __future__ import annotations

from kvrelay.audit.seeding import partner_shift
from kvrelay.audit.tasks import Task


def run_order(tasks: list[Task]) -> list[int]:
    """Task indices in run order: by length (context + prompt characters), ties by index, so tasks of
    similar length share a batch (less padding)."""
    return sorted(range(len(tasks)), key=lambda i: (len(tasks[i].context) + len(tasks[i].prompt), i))


def mismatch_partners(order: list[int], seed: int = 0) -> list[int]:
    """``partners[i]``: the task whose reading is task ``i``'s mismatched payload under ``seed`` — the
    task ``partner_shift(seed, n)`` places later in run order (wrapping; the next one under seed 0),
    so never ``i`` itself when there are two tasks or more, of nearby length, and every task is the
    partner of exactly one other."""
    shift = partner_shift(seed, len(order))
    partners = [0] * len(order)
    for k, i in enumerate(order):
        partners[i] = order[(k + shift) % len(order)]
    return partners
