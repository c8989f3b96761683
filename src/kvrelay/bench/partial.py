"""``bench partial``: accuracy against bytes for receiver-driven partial relay and what it competes with.

On each task the sender reads the document once (the audit's sender role) and the receiver answers
the task's question (the audit's receiver role) from, per method:

* ``full`` — the whole payload (budget 1);
* ``receiver_driven`` — the positions the receiver's own prompt attends to (``kv.partial``), at each
  budget (fraction of positions); ``receiver_driven+int8`` the same payload int8-coded;
* ``evict_agnostic`` — the same budget chosen without the question (the sender's own last tokens
  re-read as probes, ``evict.attention_probe`` without ``probe_ids``: question-agnostic eviction);
  ``evict_agnostic+int8`` likewise;
* ``text_message`` — a note the sender writes for the receiver (``audit.runner.MESSAGE_PROMPT``);
* ``text_full`` — the receiver re-reads the document's tokens; ``none`` — the question alone.

Per (method, budget): accuracy in points (0–100, BCa CI), the paired difference against ``full`` on the
same tasks (BCa CI of per-task differences, ``audit.bootstrap``), the mean bytes that travel (kvrelay/1
bytes for payloads, UTF-8 bytes for text) and the median receiver TTFT. For partial methods the TTFT
counts the extra hop (request bytes, the sender's scoring forward, selection, reply; ``agents.partial``);
for ``text_message`` the sender's writing is reported apart (``sender_s``).

Trials can be kept as JSON lines (one line per method and budget, a task's lines written together): a
later run with the same scoring setup reads them back and runs only the missing trials — a task recorded
for some methods, budgets or codings runs only the others (greedy answers do not depend on which other
methods ran beside them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from kvrelay.agents.agent import Agent
from kvrelay.agents.partial import make_request, partial_relay
from kvrelay.audit.bootstrap import bca_ci
from kvrelay.audit.runner import MESSAGE_PROMPT, RECEIVER_ROLE, SENDER_ROLE
from kvrelay.audit.tasks.scoring import score
from kvrelay.audit.tasks.task import Task
from kvrelay.kv import wire
from kvrelay.kv.evict import attention_probe
from kvrelay.kv.partial import Budget, request_probe

FULL, RECEIVER, AGNOSTIC = "full", "receiver_driven", "evict_agnostic"
TEXT_METHODS = ("text_message", "text_full", "none")
METHODS = (FULL, RECEIVER, AGNOSTIC, *TEXT_METHODS)
DEFAULT_BUDGETS = (0.05, 0.1, 0.25, 0.5, 1.0)
ENCODINGS = ("raw", "int8")
FIELDS = ("method", "budget", "bytes", "accuracy", "ci_low", "ci_high", "delta_vs_full", "delta_ci_low",
          "delta_ci_high", "ttft_s", "n")


@dataclass(frozen=True, slots=True)
class Trial:
    task: str
    task_set: str
    method: str  # e.g. receiver_driven, receiver_driven+int8, text_message
    budget: float  # fraction of positions asked for (1 for full and the text methods)
    score: float  # 0..1
    bytes: int
    ttft_s: float
    sender_s: float
    kept: float  # fraction of positions actually kept (sinks and recent tail are never dropped)
    context_tokens: int
    # of ttft_s, for the partial methods (None for the others, and in records written before these fields):
    probe_s: float | None = None  # the sender's look-ahead decode and probe forward (once per task and method)
    select_s: float | None = None  # selecting, and with verify checking the candidates (PartialHop.select_s)


OPTIONAL = ("probe_s", "select_s")  # Trial fields that records may lack


def _method_name(base: str, encoding: str) -> str:
    return base if encoding == "raw" else f"{base}+{encoding}"


def trial_keys(budgets: Sequence[float], encodings: Sequence[str], methods: Sequence[str]) -> list[tuple[str, float]]:
    """The ``(method, budget)`` trials a task gets: ``full`` and the text methods once (budget 1), each
    partial method at every coding and budget (``receiver_driven+int8``)."""
    keys = []
    for base in (m for m in METHODS if m in methods):
        if base in (RECEIVER, AGNOSTIC):
            keys += [(_method_name(base, enc), b) for enc in encodings for b in budgets]
        else:
            keys.append((base, 1.0))
    return keys


def run_task(sender: Agent, receiver: Agent, task: Task, task_set: str, budgets: Sequence[float],
             encodings: Sequence[str], methods: Sequence[str], message_tokens: int,
             scoring: dict | None = None, only: set[tuple[str, float]] | None = None) -> list[Trial]:
    """Every method on one task (those of ``only``'s ``(method, budget)`` keys, when given); the document
    read once. ``scoring``: ``PartialRequest``'s ``window``, ``pool``, ``lookahead``, ``verify`` and
    ``backfill`` for both partial methods (default: the request's defaults; the agnostic eviction scores by
    the sender's own last tokens whatever the lookahead)."""
    wanted = set(trial_keys(budgets, encodings, methods)) if only is None else set(only)
    payload = sender.read(task.context)
    T = payload.num_tokens
    out = []

    def trial(method: str, budget: float, r, nbytes: int, ttft: float, sender_s: float = 0.0, kept: float = 1.0,
              probe_s: float | None = None, select_s: float | None = None):
        out.append(Trial(task.id, task_set, method, budget, score(task, r.text), nbytes, ttft, sender_s, kept, T,
                         probe_s, select_s))

    def needs(base: str) -> bool:
        return any(m.split("+")[0] == base for m, _ in wanted)

    if needs(FULL):
        r = receiver.respond(task.prompt, payload)
        trial(FULL, 1.0, r, len(wire.encode(payload)), r.ttft_s)
    probes = {}
    if needs(RECEIVER):
        t0 = time.perf_counter()
        request = make_request(receiver, task.prompt, Budget(fraction=1.0), **(scoring or {}))
        probes[RECEIVER] = (request_probe(sender.model, payload, request), time.perf_counter() - t0)
    if needs(AGNOSTIC):
        t0 = time.perf_counter()
        probes[AGNOSTIC] = (attention_probe(sender.model, payload), time.perf_counter() - t0)
    for base, (probe, probe_s) in probes.items():
        for enc in encodings:
            for b in budgets:
                if (_method_name(base, enc), b) not in wanted:
                    continue
                o = partial_relay(sender, payload, receiver, task.prompt, Budget(fraction=b), probe=probe,
                                  encoding=enc, **(scoring or {}))
                trial(_method_name(base, enc), b, o.response, o.hop.reply_bytes, o.ttft_s + probe_s,
                      kept=o.selection.fraction, probe_s=probe_s, select_s=o.hop.select_s)
    if needs("text_full"):
        r = receiver.respond(task.prompt, payload.token_ids)
        trial("text_full", 1.0, r, len(task.context.encode()), r.ttft_s)
    if needs("text_message"):
        t0 = time.perf_counter()
        note = sender.respond(MESSAGE_PROMPT.format(question=task.prompt), payload, max_new_tokens=message_tokens)
        spent = time.perf_counter() - t0
        r = receiver.respond(task.prompt, note.text)
        trial("text_message", 1.0, r, len(note.text.encode()), r.ttft_s, sender_s=spent)
    if needs("none"):
        r = receiver.respond(task.prompt, None)
        trial("none", 1.0, r, 0, r.ttft_s)
    return out


def run(lm, tasks: Sequence[tuple[str, Task]], *, budgets: Sequence[float] = DEFAULT_BUDGETS,
        encodings: Sequence[str] = ENCODINGS, methods: Sequence[str] = METHODS, max_new_tokens: int = 12,
        message_tokens: int = 64, done: Sequence[Trial] = (), sink: Callable[[list[Trial]], None] | None = None,
        progress: bool = True, scoring: dict | None = None) -> list[Trial]:
    """Every method on every ``(task_set, task)``; trials already in ``done`` (same scoring setup, from
    any run) are taken from there, and only the missing ones run."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown methods {unknown}; expected some of {list(METHODS)}")
    keys = trial_keys(budgets, encodings, methods)
    have = recorded(done)
    sender = receiver = None
    trials: list[Trial] = []
    for task_set, task in tqdm(tasks, desc="bench partial", disable=not progress):
        trials += [have[(task.id, *k)] for k in keys if (task.id, *k) in have]
        todo = {k for k in keys if (task.id, *k) not in have}
        if not todo:
            continue
        if sender is None:
            sender = Agent(lm, "sender", SENDER_ROLE)
            receiver = Agent(lm, "receiver", RECEIVER_ROLE, max_new_tokens=max_new_tokens)
        mine = run_task(sender, receiver, task, task_set, budgets, encodings, methods, message_tokens, scoring,
                        only=todo)
        trials += mine
        if sink is not None:
            sink(mine)
    return trials


def _ci(values: np.ndarray) -> tuple[float | None, float | None]:
    if len(values) < 2:
        return None, None
    ci = bca_ci(values, seed=0)
    return ci.low, ci.high


def summarize(trials: Sequence[Trial]) -> list[dict]:
    """One row per (method, budget) (``FIELDS`` and a few more): points 0–100, paired against ``full``."""
    full = {t.task: t for t in trials if t.method == FULL}
    groups: dict[tuple[str, float], list[Trial]] = {}
    for t in trials:
        groups.setdefault((t.method, t.budget), []).append(t)
    rows = []
    for (method, budget), mine in groups.items():
        acc = np.array([100 * t.score for t in mine])
        lo, hi = _ci(acc)
        paired = [t for t in mine if t.task in full]
        diff = np.array([100 * (t.score - full[t.task].score) for t in paired])
        dlo, dhi = _ci(diff) if method != FULL else (0.0, 0.0)
        full_bytes = statistics.mean(full[t.task].bytes for t in paired) if paired else None
        rows.append({
            "method": method, "budget": budget, "bytes": statistics.mean(t.bytes for t in mine),
            "bytes_vs_full": (statistics.mean(t.bytes for t in paired) / full_bytes) if full_bytes else None,
            "kept": statistics.mean(t.kept for t in mine),
            "accuracy": float(acc.mean()), "ci_low": lo, "ci_high": hi,
            "delta_vs_full": float(diff.mean()) if len(diff) else None, "delta_ci_low": dlo, "delta_ci_high": dhi,
            "ttft_s": statistics.median(t.ttft_s for t in mine),
            "sender_s": statistics.median(t.sender_s for t in mine),
            **{f: _median(getattr(t, f) for t in mine) for f in OPTIONAL},
            "n": len(mine), "task_sets": sorted({t.task_set for t in mine}),
        })
    _versus(rows, trials)
    order = {m: i for i, m in enumerate(METHODS)}
    rows.sort(key=lambda r: (order.get(r["method"].split("+")[0], 99), r["method"], r["budget"]))
    return rows


def by_set(trials: Sequence[Trial]) -> dict[str, list[dict]]:
    """``summarize`` on each task set's trials alone, ``{task_set: rows}``: where a pooled difference comes
    from (one set can carry a loss the other does not show)."""
    return {name: summarize([t for t in trials if t.task_set == name]) for name in sorted({t.task_set for t in trials})}


def _median(values) -> float | None:
    """The median of the values recorded (None where no trial recorded one)."""
    have = [v for v in values if v is not None]
    return statistics.median(have) if have else None


def _versus(rows: list[dict], trials: Sequence[Trial]) -> None:
    """Add to each ``receiver_driven`` row its paired difference (points, BCa CI) against question-agnostic
    eviction at the same budget and coding (``delta_vs_agnostic``) and against the sender's text note
    (``delta_vs_text_message``), on the tasks both ran."""
    score = {(t.method, t.budget, t.task): t.score for t in trials}
    for row in rows:
        method, budget = row["method"], row["budget"]
        if not method.startswith(RECEIVER):
            continue
        for key, other, ob in (("agnostic", method.replace(RECEIVER, AGNOSTIC), budget),
                               ("text_message", "text_message", 1.0)):
            tasks = [k for (m, b, k) in score if m == method and b == budget and (other, ob, k) in score]
            diff = np.array([100 * (score[(method, budget, k)] - score[(other, ob, k)]) for k in tasks])
            lo, hi = _ci(diff)
            row[f"delta_vs_{key}"] = float(diff.mean()) if len(diff) else None
            row[f"delta_vs_{key}_ci_low"], row[f"delta_vs_{key}_ci_high"] = lo, hi


def recorded(trials: Sequence[Trial]) -> dict[tuple[str, str, float], Trial]:
    """``{(task, method, budget): trial}``, the first of any repeats."""
    out: dict[tuple[str, str, float], Trial] = {}
    for t in trials:
        out.setdefault((t.task, t.method, t.budget), t)
    return out


def missing(tasks: Sequence[tuple[str, Task]], done: Sequence[Trial], budgets: Sequence[float],
            encodings: Sequence[str], methods: Sequence[str]) -> int:
    """How many of the trials ``run`` would make are not in ``done``."""
    have, keys = recorded(done), trial_keys(budgets, encodings, methods)
    return sum((task.id, *k) not in have for _, task in tasks for k in keys)


def trial_row(setup: dict, trial: Trial) -> dict:
    return {"setup": setup, **asdict(trial)}


# what rows written before these fields ran with
SETUP_DEFAULTS = {"verify": False, "backfill": False, "first_exact": False, "engine": "fp32"}
WHAT_RAN = ("budgets", "encodings", "methods")  # setup fields that say which trials a run made, not how


def _how(setup: dict) -> dict:
    return {k: v for k, v in {**SETUP_DEFAULTS, **setup}.items() if k not in WHAT_RAN}


def select_trials(rows: Sequence[dict], setup: dict, where: object = "records") -> list[Trial]:
    """The :func:`trial_row` rows run the way ``setup`` says (model, tokens, scoring; whatever methods,
    budgets and codings their run had), as trials (others are left alone); a row that lacks a field of
    ``SETUP_DEFAULTS`` ran with its default."""
    fields = set(Trial.__dataclass_fields__)
    needed = fields - set(OPTIONAL)
    out = []
    for i, row in enumerate(rows, 1):
        if not needed <= set(row) or "setup" not in row:
            raise ValueError(f"{where}: line {i}: expected a bench partial trial with setup and {sorted(needed)}")
        if _how(row["setup"]) == _how(setup):
            out.append(Trial(**{f: row[f] for f in fields if f in row}))
    return out


def plot(rows: Sequence[dict], path) -> None:
    """The accuracy–bytes frontier: accuracy (95% CI) against bytes that travel, log scale (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["bytes"])
        x = [max(r["bytes"], 1) for r in mine]
        y = [r["accuracy"] for r in mine]
        err = [[max(0.0, r["accuracy"] - (r["ci_low"] if r["ci_low"] is not None else r["accuracy"])) for r in mine],
               [max(0.0, (r["ci_high"] if r["ci_high"] is not None else r["accuracy"]) - r["accuracy"]) for r in mine]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=method, ls="-" if len(mine) > 1 else "none")
        if len(mine) > 1:
            for r, xi in zip(mine, x, strict=True):
                ax.annotate(f"{r['budget']:g}", (xi, r["accuracy"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    ax.set_xscale("log")
    ax.set(xlabel="bytes sent to the receiver (log)", ylabel="accuracy (points, 95% CI)",
           title="accuracy vs bytes: receiver-driven partial relay")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
