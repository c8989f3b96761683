"""How often a codec's payload gives the receiver the same greedy answer as the full-precision cache.

    .venv/bin/python benchmarks/codec_agreement.py docs/audit/codecs-qwen2.5-coder-0.5b \\
        --json docs/bench/codec_agreement_qwen2.5-coder-0.5b.json

Reads an audit folder's ``records.jsonl`` (or ``records.jsonl.gz``; a run with ``kv`` and ``kv_codec:NAME`` arms, e.g. the
``codecs`` preset) and joins each codec arm's trials with the ``kv`` trial of the same task and seed.
Per codec: trials, identical answers (the exact generated text), and success under both. This is the
measurement behind the wire default (``kvrelay.kv.codecs.WIRE_CODEC``, docs/codecs.md). Nothing here
runs a model.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from kvrelay.audit.report import read_records


def agreement(records: list[dict], reference: str = "kv") -> list[dict]:
    """One row per non-reference arm that shares trials with ``reference``, in arm-name order."""
    by_trial: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        by_trial[(r["task_id"], r["seed"])][r["arm"]] = r
    arms = sorted({r["arm"] for r in records} - {reference})
    rows = []
    for arm in arms:
        pairs = [(t[reference], t[arm]) for t in by_trial.values() if reference in t and arm in t]
        if not pairs:
            continue
        rows.append({"arm": arm, "trials": len(pairs),
                     "identical": sum(a["answer"] == b["answer"] for a, b in pairs),
                     "reference_success": sum(a["score"] for a, _ in pairs) / len(pairs),
                     "arm_success": sum(b["score"] for _, b in pairs) / len(pairs),
                     "relay_bytes": sum(b["relay_bytes"] for _, b in pairs) / len(pairs)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("audit", type=Path, help="an audit output folder (holds records.jsonl[.gz])")
    ap.add_argument("--reference", default="kv", help="the arm every other arm is compared with")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    records = read_records(a.audit)
    rows = agreement(records, a.reference)
    print(f"{'arm':28} {'identical':>12} {'success ref':>12} {'success arm':>12} {'bytes/task':>12}")
    for r in rows:
        print(f"{r['arm']:28} {r['identical']:>5}/{r['trials']:<6} {100 * r['reference_success']:>12.1f} "
              f"{100 * r['arm_success']:>12.1f} {r['relay_bytes'] / 1e6:>10.2f}MB")
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"audit": str(a.audit), "reference": a.reference, "rows": rows,
                                      "command": "python benchmarks/codec_agreement.py " + str(a.audit)
                                      + (f" --json {a.json}" if a.json else "")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
