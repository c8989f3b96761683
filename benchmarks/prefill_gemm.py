"""Prefill GEMM rate by precision on this machine: the fact a per-phase precision choice rests on.

    flock /tmp/kvrelay-bench.lock .venv/bin/python benchmarks/prefill_gemm.py --threads 2 \\
        --json docs/bench/prefill_gemm.json

A prefill of ``T`` tokens multiplies (T, K) activations with every (K, N) weight. Per shape (the MLP
up-projections of qwen2.5-coder-0.5b and -1.5b at 2,048 tokens) and dtype (fp32, bf16, fp16) this
times ``x @ w`` (medians of ``--repeats`` after two warm-ups, dtypes interleaved) and reports GFLOP/s
and the ratio to fp32. fp16 is left out: on a CPU without ``avx512_fp16`` one such GEMM took over a
minute (a scalar fallback). The CPU flags that decide which kernels oneDNN can use (``avx512_bf16``,
``amx_bf16``, ``avx512_fp16``) and the 1-minute load before and after (``quiet`` only when every
reading is within the threads + 0.5, ``bench.quiet``) are recorded beside the figures.
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

from kvrelay.bench.quiet import load1, load_status

SHAPES = {"qwen2.5-coder-0.5b mlp up": (2048, 896, 4864), "qwen2.5-coder-1.5b mlp up": (2048, 1536, 8960)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # fp16 GEMM took > 60 s here (no avx512_fp16): not timed
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_flags() -> dict:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    return {"model": model, **{f: f in flags for f in FLAGS}}


def time_gemm(x: torch.Tensor, w: torch.Tensor) -> float:
    t0 = time.perf_counter()
    x @ w
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loads = [load1()]
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (T, K, N) in SHAPES.items():
        x32, w32 = torch.randn(T, K, generator=g), torch.randn(K, N, generator=g) / K ** 0.5
        pairs = {d: (x32.to(t), w32.to(t)) for d, t in DTYPES.items()}
        times: dict[str, list[float]] = {d: [] for d in DTYPES}
        for r in range(a.repeats + 2):
            for d in list(DTYPES)[r % len(DTYPES):] + list(DTYPES)[: r % len(DTYPES)]:
                s = time_gemm(*pairs[d])
                if r >= 2:
                    times[d].append(s)
        fp32 = statistics.median(times["fp32"])
        for d, ts in times.items():
            med = statistics.median(ts)
            rows.append({"shape": name, "m_k_n": [T, K, N], "dtype": d, "median_s": med,
                         "gflops": 2 * T * K * N / med / 1e9, "speedup_vs_fp32": fp32 / med, "each_s": ts})
    loads.append(load1())
    res = {"command": "python benchmarks/prefill_gemm.py " + " ".join(sys.argv[1:]), "threads": a.threads,
           "repeats": a.repeats, "torch": torch.__version__, "platform": platform.platform(), "cpu": cpu_flags(),
           "mkldnn_bf16_supported": bool(getattr(torch.backends.mkldnn, "is_available", lambda: False)()),
           "load_average": {"load1": loads, **load_status(loads, a.threads)}, "rows": rows}
    a.json.write_text(json.dumps(res, indent=1) + "\n")
    for r in rows:
        print(f"{r['shape']:28s} {r['dtype']:5s} {r['gflops']:7.1f} GFLOP/s  {r['speedup_vs_fp32']:.2f}x fp32")
    print(f"load {res['load_average']['status']}: {', '.join(f'{x:.1f}' for x in loads)}; wrote {a.json}")


if __name__ == "__main__":
    main()
