"""``bench repair``: quality against time-to-first-token over recompute budgets, for two approximate reuses.

Cases (the receiver answers a question about a document another agent read):

* ``variant`` — the sender is one fine-tuned variant of a base, the receiver another (continue
  layout). Its payload is refused unless the receiver names a repair; ``raw`` accepts it unchanged
  (an ``IdentityAdapter``), ``recompute:...`` repairs it (``fuse.repair``).
* ``replace`` — same model; the receiver keeps its own role prefix and the payload is RoPE-moved
  behind it (``Agent.respond(layout="replace", repair=...)``).

Each method is compared, on the same tasks, with the receiver re-prefilling the document's tokens
itself (``reprefill``, budget 1): accuracy (0–100, BCa CI), the paired difference repaired −
re-prefill (BCa CI on per-task differences, ``audit.bootstrap``), agreement (share of tasks whose
generated tokens equal re-prefill's) and median TTFT (cache build — repair included — plus prefill).
``budget`` is the recomputed share of (relayed token × layer) forwards, averaged over tasks.

A run can keep its trials as JSON lines (:func:`trial_row`, one line per method, a task's lines
written together once it is done): a later run with the same setup reads them back
(:func:`read_records`, or :func:`run` with ``records``) and only runs the tasks that are missing, so a frontier grows across runs
(``squad_long`` and the generated records give the same first tasks whatever ``n`` is).
"""

from __future__ import annotations

import os
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvrelay.agents.agent import Agent
from kvrelay.audit.bootstrap import bca_ci
from kvrelay.audit.tasks.scoring import score
from kvrelay.audit.tasks.task import Task, approx_tokens
from kvrelay.bench.plot import save_figure
from kvrelay.core.errors import RecordsError
from kvrelay.core.jsonl import append_json_lines, read_json_lines, resume_json_lines
from kvrelay.fuse.adapter import IdentityAdapter
from kvrelay.fuse.repair import parse_repair, repair_adapter

CASES = ("variant", "replace")
RAW, REPREFILL = "raw", "reprefill"
DEFAULT_METHODS = (RAW, "recompute:tokens=0.05", "recompute:tokens=0.12", "recompute:layers=0-3", REPREFILL)
SENDER_ROLE = "You read documents for a team and keep every detail."
RECEIVER_ROLE = "You answer questions about the document you were given, briefly."
FIELDS = ("case", "method", "budget", "accuracy", "ci_low", "ci_high", "reprefill_accuracy", "delta_ci_low",
          "delta_ci_high", "agreement", "ttft_s", "reprefill_ttft_s", "n")


@dataclass(frozen=True, slots=True)
class Trial:
    task: str
    method: str
    score: float  # 0..1
    tokens: tuple[int, ...]
    ttft_s: float
    budget: float
    context_tokens: int


SQUAD_QUESTIONS = 200  # squad_long's questions are the first of SQuAD's seed-0 order; filler comes after them


def squad_long(n: int, context_tokens: int, seed: int = 0) -> list[Task]:
    """``n`` SQuAD questions whose passage sits, at a seeded random place, among passages of other articles
    until the document is about ``context_tokens`` long (``approx_tokens``): a question about one
    article in a long report.

    Questions are the first ``n`` of SQuAD's seed-0 order (at most ``SQUAD_QUESTIONS``); filler
    passages come from the tasks after ``SQUAD_QUESTIONS`` and before ``QA_SKIP`` (the ``qa`` variant
    trains on the tasks after those, ``bench.train_variants``). The filler pool does not depend on
    ``n``, so the first ``k`` tasks are the same for every ``n >= k``.
    """
    from kvrelay.audit.tasks.datasets import load_tasks
    from kvrelay.bench.train_variants import QA_SKIP

    pool = load_tasks("squad", seed=0)[:QA_SKIP]
    if not 0 < n <= SQUAD_QUESTIONS:
        raise ValueError(f"squad_long takes 1..{SQUAD_QUESTIONS} questions, got {n}")
    title = lambda t: dict(t.covariates).get("title")  # noqa: E731
    filler = list({t.context: t for t in pool[SQUAD_QUESTIONS:]}.values())
    rng = random.Random(f"squad_long|{seed}")
    out = []
    for t in pool[:n]:
        others = [f.context for f in filler if title(f) != title(t) and f.context != t.context]
        rng.shuffle(others)
        parts, size = [t.context], approx_tokens(t.context)
        for passage in others:
            if size >= context_tokens:
                break
            parts.append(passage)
            size += approx_tokens(passage)
        parts.insert(rng.randrange(len(parts)), parts.pop(0))
        covs = dict(t.covariates) | {"doc_tokens": approx_tokens("\n\n".join(parts)), "passages": len(parts),
                                     "target_index": parts.index(t.context)}
        out.append(replace(t, id=f"{t.id}@{context_tokens}", task="squad_long", context="\n\n".join(parts),
                           covariates=covs))
    return out


