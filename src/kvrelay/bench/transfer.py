"""``kvrelay bench transfer``: what moving a payload costs, per store × codec × context size, against
the prefill it saves — and, over emulated links, the bandwidth below which text relay wins.

Everything is measured in one process on one model, interleaved (each repeat runs every codec
and store in a rotated order), and reported as medians over repeats.

**Store rows** (docs/json.md). One relay = ``encode → put → get → decode``:

* ``encode_s`` — the codec (``codecs.compress``; eviction includes its attention probe);
* ``put_s`` / ``get_s`` — the real store (``transport.stores``: ``MemoryStore``, ``DiskStore``,
  ``RedisStore``) through the payload layer, for every codec alike: ``put_payload`` (the codec's
  output packed to ``kvrelay/1`` with its checksums, then the store writes the bytes) and
  ``get_compressed`` (the store reads the bytes, parsing and digest checks); ``path`` is ``store``;
* ``decode_s`` — ``codecs.decompress`` back to the producer's dtype;
* ``saved_prefill_s`` — the receiver's prefill of the context tokens on the model (what relay
  saves it), measured in the same repeats; ``overhead_fraction = overhead_s / saved_prefill_s``.

**Link rows**: the encoded bytes cross a rate-limited veth link between two network namespaces
(``transport.netem``) at each rate; end to end at the receiver:

* kv:   ``compress + pack + transfer(payload bytes) + unpack + decompress + cache build + prompt prefill``
* text: ``transfer(text bytes) + prefill(context) + prompt prefill``

The **break-even bandwidth** is where they cross: *measured* by interpolating ``kv − text``
linearly in 1/rate between the two measured rates around the sign change (the raw codec is also
sent at half and twice its closed-form break-even, so that change is inside the measured rates), and in *closed form*
``8 (payload_bytes − text_bytes) / (prefill(context) + prompt − kv fixed costs)``. Below it text
is faster. Without namespaces (not root, no iproute2) the link part is skipped and said so; the
closed form is still reported.

**Pipeline over the link**: the end-to-end pipeline speedup across an emulated link is *computed*
from a measured in-process ``bench pipeline`` result (its per-agent relay bytes and times) plus this
run's measured link throughput and wire costs. (A pipeline whose agents really are apart runs with
``bench pipeline --backend process --store redis://...``.)
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvrelay.bench.links import (  # noqa: F401 - closed_form / measured are part of this module's API
    LinkRow,
    bench_links,
    break_evens,
    closed_form_break_even_mbps,
    headline,
    measured_break_even_mbps,
    pipeline_over_link,
    wire_parts,
)
from kvrelay.bench.relay import QUESTION, context_ids
from kvrelay.kv import codecs, wire
from kvrelay.kv.cache import to_cache
from kvrelay.kv.payload import KVPayload

STORES = ("memory", "disk", "redis")
CODECS = ("raw", "fp16", "int8", "int4", "evict:0.2")
RATES_MBIT = (10.0, 30.0, 100.0, 1000.0)
TARGET_OVERHEAD = 0.05  # target: relay overhead <= 5% of the prefill it saves


@dataclass(frozen=True, slots=True)
class StoreRow:
    store: str
    codec: str
    context_tokens: int
    raw_bytes: int  # the payload with K/V as fp32
    payload_bytes: int  # kvrelay/1 bytes of the codec's output (what a byte store holds / a wire carries)
    encode_s: float
    put_s: float
    get_s: float
    decode_s: float
    overhead_s: float  # encode + put + get + decode
    saved_prefill_s: float
    overhead_fraction: float
    # -- beyond the contract --
    path: str  # "store": the codec's output went through the real store (put_payload / get_compressed)
    compression_ratio: float  # raw_bytes / payload_bytes
    put_mbps: float  # payload megabytes (1e6) per second
    get_mbps: float
    repeats: int


# -- timing helpers ------------------------------------------------------------------------------
def _timed(fn: Callable, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def _med(xs) -> float:
    return float(statistics.median(xs))


@torch.inference_mode()
def _prefill(model, ids: list[int], start: int = 0, cache=None):
    """Seconds for one forward of ``ids`` at positions ``start..`` on ``cache`` (a fresh one if None)."""
    from transformers import DynamicCache

    from kvrelay.models.generate import forward_last

    cache = DynamicCache(config=model.config) if cache is None else cache
    ids_t = torch.tensor([ids], dtype=torch.int64)  # (1, q)
    pos = torch.arange(start, start + len(ids), dtype=torch.int64)[None]  # (1, q)
    t0 = time.perf_counter()
    forward_last(model, ids_t, pos, cache, None)
    return time.perf_counter() - t0, cache


def _warm_up(model, payload: KVPayload, ids: list[int], prompt: list[int]) -> None:
    """Each timed code path once on a short prefix, so lazy initialisation is not timed."""
    from kvrelay.kv.transforms import select_tokens

    _, cache = _prefill(model, ids)
    _prefill(model, prompt, start=len(ids), cache=cache)
    try:
        head = select_tokens(payload, range(len(ids)))
    except ValueError:  # sliding-window layers hold only the tail: no short prefix to cut
        return
    _prefill(model, prompt, start=len(ids), cache=to_cache(head, model.config))


# -- the benchmark -------------------------------------------------------------------------------
@contextmanager
def open_bench_stores(stores, redis_url: str | None, disk_dir):
    """The real stores of one run, by name: a fresh ``MemoryStore``, a ``DiskStore`` (in ``disk_dir`` or a
    temporary folder) and a ``RedisStore`` in a namespace of its own (``redis_url`` or a private server)."""
    from kvrelay.transport.redis_server import redis_url_or_private
    from kvrelay.transport.stores import DiskStore, MemoryStore, RedisStore

    for s in stores:
        if s not in STORES:
            raise ValueError(f"unknown store {s!r}; expected some of {STORES}")
    with contextlib.ExitStack() as stack:
        root = Path(disk_dir) if disk_dir is not None else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="kvrelay-transfer-")))
        out = {}
        if "memory" in stores:
            out["memory"] = MemoryStore()
        if "disk" in stores:
            out["disk"] = DiskStore(root / "store")
        if "redis" in stores:
            url = stack.enter_context(redis_url_or_private(redis_url))
            r = out["redis"] = RedisStore(url, namespace=f"kvrelay-bench-{secrets.token_hex(4)}")
            stack.callback(r.close)
            stack.callback(r.clear)
        yield {s: out[s] for s in stores}


def _rotated(xs, r: int) -> list:
    xs = list(xs)
    return xs[r % len(xs):] + xs[:r % len(xs)]


def _through_store(store, comp: codecs.Compressed, t: dict, store_name: str, enc_s: float) -> None:
    """One relay of a codec's output through a real store: put, get (bytes + parse + digests), decode."""
    from kvrelay.transport.stores import get_compressed, put_payload

    key, t_put = _timed(put_payload, store, comp)
    got, t_get = _timed(get_compressed, store, key)
    _, t_dec = _timed(codecs.decompress, got)
    store.delete(key)
    for phase, v in (("encode", enc_s), ("put", t_put), ("get", t_get), ("decode", t_dec)):
        t[(store_name, comp.name, phase)].append(v)


