"""``kvrelay bench transfer``: what moving a payload costs, per store × codec × context size, against
the prefill it saves — and, over emulated links, the bandwidth below which text relay wins.

Everything is measured in one process on one model, interleaved (each repeat runs every codec
and store in a rotated order), and reported as medians over repeats.

**Store rows** (docs/json.md). One relay = ``encode → put → get → decode``:

* ``encode_s`` — the codec (``codecs.compress``; eviction includes its attention probe);
* ``put_s`` / ``get_s`` — the store's own API (``put_payload`` / ``get``): serialisation to
  ``kvrelay/1``, checksums, writing and reading the bytes, parsing, all inside. Codecs whose output
  is a ``KVPayload`` (raw, fp16, bf16, eviction) go through ``MemoryStore``/``DiskStore``/``RedisStore``
  unchanged. Integer codecs (int8, int4) are not payloads — the stores take ``KVPayload`` only — so
  their bytes (``wire.pack_parts(*compressed.to_wire())``) go the same way by hand: an atomic file
  write + mmap read for disk, chunked pipelined SET/GET for Redis, the object itself for memory.
  Rows say which (``path``: ``store`` or ``bytes``);
* ``decode_s`` — ``codecs.decompress`` back to the producer's dtype;
* ``saved_prefill_s`` — the receiver's prefill of the context tokens on the model (what relay
  saves it), measured in the same repeats; ``overhead_fraction = overhead_s / saved_prefill_s``.

**Link rows**: the encoded bytes cross a rate-limited veth link between two network namespaces
(``relay.netem``) at each rate; end to end at the receiver:

* kv:   ``compress + pack + transfer(payload bytes) + unpack + decompress + cache build + prompt prefill``
* text: ``transfer(text bytes) + prefill(context) + prompt prefill``

The **break-even bandwidth** is where they cross: *measured* by interpolating ``kv − text``
linearly in 1/rate between the two measured rates around the sign change (the raw codec is also
sent at half and twice its closed-form break-even, so that change is inside the measured rates), and in *closed form*
``8 (payload_bytes − text_bytes) / (prefill(context) + prompt − kv fixed costs)``. Below it text
is faster. Without namespaces (not root, no iproute2) the link part is skipped and said so; the
closed form is still reported.

**Pipeline over the link**: ``workflows.run`` has no transport hook, so the end-to-end pipeline
speedup across a link is *computed* from a measured in-process ``bench pipeline`` result (its
per-agent relay bytes and times) plus this run's measured link throughput and wire costs.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kvrelay.bench.relay import QUESTION, context_ids
from kvrelay.kv import codecs, wire
from kvrelay.kv.cache import to_cache
from kvrelay.kv.payload import KVPayload, dtype_name

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
    path: str  # store: through the store's KVPayload API; bytes: the codec's wire bytes by hand
    compression_ratio: float  # raw_bytes / payload_bytes
    put_mbps: float  # payload megabytes (1e6) per second
    get_mbps: float
    repeats: int


@dataclass(frozen=True, slots=True)
class LinkRow:
    codec: str
    context_tokens: int
    rate_mbit: float
    payload_bytes: int
    text_bytes: int
    transfer_s: float  # payload over the link, measured
    text_transfer_s: float  # the context text over the link, measured
    goodput_mbit: float  # payload bits / transfer_s
    kv_s: float  # end to end at the receiver, see the module docstring
    text_s: float
    kv_faster: bool


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


# -- codec output as a payload (when it is one) --------------------------------------------------
def as_payload(c: codecs.Compressed) -> KVPayload | None:
    """The codec's output as a storable ``KVPayload`` (dtype = what travels), or None for int codecs."""
    if c.codec.encoding.kind == "int":
        return None
    t, n = c.tensors, len(c.meta.layer_indices)
    keys = tuple(t[f"layers.{i}.k"] for i in range(n))
    values = tuple(t[f"layers.{i}.v"] for i in range(n))
    return KVPayload(keys, values, t["token_ids"], t["positions"], t["mask"],
                     replace(c.meta, dtype=dtype_name(keys[0].dtype)))


