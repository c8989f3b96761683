"""``bench pipeline``: text vs kv runs of one workflow, interleaved in one process, medians.

Each repeat runs both modes back to back, alternating which goes first, so drift in machine
load (shared CPUs) hits both alike. Reported (docs/json.md):

* ``text_s`` / ``kv_s`` — median wall time of a whole run; ``speedup = text_s / kv_s``.
* ``ideal_speedup = text_s / (text_s - avoided_s)``: what kv would reach if relaying cost
  nothing. ``avoided_s`` is the prefill time kv mode avoids, measured per agent as text-mode
  prefill minus kv-mode prefill on every agent that received a cache (median over repeats).
  ``ideal_speedup_token_share`` is the same with ``avoided_s`` estimated instead as each
  agent's text prefill time × the share of its prefilled tokens that kv relays.
* ``*_paired_median`` — the same ratios computed within each repeat (its text and kv runs ran back
  to back), then the median: less sensitive to machine load drifting between repeats.
* ``outputs_identical`` — every agent wrote the same tokens in both modes, in every repeat.
* ``fact`` — exact match of the known answer in the last agent's output, per mode.
* ``load_average`` — the 1-minute load before each repeat and after the last, labelled ``quiet`` or
  ``loaded`` against the run's threads (``bench.quiet.load_status``): a loaded run's times are not the
  engines' own.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from kvrelay.bench.auto_policy import auto_routes
from kvrelay.bench.quiet import load1, repeat_loads
from kvrelay.workflows.run import RunTrace, run_workflow
from kvrelay.workflows.workloads import BENCH_NEW_TOKENS, Workload

NOISE_TOLERANCE = 0.02  # a ratio more than 2% above its ideal is measurement noise, not a real effect
TIMING = ("prefill_s", "decode_s", "relay_encode_s", "relay_transfer_s", "relay_decode_s", "relay_s", "wall_s")
COUNTS = ("prefill_tokens", "relayed_tokens", "decode_tokens", "input_tokens", "relay_bytes")


def _median(xs) -> float:
    return float(statistics.median(xs))


def fixed_length(workload: Workload, max_new_tokens: int | None = None,
                 min_new_tokens: int | None = BENCH_NEW_TOKENS) -> Workload:
    """``workload`` with every agent writing between ``min_new_tokens`` and ``max_new_tokens`` tokens.

    A benchmark forces the output length so that text and kv runs decode the same number of tokens;
    outside benchmarks agents stop at their end token (``AgentSpec.min_new_tokens`` defaults to 0).
    """
    from dataclasses import replace

    if max_new_tokens is None and min_new_tokens is None:
        return workload
    return replace(workload, workflow=workload.workflow.with_tokens(max_new_tokens, min_new_tokens))


def above_ideal(ratio: float, ideal: float, per_repeat: list[float], what: str = "speedup") -> str | None:
    """A note when ``ratio`` beats its ``ideal`` by more than ``NOISE_TOLERANCE``: that cannot be a real
    effect (the ideal assumes the relay is free), so the figure is noise; the repeats' spread says how much."""
    if ideal <= 0 or ratio <= ideal * (1 + NOISE_TOLERANCE):
        return None
    lo, hi = min(per_repeat), max(per_repeat)
    return (f"{what} {ratio:.2f}x is above its ideal {ideal:.2f}x: machine-load noise, not a real gain "
            f"(repeats ranged {lo:.2f}x to {hi:.2f}x over {len(per_repeat)} repeat(s)); rerun on a quieter machine "
            "or with more --repeats")


