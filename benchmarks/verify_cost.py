"""What a speculative verify forward costs against a one-token decode step, at a long context (one run).

    .venv/bin/python benchmarks/verify_cost.py --model qwen2.5-coder-1.5b --context-tokens 2048 \
        --widths 1,2,3,5,9 --repeats 5 --json docs/bench/verify_cost_qwen2.5-coder-1.5b_2048.json

One prefill of ``--context-tokens`` random token ids; then, per repeat and width ``q``, one forward of ``q``
new tokens over that cache, as ``models.speculative`` makes it: ``all`` returns every position's logits
(``models.speculative.verify_forward``: the one-token weights and the grouped-query causal attention)
and ``last`` only the last one's (``generate.forward_last``, the plain decode step when ``q`` = 1). The
cache is cropped back after each forward. Medians of ms per forward, and each width's cost in one-token
steps; a profiler's self-time shares of the widest ``all`` forward. The 1-minute load before each repeat
is recorded with its quiet/loaded label (``bench.quiet``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def _forward(G, model, cache, start: int, q: int, keep: str):
    from kvrelay.models.speculative import verify_forward

    ids = torch.randint(100, 20_000, (1, q), generator=torch.Generator().manual_seed(q))  # (1, q)
    pos = torch.arange(start, start + q)[None]  # (1, q)
    t0 = time.perf_counter()
    if keep == "all":
        verify_forward(model, ids, pos, cache)
    else:
        G.forward_last(model, ids, pos, cache, None)
    dt = time.perf_counter() - t0
    cache.crop(-q)  # back to the context alone
    return dt


def _profile_shares(G, model, cache, start: int, q: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _forward(G, model, cache, start, q, "all")
    rows = prof.key_averages()
    total = sum(r.self_cpu_time_total for r in rows)
    return {r.key: round(r.self_cpu_time_total / total, 3) for r in sorted(rows, key=lambda r: -r.self_cpu_time_total)[:8]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--engine", default="fp32")
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--widths", default="1,2,3,5,9")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    import kvrelay.models.generate as G
    from kvrelay.bench.quiet import load1, repeat_loads
    from kvrelay.models.loader import load_model

    widths = [int(w) for w in args.widths.split(",")]
    lm = load_model(args.model, engine=args.engine)
    ids = torch.randint(100, 20_000, (1, args.context_tokens), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=lm.model.config)
    G.forward_last(lm.model, ids, torch.arange(ids.shape[1])[None], cache, None)
    start = ids.shape[1]
    _forward(G, lm.model, cache, start, 1, "last")  # warm-up
    ms: dict[tuple[str, int], list[float]] = {(k, q): [] for q in widths for k in ("all", "last")}
    before = []
    for _ in range(args.repeats):
        before.append(round(load1(), 2))
        for q in widths:
            for keep in ("last", "all"):
                ms[(keep, q)].append(1e3 * _forward(G, lm.model, cache, start, q, keep))
    after = round(load1(), 2)
    step = statistics.median(ms[("last", 1)])
    rows = [{"width": q, "logits": keep, "ms": statistics.median(ms[(keep, q)]),
             "steps": statistics.median(ms[(keep, q)]) / step, "all_ms": ms[(keep, q)]}
            for q in widths for keep in ("last", "all")]
    for r in rows:
        print(f"q={r['width']} logits={r['logits']}: {r['ms']:.0f} ms = {r['steps']:.2f} one-token steps")
    out = {"model": args.model, "engine": args.engine, "context_tokens": start, "threads": args.threads,
           "repeats": args.repeats, "one_token_step_ms": step, "rows": rows,
           "profile_shares_widest_all": _profile_shares(G, lm.model, cache, start, max(widths)),
           "machine": {"platform": platform.platform(), "torch": torch.__version__},
           "load_average": repeat_loads(before, after, args.threads),
           "command": "python benchmarks/verify_cost.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