def from_payload(q: KVPayload, like: codecs.Compressed) -> codecs.Compressed:
    """Back from ``as_payload``: the received tensors with the sender's restore dtype."""
    return codecs.Compressed(like.codec, wire.payload_tensors(q), replace(q.meta, dtype=like.meta.dtype),
                             like.raw_nbytes)


def wire_parts(c: codecs.Compressed) -> list:
    return wire.pack_parts(*c.to_wire())


def from_wire_bytes(data) -> codecs.Compressed:
    return codecs.Compressed.from_wire(*wire.unpack(data))


# -- the byte path for codecs that are not payloads ----------------------------------------------
class ByteMover:
    """put/get of a ``Compressed`` on one store kind without a ``KVPayload`` (int codecs)."""

    def __init__(self, kind: str, *, disk_dir: Path | None = None, redis_store=None, chunk_bytes: int = 8 << 20):
        self.kind, self.disk_dir, self.redis, self.chunk_bytes = kind, disk_dir, redis_store, chunk_bytes
        self._mem: dict[str, codecs.Compressed] = {}

    def put(self, key: str, c: codecs.Compressed) -> None:
        if self.kind == "memory":  # objects are shared in-process, like MemoryStore
            self._mem[key] = c
        elif self.kind == "disk":
            wire.atomic_write(self.disk_dir / f"{key}.safetensors", wire_parts(c), fsync=False)
        else:
            pipe = self.redis.client.pipeline(transaction=True)
            chunks = list(_slices(wire_parts(c), self.chunk_bytes))
            for i, ch in enumerate(chunks):
                pipe.set(f"{self.redis.namespace}:b:{key}:{i}", ch)
            pipe.set(f"{self.redis.namespace}:b:{key}", str(len(chunks)))
            pipe.execute()

    def get(self, key: str) -> codecs.Compressed:
        if self.kind == "memory":
            return self._mem[key]
        if self.kind == "disk":
            import mmap

            with open(self.disk_dir / f"{key}.safetensors", "rb") as f, \
                    mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    return from_wire_bytes(view)  # unpack copies tensors out, verifying digests
                finally:
                    view.release()
        n = int(self.redis.client.get(f"{self.redis.namespace}:b:{key}"))
        pipe = self.redis.client.pipeline(transaction=False)
        for i in range(n):
            pipe.get(f"{self.redis.namespace}:b:{key}:{i}")
        return from_wire_bytes(b"".join(pipe.execute()))

    def delete(self, key: str) -> None:
        if self.kind == "memory":
            self._mem.pop(key, None)
        elif self.kind == "disk":
            (self.disk_dir / f"{key}.safetensors").unlink(missing_ok=True)
        else:
            n = int(self.redis.client.get(f"{self.redis.namespace}:b:{key}") or 0)
            self.redis.client.delete(f"{self.redis.namespace}:b:{key}",
                                     *(f"{self.redis.namespace}:b:{key}:{i}" for i in range(n)))


def _slices(parts, size: int):
    """Cut buffers into values of at most ``size`` bytes (big tensors sliced, small runs joined)."""
    run: list = []
    for part in parts:
        mv = memoryview(part).cast("B")
        if mv.nbytes >= 1 << 20:
            if run:
                yield b"".join(run)
                run = []
            for s in range(0, mv.nbytes, size):
                yield mv[s:s + size]
        else:
            run.append(mv)
    if run:
        yield b"".join(run)


# -- break-even math -----------------------------------------------------------------------------
def closed_form_break_even_mbps(payload_bytes: int, text_bytes: int, text_fixed_s: float, kv_fixed_s: float) -> float:
    """Bandwidth (Mbit/s) where ``kv_fixed + payload/bw == text_fixed + text/bw``; inf when kv never pays.

    ``text_fixed_s``: the text receiver's compute (prefill of context + prompt); ``kv_fixed_s``:
    every kv cost but the transfer (codec, wire, cache build, prompt prefill)."""
    gain = text_fixed_s - kv_fixed_s
    extra_bits = 8.0 * (payload_bytes - text_bytes)
    if extra_bits <= 0:
        return 0.0 if gain >= 0 else float("inf")
    if gain <= 0:
        return float("inf")
    return extra_bits / gain / 1e6