def warm_up(lm) -> None:
    """One short generation so lazy initialisation does not land in the first timed run."""
    from kvrelay.agents.agent import Agent

    Agent(lm, "warmup").respond("hello", max_new_tokens=2)


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def bench_pipeline(lm, workload: Workload, *, repeats: int = 3, model_name: str | None = None,
                   warmup: bool = True, progress=None, executor=None, policy=None,
                   load: Callable[[], float] = load1) -> dict:
    """Run ``workload`` in text and kv mode ``repeats`` times each, interleaved; the dict of docs/json.md.

    ``executor`` picks where agents run (``workflows.executors``; default: in process on ``lm``,
    payloads handed over as objects): e.g. an ``InProcessExecutor`` through a store with a codec, a
    ``RayExecutor`` or a ``ProcessExecutor``. Every backend runs the same ``run_workflow`` loop.
    ``policy``: the ``workflows.auto.AutoPolicy`` that decides the workflow's ``channel = "auto"`` edges in
    kv mode (one policy across repeats, so its switch learns); text mode re-encodes them like every edge.
    ``load``: the 1-minute load reading taken before each repeat and after the last (``load_average``).
    """
    ex = lm if executor is None else executor

    def run(wf, context, mode):
        return run_workflow(ex, wf, context, mode=mode, policy=policy if mode == "kv" else None)

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup:
        warm_up(lm)
    wf = workload.workflow
    runs: dict[str, list[RunTrace]] = {"text": [], "kv": []}
    order_log = []
    for r in range(repeats):
        order = ("text", "kv") if r % 2 == 0 else ("kv", "text")
        before = round(load(), 2)  # 1-min load average before the repeat: was the machine quiet?
        for mode in order:
            t = run(wf, workload.context, mode)
            runs[mode].append(t)
            if progress:
                progress(f"repeat {r + 1}/{repeats} {mode}: {t.wall_s:.1f}s")
        order_log.append({"repeat": r, "order": list(order), "text_s": runs["text"][-1].wall_s,
                          "kv_s": runs["kv"][-1].wall_s, "load1_before": before})
    after = round(load(), 2)
    out = summarize(workload, runs, order_log, model_name or getattr(lm, "name", "?"))
    out["load_average"] = repeat_loads([o["load1_before"] for o in order_log], after, out["machine"]["threads"])
    return out


def _avoided(t: RunTrace, k: RunTrace, share: bool = False) -> float:
    """Prefill seconds kv mode avoided in one repeat: per relayed agent, text prefill − kv prefill (or, with
    ``share``, text prefill × the share of its prefilled tokens that arrived as a cache)."""
    s = 0.0
    for at, ak in zip(t.agents, k.agents, strict=True):
        if ak.relayed_tokens:
            s += at.prefill_s * ak.relayed_tokens / at.prefill_tokens if share else at.prefill_s - ak.prefill_s
    return s


def _agent_row(i: int, name: str, text_runs: list[RunTrace], kv_runs: list[RunTrace]) -> dict:
    """Agent ``i``'s medians over repeats in both modes, what relay saved it, and whether its outputs agree."""
    row: dict = {"agent": name, "channel": kv_runs[0].agents[i].channel,
                 "decision": kv_runs[0].agents[i].decision}  # an auto edge's route in the first kv run
    for mode, rs in (("text", text_runs), ("kv", kv_runs)):
        recs = [t.agents[i] for t in rs]
        for f in COUNTS:
            row[f"{mode}_{f}"] = int(_median([getattr(a, f) for a in recs]))
        for f in TIMING:
            row[f"{mode}_{f}"] = _median([getattr(a, f) for a in recs])
    t0, k0 = text_runs[0].agents[i], kv_runs[0].agents[i]
    row["avoided_prefill_s"] = (_median([t.agents[i].prefill_s - k.agents[i].prefill_s
                                         for t, k in zip(text_runs, kv_runs, strict=True)])
                                if k0.relayed_tokens else 0.0)
    row["prefill_tokens_saved"] = t0.prefill_tokens - k0.prefill_tokens
    row["identical"] = t0.token_ids == k0.token_ids
    row["common_prefix_tokens"] = _common_prefix(t0.token_ids, k0.token_ids)
    row["text_output"], row["kv_output"] = t0.text, k0.text
    return row


