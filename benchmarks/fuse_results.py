"""Render `kvrelay fuse eval --json` files as the markdown tables docs/fuse.md quotes, and compare one
method's trials across two records files task by task.

    .venv/bin/python benchmarks/fuse_results.py docs/bench/fuse/eval_fuser2000_shared_....json [...]
    .venv/bin/python benchmarks/fuse_results.py --paired NEW.jsonl OLD.jsonl --method fuser --json OUT.json
    .venv/bin/python benchmarks/fuse_results.py --paired R.jsonl R.jsonl --method fuser --against text_full

The first form prints one table per file and regime: method, accuracy [95% CI], paired difference vs the
receiver alone and vs text [95% CI], pairing (matched − mismatched sharer cache), median TTFT, bytes
moved, n (points out of 100). The second pairs ``--method``'s matched trials of the two files on the
tasks both hold (e.g. a retrained adapter against the one before it; with ``--against M``, against
OLD's method M instead, e.g. the same file's ``text_full``) and prints, and with ``--json`` writes, the
difference NEW − OLD with its BCa CI per regime. Nothing here runs a model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kvrelay.audit.bootstrap import bca_ci
from kvrelay.bench.fuse_eval import read_trials


def _pts(x: float) -> str:
    return f"{100 * x:.1f}"


def _diff(c: dict | None) -> str:
    if c is None:
        return "—"
    return f"{_signed(c['estimate'])} [{_signed(c['ci_low'])}, {_signed(c['ci_high'])}]"


def _signed(x: float) -> str:
    """Points with their sign and a true minus; a difference that rounds to zero is ``0.0``."""
    s = f"{100 * x:+.1f}"
    return "0.0" if s in ("+0.0", "-0.0") else s.replace("-", "−")


def table(d: dict, regime: str) -> list[str]:
    """The rows of ``d``'s ``regime``: one per method, receiver first, then as the JSON lists them."""
    con = {(c["method"], c["baseline"]): c for c in d["contrasts"] if c["regime"] == regime}
    pair = {p["method"]: p for p in d["pairing"] if p["regime"] == regime}
    out = ["| method | accuracy [95% CI] | vs receiver alone (paired) | vs text (paired) | "
           "pairing (matched − mismatched) | median TTFT s | bytes moved | n |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = sorted((p for p in d["pairs"] if p["regime"] == regime), key=lambda p: p["method"] != "receiver")
    for p in rows:
        m = p["method"]
        out.append(f"| {m} | {_pts(p['accuracy'])} [{_pts(p['ci_low'])}, {_pts(p['ci_high'])}] | "
                   f"{_diff(con.get((m, 'receiver')))} | {_diff(con.get((m, 'text')))} | {_diff(pair.get(m))} | "
                   f"{p['ttft_s']:.2f} | {p['bytes']:,} | {p['n']} |")
    return out


def paired(new: Path, old: Path, method: str, against: str | None = None, n_boot: int = 2000) -> list[dict]:
    """Per regime, ``method``'s matched score in ``new`` − ``against``'s (default: ``method``'s) in ``old``, on
    the tasks both hold."""
    def scores(path: Path, m: str) -> dict:
        return {(t.regime, t.task_id): t.score for t in read_trials([path]) if t.method == m and not t.mismatched}

    against = against or method
    a, b = scores(new, method), scores(old, against)
    out = []
    for regime in sorted({r for r, _ in a}):
        common = sorted(k for k in a if k[0] == regime and k in b)
        if not common:
            continue
        ci = bca_ci(np.array([a[k] - b[k] for k in common]), n_boot=n_boot)
        out.append({"regime": regime, "method": method, "against": against, "new": str(new), "old": str(old),
                    "n": len(common),
                    "new_accuracy": float(np.mean([a[k] for k in common])),
                    "old_accuracy": float(np.mean([b[k] for k in common])),
                    "estimate": ci.estimate, "ci_low": ci.low, "ci_high": ci.high})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help="`kvrelay fuse eval --json` files to render")
    ap.add_argument("--paired", nargs=2, type=Path, metavar=("NEW", "OLD"), help="two `--records` files to pair")
    ap.add_argument("--method", default="fuser", help="the method whose trials --paired compares")
    ap.add_argument("--against", help="OLD's method to compare with (default: --method)")
    ap.add_argument("--json", type=Path, help="write --paired's result here")
    args = ap.parse_args(argv)
    for f in args.files:
        d = json.loads(f.read_text())
        for regime in sorted({p["regime"] for p in d["pairs"]}):
            print(f"{f} ({regime}; load {d.get('load_average', 'not recorded')})\n")
            print("\n".join(table(d, regime)) + "\n")
    if args.paired:
        res = paired(*args.paired, args.method, args.against)
        for r in res:
            print(f"{r['regime']} {r['method']} vs {r['against']}: {_pts(r['new_accuracy'])} vs {_pts(r['old_accuracy'])} "
                  f"on {r['n']} common tasks, paired {_diff(r)}")
        if args.json:
            cmd = ("python benchmarks/fuse_results.py --paired " + " ".join(map(str, args.paired)) +
                   f" --method {args.method}" + (f" --against {args.against}" if args.against else ""))
            args.json.write_text(json.dumps({"paired": res, "command": f"{cmd} --json {args.json}"}, indent=1) + "\n")


if __name__ == "__main__":
    main()
