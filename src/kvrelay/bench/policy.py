"""``kvrelay bench policy``: fixed strategies vs the learned policy on a held-out mixed workload.

The workload is replayed from audit records, so it runs in seconds: every held-out task (task sets
the value model was *not* fitted on; private and shared regimes, short and long contexts) is sent
over each emulated link (``LINKS``: a fast and a slow one), and each strategy picks a channel per
request; at most ``per_set`` tasks of each held-out set are replayed (a seeded sample), so one big set
does not drown the mix. A pick's **success** is what the audit measured for that task under that channel (mean
over seeds); its **latency** is the calibrated cost model's receiver time to first token for that
task's token counts over that link (``CostProfile.latency_s``: the audit's own timings come from
runs at other loads, so they are not mixed in).

Strategies: ``always_text`` (``text_full``), ``always_kv``, ``always_kv_int8``, ``always_none``,
``random`` (a seeded uniform pick), ``checklist`` (the static rules: no relay when the receiver's
prompt holds the context; else kv if the link beats raw's break-even, kv+int8 if it beats int8's,
else text), and ``learned`` (``policy.decide`` with the value model fitted on the other task sets).

A task needs an outcome for every channel a strategy can pick (``CHANNELS``). In the continue layout
``text_full`` and ``kv`` feed the receiver the same tokens and give the same answer; where an audit
ran only one of them, the other's outcome is taken from it; likewise ``kv+int8`` from ``kv`` — each
identity (``IDENTITIES``) only when every trial of every audit that ran both channels answered
identically (``identity_check``: trials with both, identical answers, imputed outcomes). A task still
missing a channel is left out (``skipped_tasks``).

``policy_dominated`` is true when some other strategy is both more accurate and faster than
``learned``. Accuracy intervals: 95% bootstrap over tasks.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvrelay.core.errors import InvalidInput
from kvrelay.core.jsonl import read_json_lines
from kvrelay.core.records_file import ENGINE_BEFORE_RECORDED, record_folders, records_engine, records_file
from kvrelay.policy.cost import CostProfile, Link
from kvrelay.policy.decide import Request, Slo, decide
from kvrelay.policy.features import Features, channel_key, channel_of_arm
from kvrelay.policy.value import ValueModel, mean_ci, observations_from_records

LINKS = {"fast": Link(1000.0), "slow": Link(20.0)}
CHANNELS = (("none", None), ("text_full", None), ("kv", "raw"), ("kv", "int8"))
STRATEGIES = ("always_text", "always_kv", "always_kv_int8", "always_none", "random", "checklist", "learned")
AUDITS = "docs/audit"  # the folder of audits replayed when no folders are given
PER_SET = 48  # held-out tasks replayed per task set
DEFAULT_HELD_OUT = ("gen_easy", "arc_challenge")  # a private and a shared set; the fit keeps squad, gen_grid, openbookqa


def task_texts(task_sets) -> callable:
    """``task_id -> (context, prompt)`` from the audit's own task loader (None for a set it cannot load)."""
    from kvrelay.audit.tasks import load_tasks

    table: dict[str, tuple[str, str]] = {}
    for name in sorted(set(task_sets)):
        try:
            table.update({t.id: (t.context, t.prompt) for t in load_tasks(name)})
        except Exception:  # noqa: BLE001 - a set whose data cannot be read here falls back to its regime
            continue
    return table.get


def load_observations(folders, texts=None) -> tuple[list, list[dict]]:
    obs, rows = [], []
    for f in folders:
        recs = read_json_lines(records_file(f), cut_tail_ok=True)
        engine = records_engine(f) or ENGINE_BEFORE_RECORDED
        obs += observations_from_records(recs, texts=texts, engine=engine, source=str(f))
        rows += [dict(r, _source=str(f), _engine=engine) for r in recs]
    return obs, rows


IDENTITIES = (("kv", "text_full"), ("text_full", "kv"), ("kv+int8", "kv"))  # (missing, taken from)


