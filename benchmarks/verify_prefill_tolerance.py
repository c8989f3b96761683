"""Largest relative K/V error ``kvrelay verify`` sees on genuine payloads, per engine mode and codec.

    .venv/bin/python benchmarks/verify_prefill_tolerance.py --model qwen2.5-coder-0.5b \
        --engines fp32,bf16+fp32 --payloads 8 --json docs/bench/verify_prefill_tolerance.json

Payload ``i`` is the trust corpus's genuine input ``i`` (``kvrelay.bench.trust.genuine_inputs``), made by a
producer in the mode and checked (spot check at k = 4 and 32, seeded) by a receiver in the same mode under
every codec a receiver accepts. The JSON holds every check and, per (mode, codec), the largest error and the
tolerance ``agents.verify.tolerance`` applied: the source of the bf16-prefill floor in that module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--engines", default="fp32,bf16+fp32")
    ap.add_argument("--payloads", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvrelay.agents.verify import VerifySpec, verify_payload
    from kvrelay.bench import trust
    from kvrelay.models.engine import with_engine
    from kvrelay.models.loader import load_model

    load_before = os.getloadavg()[0]
    texts = trust.genuine_inputs(args.payloads)
    checks, worst = [], {}
    base = load_model(args.model)
    for mode in args.engines.split(","):
        lm = base if mode == base.engine else with_engine(base, mode)  # one load: the modes share its weights
        for i, text in enumerate(texts):
            p = trust.genuine_payload(lm, text)
            for c in trust.CODECS:
                q = trust.shipped(p, c)
                for k in (4, 32):
                    v = verify_payload(lm.model, q, VerifySpec(k=k, seed=i), codec=c)
                    checks.append({"engine": mode, "payload": i, "tokens": p.num_tokens, "codec": c, "k": k,
                                   "max_error": round(v.max_error, 6), "tolerance": v.tolerance,
                                   "verdict": v.verdict})
                    w = worst.setdefault(f"{mode} {c}", {"max_error": 0.0, "tolerance": v.tolerance})
                    w["max_error"] = max(w["max_error"], round(v.max_error, 6))
            print(f"{mode} payload {i}: {p.num_tokens} tokens", file=sys.stderr, flush=True)
        del lm
    res = {"command": "benchmarks/verify_prefill_tolerance.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": args.model, "threads": args.threads, "payloads": args.payloads,
           "load_average": {"load1_before": round(load_before, 2), "load1_after": round(os.getloadavg()[0], 2)},
           "worst": worst, "flagged": sum(c["verdict"] != "ok" for c in checks), "checks": checks}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1) + "\n")
    for key, w in worst.items():
        print(f"{key:>20}: largest error {w['max_error']:.4f}, tolerance {w['tolerance']:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
