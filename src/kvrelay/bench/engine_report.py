"""The ``bench engine`` report: raw measurements (``bench.engine``) -> rows, pipeline, targets.

Pure functions over plain dicts, so a recorded run (the raw dict is kept in the JSON under
``raw``) re-reports the same. Row fields (a contract): ``engine``, ``mode``,
``prefill_tokens_per_s``, ``decode_tokens_per_s``, ``relay_ttft_s``, ``text_ttft_s``,
``relay_bytes``, ``decode_fraction_of_limit``, ``prefill_fraction_of_limit``; pipeline fields:
``engine``, ``handoff``, ``total_s``. All times are medians over the repeats. ``load_average.status``
is ``quiet`` or ``loaded`` (``bench.quiet.load_status`` of every load reading of the run).
"""

from __future__ import annotations

import statistics

from kvrelay.bench.limits import (
    Geometry,
    decode_fraction,
    decode_limit_tokens_per_s,
    prefill_flops,
    prefill_fraction,
)
from kvrelay.bench.quiet import load_status

ROW_FIELDS = ("engine", "mode", "prefill_tokens_per_s", "decode_tokens_per_s", "relay_ttft_s", "text_ttft_s",
              "relay_bytes", "decode_fraction_of_limit", "prefill_fraction_of_limit")
PIPELINE_FIELDS = ("engine", "handoff", "total_s")
TRIAL_FIELDS = ("text_ttft_s", "text_prefill_tokens", "relay_ttft_s", "decode_s", "decode_tokens")


def _median(xs) -> float:
    xs = list(xs)
    if not xs:
        raise ValueError("no measurements to take a median of")
    return float(statistics.median(xs))


def engine_row(raw: dict, limits: dict, geometry: Geometry) -> dict:
    """One engine (mode) from its trials: medians, and the fractions of the machine's limits."""
    trials = raw["trials"]
    missing = sorted({f for t in trials for f in TRIAL_FIELDS if f not in t})
    if not trials or missing:
        raise ValueError(f"{raw.get('engine')}/{raw.get('mode')}: expected trials with {TRIAL_FIELDS}, "
                         f"got {len(trials)} trial(s) missing {missing}")
    steps = [t["decode_tokens"] - 1 for t in trials]  # the first token is the prefill's argmax
    if min(steps) < 1:
        raise ValueError(f"{raw['engine']}/{raw['mode']}: a trial decoded fewer than 2 tokens")
    decode = _median(n / t["decode_s"] for n, t in zip(steps, trials, strict=True))
    prefill = _median(t["text_prefill_tokens"] / t["text_ttft_s"] for t in trials)
    text_s, relay_s = _median(t["text_ttft_s"] for t in trials), _median(t["relay_ttft_s"] for t in trials)
    tokens = trials[0]["text_prefill_tokens"]
    flops_per_token = prefill_flops(geometry, tokens) / tokens
    row = {
        "engine": raw["engine"], "mode": raw["mode"],
        "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
        "relay_ttft_s": relay_s, "text_ttft_s": text_s, "relay_bytes": int(raw["relay_bytes"]),
        "decode_fraction_of_limit": decode_fraction(decode, limits["mem_gbs"], raw["weight_bytes"]),
        "prefill_fraction_of_limit": prefill_fraction(prefill, flops_per_token, limits["gemm_gflops"]),
        # -- beyond the contract --------------------------------------------------------------------
        "decode_s_per_token": 1.0 / decode,
        "decode_limit_tokens_per_s": decode_limit_tokens_per_s(limits["mem_gbs"], raw["weight_bytes"]),
        "weight_bytes_per_token": int(raw["weight_bytes"]),
        "prefill_gflops": prefill * flops_per_token / 1e9,
        "relay_speedup": text_s / relay_s,
        "relay_identical": raw["check"]["relay_identical"],
        "text_prefill_tokens": tokens,
        "decode_tokens": min(t["decode_tokens"] for t in trials),
    }
    if "relay_ttft_c_api_s" in trials[0]:
        row["relay_ttft_c_api_s"] = _median(t["relay_ttft_c_api_s"] for t in trials)
    for extra in ("resolved_mode", "prefill_precision", "decode_precision", "codec", "version",
                  "tokenization_identical"):
        if extra in raw:
            row[extra] = raw[extra]
    return row


