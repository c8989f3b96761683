"""Each engine mode side by side on one model: decode s/token, prefill tokens/s, relay TTFT, exactness.

    flock /tmp/kvrelay-bench.lock .venv/bin/python benchmarks/engine_modes.py \\
        --model qwen2.5-coder-0.5b --context-tokens 2048 --repeats 3 --threads 2 --new-tokens 16 --engines fp32,int8,int4 \\
        --json docs/bench/engine_modes_qwen2.5-coder-0.5b_2048.json

Every mode shares the fp32 weights of one load (``with_engine``); modes are interleaved within each
repeat and medians are reported. Per mode and repeat: the receiver answers a question about a
relayed 2,048-token cache and about the same tokens re-read as text (``identical``: same greedy
tokens), writing ``--new-tokens`` tokens with stop tokens suppressed; decode s/token is its decode
time over the steps after the first token; prefill tokens/s is the text receiver's prompt tokens
over its TTFT. ``turn_payload_s`` is what a whole-turn payload adds in a compact mode: the answer
and end marker re-prefilled at prefill precision after the relayed cache (0 in fp32, which keeps
the decode loop's K/V). ``same_as_fp32``: the mode's answer
equals the fp32 mode's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvrelay.agents.agent import Agent
from kvrelay.bench.relay import QUESTION, context_ids
from kvrelay.models.engine import ENGINES, decode_weight_bytes
from kvrelay.models.loader import load_model, with_engine


def one_repeat(lm, payload, new_tokens: int) -> dict:
    receiver = Agent(lm, "receiver", max_new_tokens=new_tokens)
    text = receiver.respond(QUESTION, payload.token_ids, min_new_tokens=new_tokens)
    kv = receiver.respond(QUESTION, payload, min_new_tokens=new_tokens)
    t0 = time.perf_counter()  # what a whole-turn payload adds in a compact mode: the answer re-prefilled
    receiver.extend(payload, list(kv.token_ids) + receiver.encode(receiver.fmt.assistant_end))
    turn_s = time.perf_counter() - t0 if lm.engine != "fp32" else 0.0
    steps = max(len(kv.token_ids) - 1, 1)
    return {"text_ttft_s": text.ttft_s, "kv_ttft_s": kv.ttft_s, "decode_s_per_token": kv.decode_s / steps,
            "prefill_tokens_per_s": text.prefill_tokens / text.prefill_s, "turn_payload_s": turn_s,
            "identical": kv.token_ids == text.token_ids, "tokens": list(kv.token_ids)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base = load_model(a.model)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    lms = {e: with_engine(base, e) for e in engines}
    sender = Agent(base, "sender", role="You are a careful reader.")
    ids = context_ids(sender, a.context_tokens)
    payloads = {e: Agent(lms[e], "sender", role="You are a careful reader.").prefill(ids) for e in engines}
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    loads = []
    for r in range(a.repeats):
        loads.append(os.getloadavg()[0])
        for e in (engines if r % 2 == 0 else engines[::-1]):
            runs[e].append(one_repeat(lms[e], payloads[e], a.new_tokens))
            print(f"repeat {r + 1}/{a.repeats} {e}: {runs[e][-1]['decode_s_per_token']:.4f} s/token", flush=True)
    med = statistics.median
    rows = []
    for e in engines:
        rs = runs[e]
        rows.append({"engine": e, **{k: med(x[k] for x in rs) for k in ("text_ttft_s", "kv_ttft_s",
                     "decode_s_per_token", "prefill_tokens_per_s", "turn_payload_s")},
                     "decode_tokens_per_s": 1 / med(x["decode_s_per_token"] for x in rs),
                     "relay_speedup": med(x["text_ttft_s"] / x["kv_ttft_s"] for x in rs),
                     "identical": all(x["identical"] for x in rs),
                     "same_as_fp32": "fp32" in runs and rs[0]["tokens"] == runs["fp32"][0]["tokens"],
                     "decode_weight_bytes": decode_weight_bytes(lms[e].model)})
    res = {"model": a.model, "context_tokens": len(ids), "new_tokens": a.new_tokens, "threads": a.threads,
           "repeats": a.repeats, "load1_before": loads, "rows": rows, "runs": runs,
           "command": " ".join(["python benchmarks/engine_modes.py", *(argv or sys.argv[1:])])}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(res, indent=2) + "\n")
    print(f"{'engine':6} {'decode s/tok':>12} {'prefill tok/s':>13} {'kv TTFT s':>9} {'text TTFT s':>11} "
          f"{'speedup':>7} {'turn +s':>7} {'weights MB':>10} identical same_as_fp32")
    for w in rows:
        print(f"{w['engine']:6} {w['decode_s_per_token']:12.4f} {w['prefill_tokens_per_s']:13.1f} "
              f"{w['kv_ttft_s']:9.3f} {w['text_ttft_s']:11.3f} {w['relay_speedup']:6.1f}x {w['turn_payload_s']:7.2f} "
              f"{w['decode_weight_bytes'] / 1e6:10.0f} {w['identical']!s:9} {w['same_as_fp32']}")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