def _through_wire(comp: codecs.Compressed, enc_s: float, t: dict) -> None:
    """The codec's output packed to kvrelay/1 bytes and back in memory (what a link adds to the codec)."""
    parts, t_pack = _timed(wire_parts, comp)
    blob = b"".join(parts)
    back, t_unpack = _timed(lambda b: codecs.Compressed.from_wire(*wire.unpack(b)), blob)
    _, t_dec = _timed(codecs.decompress, back)
    for phase, v in (("compress", enc_s), ("pack", t_pack), ("unpack", t_unpack), ("decompress", t_dec)):
        t[("wire", comp.name, phase)].append(v)


def _receiver_costs(model, payload: KVPayload, ids: list[int], prompt: list[int], t: dict) -> None:
    """The text receiver's prefill (what relay saves), its prompt prefill, and the kv receiver's."""
    t_ctx, cache = _prefill(model, ids)  # what the text receiver re-encodes
    t_q, _ = _prefill(model, prompt, start=len(ids), cache=cache)
    kv_cache, t_build = _timed(to_cache, payload, model.config)
    t_qkv, _ = _prefill(model, prompt, start=len(ids), cache=kv_cache)
    for phase, v in (("context", t_ctx), ("prompt_text", t_q), ("build", t_build), ("prompt_kv", t_qkv)):
        t[("receiver", "", phase)].append(v)


def _measure_size(lm, sender, prompt, n: int, stores: dict, parsed, repeats: int, say):
    """Every repeat of one context size: receiver costs, then each codec through the wire and each store
    (codecs and stores in a rotated order per repeat). Returns (timings, last compressed per codec, ids)."""
    ids = context_ids(sender, n)
    payload = sender.prefill(ids)
    _warm_up(lm.model, payload, ids[:32], prompt)
    t: dict = defaultdict(list)
    last: dict[str, codecs.Compressed] = {}
    for r in range(repeats):
        say(f"{len(ids)} tokens, repeat {r + 1}/{repeats}")
        _receiver_costs(lm.model, payload, ids, prompt, t)
        for c in _rotated(parsed, r):
            comp, t_enc = _timed(codecs.compress, payload, c, model=lm.model)
            last[c.name] = comp
            _through_wire(comp, t_enc, t)
            for s in _rotated(stores, r):
                _through_store(stores[s], comp, t, s, t_enc)
    return t, last, ids


def _store_rows(t: dict, last: dict, stores, n_tokens: int, repeats: int) -> list[StoreRow]:
    saved = _med(t[("receiver", "", "context")])
    rows = []
    for s in stores:
        for name, comp in last.items():
            e, p, g, d = (_med(t[(s, name, k)]) for k in ("encode", "put", "get", "decode"))
            nb = _nbytes(comp)
            rows.append(StoreRow(
                store=s, codec=name, context_tokens=n_tokens, raw_bytes=comp.raw_nbytes, payload_bytes=nb,
                encode_s=e, put_s=p, get_s=g, decode_s=d, overhead_s=e + p + g + d, saved_prefill_s=saved,
                overhead_fraction=(e + p + g + d) / saved, path="store", compression_ratio=comp.raw_nbytes / nb,
                put_mbps=nb / p / 1e6, get_mbps=nb / g / 1e6, repeats=repeats))
    return rows


