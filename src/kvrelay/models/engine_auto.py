"""``engine="auto"``: the fastest engine mode for a model on this machine, each phase measured once and cached.

Two measurements of the real model (random token ids, medians after a warm-up):

* **prefill** — seconds of one ``PREFILL_TOKENS``-token prefill with fp32 GEMMs and with bf16 GEMMs
  (``AUTO_PREFILLS``): bf16 is several times faster on CPUs with bf16 dot products (``avx512_bf16``,
  AMX) and several times slower on AVX2-only ones, so only a measurement can tell;
* **decode** — seconds per one-token step in each decode precision of ``AUTO_DECODES``, after a
  ``DECODE_CONTEXT``-token prefill.

``choose`` turns the measurements into a mode: bf16 prefill only when it is at least
``PREFILL_MARGIN`` times as fast as fp32 (it rounds the prefill's GEMM inputs to bf16, so it must buy
a clear speedup), the decode precision with the fewest seconds per token. ``choose`` is a pure function
of what is recorded, so the pick can be recomputed from the cache file, and its ``why`` says it in
one sentence.

Results are cached in ``$KVRELAY_HOME/engine_auto.json`` per (CPU model, the CPU flags that decide
GEMM speed, torch version, threads, model fingerprint), so later loads pick without measuring. An
entry holds the key's parts, the measurements, the pick and the reason (``docs/engine.md``).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from kvrelay.core.atomic import write_json_atomic
from kvrelay.core.paths import home
from kvrelay.models.engine import fp16w_available, mode_name

AUTO_PREFILLS = ("fp32", "bf16")
# Only decodes that keep fp32's answers: fp32p (oneDNN's layout, where PyTorch has oneDNN) and fp16w
# (fp16 weights, fp32 arithmetic, where fbgemm runs) matched fp32 within the quick audit's noise; bf16,
# fp16, int8 and int4 cost accuracy there and are opt-in (docs/engine.md: "Accuracy against fp32" and the
# accuracy paragraphs of the fp32p and fp16w sections).
AUTO_DECODES = ("fp32", *(("fp32p",) if torch.backends.mkldnn.is_available() else ()),
                *(("fp16w",) if fp16w_available() else ()))
PREFILL_MARGIN = 1.2  # bf16 prefill must be at least this many times as fast as fp32
PREFILL_TOKENS, DECODE_CONTEXT = 256, 128
_PREFILL_RUNS, _WARMUP, _STEPS = 3, 2, 6
GEMM_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16",
              "amx_int8")  # the CPU flags that decide which GEMM kernels oneDNN can use
VERSION = 4  # of an entry's layout; entries of other versions are measured again


@dataclass(frozen=True, slots=True)
class Choice:
    engine: str
    prefill: str
    decode: str
    why: str


def choose(prefill_s: dict[str, float], decode_s: dict[str, float], margin: float = PREFILL_MARGIN) -> Choice:
    """The mode the measurements call for (pure: the same numbers give the same pick).

    ``prefill_s``: seconds of one prefill per prefill precision (must include fp32);
    ``decode_s``: seconds per decode step per decode precision.
    """
    if "fp32" not in prefill_s or not decode_s or any(t <= 0 for t in (*prefill_s.values(), *decode_s.values())):
        raise ValueError(f"expected positive timings with an fp32 prefill, got {prefill_s}, {decode_s}")
    decode = min(decode_s, key=lambda k: (decode_s[k], k))
    ratio = prefill_s["fp32"] / prefill_s["bf16"] if "bf16" in prefill_s else None
    prefill = "bf16" if ratio is not None and ratio >= margin else "fp32"
    if ratio is None:
        p_why = "prefill fp32 (bf16 not measured)"
    else:
        p_why = (f"prefill {prefill}: bf16 GEMMs ran {ratio:.2f}x fp32's speed "
                 f"({prefill_s['bf16']:.3f} s vs {prefill_s['fp32']:.3f} s), "
                 f"{'at least' if prefill == 'bf16' else 'under'} the {margin}x required")
    others = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(decode_s.items(), key=lambda kv: kv[1]))
    d_why = f"decode {decode}: the fewest ms per token ({others})"
    return Choice(mode_name(prefill, decode), prefill, decode, f"{p_why}; {d_why}")


def cpu_flags() -> tuple[str, ...]:
    """Which of ``GEMM_FLAGS`` this CPU has (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ()
    have = set(line.split(":", 1)[-1].split())
    return tuple(f for f in GEMM_FLAGS if f in have)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        platform.processor() or platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def machine_key(fingerprint: str) -> str:
    return (f"{cpu_model()}|{','.join(cpu_flags())}|torch {torch.__version__}|threads {torch.get_num_threads()}"
            f"|{fingerprint[:16]}")


def _cache_file():
    return home() / "engine_auto.json"


def _read_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _ids(lm, n: int) -> torch.Tensor:
    vocab = lm.model.config.get_text_config(decoder=True).vocab_size
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))  # (1, n)


