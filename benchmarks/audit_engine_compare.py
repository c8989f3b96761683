"""Two audits of the same preset under two engine modes, paired trial by trial.

    .venv/bin/python benchmarks/audit_engine_compare.py docs/audit/quick-qwen2.5-coder-0.5b \\
        docs/audit/quick-qwen2.5-coder-0.5b-int8 --json docs/audit/quick-qwen2.5-coder-0.5b-int8/vs_fp32.json

Trials are joined on (task_id, arm, seed). Per arm: success (mean score, in points) under each mode,
the paired difference with a bootstrap 95% CI over tasks, and the share of identical answers. The
pairing effect (``kv`` minus ``kv_mismatched``: what relaying the right cache adds) is reported under
each mode with its own bootstrap CI. Nothing here runs a model.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from kvrelay.audit.report import read_records


def _records(folder: Path) -> dict[tuple, dict]:
    """The folder's trials (``records.jsonl`` or ``records.jsonl.gz``) by (task_id, arm, seed)."""
    return {(r["task_id"], r["arm"], r["seed"]): r for r in read_records(folder)}


def _ci(diffs: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    if not diffs:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(n_boot))
    return means[int(0.025 * n_boot)], means[int(0.975 * n_boot) - 1]


def compare(a_dir: Path, b_dir: Path) -> dict:
    a, b = _records(a_dir), _records(b_dir)
    keys = sorted(set(a) & set(b))
    arms = sorted({k[1] for k in keys})
    rows = []
    for arm in arms:
        ks = [k for k in keys if k[1] == arm]
        sa = [100 * a[k]["score"] for k in ks]
        sb = [100 * b[k]["score"] for k in ks]
        diffs = [y - x for x, y in zip(sa, sb, strict=True)]
        lo, hi = _ci(diffs)
        rows.append({"arm": arm, "trials": len(ks), "success_a": statistics.fmean(sa), "success_b": statistics.fmean(sb),
                     "diff": statistics.fmean(diffs), "diff_ci95": [lo, hi],
                     "same_answer": statistics.fmean(a[k]["answer"] == b[k]["answer"] for k in ks)})
    pairing = {}
    for name, recs in (("a", a), ("b", b)):
        ks = [k for k in keys if k[1] == "kv" and (k[0], "kv_mismatched", k[2]) in recs]
        d = [100 * (recs[k]["score"] - recs[(k[0], "kv_mismatched", k[2])]["score"]) for k in ks]
        pairing[name] = {"effect": statistics.fmean(d) if d else float("nan"), "ci95": list(_ci(d)), "pairs": len(d)}
    return {"a": str(a_dir), "b": str(b_dir), "joined_trials": len(keys), "only_a": len(set(a) - set(b)),
            "only_b": len(set(b) - set(a)), "rows": rows, "pairing_kv_minus_mismatched": pairing}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    res = compare(args.a, args.b)
    res["command"] = " ".join([".venv/bin/python benchmarks/audit_engine_compare.py", *(argv or sys.argv[1:])])
    print(f"{'arm':16} {'trials':>6} {'A %':>6} {'B %':>6} {'B-A':>6} {'95% CI':>16} {'same answer':>11}")
    for r in res["rows"]:
        lo, hi = r["diff_ci95"]
        print(f"{r['arm']:16} {r['trials']:6d} {r['success_a']:6.1f} {r['success_b']:6.1f} {r['diff']:+6.1f} "
              f"[{lo:+6.1f}, {hi:+6.1f}] {r['same_answer']:11.2f}")
    for k, p in res["pairing_kv_minus_mismatched"].items():
        print(f"pairing effect (kv - kv_mismatched) in {k}: {p['effect']:+.1f} "
              f"[{p['ci95'][0]:+.1f}, {p['ci95'][1]:+.1f}] over {p['pairs']} pairs")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