def _ratios(runs: dict[str, list[RunTrace]], order_log: list[dict]) -> dict:
    """Medians, speedup, ideal speedup, and the same ratios paired within each repeat."""
    text_runs, kv_runs = runs["text"], runs["kv"]
    pairs = list(zip(text_runs, kv_runs, strict=True))  # text and kv of one repeat
    avoided_each = [_avoided(t, k) for t, k in pairs]
    avoided_s = _median(avoided_each)
    ideal_paired = [t.wall_s / (t.wall_s - a) for (t, _), a in zip(pairs, avoided_each, strict=True)]
    text_s = _median([t.wall_s for t in text_runs])
    kv_s = _median([k.wall_s for k in kv_runs])
    speedup, ideal = text_s / kv_s, text_s / (text_s - avoided_s)
    per_repeat = [o["text_s"] / o["kv_s"] for o in order_log]
    return {
        "text_s": text_s, "kv_s": kv_s, "speedup": speedup, "ideal_speedup": ideal,
        "speedup_vs_ideal": speedup / ideal,
        "speedup_paired_median": _median(per_repeat),
        "speedup_per_repeat": per_repeat,
        "noise": above_ideal(speedup, ideal, per_repeat),
        # per repeat (text and kv of one repeat ran back to back), then the median: robust to load drift
        "ideal_speedup_paired_median": _median(ideal_paired),
        "speedup_vs_ideal_paired_median": _median([(t.wall_s / k.wall_s) / i
                                                   for (t, k), i in zip(pairs, ideal_paired, strict=True)]),
        "ideal_speedup_token_share": text_s / (text_s - _median([_avoided(t, k, True) for t, k in pairs])),
        "avoided_prefill_s": avoided_s,
    }


def _raw(runs: dict[str, list[RunTrace]]) -> dict:
    return {mode: [[{"agent": a.name, "prefill_s": a.prefill_s, "decode_s": a.decode_s, "relay_s": a.relay_s,
                     "wall_s": a.wall_s} for a in t.agents] for t in rs] for mode, rs in runs.items()}