def prefill_s(lm, tokens: int = PREFILL_TOKENS, runs: int = _PREFILL_RUNS) -> float:
    """Median seconds of one ``tokens``-token prefill from an empty cache (after one untimed run)."""
    from transformers import DynamicCache

    from kvrelay.models.generate import forward_last

    ids = _ids(lm, tokens)
    pos = torch.arange(tokens)[None]  # (1, T)
    times = []
    for _ in range(runs + 1):
        cache = DynamicCache(config=lm.model.config)
        t0 = time.perf_counter()
        forward_last(lm.model, ids, pos, cache, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def decode_step_s(lm, *, context: int = DECODE_CONTEXT, warmup: int = _WARMUP, steps: int = _STEPS) -> float:
    """Median seconds of one greedy decode step after a ``context``-token prefill (random token ids)."""
    from transformers import DynamicCache

    from kvrelay.models.generate import forward_last

    cache = DynamicCache(config=lm.model.config)
    logits = forward_last(lm.model, _ids(lm, context), torch.arange(context)[None], cache, None)
    times = []
    for step in range(warmup + steps):
        tok = logits.argmax(-1)[:, None]  # (1, 1)
        t0 = time.perf_counter()
        logits = forward_last(lm.model, tok, torch.tensor([[context + step]]), cache, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def measure(lm, prefills=AUTO_PREFILLS, decodes=AUTO_DECODES) -> dict[str, dict[str, float]]:
    """``{"prefill_s": {precision: s}, "decode_s": {precision: s per token}}`` of ``lm`` (fp32) on this machine."""
    from kvrelay.models.engine import with_engine

    return {"prefill_s": {p: prefill_s(with_engine(lm, mode_name(p, "fp32"))) for p in prefills},
            "decode_s": {d: decode_step_s(with_engine(lm, d)) for d in decodes}}


def cached_entry(lm) -> dict | None:
    """This machine's recorded measurement and pick for ``lm``, if any (what ``pick_engine`` reads)."""
    hit = _read_cache().get(machine_key(lm.identity.fingerprint))
    return hit if isinstance(hit, dict) and hit.get("version") == VERSION else None


def pick_engine(lm, candidates=AUTO_DECODES, prefills=AUTO_PREFILLS) -> str:
    """The cached pick for ``lm`` on this machine, or measure both phases, cache and return it."""
    hit = cached_entry(lm)
    if hit and set(hit.get("decode_s", {})) == set(candidates) and set(hit.get("prefill_s", {})) == set(prefills):
        return hit["engine"]
    measured = measure(lm, prefills, candidates)
    c = choose(measured["prefill_s"], measured["decode_s"])
    entry = {"version": VERSION, "engine": c.engine, "prefill": c.prefill, "decode": c.decode, "why": c.why,
             **measured, "prefill_margin": PREFILL_MARGIN, "prefill_tokens": PREFILL_TOKENS,
             "decode_context": DECODE_CONTEXT, "cpu": cpu_model(), "cpu_flags": list(cpu_flags()),
             "torch": torch.__version__, "threads": torch.get_num_threads(),
             "model_fingerprint": lm.identity.fingerprint, "measured_at": time.time()}
    cache = _read_cache()
    cache[machine_key(lm.identity.fingerprint)] = entry
    write_json_atomic(_cache_file(), cache, indent=1, end="")
    return c.engine
