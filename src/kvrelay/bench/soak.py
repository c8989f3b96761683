"""``kvrelay bench soak``: producer and consumer processes hammering one store, every payload checked.

Each producer process puts payloads for ``seconds`` (synthetic ``KVPayload``s rebuilt bit for bit
from their key's seed, ``layers`` x 2 KV heads x ``tokens`` x 64 dims, fp16 on the wire) and hands
each key to the consumers over a process queue; each consumer gets the key back from the store,
decodes it (every checksum), rebuilds the payload the key names and compares them bit for bit. A
payload a consumer cannot find is *lost*; one whose bytes are another payload's is *mixed up*.
Latencies are measured around each put and get in the process that makes it; the clock starts
once every process has started.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import queue
import secrets
import time

MAX_PROCS = 16
MAX_SECONDS = 600


def synthetic(seed: int, *, layers: int = 4, tokens: int = 256):
    """The payload a key's seed names: random K/V of a made-up 4-layer model (no model needed)."""
    import torch

    from kvrelay.kv.layout import FULL
    from kvrelay.kv.payload import KVPayload, PayloadMeta
    from kvrelay.models.identity import ModelIdentity, RopeSpec

    ident = ModelIdentity(fingerprint="5" * 64, tokenizer_hash="5" * 64, arch="soak", num_layers=layers,
                          num_kv_heads=2, head_dim=64, layer_types=(FULL,) * layers, sliding_window=None,
                          rope=(RopeSpec(FULL, (1.0,)),))
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(1, 2, tokens, 64, generator=g) for _ in range(2 * layers)]  # (1, H, T, D)
    ids = torch.randint(0, 30000, (1, tokens), generator=g)
    return KVPayload(tuple(kv[:layers]), tuple(kv[layers:]), ids, torch.arange(tokens)[None],
                     torch.ones(1, tokens, dtype=torch.bool),
                     PayloadMeta.from_identity(ident, producer=f"soak-{seed}", created_at=0.0))


def _producer(url: str, run: str, pid: int, seconds: float, go, ready, keys, out, codec: str) -> None:
    from kvrelay.transport.stores import open_store, put_payload

    store = open_store(url)
    synthetic(0)  # imports done before the clock starts
    ready.put(pid)
    go.wait()
    deadline = time.time() + seconds
    lat, n, nbytes = [], 0, 0
    while time.time() < deadline:
        seed = pid * 1_000_000 + n
        p = synthetic(seed)
        t0 = time.perf_counter()
        put_payload(store, p, codec, ttl_s=600, key=f"soak:{run}:{seed}")
        lat.append(time.perf_counter() - t0)
        keys.put(seed)
        n += 1
        nbytes += p.nbytes
    out.put({"role": "producer", "puts": n, "put_s": lat, "payload_bytes": nbytes})


def _consumer(url: str, run: str, producers_done, ready, keys, out, codec: str) -> None:
    import torch

    from kvrelay.core.errors import KVRelayError, PayloadNotFound
    from kvrelay.kv import codecs
    from kvrelay.transport.stores import get_payload, open_store

    store = open_store(url)
    synthetic(0)
    ready.put(-1)
    lat, got, lost, mixed, corrupt = [], 0, 0, 0, 0
    lossless = codecs.parse(codec).lossless
    while True:
        try:
            seed = keys.get(timeout=0.5)
        except queue.Empty:
            if producers_done.is_set():
                break
            continue
        t0 = time.perf_counter()
        try:
            p = get_payload(store, f"soak:{run}:{seed}")
        except PayloadNotFound:
            lost += 1
            continue
        except KVRelayError:  # a corrupt or foreign payload under the key: mixed up
            corrupt += 1
            continue
        lat.append(time.perf_counter() - t0)
        want = synthetic(seed)
        want = want if lossless else codecs.decompress(codecs.compress(want, codec))
        same = (torch.equal(p.token_ids, want.token_ids) and p.meta.producer == want.meta.producer
                and all(torch.equal(a, b) for a, b in zip((*p.keys, *p.values), (*want.keys, *want.values),
                                                          strict=True)))
        got += 1
        mixed += not same
        store.delete(f"soak:{run}:{seed}")
    out.put({"role": "consumer", "gets": got, "lost": lost, "mixed": mixed, "corrupt": corrupt, "get_s": lat})


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_soak(store: str | None, *, producers: int = 2, consumers: int = 2, seconds: float = 10.0,
             codec: str = "fp16") -> dict:
    """Run the soak (a private redis-server on loopback when ``store`` is None) and return its JSON."""
    if not 1 <= producers <= MAX_PROCS or not 1 <= consumers <= MAX_PROCS:
        raise ValueError(f"producers and consumers must be in 1..{MAX_PROCS}")
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"seconds must be in (0, {MAX_SECONDS}]")
    server = None
    if store is None:
        from kvrelay.transport.redis_server import RedisServer

        server = RedisServer().start()
        store = server.url
    from kvrelay.transport.stores import open_store

    shown = open_store(store).url  # the password, if any, redacted
    ctx = mp.get_context("spawn")
    keys, out, ready, done, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    run = secrets.token_hex(4)
    try:
        prods = [ctx.Process(target=_producer, args=(store, run, i, seconds, go, ready, keys, out, codec))
                 for i in range(producers)]
        cons = [ctx.Process(target=_consumer, args=(store, run, done, ready, keys, out, codec)) for _ in range(consumers)]
        for proc in (*prods, *cons):
            proc.start()
        for _ in (*prods, *cons):
            ready.get(timeout=300)  # every process started and imported
        load_before = list(os.getloadavg())
        t0 = time.time()
        go.set()
        results = [out.get(timeout=seconds + 300) for _ in prods]
        done.set()
        results += [out.get(timeout=600) for _ in cons]
        for proc in (*prods, *cons):
            proc.join(timeout=60)
    finally:
        if server is not None:
            server.stop()
    wall = time.time() - t0
    puts = sum(r["puts"] for r in results if r["role"] == "producer")
    put_s = [x for r in results if r["role"] == "producer" for x in r["put_s"]]
    get_s = [x for r in results if r["role"] == "consumer" for x in r["get_s"]]
    gets = sum(r["gets"] for r in results if r["role"] == "consumer")
    nbytes = sum(r["payload_bytes"] for r in results if r["role"] == "producer")
    return {"store": shown, "producers": producers, "consumers": consumers, "seconds": seconds, "codec": codec,
            "wall_s": round(wall, 3), "puts": puts, "gets": gets,
            "lost": sum(r["lost"] for r in results if r["role"] == "consumer"),
            "mixed_up": sum(r["mixed"] + r["corrupt"] for r in results if r["role"] == "consumer"),
            "unconsumed": puts - gets - sum(r["lost"] + r["corrupt"] for r in results if r["role"] == "consumer"),
            "throughput_payloads_per_s": round(gets / wall, 3), "throughput_mb_per_s": round(
                nbytes * (gets / max(1, puts)) / wall / 1e6, 3),
            "payload_bytes": nbytes // max(1, puts),
            "put_p50_ms": _ms(_pct(put_s, 0.5)), "put_p99_ms": _ms(_pct(put_s, 0.99)),
            "get_p50_ms": _ms(_pct(get_s, 0.5)), "get_p99_ms": _ms(_pct(get_s, 0.99)),
            "machine": platform.node(), "load_average": {"before": load_before, "after": list(os.getloadavg())},
            "created_at": time.time()}


def _ms(s: float | None) -> float | None:
    return None if s is None else round(1000 * s, 3)
