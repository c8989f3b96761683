"""Wall time of one shell command, with the machine's load around it, as a committed-figure JSON.

    .venv/bin/python benchmarks/time_command.py --json docs/bench/make_demo.json -- make demo

writes ``{"command", "timed", "elapsed_s", "returncode", "load_average": {"load1_before", "load1_after"},
"cpus"}``, so a "how long it takes" figure in the docs can sit beside a committed file that records its load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("timed", nargs=argparse.REMAINDER, help="-- then the command to time")
    args = ap.parse_args(argv)
    timed = [a for a in args.timed if a != "--"] if args.timed[:1] == ["--"] else args.timed
    before = os.getloadavg()[0]
    start = time.perf_counter()
    rc = subprocess.call(timed)
    elapsed = time.perf_counter() - start
    res = {"command": " ".join(["benchmarks/time_command.py", "--json", str(args.json), "--", *timed]),
           "timed": " ".join(timed), "elapsed_s": elapsed, "returncode": rc,
           "load_average": {"load1_before": before, "load1_after": os.getloadavg()[0]}, "cpus": os.cpu_count()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2) + "\n")
    print(f"{' '.join(timed)}: {elapsed:.0f} s, exit {rc}, load {before:.1f} -> {res['load_average']['load1_after']:.1f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
