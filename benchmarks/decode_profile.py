"""Decode time per token at a long context, with the decode cache's room reserved and without (one run).

    .venv/bin/python benchmarks/decode_profile.py --model qwen2.5-coder-0.5b --engines bf16+int8,int4 \
        --context-tokens 2048 --tokens 32 --repeats 5 --json docs/bench/decode_reserve_qwen2.5-coder-0.5b_2048.json

Per engine mode: one prefill of ``--context-tokens`` random token ids, then ``--repeats`` alternated pairs of
greedy decodes of ``--tokens`` tokens from a copy of that cache, one through ``models.generate.decode_n_tokens``
as shipped (room reserved, ``models.reserve``) and one with the reservation switched off (every step
concatenates the whole cache, as transformers' ``DynamicLayer`` does); medians of ms per token, their ratio,
whether both produced the same tokens, and a profiler's self-time shares of one reserved decode. The
1-minute load average before each repeat is recorded with its quiet/loaded label (``bench.quiet``).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch


def _profile_shares(model, cache, logits, start: int, tokens: int, decode) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(model, copy.deepcopy(cache), logits, torch.tensor([start]), None, tokens, set())
    rows = prof.key_averages()
    total = sum(r.self_cpu_time_total for r in rows)
    top = sorted(rows, key=lambda r: -r.self_cpu_time_total)[:6]
    return {r.key: round(r.self_cpu_time_total / total, 3) for r in top}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--engines", default="bf16+int8,int4")
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    import kvrelay.models.generate as G
    from kvrelay.bench.quiet import load1, repeat_loads
    from kvrelay.models import reserve
    from kvrelay.models.loader import load_model

    ids = torch.randint(100, 20_000, (1, args.context_tokens), generator=torch.Generator().manual_seed(0))
    rows, before = [], []
    for engine in args.engines.split(","):
        lm = load_model(args.model, engine=engine)
        cache = DynamicCache(config=lm.model.config)
        logits = G.forward_last(lm.model, ids, torch.arange(ids.shape[1])[None], cache, None)
        ms = {"reserved": [], "concatenating": []}
        toks = {}
        for _ in range(args.repeats):
            before.append(round(load1(), 2))
            for label in ms:
                G.reserved = reserve.reserved if label == "reserved" else (lambda c, room: nullcontext(c))
                work = copy.deepcopy(cache)
                t0 = time.perf_counter()
                out, _, _ = G.decode_n_tokens(lm.model, work, logits, torch.tensor([ids.shape[1]]), None,
                                              args.tokens, set())
                ms[label].append(1e3 * (time.perf_counter() - t0) / (args.tokens - 1))
                toks[label] = out[0].tolist()
        G.reserved = reserve.reserved
        med = {k: statistics.median(v) for k, v in ms.items()}
        rows.append({"engine": engine, "context_tokens": ids.shape[1], "tokens": args.tokens,
                     "reserved_ms_per_token": med["reserved"], "concatenating_ms_per_token": med["concatenating"],
                     "speedup": med["concatenating"] / med["reserved"],
                     "reserved_tokens_per_s": 1e3 / med["reserved"],
                     "concatenating_tokens_per_s": 1e3 / med["concatenating"],
                     "same_tokens": toks["reserved"] == toks["concatenating"],
                     "reserved_all": ms["reserved"], "concatenating_all": ms["concatenating"],
                     "reserved_profile_shares": _profile_shares(lm.model, cache, logits, ids.shape[1], 12,
                                                                G.decode_n_tokens)})
        print(f"{engine}: {med['concatenating']:.1f} -> {med['reserved']:.1f} ms/token "
              f"({med['concatenating'] / med['reserved']:.2f}x), same tokens: {rows[-1]['same_tokens']}")
    after = round(load1(), 2)
    out = {"model": args.model, "threads": args.threads, "repeats": args.repeats, "rows": rows,
           "machine": platform.node(), "load_average": repeat_loads(before, after, args.threads),
           "command": "python benchmarks/decode_profile.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