def pipeline_rows(raw: dict) -> list[dict]:
    out = []
    for handoff, runs in raw.get("pipeline", {}).items():
        if not runs:
            continue
        out.append({"engine": raw["engine"], "mode": raw["mode"], "handoff": handoff,
                    "total_s": _median(r["total_s"] for r in runs), "total_s_each": [r["total_s"] for r in runs],
                    "agents": len(runs[0]["agents"]),
                    "min_decode_tokens": min(a["decode_tokens"] for r in runs for a in r["agents"]),
                    "relay_bytes": sum(a["relay_bytes"] for a in runs[0]["agents"])})
    return out


def _target(name: str, value: float, goal: float, better: str, detail: str) -> dict:
    met = value >= goal if better == "higher" else value <= goal
    return {"target": name, "value": value, "goal": goal, "better": better, "met": bool(met), "detail": detail}


def mode_label(row: dict) -> str:
    """``auto (bf16+int8)`` for a mode that resolved to another, else the mode."""
    resolved = row.get("resolved_mode")
    return f"{row['mode']} ({resolved})" if resolved and resolved != row["mode"] else row["mode"]


def targets(rows: list[dict], pipes: list[dict], amx: bool = False) -> list[dict]:
    """The goals of kvrelay's default mode (``auto``, when measured; else the fastest-decoding mode) against
    llama.cpp (and vLLM's cold TTFT, when it ran), each with its measured value. ``amx``: the CPU has AMX tiles (prefill must then be 3x ahead)."""
    ours = [r for r in rows if r["engine"] == "kvrelay"]
    peer = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    if not ours:
        return []
    best = next((r for r in ours if r["mode"] == "auto"), None) or max(ours, key=lambda r: r["decode_tokens_per_s"])
    m = best["mode"]
    prefill_goal = 3.0 if amx else 1.0
    out = [_target("decode at >= 0.7 of the bandwidth limit", best["decode_fraction_of_limit"], 0.7, "higher",
                   f"kvrelay {mode_label(best)}: {best['decode_tokens_per_s']:.2f} tok/s of "
                   f"{best['decode_limit_tokens_per_s']:.2f}")]
    vllm = next((r for r in rows if r["engine"] == "vllm"), None)
    if vllm is not None:
        out.append(_target("cold text TTFT no slower than vLLM's CPU build (bf16)",
                           vllm["text_ttft_s"] / best["text_ttft_s"], 1.0, "higher",
                           f"{best['text_ttft_s']:.2f} vs {vllm['text_ttft_s']:.2f} s for "
                           f"{best['text_prefill_tokens']} tokens"))
    if peer is None:
        return out
    out += [
        _target("decode >= 1.0x llama.cpp tokens/s", best["decode_tokens_per_s"] / peer["decode_tokens_per_s"], 1.0,
                "higher", f"{best['decode_tokens_per_s']:.2f} vs {peer['decode_tokens_per_s']:.2f} tok/s"),
        _target(f"prefill >= {prefill_goal:g}x llama.cpp ({'AMX' if amx else 'no AMX'} on this CPU)",
                best["prefill_tokens_per_s"] / peer["prefill_tokens_per_s"], prefill_goal,
                "higher", f"{best['prefill_tokens_per_s']:.0f} vs {peer['prefill_tokens_per_s']:.0f} tok/s"),
        _target("relay TTFT ahead of llama.cpp", peer["relay_ttft_s"] / best["relay_ttft_s"], 1.0, "higher",
                f"{best['relay_ttft_s']:.3f} vs {peer['relay_ttft_s']:.3f} s"),
        *([_target("relay TTFT ahead of llama.cpp's C-API restore", peer["relay_ttft_c_api_s"] / best["relay_ttft_s"],
                   1.0, "higher", f"{best['relay_ttft_s']:.3f} vs {peer['relay_ttft_c_api_s']:.3f} s "
                   "(llama_state_set_data without the Python wrapper's copies)")]
          if "relay_ttft_c_api_s" in peer else []),
        _target("relayed bytes <= llama.cpp's", best["relay_bytes"] / peer["relay_bytes"], 1.0, "lower",
                f"{best['relay_bytes'] / 1e6:.1f} vs {peer['relay_bytes'] / 1e6:.1f} MB"),
    ]
    mine = next((p for p in pipes if p["engine"] == "kvrelay" and p["mode"] == m), None)
    for handoff, goal in (("text", 2.0), ("state", 1.3)):
        theirs = next((p for p in pipes if p["engine"] == "llama.cpp" and p["handoff"] == handoff), None)
        if mine and theirs:
            out.append(_target(f"5-agent pipeline >= {goal:g}x llama.cpp with {handoff} hand-offs",
                               theirs["total_s"] / mine["total_s"], goal, "higher",
                               f"{mine['total_s']:.1f} vs {theirs['total_s']:.1f} s"))
    return out