def measured_break_even_mbps(rates: list[float], kv_s: list[float], text_s: list[float]) -> dict:
    """Where ``kv − text`` changes sign, interpolated linearly in 1/rate (transfer time ∝ 1/rate).

    Returns ``{"mbps": float | None, "bound": "between" | "below" | "above"}``: "below" = kv was
    faster at every measured rate (break-even under the lowest), "above" = text always faster."""
    pts = sorted(zip(rates, (k - t for k, t in zip(kv_s, text_s, strict=True)), strict=True))
    if not pts:
        return {"mbps": None, "bound": "none"}
    if all(d < 0 for _, d in pts):
        return {"mbps": None, "bound": "below", "lowest_rate_mbit": pts[0][0]}
    if all(d >= 0 for _, d in pts):
        return {"mbps": None, "bound": "above", "highest_rate_mbit": pts[-1][0]}
    for (r1, d1), (r2, d2) in zip(pts, pts[1:], strict=False):
        if d1 >= 0 > d2:  # text faster at r1, kv faster at r2
            x1, x2 = 1.0 / r1, 1.0 / r2
            x = x1 + (0.0 - d1) * (x2 - x1) / (d2 - d1)
            return {"mbps": 1.0 / x, "bound": "between", "rates_mbit": [r1, r2]}
    return {"mbps": None, "bound": "non-monotonic"}


# -- the benchmark -------------------------------------------------------------------------------
@dataclass
class _Samples:
    encode: list
    put: list
    get: list
    decode: list