def _budget(method: str, num_layers: int, relayed: int, profile=None, sender_fp: str = "",
            receiver_fp: str = "") -> float:
    if method == RAW:
        return 0.0
    if method == REPREFILL:
        return 1.0
    spec = parse_repair(method)
    block = None
    if spec.auto_layers is not None:
        profile.require_pair(sender_fp, receiver_fp)
        block = profile.block(spec.auto_layers)
    return spec.plan(num_layers, block).budget(num_layers, relayed)


def _receivers(case: str, sender_lm, receiver_lm, methods: Sequence[str], max_new_tokens: int, profile) -> dict:
    """One receiving agent per method (its adapter fixed), all on ``receiver_lm``."""
    out = {}
    src = sender_lm.identity.fingerprint
    for m in methods:
        adapter = None
        if case == "variant" and m == RAW:
            adapter = IdentityAdapter(src, receiver_lm.identity.fingerprint)
        elif case == "variant" and m != REPREFILL:
            adapter = repair_adapter(receiver_lm, m, sources=(src,), profile=profile)
        out[m] = Agent(receiver_lm, "receiver", RECEIVER_ROLE, max_new_tokens=max_new_tokens, adapter=adapter)
    return out


def run_case(case: str, sender_lm, receiver_lm, tasks: Sequence[Task], methods: Sequence[str] = DEFAULT_METHODS, *,
             max_new_tokens: int = 12, profile=None, progress: bool = True, done: Sequence[Trial] = (),
             sink: Callable[[list[Trial]], None] | None = None) -> list[Trial]:
    """Every method on every task; the document is read once per task by the sender.

    ``done``: trials of an earlier run with the same setup; a task that has all ``methods`` there is
    taken from them, not rerun. ``sink`` receives each newly run task's trials together."""
    if case not in CASES:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    if case == "replace" and sender_lm is not receiver_lm:
        raise ValueError("the replace case relays within one model: pass the same model as sender and receiver")
    if case == "variant" and sender_lm.identity.fingerprint == receiver_lm.identity.fingerprint:
        raise ValueError("the variant case needs two different variants (their fingerprints are equal)")
    methods = list(dict.fromkeys([*methods, REPREFILL]))
    sender = Agent(sender_lm, "sender", SENDER_ROLE)
    agents = _receivers(case, sender_lm, receiver_lm, methods, max_new_tokens, profile)
    layout = "replace" if case == "replace" else "continue"
    L = receiver_lm.identity.num_layers
    earlier: dict[str, dict[str, Trial]] = {}
    for t in done:
        earlier.setdefault(t.task, {})[t.method] = t
    trials = []
    for task in tqdm(tasks, desc=f"bench repair {case}", disable=not progress):
        have = earlier.get(task.id, {})
        if all(m in have for m in methods):
            trials += [have[m] for m in methods]
            continue
        mine = []
        payload = sender.read(task.context)
        for m in methods:
            agent = agents[m]
            if m == REPREFILL:
                r = agent.respond(task.prompt, payload.token_ids, layout=layout)
            elif case == "replace":
                r = agent.respond(task.prompt, payload, layout="replace", repair=None if m == RAW else m)
            else:
                r = agent.respond(task.prompt, payload)
            b = _budget(m, L, payload.num_tokens, profile, sender_lm.identity.fingerprint,
                        receiver_lm.identity.fingerprint)
            mine.append(Trial(task.id, m, score(task, r.text), r.token_ids, r.ttft_s, b, payload.num_tokens))
        trials += mine
        if sink is not None:
            sink(mine)
    return trials


TASK_SETS = ("gen", "squad")