def summarize(workload: Workload, runs: dict[str, list[RunTrace]], order_log: list[dict], model: str) -> dict:
    wf = workload.workflow
    names = [a.name for a in wf.agents]
    text_runs, kv_runs = runs["text"], runs["kv"]
    r = _ratios(runs, order_log)
    identical_per_repeat = [t.outputs() == k.outputs() for t, k in zip(text_runs, kv_runs, strict=True)]
    deterministic = all(t.outputs() == text_runs[0].outputs() for t in text_runs) and all(
        k.outputs() == kv_runs[0].outputs() for k in kv_runs)
    per_agent = [_agent_row(i, name, text_runs, kv_runs) for i, name in enumerate(names)]
    last_text, last_kv = text_runs[0].agents[-1].text, kv_runs[0].agents[-1].text
    t_tot, k_tot = text_runs[0].totals(), kv_runs[0].totals()
    differ = [row["agent"] for row in per_agent if not row["identical"]]
    return {
        "workflow": wf.name,
        "agents": len(names),
        "text_s": r["text_s"],
        "kv_s": r["kv_s"],
        "speedup": r["speedup"],
        "ideal_speedup": r["ideal_speedup"],
        "outputs_identical": all(identical_per_repeat),
        "per_agent": per_agent,
        # -- beyond the contract ---------------------------------------------------------------
        "model": model,
        "layout": wf.layout,
        "context_tokens": text_runs[0].context_tokens,
        "repeats": len(text_runs),
        "agent_names": names,
        "edges": [{"src": e.src, "dst": e.dst, "channel": e.channel} for e in wf.edges],
        "auto_routes": auto_routes(kv_runs),  # each auto edge's routes over the kv repeats
        "switch_events": [ev for k in kv_runs for ev in k.switch_events],
        **{k: v for k, v in r.items() if k not in ("text_s", "kv_s", "speedup", "ideal_speedup")},
        "min_decode_tokens": min(a.decode_tokens for t in (*text_runs, *kv_runs) for a in t.agents),
        "min_new_tokens": min(a.min_new_tokens for a in wf.agents),
        "max_new_tokens": max(a.max_new_tokens for a in wf.agents),
        "text_prefill_tokens": t_tot["prefill_tokens"],
        "kv_prefill_tokens": k_tot["prefill_tokens"],
        "prefill_tokens_saved": t_tot["prefill_tokens"] - k_tot["prefill_tokens"],
        "relayed_tokens": k_tot["relayed_tokens"],
        "relay_bytes": k_tot["relay_bytes"],
        "kv_relay_s": _median([k.totals()["relay_s"] for k in kv_runs]),
        "outputs_identical_per_repeat": identical_per_repeat,
        "deterministic": deterministic,
        "agents_differing": differ,
        "fraction_agents_differing": len(differ) / len(names),
        "fact": {"answer": workload.fact, "text_exact_match": workload.fact_found(last_text),
                 "kv_exact_match": workload.fact_found(last_kv)},
        "source": workload.source,
        "runs": order_log,
        "raw": _raw(runs),
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def replace_quality(lm, names, context_tokens: int, seeds, *, model_name: str | None = None,
                    include_continue: bool = True, max_new_tokens: int | None = None, progress=None) -> dict:
    """How much the replace layout changes answers: per workload and seed, text vs kv (both replace).

    In the replace layout both modes read the same tokens, but the relayed K/V never attended to the
    receiver's own prefix, so outputs may differ. Reported: how often an agent's output differs,
    how far outputs agree (common prefix / length), and exact match on the known fact (asked first
    in the last agent's turn, so it fits in a short answer) for text,
    kv (replace) and — with ``include_continue`` — the exact continue layout (where kv == text).
    """
    from kvrelay.workflows.workloads import build_workload

    rows = []
    for name in names:
        for seed in seeds:
            wl = build_workload(name, lm.tokenizer, context_tokens, seed=seed, layout="replace").fact_first()
            n_new = BENCH_NEW_TOKENS if max_new_tokens is None else max_new_tokens
            wf = fixed_length(wl, n_new, n_new).workflow
            t = run_workflow(lm, wf, wl.context, mode="text")
            k = run_workflow(lm, wf, wl.context, mode="kv")
            agree = [_common_prefix(a.token_ids, b.token_ids) / max(len(a.token_ids), len(b.token_ids), 1)
                     for a, b in zip(t.agents, k.agents, strict=True)]
            row = {"workflow": name, "seed": seed, "context_tokens": t.context_tokens, "agents": len(agree),
                   "agents_differing": sum(a.token_ids != b.token_ids for a, b in zip(t.agents, k.agents, strict=True)),
                   "final_differs": t.agents[-1].token_ids != k.agents[-1].token_ids,
                   "mean_agreement": sum(agree) / len(agree),
                   "text_exact_match": wl.fact_found(t.agents[-1].text),
                   "kv_exact_match": wl.fact_found(k.agents[-1].text)}
            if include_continue:
                c = run_workflow(lm, wf.with_layout("continue"), wl.context, mode="kv")
                row["continue_exact_match"] = wl.fact_found(c.agents[-1].text)
            rows.append(row)
            if progress:
                progress(f"{name} seed {seed}: {row['agents_differing']}/{row['agents']} agent outputs differ")
    n = len(rows)
    summary = {
        "runs": n,
        "fraction_agent_outputs_differing": sum(r["agents_differing"] for r in rows) / sum(r["agents"] for r in rows),
        "fraction_final_answers_differing": sum(r["final_differs"] for r in rows) / n,
        "mean_agreement": sum(r["mean_agreement"] for r in rows) / n,
        "text_exact_match": sum(r["text_exact_match"] for r in rows) / n,
        "kv_exact_match": sum(r["kv_exact_match"] for r in rows) / n,
    }
    if include_continue:
        summary["continue_exact_match"] = sum(r["continue_exact_match"] for r in rows) / n
    return {"model": model_name or getattr(lm, "name", "?"), "layout": "replace", "context_tokens": context_tokens,
            "workflows": list(names), "seeds": list(seeds), "summary": summary, "rows": rows,
            "machine": {"platform": platform.platform(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()}}


def results_markdown(results: list[dict]) -> str:
    """A markdown table of ``bench_pipeline`` results (for docs), one row per result."""
    head = ("| workflow | layout | context tokens | agents | text s | kv s | speedup | ideal | of ideal "
            "| identical | min tokens | command |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {r['workflow']} | {r['layout']} | {r['context_tokens']} | {r['agents']} | {r['text_s']:.1f} "
            f"| {r['kv_s']:.1f} | {r['speedup']:.2f}x | {r['ideal_speedup']:.2f}x | {r['speedup_vs_ideal']:.2f} "
            f"| {r['outputs_identical']} | {r['min_decode_tokens']} | `{r.get('command', '')}` |" for r in results]
    return head + "\n".join(rows) + "\n"