def _nbytes(comp: codecs.Compressed) -> int:
    return sum(memoryview(p).nbytes for p in wire_parts(comp))


def _codec_rows(t: dict, last: dict, n_tokens: int, text_bytes: int) -> list[dict]:
    """Per codec: the wire costs and the fixed (rate-independent) costs of the kv and text receivers."""
    rc = {k: _med(t[("receiver", "", k)]) for k in ("context", "prompt_text", "build", "prompt_kv")}
    out = []
    for name, comp in last.items():
        w = {k: _med(t[("wire", name, k)]) for k in ("compress", "pack", "unpack", "decompress")}
        kv_fixed = sum(w.values()) + rc["build"] + rc["prompt_kv"]
        out.append({"codec": name, "context_tokens": n_tokens, "raw_bytes": comp.raw_nbytes,
                    "payload_bytes": _nbytes(comp), "text_bytes": text_bytes, **{f"{k}_s": v for k, v in w.items()},
                    "cache_build_s": rc["build"], "prompt_prefill_kv_s": rc["prompt_kv"],
                    "prompt_prefill_text_s": rc["prompt_text"], "prefill_context_s": rc["context"],
                    "kv_fixed_s": kv_fixed, "text_fixed_s": rc["context"] + rc["prompt_text"]})
    return out


def bench_transfer(lm, sizes: list[int], *, stores=STORES, codec_names=CODECS, repeats: int = 3,
                   redis_url: str | None = None, disk_dir: str | os.PathLike | None = None,
                   rates_mbit=RATES_MBIT, link: bool = True, bracket_codecs=("raw",), pipeline: dict | None = None,
                   progress=None) -> dict:
    """The ``bench transfer`` dict (``docs/json.md``): store rows, plus ``links``, ``break_even``, ``codecs``
    and ``pipeline_over_link``. Every codec goes through every real store (``transport.stores``).

    ``bracket_codecs`` also cross the link at half and twice their closed-form break-even, so the
    measured figure is interpolated between two measured rates rather than left as a bound."""
    from kvrelay.agents.agent import Agent

    say = progress or (lambda s: None)
    parsed = [codecs.parse(n) for n in codec_names]  # fail fast on a bad name
    sender = Agent(lm, "sender", role="You are a careful reader.")
    prompt = Agent(lm, "receiver").prompt_ids(QUESTION)
    rows, codec_rows, per_size, links, link_note = [], [], {}, [], ""
    with open_bench_stores(stores, redis_url, disk_dir) as the_stores:
        for n in sizes:
            t, last, ids = _measure_size(lm, sender, prompt, n, the_stores, parsed, repeats, say)
            text = sender.decode(ids).encode("utf-8")  # what the text channel sends instead
            rows += _store_rows(t, last, stores, len(ids), repeats)
            codec_rows += _codec_rows(t, last, len(ids), len(text))
            per_size[len(ids)] = (last, text)
    if link:
        bracket_names = {codecs.parse(b).name for b in bracket_codecs}
        links, link_note = bench_links(per_size, codec_rows, rates_mbit, say, bracket_names)
    breaks = break_evens(codec_rows, links)
    head = headline(breaks)
    res = {
        "rows": [asdict(r) for r in rows],
        "break_even_mbps": head["mbps"],
        # -- beyond the contract ---------------------------------------------------------------
        "break_even_basis": head["basis"],
        "break_even": breaks,
        "links": [asdict(lr) for lr in links],
        "link_note": link_note or ("link emulation skipped (--no-link)" if not link else ""),
        "codecs": codec_rows,
        "model": getattr(lm, "name", "?"),
        "fingerprint": lm.identity.fingerprint,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "target_overhead_fraction": TARGET_OVERHEAD,
        "checks": _checks(rows, max((r.context_tokens for r in rows), default=0)),
        "load_average": list(os.getloadavg()),
    }
    if pipeline is not None and links:
        res["pipeline_over_link"] = pipeline_over_link(pipeline, res)
    return res


def _checks(rows: list[StoreRow], biggest: int) -> dict:
    at = [r for r in rows if r.context_tokens == biggest]
    raw = {r.store: r.overhead_fraction for r in at if codecs.parse(r.codec).lossless}
    int8 = [r.payload_bytes / r.raw_bytes for r in at if r.codec.startswith("int8")]
    return {"context_tokens": biggest,
            "raw_overhead_fraction_by_store": raw,
            "raw_overhead_within_target": all(v <= TARGET_OVERHEAD for v in raw.values()) if raw else None,
            "int8_bytes_fraction_of_fp32": int8[0] if int8 else None,
            "int8_within_30pct": (int8[0] <= 0.30) if int8 else None}


def load_pipeline(path: str | os.PathLike | None) -> dict | None:
    if path is None:
        return None
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None