def outcome_table(rows: list[dict]) -> tuple[dict, dict]:
    """``{task_id: {channel key: mean score}}`` over fp32-engine records, with the answer identities filled
    in (module docstring), and the identity check behind each."""
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    ans: dict[tuple, dict[str, str]] = defaultdict(dict)
    for r in rows:
        if r["_engine"] != "fp32":
            continue
        key = channel_of_arm(r["arm"])
        if key is None:
            continue
        by[r["task_id"]][key].append(float(r["score"]))
        ans[(r["_source"], r["task_id"], r["seed"])][key] = r.get("answer")
    check = {}
    for a, b in IDENTITIES:
        both = [x for x in ans.values() if a in x and b in x]
        check[f"{a}={b}"] = {"trials_with_both": len(both), "identical_answers": sum(x[a] == x[b] for x in both),
                             "imputed": 0}
    table = {}
    for tid, d in by.items():
        t = {k: float(np.mean(v)) for k, v in d.items()}
        for a, b in IDENTITIES:
            c = check[f"{a}={b}"]
            if a not in t and b in t and c["trials_with_both"] and c["identical_answers"] == c["trials_with_both"]:
                t[a] = t[b]  # only where every trial that ran both answered identically
                c["imputed"] += 1
        table[tid] = t
    check["imputed"] = sum(c["imputed"] for k, c in check.items() if k != "imputed")
    return table, check


def _checklist(f: Features, link: Link, cost: CostProfile, prompt_tokens: int) -> tuple[str, str | None]:
    if f.sees_context:
        return "none", None
    if link.mbps >= cost.break_even_mbps("raw", f.context_tokens, prompt_tokens):
        return "kv", "raw"
    if link.mbps >= cost.break_even_mbps("int8", f.context_tokens, prompt_tokens):
        return "kv", "int8"
    return "text_full", None


