"""Render `kvrelay bench repair --json` files as the markdown tables docs/repair.md quotes.

    .venv/bin/python benchmarks/repair_results.py docs/bench/repair_variant_squad_2048.json [...]

prints one table per file: method, budget, accuracy [95% CI], paired difference vs re-prefill [95% CI],
agreement, median TTFT and its ratio to re-prefill's, n. Nothing here runs a model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LABEL = {"raw": "`raw` (no repair)", "reprefill": "`reprefill`"}


def table(d: dict) -> list[str]:
    out = ["| case | method | budget | accuracy [95% CI] | Δ vs re-prefill [95% CI] | agreement | TTFT s | "
           "vs re-prefill | n |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(d["rows"], key=lambda r: (r["case"], r["budget"])):
        delta = "—" if r["method"] == "reprefill" else (
            f"{r['delta']:+.1f} [{r['delta_ci_low']:+.1f}, {r['delta_ci_high']:+.1f}]")
        out.append(f"| {r['case']} | {LABEL.get(r['method'], '`' + r['method'] + '`')} | {r['budget']:.3f} | "
                   f"{r['accuracy']:.1f} [{r['ci_low']:.1f}, {r['ci_high']:.1f}] | {delta} | {r['agreement']:.2f} | "
                   f"{r['ttft_s']:.2f} | {r['reprefill_ttft_s'] / r['ttft_s']:.1f}× | {r['n']} |")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    for f in args.files:
        d = json.loads(f.read_text())
        load = d.get("load_average") or {}
        print(f"{f} (load average {load.get('load1_before', '?')} → {load.get('load1_after', '?')}; "
              f"target met: {d.get('target_met')})\n")
        print("\n".join(table(d)) + "\n")


if __name__ == "__main__":
    main()