def bench_transfer(lm, sizes: list[int], *, stores=STORES, codec_names=CODECS, repeats: int = 3,
                   redis_url: str | None = None, disk_dir: str | os.PathLike | None = None,
                   rates_mbit=RATES_MBIT, link: bool = True, bracket_codecs=("raw",), pipeline: dict | None = None,
                   progress=None) -> dict:
    """The ``bench transfer`` dict (docs/json.md) (plus ``links``, ``break_even``, ``codecs``, ``pipeline_over_link``).

    ``bracket_codecs`` also cross the link at half and twice their closed-form break-even, so the
    measured figure is interpolated between two measured rates rather than left as a bound."""
    from kvrelay.agents.agent import Agent
    from kvrelay.transport.redis_server import redis_url_or_private
    from kvrelay.transport.stores import DiskStore, MemoryStore, RedisStore, put_payload

    say = progress or (lambda s: None)
    for s in stores:
        if s not in STORES:
            raise ValueError(f"unknown store {s!r}; expected some of {STORES}")
    parsed = [codecs.parse(n) for n in codec_names]  # fail fast on a bad name
    sender = Agent(lm, "sender", role="You are a careful reader.")
    receiver = Agent(lm, "receiver")
    prompt = receiver.prompt_ids(QUESTION)
    rows, links, breaks, codec_rows, link_note = [], [], [], [], ""
    tmp = tempfile.TemporaryDirectory(prefix="kvrelay-transfer-") if disk_dir is None else None
    root = Path(tmp.name if tmp else disk_dir)
    need_redis = "redis" in stores
    with redis_url_or_private(redis_url if need_redis else "unused://") as url:
        redis_store = RedisStore(url, namespace=f"kvrelay-bench-{secrets.token_hex(4)}") if need_redis else None
        movers = {s: ByteMover(s, disk_dir=root / "bytes", redis_store=redis_store) for s in stores}
        (root / "bytes").mkdir(parents=True, exist_ok=True)
        the_stores = {"memory": MemoryStore(), "disk": DiskStore(root / "store"), "redis": redis_store}
        try:
            per_size = {}
            for n in sizes:
                ids = context_ids(sender, n)
                payload = sender.prefill(ids)
                _warm_up(lm.model, payload, ids[:32], prompt)
                pre, prompt_s, build_s = [], [], []
                samp = {(s, c.name): _Samples([], [], [], []) for s in stores for c in parsed}
                wire_t = {c.name: {"compress": [], "pack": [], "unpack": [], "decompress": []} for c in parsed}
                last: dict[str, codecs.Compressed] = {}
                for r in range(repeats):
                    say(f"{len(ids)} tokens, repeat {r + 1}/{repeats}: prefill")
                    t_ctx, cache = _prefill(lm.model, ids)  # what the text receiver re-encodes
                    t_q, _ = _prefill(lm.model, prompt, start=len(ids), cache=cache)
                    kv_cache, t_build = _timed(to_cache, payload, lm.model.config)
                    t_qkv, _ = _prefill(lm.model, prompt, start=len(ids), cache=kv_cache)
                    del cache, kv_cache
                    pre.append(t_ctx)
                    prompt_s.append((t_q, t_qkv))
                    build_s.append(t_build)
                    order = parsed[r % len(parsed):] + parsed[:r % len(parsed)]
                    for c in order:
                        comp, t_enc = _timed(codecs.compress, payload, c, model=lm.model)
                        last[c.name] = comp
                        parts, t_pack = _timed(wire_parts, comp)
                        blob = b"".join(parts)
                        back, t_unpack = _timed(from_wire_bytes, blob)
                        _, t_dec = _timed(codecs.decompress, back)
                        w = wire_t[c.name]
                        w["compress"].append(t_enc)
                        w["pack"].append(t_pack)
                        w["unpack"].append(t_unpack)
                        w["decompress"].append(t_dec)
                        del blob, back
                        as_p = as_payload(comp)
                        s_order = list(stores[r % len(stores):]) + list(stores[:r % len(stores)])
                        for s in s_order:
                            sm = samp[(s, c.name)]
                            if as_p is not None:
                                st = the_stores[s]
                                key, t_put = _timed(put_payload, st, as_p)
                                got, t_get = _timed(st.get, key)
                                _, t_d = _timed(codecs.decompress, from_payload(got, comp))
                                st.delete(key)
                            else:
                                key = f"{c.name}-{r}"
                                _, t_put = _timed(movers[s].put, key, comp)
                                got, t_get = _timed(movers[s].get, key)
                                _, t_d = _timed(codecs.decompress, got)
                                movers[s].delete(key)
                            del got
                            sm.encode.append(t_enc)
                            sm.put.append(t_put)
                            sm.get.append(t_get)
                            sm.decode.append(t_d)
                saved = _med(pre)
                sizes_b = {c.name: sum(memoryview(p).nbytes for p in wire_parts(last[c.name])) for c in parsed}
                for s in stores:
                    for c in parsed:
                        sm = samp[(s, c.name)]
                        e, p, g, d = _med(sm.encode), _med(sm.put), _med(sm.get), _med(sm.decode)
                        over = e + p + g + d
                        nb = sizes_b[c.name]
                        rows.append(StoreRow(
                            store=s, codec=c.name, context_tokens=len(ids), raw_bytes=last[c.name].raw_nbytes,
                            payload_bytes=nb, encode_s=e, put_s=p, get_s=g, decode_s=d, overhead_s=over,
                            saved_prefill_s=saved, overhead_fraction=over / saved,
                            path="store" if as_payload(last[c.name]) is not None else "bytes",
                            compression_ratio=last[c.name].raw_nbytes / nb, put_mbps=nb / p / 1e6,
                            get_mbps=nb / g / 1e6, repeats=repeats))
                text = sender.decode(ids).encode("utf-8")  # what the text channel sends instead
                text_bytes = len(text)
                t_q = _med([a for a, _ in prompt_s])
                t_qkv = _med([b for _, b in prompt_s])
                t_build = _med(build_s)
                for c in parsed:
                    w = {k: _med(v) for k, v in wire_t[c.name].items()}
                    kv_fixed = w["compress"] + w["pack"] + w["unpack"] + w["decompress"] + t_build + t_qkv
                    codec_rows.append({"codec": c.name, "context_tokens": len(ids), "raw_bytes": last[c.name].raw_nbytes,
                                       "payload_bytes": sizes_b[c.name], "text_bytes": text_bytes,
                                       **{f"{k}_s": v for k, v in w.items()}, "cache_build_s": t_build,
                                       "prompt_prefill_kv_s": t_qkv, "prompt_prefill_text_s": t_q,
                                       "prefill_context_s": saved, "kv_fixed_s": kv_fixed,
                                       "text_fixed_s": saved + t_q})
                per_size[len(ids)] = ({c.name: last[c.name] for c in parsed}, text)
                del payload
            if link:
                bracket_names = {codecs.parse(b).name for b in bracket_codecs}
                links, link_note = _bench_links(per_size, codec_rows, rates_mbit, say, bracket_names)
        finally:
            if redis_store is not None:
                redis_store.clear()
                redis_store.close()
            if tmp is not None:
                tmp.cleanup()
    for cr in codec_rows:
        mine = [lr for lr in links if lr.codec == cr["codec"] and lr.context_tokens == cr["context_tokens"]]
        meas = measured_break_even_mbps([lr.rate_mbit for lr in mine], [lr.kv_s for lr in mine],
                                        [lr.text_s for lr in mine]) if mine else {"mbps": None, "bound": "skipped"}
        breaks.append({"codec": cr["codec"], "context_tokens": cr["context_tokens"],
                       "measured_mbps": meas["mbps"], "measured": meas,
                       "closed_form_mbps": closed_form_break_even_mbps(cr["payload_bytes"], cr["text_bytes"],
                                                                        cr["text_fixed_s"], cr["kv_fixed_s"])})
    headline = _headline(breaks)
    res = {
        "rows": [asdict(r) for r in rows],
        "break_even_mbps": headline["mbps"],
        # -- beyond the contract ---------------------------------------------------------------
        "break_even_basis": headline["basis"],
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


def _bench_links(per_size: dict, codec_rows: list[dict], rates, say, bracket=("raw",),
                 max_transfer_s: float = 300.0) -> tuple[list[LinkRow], str]:
    """Every codec at every rate in ``rates``; the ``bracket`` codecs also at half and twice their
    closed-form break-even (when that is not near a listed rate and the send takes <= ``max_transfer_s``)."""
    from kvrelay.transport import netem

    ok, why = netem.available()
    if not ok:
        return [], f"link emulation skipped: {why}"
    out = []
    fixed = {(cr["codec"], cr["context_tokens"]): cr for cr in codec_rows}
    plan = [(rate, n, name) for rate in rates for n, (comps, _) in per_size.items() for name in comps]
    for n, (comps, _) in per_size.items():  # rates around the closed-form break-even, so it is bracketed
        for name in comps:
            if name not in bracket:
                continue
            cr = fixed[(name, n)]
            cf = closed_form_break_even_mbps(cr["payload_bytes"], cr["text_bytes"], cr["text_fixed_s"], cr["kv_fixed_s"])
            for r in (cf / 2, cf * 2):
                slow = 8 * cr["payload_bytes"] / (r * 1e6) if 0 < r < float("inf") else float("inf")
                near = any(abs(r - x) / x < 0.25 for x in rates) if slow < float("inf") else True
                if not near and slow <= max_transfer_s:
                    plan.append((round(r, 3), n, name))
    with netem.Link() as link:
        for rate in sorted({p[0] for p in plan}):
            link.set_rate(rate)
            for n, (comps, text) in per_size.items():
                todo = [name for r, m, name in plan if r == rate and m == n]
                if not todo:
                    continue
                t_text = link.send(text)
                for name in todo:
                    parts = wire_parts(comps[name])
                    nb = sum(memoryview(p).nbytes for p in parts)
                    say(f"link {rate:g} Mbit/s: {name} at {n} tokens ({nb / 1e6:.1f} MB)")
                    t = link.send(parts)
                    cr = fixed[(name, n)]
                    kv_s, text_s = cr["kv_fixed_s"] + t, cr["text_fixed_s"] + t_text
                    out.append(LinkRow(codec=name, context_tokens=n, rate_mbit=rate, payload_bytes=nb,
                                       text_bytes=len(text), transfer_s=t, text_transfer_s=t_text,
                                       goodput_mbit=8 * nb / t / 1e6, kv_s=kv_s, text_s=text_s, kv_faster=kv_s < text_s))
    note = (f"veth pair between namespaces {link.ns_a} and {link.ns_b} (10.201.0.1/30 -> 10.201.0.2/30), "
            "tc tbf on the sender's egress; no propagation delay (netem unavailable)")
    return out, note


def _headline(breaks: list[dict]) -> dict:
    """The figure for the contract field: raw payload at the largest context, measured if possible."""
    raw = [b for b in breaks if codecs.parse(b["codec"]).lossless]
    if not raw:
        return {"mbps": None, "basis": "no raw codec measured"}
    b = max(raw, key=lambda x: x["context_tokens"])
    if b["measured_mbps"] is not None:
        return {"mbps": b["measured_mbps"], "basis": f"measured, raw payload, {b['context_tokens']} tokens"}
    return {"mbps": b["closed_form_mbps"], "basis": f"closed form, raw payload, {b['context_tokens']} tokens "
                                                    f"(measured: {b['measured']['bound']})"}


def _checks(rows: list[StoreRow], biggest: int) -> dict:
    at = [r for r in rows if r.context_tokens == biggest]
    raw = {r.store: r.overhead_fraction for r in at if codecs.parse(r.codec).lossless}
    int8 = [r.payload_bytes / r.raw_bytes for r in at if r.codec.startswith("int8")]
    return {"context_tokens": biggest,
            "raw_overhead_fraction_by_store": raw,
            "raw_overhead_within_target": all(v <= TARGET_OVERHEAD for v in raw.values()) if raw else None,
            "int8_bytes_fraction_of_fp32": int8[0] if int8 else None,
            "int8_within_30pct": (int8[0] <= 0.30) if int8 else None}


def pipeline_over_link(pipeline: dict, res: dict) -> dict:
    """A measured in-process ``bench pipeline`` result re-costed with every kv hand-off crossing each
    measured link: + wire pack/unpack (this run's raw throughput) + transfer at the measured goodput.
    Text hand-offs send the same tokens as text (bytes per token from this run). Computed, not run."""
    raw_codecs = [c for c in res["codecs"] if codecs.parse(c["codec"]).lossless]
    big = max(raw_codecs, key=lambda c: c["context_tokens"])
    wire_s_per_byte = (big["pack_s"] + big["unpack_s"]) / big["payload_bytes"]
    text_bytes_per_token = big["text_bytes"] / big["context_tokens"]
    out = []
    for rate in sorted({lr["rate_mbit"] for lr in res["links"]}):
        lr = max((x for x in res["links"] if x["rate_mbit"] == rate and codecs.parse(x["codec"]).lossless),
                 key=lambda x: x["payload_bytes"])
        goodput = lr["goodput_mbit"] * 1e6 / 8  # bytes/s
        text_goodput = max(lr["text_bytes"] / lr["text_transfer_s"], 1.0)
        kv_extra = sum(a["kv_relay_bytes"] * wire_s_per_byte + a["kv_relay_bytes"] / goodput
                       for a in pipeline["per_agent"] if a["kv_relay_bytes"])
        text_extra = sum(a["kv_relayed_tokens"] * text_bytes_per_token / text_goodput
                         for a in pipeline["per_agent"] if a["kv_relay_bytes"])
        kv_s, text_s = pipeline["kv_s"] + kv_extra, pipeline["text_s"] + text_extra
        out.append({"rate_mbit": rate, "goodput_mbit": lr["goodput_mbit"], "text_s": text_s, "kv_s": kv_s,
                    "speedup": text_s / kv_s})
    return {"method": "computed: measured in-process pipeline + measured link goodput and wire costs per hand-off",
            "workflow": pipeline.get("workflow"), "context_tokens": pipeline.get("context_tokens"),
            "model": pipeline.get("model"), "in_process_speedup": pipeline["speedup"],
            "hand_offs": sum(1 for a in pipeline["per_agent"] if a["kv_relay_bytes"]),
            "relay_bytes": sum(a["kv_relay_bytes"] for a in pipeline["per_agent"]), "rows": out}


def load_pipeline(path: str | os.PathLike | None) -> dict | None:
    if path is None:
        return None
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None