def task_set(kind: str, n: int, context_tokens: int, seed: int) -> list[Task]:
    """``gen``: generated records (the receiver answers a number); ``squad``: ``squad_long``."""
    if kind not in TASK_SETS:
        raise ValueError(f"task set must be one of {TASK_SETS}, got {kind!r}")
    if kind == "squad":
        return squad_long(n, context_tokens, seed)
    from kvrelay.audit.tasks.generated import generate

    return generate(n, seed=seed, name="gen_repair", doc_tokens=context_tokens, n_distractors=0)


def run(load: Callable, cases: Sequence[str], methods: Sequence[str], *, sender: str, receiver: str, model: str,
        tasks: str = "gen", n: int = 20, context_tokens: int = 2048, seed: int = 0, max_new_tokens: int = 12,
        profile: Path | None = None, threads: int | None = None, records: Path | None = None) -> dict:
    """``bench repair``'s run: each case on the same tasks, its summary rows, the target check and the load.

    ``load(name)`` loads a model (``variant``: ``sender`` and ``receiver``; ``replace``: ``model``).
    ``records``: every trial as JSON lines (:func:`trial_row`), a task's lines appended once it is done; an
    existing file is resumed first (a cut last line dropped), so the tasks it holds for the same setup are
    not rerun and a larger ``n`` extends an earlier run."""
    from kvrelay.fuse.profile import load_profile

    prof = load_profile(profile) if profile else None
    task_list = task_set(tasks, n, context_tokens, seed)
    kept = resume_json_lines(records) if records else []
    rows, meta, reused, total = [], {}, 0, 0
    load_before = os.getloadavg()[0]
    setting = {"tasks": tasks, "context_tokens": context_tokens, "seed": seed, "max_new_tokens": max_new_tokens,
               "threads": threads, "profile": str(profile) if profile else None}
    for case in cases:
        if case == "variant":
            s_lm, r_lm = load(sender), load(receiver)
            meta[case] = {"sender": sender, "receiver": receiver}
        else:
            s_lm = r_lm = load(model)
            meta[case] = {"model": model}
        setup = {**meta[case], **setting}
        done = select_trials(kept, case, setup, where=records)
        sink = None
        if records:
            def sink(trials, case=case, setup=setup):
                append_json_lines(records, (trial_row(case, setup, t) for t in trials))

        trials = run_case(case, s_lm, r_lm, task_list, methods, max_new_tokens=max_new_tokens,
                          profile=prof if case == "variant" else None, done=done, sink=sink)
        earlier = {id(t) for t in done}  # run_case hands back the very trials it took from the records
        reused += sum(id(t) in earlier for t in trials)
        total += len(trials)
        rows += summarize(case, trials)
    return {"rows": rows, "cases": meta, "tasks": {"set": "gen_repair" if tasks == "gen" else "squad_long", "n": n,
                                                   "context_tokens": context_tokens, "seed": seed},
            "target_met": target_met(rows), "records": str(records) if records else None,
            "trials_measured": total - reused, "trials_from_records": reused,
            "load_average": {"load1_before": round(load_before, 2), "load1_after": round(os.getloadavg()[0], 2)}}


def profile_variants(sender_lm, receiver_lm, sequences: int, context_tokens: int):
    """``fuse.profile.profile_pair`` over the receiver's readings of ``sequences`` generated documents."""
    from kvrelay.fuse.profile import profile_pair

    reader = Agent(receiver_lm, "sender")
    seqs = [reader.reading_ids(t.context) for t in task_set("gen", sequences, context_tokens, seed=1000)]
    return profile_pair(sender_lm, receiver_lm, seqs)


def trial_row(case: str, setup: dict, trial: Trial) -> dict:
    """One records line: the case, the run's ``setup`` (models, task set, seed, length...) and the trial."""
    return {"case": case, "setup": setup, **asdict(trial)}


def read_records(path: Path, case: str, setup: dict) -> list[Trial]:
    """The trials in ``path`` (JSON lines from :func:`trial_row`) of ``case`` run with exactly ``setup``;
    lines of other cases or setups are left alone. A last line cut short (a run killed while writing) is
    ignored; any other line that is not a trial raises ``ValueError`` naming the file and line."""
    return select_trials(read_json_lines(path, cut_tail_ok=True), case, setup, where=path)


