"""What an audit seed varies (pure functions, no model): option order, mismatch partner, sampling.

A seed that changes nothing buys no information: with greedy decoding every deterministic arm
gives the same answer under every seed. So a seed changes, per task:

* **the option order** of a multiple-choice task (``seeded``): the gold option lands in slot
  ``(offset(task) + seed) mod k`` for ``k`` options, ``offset`` a fixed hash of the task id, so
  over ``k`` consecutive seeds every slot holds the answer exactly once (the answer letter is
  balanced across seeds, and across tasks for any one seed); the other options are shuffled by
  ``(task id, seed)``. Sender and receiver see the same order (it is the task's problem text);
* **the mismatch partner** (``partner_shift``): task ``i``'s ``kv_mismatched`` payload is the
  reading of the task ``1 + seed mod (n - 1)`` places after it in run order (by length), so it is
  never the task itself, stays of similar length, and differs between seeds;
* **the sampling draw**, when the audit decodes at a temperature above 0 (``row_seed``): each
  trial samples from its own generator, seeded by ``(seed, task id, arm)``, so a seed's answers
  are reproducible and independent of the batch they ran in.

``SEED_DESIGN`` names this scheme in ``config.json``; a folder made under another scheme is not
resumed (its records would mix two meanings of the same seed). ``seed_report`` says, from the
records alone, what the seeds of a run actually varied and how often a task's success changed
with the seed (the within-task variation the task-clustered bootstrap resamples).
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import replace

from kvrelay.audit.tasks.scoring import choice_letters
from kvrelay.audit.tasks.task import Task

#: the scheme above, as recorded in ``config.json`` (folders made before it have no such key)
SEED_DESIGN = "option-order+partner+sampling"


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def option_order(task_id: str, n_choices: int, gold: int, seed: int) -> tuple[int, ...]:
    """``order[slot]`` = index of the original option shown in ``slot`` under ``seed``.

    The gold option ``gold`` is shown in slot ``(offset + seed) % n_choices``; the others fill the
    remaining slots in an order shuffled by ``(task_id, seed)``. Pure and deterministic.
    """
    if n_choices < 2 or not 0 <= gold < n_choices:
        raise ValueError(f"option_order needs >= 2 options and a gold index among them, got {n_choices}, {gold}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    slot = (_digest(f"kvrelay-gold-slot|{task_id}") + seed) % n_choices
    others = [i for i in range(n_choices) if i != gold]
    random.Random(f"kvrelay-options|{task_id}|{seed}").shuffle(others)
    return tuple(others[:slot] + [gold] + others[slot:])


def seeded(task: Task, seed: int) -> tuple[Task, tuple[int, ...] | None]:
    """The task as seed ``seed`` shows it, and its option order (None: the seed does not change it).

    Multiple-choice tasks (``choice_letter`` with ``choices``) get their options reordered in both the
    context and the prompt, and their gold letter moved with it; every other task is returned as is.
    The problem text must end with the lettered options block that ``datasets.choice_task`` writes.
    """
    if task.scorer != "choice_letter" or not task.choices:
        return task, None
    letters = choice_letters(len(task.choices))
    block = "\n".join(f"{ltr}. {c}" for ltr, c in zip(letters, task.choices, strict=True))
    if not task.context.endswith(block) or not task.prompt.startswith(task.context):
        raise ValueError(f"{task.id}: its problem text does not end with its lettered options; cannot reorder them")
    gold = letters.index(task.answers[0])
    order = option_order(task.id, len(task.choices), gold, seed)
    choices = tuple(task.choices[i] for i in order)
    shown = "\n".join(f"{ltr}. {c}" for ltr, c in zip(letters, choices, strict=True))
    context = task.context[: len(task.context) - len(block)] + shown
    prompt = context + task.prompt[len(task.context):]
    answers = tuple(letters[order.index(letters.index(a))] for a in task.answers)
    covs = task.covariate_dict() | {"answer_slot": order.index(gold)}
    return replace(task, context=context, prompt=prompt, answers=answers, choices=choices, covariates=covs), order


def partner_shift(seed: int, n_tasks: int) -> int:
    """How many places after a task (in run order) its mismatch partner is under ``seed``: 1 .. n - 1."""
    if n_tasks < 2:
        raise ValueError(f"a mismatch partner needs at least 2 tasks, got {n_tasks}")
    return 1 + seed % (n_tasks - 1)


def row_seed(seed: int, task_id: str, arm: str) -> int:
    """The sampling generator's seed of one trial (``seed``, task, arm): reproducible, batch-independent."""
    return _digest(f"kvrelay-sample|{seed}|{task_id}|{arm}") % (2**63)


def seed_report(records: Iterable[Mapping]) -> dict:
    """What the seeds of these records varied, and how much a task's success moved with them.

    ``varies``: the factors that differed between two seeds of one task somewhere in the records —
    ``option_order`` (a task shown with two option orders), ``mismatch_partner`` (two partners),
    ``sampling`` (a temperature above 0), ``random_draws`` (a ``kv_random`` / ``kv_noise`` arm);
    empty when every seed repeated the same trial. ``temperature``: the largest recorded (0 greedy).
    ``by_arm``: per ``regime/task`` cell and arm, ``tasks`` with two or more seeds and the share
    ``varying`` whose score differs between seeds. ``reused``: trials copied from another seed
    (their input did not depend on it).
    """
    orders: dict[str, set] = defaultdict(set)
    partners: dict[tuple[str, str], set] = defaultdict(set)
    scores: dict[tuple[str, str, str], dict[str, set]] = defaultdict(lambda: defaultdict(set))
    seeds: dict[tuple[str, str, str], dict[str, set]] = defaultdict(lambda: defaultdict(set))
    temperature, random_draws, reused, n = 0.0, False, 0, 0
    for r in records:
        n += 1
        key = f"{r['task']}/{r['task_id']}"
        if r.get("option_order") is not None:
            orders[key].add(tuple(r["option_order"]))
        if r.get("partner") is not None:
            partners[(key, r["arm"])].add(r["partner"])
        temperature = max(temperature, float(r.get("temperature") or 0.0))
        base = str(r["arm"]).partition(":")[0]
        random_draws |= base in ("kv_random", "kv_noise")
        reused += bool(r.get("reused"))
        cell = (r["regime"], r["task"], r["arm"])
        scores[cell][key].add(float(r["score"]))
        seeds[cell][key].add(int(r["seed"]))
    varies = [name for name, hit in (("option_order", any(len(v) > 1 for v in orders.values())),
                                     ("mismatch_partner", any(len(v) > 1 for v in partners.values())),
                                     ("sampling", temperature > 0), ("random_draws", random_draws)) if hit]
    by_arm = []
    for (regime, task, arm), per_task in sorted(scores.items()):
        multi = [k for k in per_task if len(seeds[(regime, task, arm)][k]) > 1]
        if multi:
            by_arm.append({"regime": regime, "task": task, "arm": arm, "tasks": len(multi),
                           "varying": sum(len(per_task[k]) > 1 for k in multi) / len(multi)})
    return {"varies": varies, "temperature": temperature, "reused": reused, "trials": n, "by_arm": by_arm}
