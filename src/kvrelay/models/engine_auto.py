"""``engine="auto"``: the fastest engine mode for a model on this machine, measured once and cached.

The measurement times one-token decode steps of the real model in each candidate mode (medians
over a few steps after a warm-up) and keeps the fastest. Results are cached in
``$KVRELAY_HOME/engine_auto.json`` per (machine, torch version, threads, model fingerprint), so later
loads pick without measuring. Candidates are the modes whose greedy answers are kept on the
benchmarks (``AUTO_CANDIDATES``); other modes are opt-in.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from kvrelay.core.paths import home

AUTO_CANDIDATES = ("fp32", "bf16", "int8")
_CONTEXT, _WARMUP, _STEPS = 128, 2, 6


def machine_key(fingerprint: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}|torch {torch.__version__}|threads {torch.get_num_threads()}|{fingerprint[:16]}"


def _cache_file():
    return home() / "engine_auto.json"


def _read_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def decode_step_s(lm, *, context: int = _CONTEXT, warmup: int = _WARMUP, steps: int = _STEPS) -> float:
    """Median seconds of one greedy decode step after a ``context``-token prefill (random token ids)."""
    from transformers import DynamicCache

    from kvrelay.models.generate import forward_last

    vocab = lm.model.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context), generator=g)  # (1, T)
    cache = DynamicCache(config=lm.model.config)
    logits = forward_last(lm.model, ids, torch.arange(context)[None], cache, None)
    times = []
    for step in range(warmup + steps):
        tok = logits.argmax(-1)[:, None]  # (1, 1)
        t0 = time.perf_counter()
        logits = forward_last(lm.model, tok, torch.tensor([[context + step]]), cache, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def measure_engines(lm, candidates=AUTO_CANDIDATES) -> dict[str, float]:
    """Decode seconds per token of ``lm`` (fp32) in each candidate mode."""
    from kvrelay.models.engine import with_engine

    return {name: decode_step_s(with_engine(lm, name)) for name in candidates}


def pick_engine(lm, candidates=AUTO_CANDIDATES) -> str:
    """The cached pick for ``lm`` on this machine, or measure, cache and return it."""
    key = machine_key(lm.identity.fingerprint)
    hit = _read_cache().get(key)
    if hit and hit.get("engine") in candidates and set(hit.get("decode_s", {})) == set(candidates):
        return hit["engine"]
    times = measure_engines(lm, candidates)
    best = min(times, key=times.get)
    cache = _read_cache()
    cache[key] = {"engine": best, "decode_s": times, "measured_at": time.time()}
    tmp = _cache_file().with_name(f"engine_auto.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, _cache_file())
    return best
