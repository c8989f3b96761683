"""Run order and mismatch partners of an audit's task set (pure functions, no model).

Tasks run in batches of similar length; the ``kv_mismatched`` control of a task is the reading of
the *next* task in run order — a fixed shift, as in the paper — so it is another task's context of
about the same length, never the task's own.
"""

from __future__ import annotations

from kvrelay.audit.tasks import Task


def run_order(tasks: list[Task]) -> list[int]:
    """Task indices in run order: by length (context + prompt characters), ties by index, so tasks of
    similar length share a batch (less padding)."""
    return sorted(range(len(tasks)), key=lambda i: (len(tasks[i].context) + len(tasks[i].prompt), i))


def mismatch_partners(order: list[int]) -> list[int]:
    """``partners[i]``: the task whose reading is task ``i``'s mismatched payload — the next task in run
    order (a fixed shift, wrapping), so never ``i`` itself when there are two tasks or more, of
    adjacent length, and every task is the partner of exactly one other."""
    if len(order) < 2:
        raise ValueError(f"a mismatch partner needs at least 2 tasks, got {len(order)}")
    partners = [0] * len(order)
    for k, i in enumerate(order):
        partners[i] = order[(k + 1) % len(order)]
    return partners
