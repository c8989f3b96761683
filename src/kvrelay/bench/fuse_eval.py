"""Cross-model relay, evaluated per task against the text baselines, with a mismatched-cache control.

For each task the sharer reads the task's context once (``Agent.read``, no role) into a payload.
Methods (what the receiver answers from):

==============  ================================================================================
``receiver``    its prompt only
``sharer``      the sharer answers itself, continuing its own reading
``text``        the sharer's answer as a message the receiver reads (timed: sharer decode included)
``text_full``   the receiver re-reads the context as text (translate's upper bound)
``ridge``       the sharer's payload through the ridge adapter (``fuse.ridge``)
``layers``      the same maps in the chosen receiver layers only (``fuse.layers``); the other layers
                never see the context. Bytes: the mapped chosen layers (what a sharer that maps
                before sending moves)
``fuser``       the receiver's own reading of the context fused with the sharer's payload
                (``fuse.fuser``; its time to first token includes the receiver's own prefill)
==============  ================================================================================

Regimes follow the task: ``private`` (SQuAD, generated records — only the context holds the
answer: *translate*) and ``shared`` (ARC, OpenBookQA, MMLU — the receiver's prompt holds the whole
problem too: *fuse*, the mapped cache is extra). The pairing control for ``ridge`` gives the
receiver the adapted payload of *another* task (the next one in order; ``layers`` likewise); pairing = matched −
mismatched accuracy, with a paired bootstrap CI over tasks. The fuser's control is the sharer's
reading of the next task cut or extended to the same number of tokens and labelled with this
task's tokens (``audit.runner.length_matched``), so the receiver still reads this task itself and
only the sharer's cache is another task's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvrelay.agents.agent import Agent
from kvrelay.audit.bootstrap import bca_ci
from kvrelay.audit.channels import relabelled
from kvrelay.audit.runner import length_matched
from kvrelay.audit.tasks.scoring import score
from kvrelay.audit.tasks.task import Task
from kvrelay.bench.quiet import load1, load_status, repeat_loads
from kvrelay.core.errors import RecordsError
from kvrelay.core.jsonl import append_json_lines, read_json_lines, resume_json_lines
from kvrelay.fuse import artefact
from kvrelay.fuse.fuser import FuserAdapter
from kvrelay.fuse.layers import LayersAdapter
from kvrelay.fuse.ridge import RidgeAdapter

METHODS = ("receiver", "sharer", "text", "text_full", "ridge", "layers", "fuser")
MESSAGE = "Another assistant read the material and answered: {msg}"


@dataclass(frozen=True, slots=True)
class Trial:
    task_id: str
    task: str
    regime: str
    method: str
    generation: str
    score: float
    ttft_s: float
    bytes: int
    mismatched: bool = False
    adapter: str | None = None  # NAME@FINGERPRINT16 of the adapter a ridge / layers / fuser trial used


ADAPTER_OF = {"ridge": "adapter", "layers": "layers", "fuser": "fuser"}  # method -> its key in ``load_adapters``


def _trial(t: Task, method: str, gen: str, ttft: float, nbytes: int, mismatched: bool = False,
           labels: dict | None = None) -> Trial:
    label = (labels or {}).get(ADAPTER_OF.get(method, ""))
    return Trial(t.id, t.task, t.regime, method, gen, float(score(t, gen)), ttft, nbytes, mismatched, label)


def run_tasks(receiver_lm, sharer_lm, adapter, tasks: Sequence[Task], methods: Sequence[str] = METHODS, *,
              max_new_tokens: int = 16, progress: Callable | None = None, done: Sequence[Trial] = (),
              sink: Callable[[Trial], None] | None = None, fuser=None, layers=None,
              labels: dict | None = None) -> list[Trial]:
    """Every method on every task (and ``ridge`` / ``layers`` / ``fuser`` on another task's payload); one
    greedy answer each.

    ``adapter``: the ridge adapter (for ``ridge``); ``layers``: a ``LayersAdapter``; ``fuser``: a
    ``FuserAdapter`` (for ``fuser``).
    ``done``: trials already on disk (skipped, returned as they are); ``sink`` gets each new trial as it lands;
    ``labels``: ``settings_label`` of the adapters, stamped on the trials of the methods that use one.
    """
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; available: {', '.join(METHODS)}")
    for method, adp in (("ridge", adapter), ("layers", layers), ("fuser", fuser)):
        if method in methods and adp is None:
            raise ValueError(f"method {method!r} needs its adapter")
    sharer = Agent(sharer_lm, "sharer", max_new_tokens=max_new_tokens)
    plain = Agent(receiver_lm, "receiver", max_new_tokens=max_new_tokens)
    mapped = Agent(receiver_lm, "receiver", max_new_tokens=max_new_tokens, adapter=adapter)
    fused = Agent(receiver_lm, "receiver", max_new_tokens=max_new_tokens, adapter=fuser)
    chosen = Agent(receiver_lm, "receiver", max_new_tokens=max_new_tokens, adapter=layers)
    have = {(t.task_id, t.method, t.mismatched): t for t in done}
    trials = list(have.values())
    reads: dict[int, tuple] = {}

    def payload(i: int):
        if i not in reads:
            t0 = time.perf_counter()
            p = sharer.read(tasks[i].context)
            reads[i] = (p, time.perf_counter() - t0)
        return reads[i]

    def todo(t: Task, method: str, mm: bool = False) -> bool:
        return method in methods and (t.id, method, mm) not in have

    def add(trial: Trial) -> None:
        trials.append(trial)
        if sink:
            sink(trial)

    for i, t in enumerate(progress(tasks, "tasks") if progress else tasks):
        if todo(t, "receiver"):
            r = plain.respond(t.prompt)
            add(_trial(t, "receiver", r.text, r.ttft_s, 0))
        if todo(t, "sharer") or todo(t, "text"):
            p, read_s = payload(i)
            s = sharer.respond(t.prompt, p)
            if todo(t, "sharer"):
                add(_trial(t, "sharer", s.text, read_s + s.ttft_s, 0))
            if todo(t, "text"):
                r = plain.respond(t.prompt, MESSAGE.format(msg=s.text.strip() or "(nothing)"))
                add(_trial(t, "text", r.text, read_s + s.ttft_s + s.decode_s + r.ttft_s, len(s.text.encode())))
        if todo(t, "text_full"):
            r = plain.respond(t.prompt, t.context)
            add(_trial(t, "text_full", r.text, r.ttft_s, len(t.context.encode())))
        for j, mm in ((i, False), ((i + 1) % len(tasks), True)):
            if todo(t, "ridge", mm):
                p = payload(j)[0]
                r = mapped.respond(t.prompt, p)
                add(_trial(t, "ridge", r.text, r.ttft_s, p.nbytes, mm, labels))
            if todo(t, "layers", mm):
                p = payload(j)[0]
                r = chosen.respond(t.prompt, p)
                add(_trial(t, "layers", r.text, r.ttft_s, layers.adapt(p, receiver_lm.identity).nbytes, mm,
                           labels))
            if todo(t, "fuser", mm):
                p = payload(i)[0]
                if mm:
                    p = relabelled(length_matched(sharer, list(tasks), j, p.num_tokens, payload(j)[0]), p)
                r = fused.respond(t.prompt, p)
                add(_trial(t, "fuser", r.text, r.ttft_s, p.nbytes, mm, labels))
        reads.pop(i - 1, None)  # task i-1's reading is no longer needed (i+1's may be, as i's partner)
    return trials


def summarize(trials: Sequence[Trial], receiver: str, sharer: str, n_boot: int = 2000) -> dict:
    """The ``kvrelay fuse eval`` JSON: accuracy with CIs per (regime, method), pairing per regime for ridge."""
    pairs, pairing = [], []
    keys = sorted({(t.regime, t.method) for t in trials})
    for regime, method in keys:
        rows = [t for t in trials if t.regime == regime and t.method == method and not t.mismatched]
        ci = bca_ci(np.array([t.score for t in rows]), n_boot=n_boot)
        pairs.append({"receiver": receiver, "sharer": sharer, "regime": regime, "method": method,
                      "accuracy": ci.estimate, "ci_low": ci.low, "ci_high": ci.high,
                      "ttft_s": statistics.median(t.ttft_s for t in rows), "bytes": int(statistics.median(t.bytes for t in rows)),
                      "n": len(rows)})
        mm = {t.task_id: t.score for t in trials if t.regime == regime and t.method == method and t.mismatched}
        if mm:
            diff = np.array([t.score - mm[t.task_id] for t in rows if t.task_id in mm])
            d = bca_ci(diff, n_boot=n_boot)
            pairing.append({"receiver": receiver, "sharer": sharer, "regime": regime, "method": method,
                            "estimate": d.estimate, "ci_low": d.low, "ci_high": d.high})
    return {"pairs": pairs, "pairing": pairing, "contrasts": contrasts(trials, receiver, sharer, n_boot)}


BASELINES = ("receiver", "text")


def contrasts(trials: Sequence[Trial], receiver: str, sharer: str, n_boot: int = 2000) -> list[dict]:
    """Per regime, every method against each baseline (``BASELINES``) on the same tasks: the paired
    accuracy difference method − baseline with its BCa CI (what "beats the receiver alone" needs)."""
    score = {(t.regime, t.method, t.task_id): t.score for t in trials if not t.mismatched}
    out = []
    for regime, method in sorted({(r, m) for r, m, _ in score}):
        for base in BASELINES:
            if base == method:
                continue
            tasks = [k for r, m, k in score if r == regime and m == method and (regime, base, k) in score]
            if not tasks:
                continue
            d = bca_ci(np.array([score[(regime, method, k)] - score[(regime, base, k)] for k in tasks]), n_boot=n_boot)
            out.append({"receiver": receiver, "sharer": sharer, "regime": regime, "method": method, "baseline": base,
                        "estimate": d.estimate, "ci_low": d.low, "ci_high": d.high, "n": len(tasks)})
    return out


def trial_rows(trials: Sequence[Trial]) -> list[dict]:
    return [asdict(t) for t in trials]


def as_trials(rows: Sequence[dict], where: object) -> list[Trial]:
    """Records lines (``trial_rows``) back as trials; ``RecordsError`` naming ``where`` for one that is not."""
    try:
        return [Trial(**row) for row in rows]
    except TypeError as err:  # a line without a trial's fields
        raise RecordsError(f"{where}: not a fuse eval trial ({err})") from None


def read_trials(paths: Sequence[Path]) -> list[Trial]:
    """Every trial in ``paths`` (files written by ``evaluate``'s records; a cut last line is dropped)."""
    return [t for f in paths for t in as_trials(read_json_lines(f, cut_tail_ok=True), f)]


def load_adapters(r_lm, s_lm, receiver: str, sharer: str, methods: Sequence[str], *, ridge: Path | None = None,
                  layers: Path | None = None, fuser: Path | None = None) -> dict:
    """``{"adapter", "fuser", "layers"}`` (in the order a run's settings list them) for ``run_tasks``: the
    adapter of each of ``ridge``, ``fuser``, ``layers`` that ``methods`` name, from its folder (default: the
    pair's committed artefact), else None."""
    def folder(given, method):
        return given or artefact.default_dir(receiver, sharer, method)

    return {"adapter": RidgeAdapter.load(folder(ridge, "ridge"), s_lm.tokenizer, r_lm.tokenizer)
            if "ridge" in methods else None,
            "fuser": FuserAdapter.load(folder(fuser, "fuser"), r_lm, s_lm.tokenizer) if "fuser" in methods else None,
            "layers": LayersAdapter.load(folder(layers, "layers"), s_lm.tokenizer, r_lm.tokenizer)
            if "layers" in methods else None}


@dataclass(frozen=True)
class Evaluation:
    """``evaluate``'s trials (this run's tasks and methods) and how many of them came from the records."""

    trials: list[Trial]
    resumed: int  # trials taken from the records file, not run now


def evaluate(r_lm, s_lm, tasks: Sequence[Task], methods: Sequence[str], adapters: dict, *, max_new_tokens: int = 16,
             records: Path | None = None, progress: Callable | None = None) -> Evaluation:
    """``run_tasks`` with every trial kept in ``records`` as it lands. An existing file is resumed: its trials
    of these tasks are not rerun, and every earlier trial stays in the file (this run's tasks or not). A
    ridge / layers / fuser trial made with another adapter than this run's (or recorded without its adapter)
    is never counted as done: ``RecordsError`` says which, so a retrained adapter is evaluated afresh."""
    earlier = as_trials(resume_json_lines(records), records) if records else []
    labels = settings_label(adapters)
    ids = {t.id for t in tasks}
    for t in earlier:
        want = labels.get(ADAPTER_OF.get(t.method, ""))
        if t.task_id in ids and t.method in methods and want is not None and t.adapter != want:
            raise RecordsError(f"{records}: its {t.method} trials were made with adapter {t.adapter or '(not recorded)'}, "
                               f"this run's is {want}; give another --records file (or drop that method's lines)")
    new: list[Trial] = []

    def sink(trial: Trial) -> None:
        new.append(trial)
        if records:
            append_json_lines(records, trial_rows([trial]))

    trials = run_tasks(r_lm, s_lm, adapters["adapter"], tasks, methods, max_new_tokens=max_new_tokens,
                       progress=progress, done=[t for t in earlier if t.task_id in ids], sink=sink,
                       fuser=adapters["fuser"], layers=adapters["layers"], labels=labels)
    return Evaluation(trials, len(trials) - len(new))


def eval_result(r_lm, s_lm, tasks: Sequence[Task], methods: Sequence[str], adapters: dict, *, threads: int | None,
                max_new_tokens: int = 16, records: Path | None = None, progress: Callable | None = None,
                load: Callable[[], float] = load1) -> dict:
    """The `fuse eval` JSON of ``evaluate`` (``summarize``) with what a reader needs to weigh its TTFTs:
    ``trials_measured`` (run now) and ``trials_from_records`` (resumed from ``records``, timed by an earlier
    run under its own load), ``threads`` (torch's, when not given) and ``load_average`` {load1_before,
    load1_after, status, limit, max} of this run (``bench.quiet.load_status``)."""
    import torch

    threads = threads or torch.get_num_threads()
    before = round(load(), 2)
    run = evaluate(r_lm, s_lm, tasks, methods, adapters, max_new_tokens=max_new_tokens, records=records,
                   progress=progress)
    after = round(load(), 2)
    out = summarize(run.trials, r_lm.name, s_lm.name)
    out |= {"trials_measured": len(run.trials) - run.resumed, "trials_from_records": run.resumed,
            "threads": threads,
            "load_average": {"load1_before": before, "load1_after": after, **load_status([before, after], threads)}}
    return out


def settings_label(adapters: dict) -> dict:
    """What each loaded adapter is, ``NAME@FINGERPRINT16`` (None when not loaded), for a run's settings."""
    return {k: a and f"{a.name}@{a.fingerprint[:16]}" for k, a in adapters.items()}


def synthetic_payload(sharer_lm, tokens: int):
    """(context text of about ``tokens`` sharer tokens, a sharer payload of its reading with random K/V)."""
    import torch

    from kvrelay.audit.tasks.generated import generate
    from kvrelay.kv.payload import KVPayload

    text = generate(1, seed=424242, doc_tokens=tokens)[0].context
    reader = Agent(sharer_lm, "sharer")
    ids = reader.reading_ids(text)[:tokens]
    ident, g = sharer_lm.identity, torch.Generator().manual_seed(0)
    shape = (1, ident.num_kv_heads, len(ids), ident.head_dim)
    keys = tuple(torch.randn(shape, generator=g) for _ in range(ident.num_layers))
    values = tuple(torch.randn(shape, generator=g) for _ in range(ident.num_layers))
    ids_t = torch.tensor([ids], dtype=torch.int64)
    payload = KVPayload(keys, values, ids_t, torch.arange(len(ids))[None], torch.ones_like(ids_t, dtype=torch.bool),
                        reader.meta())
    return sharer_lm.tokenizer.decode(ids, skip_special_tokens=True), payload


TTFT_PROMPT = "Question: What is the access code for the red vault?\nAnswer with the number only."


def ttft_result(receiver_lm, sharer_lm, adapter, method: str, tokens: int, repeats: int, threads: int,
                load: Callable[[], float] = load1) -> dict:
    """The `fuse ttft` JSON: medians over ``repeats`` of the receiver re-reading a ``tokens``-long record vs
    reading the sharer's mapped cache, their ratio, the bytes moved, and the 1-minute load before each repeat.

    Keys: receiver, sharer, method, context_tokens, repeats, text_full_ttft_s, ``{method}_ttft_s``, speedup
    (re-prefill median / mapped median), text_full_all, ``{method}_all``, bytes, load_average
    ({load1_before_repeat, load1_after, status, limit, max}: ``bench.quiet.load_status``)."""
    text, payload = synthetic_payload(sharer_lm, tokens)
    before: list[float] = []
    text_s: list[float] = []
    mapped_s: list[float] = []
    for _ in range(repeats):
        before.append(round(load(), 2))
        t, m = time_ttft(receiver_lm, adapter, text, payload, TTFT_PROMPT, 1)
        text_s += t
        mapped_s += m
    after = round(load(), 2)
    moved = adapter.adapt(payload, receiver_lm.identity).nbytes if method == "layers" else payload.nbytes
    text_med, mapped_med = statistics.median(text_s), statistics.median(mapped_s)
    return {"receiver": receiver_lm.name, "sharer": sharer_lm.name, "method": method,
            "context_tokens": payload.num_tokens, "repeats": repeats, "text_full_ttft_s": text_med,
            f"{method}_ttft_s": mapped_med, "speedup": text_med / mapped_med, "text_full_all": text_s,
            f"{method}_all": mapped_s, "bytes": moved, "threads": threads,
            "load_average": repeat_loads(before, after, threads)}


def time_ttft(receiver_lm, adapter, text: str, payload, prompt: str, repeats: int) -> tuple[list[float], list[float]]:
    """TTFT of the receiver re-reading ``text`` and of it reading ``payload`` through ``adapter``, alternated."""
    plain = Agent(receiver_lm, "receiver", max_new_tokens=1)
    mapped = Agent(receiver_lm, "receiver", max_new_tokens=1, adapter=adapter)
    text_s, mapped_s = [], []
    for _ in range(repeats):
        text_s.append(plain.respond(prompt, text, max_new_tokens=1).ttft_s)
        mapped_s.append(mapped.respond(prompt, payload, max_new_tokens=1).ttft_s)
    return text_s, mapped_s