def bench_policy(cost: CostProfile, *, folders=None, held_out=DEFAULT_HELD_OUT, links=None, seed: int = 0,
                 slo_s: float | None = None, n_boot: int = 200, texts=None, per_set: int | None = PER_SET) -> dict:
    """The ``bench policy`` dict (docs/json.md)."""
    folders = [Path(f) for f in (folders if folders is not None else record_folders(AUDITS))]
    links = links or LINKS
    held = set(held_out)
    if texts is None:
        texts = task_texts({t.split(":")[0] for f in folders
                            for t in json.loads((Path(f) / "config.json").read_text()).get("tasks", [])})
    obs, rows = load_observations(folders, texts)
    fit_obs = [o for o in obs if o.task_set not in held]
    test_obs = [o for o in obs if o.task_set in held]
    if not test_obs:
        raise InvalidInput(f"no records of the held-out task sets {sorted(held)} in {[str(f) for f in folders]}",
                           "task sets some of the audits ran (their config.json tasks)")
    vm = ValueModel.fit(fit_obs, n_boot=n_boot, seed=seed, sources=tuple(str(f) for f in folders))
    table, check = outcome_table(rows)  # identities checked on every audit, applied to held-out tasks
    table = {t: v for t, v in table.items() if t in {o.task_id for o in test_obs}}
    feats = {o.task_id: o.features for o in test_obs if not o.features.quantized}  # the replay is fp32
    prompt = {r["task_id"]: int(r["prefill_tokens"]) for r in rows if r["arm"] == "none" and r["task"] in held}
    need = {channel_key(c, k) for c, k in CHANNELS}
    tasks = sorted(t for t in table if need <= set(table[t]) and t in prompt and t in feats)
    skipped = sorted(t for t in table if t not in tasks)
    rng = np.random.default_rng(seed)
    if per_set is not None:  # a balanced mix: at most per_set tasks of each held-out set, a seeded sample
        by_set = defaultdict(list)
        for t in tasks:
            by_set[t.split("/")[0]].append(t)
        tasks = sorted(x for ts in by_set.values()
                       for x in (ts if len(ts) <= per_set else rng.choice(ts, per_set, replace=False).tolist()))
    picks: dict[str, list] = {s: [] for s in STRATEGIES}
    decisions = []
    for tid in tasks:
        f, q = feats[tid], prompt[tid]
        for lname, link in links.items():
            choice = {"always_text": ("text_full", None), "always_kv": ("kv", "raw"),
                      "always_kv_int8": ("kv", "int8"), "always_none": ("none", None),
                      "random": CHANNELS[int(rng.integers(len(CHANNELS)))],
                      "checklist": _checklist(f, link, cost, q)}
            d = decide(Request(f, prompt_tokens=q, link=link, codecs=("raw", "int8")), Slo(latency_s=slo_s), vm, cost)
            choice["learned"] = (d.channel, d.codec)
            decisions.append({"task_id": tid, "link": lname, "channel": d.channel, "codec": d.codec,
                              "reason": d.reason})
            for s, (c, k) in choice.items():
                lat = cost.latency_s(c, k, context_tokens=f.context_tokens, prompt_tokens=q, link=link)
                picks[s].append((tid, lname, table[tid][channel_key(c, k)], lat, channel_key(c, k)))
    strategies = []
    for s in STRATEGIES:
        per_task = defaultdict(list)
        for tid, _, y, _, _ in picks[s]:
            per_task[tid].append(y)
        acc, lo, hi = mean_ci([100 * np.mean(v) for v in per_task.values()], seed=seed)
        lat = float(np.mean([p[3] for p in picks[s]])) if picks[s] else float("nan")
        mix = defaultdict(int)
        for p in picks[s]:
            mix[p[4]] += 1
        strategies.append({"name": s, "accuracy": acc, "ci_low": lo, "ci_high": hi, "latency_s": lat,
                           "requests": len(picks[s]), "channels": dict(mix)})
    learned = next(x for x in strategies if x["name"] == "learned")
    dominated_by = [x["name"] for x in strategies if x["name"] != "learned"
                    and x["accuracy"] > learned["accuracy"] and x["latency_s"] < learned["latency_s"]]
    return {
        "strategies": strategies, "policy_dominated": bool(dominated_by), "dominated_by": dominated_by,
        "held_out_tasks": sorted(held), "n_tasks": len(tasks), "per_set": per_set,
        "requests": len(tasks) * len(links), "links": {k: {"mbps": v.mbps, "latency_s": v.latency_s}
                                                       for k, v in links.items()},
        "regimes": _regimes(tasks, feats), "skipped_tasks": len(skipped), "identity_check": check,
        "slo_s": slo_s, "fit_task_sets": sorted({o.task_set for o in fit_obs}),
        "value_model": vm.summary(), "calibration": vm.calibration(test_obs),
        "profile": {"model": cost.model, "engine": cost.engine,
                    "break_even_mbps": {c.name: cost.break_even_mbps(c.name, 512) for c in cost.codecs}},
        "decisions": decisions, "audits": [str(f) for f in folders], "load_average": list(os.getloadavg()),
    }


def _regimes(tasks, feats) -> dict:
    out = defaultdict(int)
    for t in tasks:
        f = feats[t]
        out[("shared" if f.sees_context else "private") + ("_long" if f.context_tokens >= 256 else "_short")] += 1
    return dict(out)


def plot_frontier(res: dict, path: str | Path) -> Path:
    """Latency (x) vs accuracy (y) per strategy, with its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvrelay.bench.plot import save_figure

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for s in res["strategies"]:
        star = s["name"] == "learned"
        ax.errorbar(s["latency_s"], s["accuracy"], yerr=[[s["accuracy"] - s["ci_low"]], [s["ci_high"] - s["accuracy"]]],
                    fmt="*" if star else "o", ms=14 if star else 7, capsize=3, color="#d95f02" if star else "#1b9e77")
        ax.annotate(s["name"], (s["latency_s"], s["accuracy"]), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("mean receiver time to first token, s (cost model)")
    ax.set_ylabel("accuracy, points (held-out audit records)")
    ax.set_title(f"policy frontier · held out: {', '.join(res['held_out_tasks'])} · {res['requests']} requests"
                 f"\nlearned policy dominated: {res['policy_dominated']}", fontsize=9)
    return save_figure(fig, path)