def report(raw: dict, *, model: str, command: str, extra: dict | None = None) -> dict:
    """The ``bench engine`` JSON: machine, rows, pipeline, targets, and the raw measurements."""
    g = Geometry(**raw["geometry"])
    limits = raw["limits"]
    rows = [engine_row(e, limits, g) for e in raw["engines"]]
    pipes = [p for e in raw["engines"] for p in pipeline_rows(e)]
    before_pipeline = [r["load1_before"] for e in raw["engines"] for runs in e.get("pipeline", {}).values()
                       for r in runs]
    return {
        "model": model, "command": command, "threads": raw["threads"], "repeats": raw["repeats"],
        "load_average": {"load1_before_repeat": raw["load1_before_repeat"], "load1_before_pipeline": before_pipeline,
                         **load_status([*raw["load1_before_repeat"], *before_pipeline], raw["threads"])},
        "context_tokens": raw["context_tokens"], "question_tokens": raw["question_tokens"],
        "new_tokens": raw["new_tokens"], "pipeline_tokens": raw["pipeline_tokens"],
        "pipeline_workload": raw["pipeline_workload"], "codec": raw["codec"],
        "machine": {"mem_gbs": limits["mem_gbs"], "gemm_gflops": limits["gemm_gflops"],
                    **{k: limits[k] for k in ("read_gbs", "copy_gbs", "triad_gbs", "gemm", "array_bytes")},
                    **(extra or {})},
        "rows": rows, "pipeline": pipes,
        "targets": targets(rows, pipes, amx="amx_bf16" in (extra or {}).get("cpu_flags", ())), "raw": raw,
    }


def markdown(res: dict) -> str:
    """Markdown tables of a ``bench engine`` report: engines side by side, the pipeline, the targets."""
    m = res["machine"]
    lines = [f"`{res['command']}`", "",
             f"{res['model']}, {res['context_tokens']} context tokens + {res['question_tokens']} question tokens, "
             f"{res['threads']} threads, medians of {res['repeats']} interleaved repeats; machine: "
             f"{m['mem_gbs']:.1f} GB/s memory bandwidth, {m['gemm_gflops']:.0f} GFLOP/s fp32 GEMM peak; "
             f"1-min load before each repeat: {', '.join(f'{x:.1f}' for x in res['load_average']['load1_before_repeat'])}"
             f" — **{res['load_average']['status']}** (quiet: every reading <= {res['load_average']['limit']:g}).",
             "", "| engine | mode | prefill tok/s | of GEMM peak | decode tok/s | of bandwidth limit | text TTFT s "
             "| relay TTFT s | relay MB | relay = text |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['engine']} | {mode_label(r)} | {r['prefill_tokens_per_s']:.0f} | "
                     f"{r['prefill_fraction_of_limit']:.2f} | {r['decode_tokens_per_s']:.2f} | "
                     f"{r['decode_fraction_of_limit']:.2f} | {r['text_ttft_s']:.2f} | {r['relay_ttft_s']:.3f} | "
                     f"{r['relay_bytes'] / 1e6:.1f} | {'yes' if r['relay_identical'] else 'no'} |")
    if res["pipeline"]:
        lines += ["", f"{res['pipeline_workload']}, 5 agents, {res['pipeline_tokens']} tokens each:", "",
                  "| engine | mode | hand-off | total s | each run s |", "|---|---|---|---:|---|"]
        lines += [f"| {p['engine']} | {p['mode']} | {p['handoff']} | {p['total_s']:.1f} | "
                  f"{' '.join(f'{x:.1f}' for x in p['total_s_each'])} |" for p in res["pipeline"]]
    if res["targets"]:
        lines += ["", "| target | value | goal | met | measured |", "|---|---:|---:|---|---|"]
        lines += [f"| {t['target']} | {t['value']:.2f} | {t['goal']:g} | {'yes' if t['met'] else '**no**'} | "
                  f"{t['detail']} |" for t in res["targets"]]
    return "\n".join(lines) + "\n"
