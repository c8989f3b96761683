"""``kvrelay calibrate``: measure this machine's cost profile (``policy.cost.CostProfile``) for one model.

One ``bench transfer`` run (``bench.transfer.bench_transfer``: the receiver's prefill at each context
size, every codec through the wire and every store, interleaved repeats, medians) plus the
receiver's decode step, turned into rates:

* prefill: a least-squares line ``fixed + per_token × tokens`` through the receiver's prompt prefill
  (prompt tokens after the context) and the context prefill at each size;
* decode: the median one-token forward after the largest context (``DECODE_STEPS`` steps);
* codecs: compression ratio at the largest size; encode (compress + pack) and decode (unpack +
  decompress + cache build) seconds per raw (fp32) cache byte, pooled over sizes;
* stores: put and get seconds per payload byte of the lossless payload, pooled over sizes;
* link: the bandwidth and latency given (``--link-mbps``), when one is configured.

**Agreement.** With emulated links on (root, iproute2), the same run measures the break-even
bandwidth across a real rate-limited link (``bench.links``); ``agreement`` sets the profile's
break-even (from the fitted rates) beside that measured one and the closed form, per codec and
size. The profile is saved under ``$KVRELAY_HOME/profiles/`` (``profile_path``) and reused by
``decide`` and ``bench policy`` until the next calibration.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from kvrelay.core.paths import subdir
from kvrelay.policy.cost import CodecCost, CostProfile, Link, StoreCost

DECODE_STEPS = 8


def profile_path(model: str, engine: str = "fp32"):
    safe = model.replace("/", "_").replace("+", "_")
    return subdir("profiles") / f"{safe}__{engine}.json"


def _decode_step_s(lm, n_tokens: int) -> float:
    """Median seconds of a one-token forward on a cache of ``n_tokens`` (a decode step)."""
    from kvrelay.agents.agent import Agent
    from kvrelay.bench.relay import context_ids
    from kvrelay.bench.transfer import _prefill

    ids = context_ids(Agent(lm, "sender"), n_tokens)
    _, cache = _prefill(lm.model, ids)
    times = []
    for i in range(DECODE_STEPS):
        t, cache = _prefill(lm.model, [ids[-1]], start=len(ids) + i, cache=cache)
        times.append(t)
    return float(statistics.median(times[1:]))  # the first step warms up


def profile_from_transfer(res: dict, *, model: str, prompt_tokens: int, decode_s_per_token: float,
                          link: Link | None = None, engine: str = "", load_average=()) -> CostProfile:
    """Rates from a ``bench transfer`` result dict (module docstring)."""
    codec_rows = res["codecs"]
    sizes = sorted({c["context_tokens"] for c in codec_rows})
    big = max(sizes)
    first = {c["context_tokens"]: c for c in codec_rows}  # one row per size has the receiver's costs
    xs = [prompt_tokens] + sizes
    ys = [statistics.median(c["prompt_prefill_kv_s"] for c in codec_rows)] + [first[n]["prefill_context_s"]
                                                                                for n in sizes]
    slope, fixed = np.polyfit(np.array(xs, float), np.array(ys, float), 1)
    if fixed < 0:  # a line through the origin when the fit would make the fixed part negative
        slope, fixed = float(np.dot(xs, ys) / np.dot(xs, xs)), 0.0
    if slope < 0:  # timing noise swamped the per-token part (tiny models): a flat cost, said in ``measured``
        slope, fixed = 0.0, float(np.mean(ys))
    raw_at_big = next(c for c in codec_rows if c["context_tokens"] == big)
    codecs = []
    for name in dict.fromkeys(c["codec"] for c in codec_rows):
        mine = [c for c in codec_rows if c["codec"] == name]
        raw = sum(c["raw_bytes"] for c in mine)
        at_big = next(c for c in mine if c["context_tokens"] == big)
        enc = sum(c["compress_s"] + c["pack_s"] for c in mine) / raw
        dec = sum(c["unpack_s"] + c["decompress_s"] + c["cache_build_s"] for c in mine) / raw
        codecs.append(CodecCost(name, at_big["raw_bytes"] / at_big["payload_bytes"], enc, dec,
                                lossless=name in ("raw", "fp32")))
    stores = []
    for store in dict.fromkeys(r["store"] for r in res["rows"]):
        mine = [r for r in res["rows"] if r["store"] == store and r["codec"] == "raw"]
        if mine:
            nb = sum(r["payload_bytes"] for r in mine)
            stores.append(StoreCost(store, sum(r["put_s"] for r in mine) / nb, sum(r["get_s"] for r in mine) / nb))
    return CostProfile(
        model=model, prefill_fixed_s=float(fixed), prefill_s_per_token=float(slope),
        decode_s_per_token=decode_s_per_token, raw_bytes_per_token=raw_at_big["raw_bytes"] / big,
        text_bytes_per_token=raw_at_big["text_bytes"] / big, codecs=tuple(codecs), stores=tuple(stores), link=link,
        fingerprint=res.get("fingerprint", ""), engine=engine, threads=int(res.get("threads", 0)),
        load_average=tuple(load_average),
        measured={"prefill_points": [[x, y] for x, y in zip(xs, ys, strict=True)], "sizes": sizes,
                  "prompt_tokens": prompt_tokens})


def agreement(profile: CostProfile, res: dict, prompt_tokens: int) -> list[dict]:
    """Per codec and size: the profile's break-even beside ``bench transfer``'s measured and closed form."""
    out = []
    for b in res["break_even"]:
        mine = profile.break_even_mbps(b["codec"], b["context_tokens"], prompt_tokens)
        meas = b["measured_mbps"]
        out.append({"codec": b["codec"], "context_tokens": b["context_tokens"], "profile_mbps": mine,
                    "transfer_measured_mbps": meas, "transfer_measured_bound": b["measured"]["bound"],
                    "transfer_closed_form_mbps": b["closed_form_mbps"],
                    "profile_over_measured": (mine / meas) if meas else None})
    return out


def calibrate(lm, sizes: list[int], *, codec_names, stores=("memory", "disk"), repeats: int = 3,
              link: Link | None = None, compare: bool = True, rates_mbit=(10.0, 30.0, 100.0, 1000.0),
              redis_url: str | None = None, progress=None) -> dict:
    """The ``kvrelay calibrate`` dict (docs/json.md): ``profile``, ``break_even`` per codec and size from
    the profile, and (``compare``) ``agreement`` with the measured break-even of the same run."""
    from kvrelay.agents.agent import Agent
    from kvrelay.bench.relay import QUESTION
    from kvrelay.bench.transfer import bench_transfer

    say = progress or (lambda s: None)
    load_before = list(os.getloadavg())
    t0 = time.perf_counter()
    prompt_tokens = len(Agent(lm, "receiver").prompt_ids(QUESTION))
    res = bench_transfer(lm, sizes, stores=list(stores), codec_names=list(codec_names), repeats=repeats,
                         redis_url=redis_url, rates_mbit=rates_mbit, link=compare, bracket_codecs=("raw",),
                         progress=say)
    say("decode step")
    dec = _decode_step_s(lm, max(sizes))
    load_after = list(os.getloadavg())
    prof = profile_from_transfer(res, model=getattr(lm, "name", "?"), prompt_tokens=prompt_tokens,
                                 decode_s_per_token=dec, link=link, engine=getattr(lm, "engine", ""),
                                 load_average=load_after)
    out = {"model": prof.model, "engine": prof.engine, "profile": prof.to_dict(),
           "break_even": [{"codec": c.name, "context_tokens": n,
                           "mbps": prof.break_even_mbps(c.name, n, prompt_tokens)}
                          for n in sorted({r["context_tokens"] for r in res["codecs"]}) for c in prof.codecs],
           "prompt_tokens": prompt_tokens,
           "link_note": res["link_note"] if compare else "link emulation skipped (--no-compare)",
           "load_average_before": load_before, "load_average_after": load_after,
           "elapsed_s": time.perf_counter() - t0}
    if compare:
        out["agreement"] = agreement(prof, res, prompt_tokens)
    out["transfer"] = {k: res[k] for k in ("break_even", "links", "codecs", "rows")}
    return out