def select_trials(rows: Sequence[dict], case: str, setup: dict, where: object = "records") -> list[Trial]:
    """The :func:`trial_row` rows of ``case`` run with exactly ``setup``, as trials; a row that is not a
    bench repair trial raises ``RecordsError`` (a ``ValueError``) naming ``where`` and its position."""
    out = []
    fields = set(Trial.__dataclass_fields__)
    for i, row in enumerate(rows, 1):
        if not fields <= set(row) or not {"case", "setup"} <= set(row):
            raise RecordsError(f"{where}: trial {i}: expected a bench repair trial with case, setup and {sorted(fields)}")
        if row["case"] == case and row["setup"] == setup:
            out.append(Trial(**{**{f: row[f] for f in fields}, "tokens": tuple(row["tokens"])}))
    return out


def _ci(values: np.ndarray) -> tuple[float, float]:
    ci = bca_ci(values, seed=0)
    return (ci.low, ci.high) if ci.low is not None else (float("nan"), float("nan"))


def summarize(case: str, trials: Sequence[Trial]) -> list[dict]:
    """One row per method (``FIELDS``): accuracies and the paired difference in points (0–100)."""
    ref = {t.task: t for t in trials if t.method == REPREFILL}
    rows = []
    for m in dict.fromkeys(t.method for t in trials):
        mine = [t for t in trials if t.method == m]
        acc = np.array([100 * t.score for t in mine])
        ref_acc = np.array([100 * ref[t.task].score for t in mine])
        lo, hi = _ci(acc)
        dlo, dhi = _ci(acc - ref_acc)
        rows.append({"case": case, "method": m, "budget": round(float(np.mean([t.budget for t in mine])), 4),
                     "accuracy": float(acc.mean()), "ci_low": lo, "ci_high": hi,
                     "reprefill_accuracy": float(ref_acc.mean()), "delta": float((acc - ref_acc).mean()),
                     "delta_ci_low": dlo, "delta_ci_high": dhi,
                     "agreement": float(np.mean([t.tokens == ref[t.task].tokens for t in mine])),
                     "ttft_s": statistics.median(t.ttft_s for t in mine),
                     "reprefill_ttft_s": statistics.median(ref[t.task].ttft_s for t in mine),
                     "context_tokens": statistics.mean(t.context_tokens for t in mine), "n": len(mine)})
    return rows


def target_met(rows: Sequence[dict], *, max_budget: float = 0.2, margin: float = 2.0, speedup: float = 3.0) -> dict:
    """Per case: the repaired methods within ``max_budget`` whose paired CI lies inside ±``margin`` points
    and whose TTFT is ``speedup``× below re-prefill's."""
    out = {}
    for case in dict.fromkeys(r["case"] for r in rows):
        ok = [r["method"] for r in rows if r["case"] == case and r["method"] not in (RAW, REPREFILL)
              and r["budget"] <= max_budget and -margin <= r["delta_ci_low"] and r["delta_ci_high"] <= margin
              and r["reprefill_ttft_s"] >= speedup * r["ttft_s"]]
        out[case] = ok
    return out


def plot(rows: Sequence[dict], path) -> None:
    """Accuracy and TTFT against budget, one line per case; re-prefill's accuracy dashed (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = sorted((r for r in rows if r["case"] == case), key=lambda r: r["budget"])
        x = [r["budget"] for r in mine]
        line = ax_acc.errorbar(x, [r["accuracy"] for r in mine],
                               yerr=[[max(0.0, r["accuracy"] - r["ci_low"]) for r in mine],
                                     [max(0.0, r["ci_high"] - r["accuracy"]) for r in mine]],
                               marker="o", capsize=3, label=case)
        ax_acc.axhline(mine[-1]["reprefill_accuracy"], ls="--", lw=0.8, color=line[0].get_color())
        for r in mine:
            ax_acc.annotate(r["method"].removeprefix("recompute:"), (r["budget"], r["accuracy"]), fontsize=7,
                            xytext=(3, -10), textcoords="offset points")
        ax_t.plot(x, [r["ttft_s"] for r in mine], marker="o", label=case)
    ax_acc.set(xlabel="recomputed fraction (budget)", ylabel="accuracy (points, 95% CI)",
               title="quality vs recompute budget")
    ax_t.set(xlabel="recomputed fraction (budget)", ylabel="median TTFT (s)", title="time to first token")
    for ax in (ax_acc, ax_t):
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path, dpi=120)
