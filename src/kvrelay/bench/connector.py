"""``kvrelay bench connector``: one relayed cache continued by each receiver kvrelay can connect it to.

A sender reads exactly ``context_tokens`` tokens of real prose (``bench.relay.context_ids``) and relays
its payload as kvrelay/1 bytes. The receiver answers one question greedily, ``new_tokens`` at most, from:

* ``text`` — it re-reads the sender's tokens (the baseline every answer is compared with);
* ``dynamic_cache`` — the relayed bytes unpacked, checked (``Agent.check``) and continued through
  transformers' ``DynamicCache`` (``Agent.respond``);
* ``continuous_batching`` — the same payload, checked, written as prefix blocks of transformers'
  continuous-batching engine (``kv.connector``), which then prefills only the rest of the request;
* ``continuous_batching_text`` — that engine re-reading the whole request itself (its own baseline);
* with ``lmcache`` (``bench.peers.lmcache_vllm``: LMCache's cache server and vLLM's CPU build in fp32 with its
  LMCache connector, from vLLM's environment) — ``lmcache_vllm``: the payload, checked, packed as LMCache
  chunks (``kv.lmcache_chunks``) and stored, then vLLM answers the whole request, loading the stored
  chunks instead of prefilling them; ``vllm_text``: vLLM re-reading it (LMCache emptied first). Once,
  untimed, the other direction too: the chunks vLLM stored for the request read back as a payload
  (``lmcache_import``: its largest difference from the sender's K/V and whether kvrelay's answer from it
  equals re-reading).

Every mode sees the same token sequence (the sender's tokens, then the receiver's prompt), so a greedy
answer equal to ``text``'s is the check that the cache was continued, not approximated. TTFT counts what
the receiver does once the bytes are in hand (unpacking, checking, building the cache or writing the
blocks, the prefill of what is left, the first token); the engine's start is a server's and is left out.
Receivers that cannot be connected are named with the reason in ``unavailable`` (``lmcache_vllm``
and ``vllm_text`` without ``lmcache``).

Per repeat the modes run in an order that rotates between repeats, after one untimed warm-up of each;
medians are reported. The 1-minute load is read before every repeat and after the run (``bench.quiet``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrelay.agents.agent import Agent
from kvrelay.bench.quiet import LoadReader, load1, load_status, require_quiet
from kvrelay.bench.relay import QUESTION, context_ids
from kvrelay.core.errors import InvalidInput, PeerUnavailable
from kvrelay.kv import wire
from kvrelay.kv.connector import MAX_BATCH_TOKENS, PAGE_SIZE, continue_in_engine

TEXT, DYNAMIC, ENGINE, ENGINE_TEXT = "text", "dynamic_cache", "continuous_batching", "continuous_batching_text"
MODES = (TEXT, DYNAMIC, ENGINE, ENGINE_TEXT)
LMCACHE_VLLM, VLLM_TEXT = "lmcache_vllm", "vllm_text"
PEER_MODES = (LMCACHE_VLLM, VLLM_TEXT)
ROW_FIELDS = ("mode", "ttft_s", "answer", "answer_equal_to_text", "reused_tokens", "prefilled_tokens")
SENDER_ROLE = "You are a careful reader."


@dataclass(frozen=True, slots=True)
class Setup:
    context_tokens: int = 2048
    new_tokens: int = 16
    repeats: int = 3
    page_size: int = PAGE_SIZE
    max_batch_tokens: int = MAX_BATCH_TOKENS
    question: str = QUESTION

    def __post_init__(self):
        if self.context_tokens < 16 or self.new_tokens < 1 or self.repeats < 1 or self.page_size < 1 \
                or self.max_batch_tokens < 1:
            raise InvalidInput(f"context_tokens={self.context_tokens}, new_tokens={self.new_tokens}, "
                               f"repeats={self.repeats}, page_size={self.page_size}, "
                               f"max_batch_tokens={self.max_batch_tokens}",
                               "context_tokens >= 16 and the others >= 1")


def lmcache_vllm_reason() -> str:
    """Why LMCache into vLLM did not run, when it was not asked for."""
    from kvrelay.bench.peer_servers import lmcache_available

    missing = lmcache_available()
    return (f"not run: {missing}" if missing else
            "not asked for: --lmcache starts LMCache's cache server and vLLM (vLLM's environment, make peers-vllm)")


def _until_stop(tokens, stop: set[int]) -> tuple[int, ...]:
    out = []
    for t in tokens:
        if t in stop:
            break
        out.append(int(t))
    return tuple(out)


def trial(receiver: Agent, blob: bytes, ids: list[int], mode: str, setup: Setup, peer=None) -> dict:
    """One answer in ``mode``: TTFT (unpacking counted), the tokens up to a stop token, engine reuse."""
    n = setup.new_tokens
    if mode in PEER_MODES:
        return _peer_trial(receiver, blob, ids, mode, setup, peer)
    t0 = time.perf_counter()
    if mode == TEXT:
        r = receiver.respond(setup.question, ids, max_new_tokens=n)
        return {"ttft_s": r.ttft_s, "tokens": list(r.token_ids), "reused_tokens": 0, "prefilled_tokens":
                r.prefill_tokens}
    if mode == DYNAMIC:
        p = wire.decode(blob)
        unpack_s = time.perf_counter() - t0
        r = receiver.respond(setup.question, p, max_new_tokens=n)  # checks it
        return {"ttft_s": unpack_s + r.ttft_s, "tokens": list(r.token_ids), "reused_tokens": r.relayed_tokens,
                "prefilled_tokens": r.prefill_tokens}
    prompt = receiver.prompt_ids(setup.question)
    if mode == ENGINE:
        p = receiver.check(wire.decode(blob))
        unpack_s = time.perf_counter() - t0
        e = continue_in_engine(receiver.model, p, prompt, max_new_tokens=n, eos_token_id=sorted(receiver.stop_ids),
                               page_size=setup.page_size, max_batch_tokens=setup.max_batch_tokens)
    else:
        unpack_s = 0.0
        e = continue_in_engine(receiver.model, None, ids + prompt, max_new_tokens=n,
                               eos_token_id=sorted(receiver.stop_ids), page_size=setup.page_size,
                               max_batch_tokens=setup.max_batch_tokens)
    return {"ttft_s": unpack_s + e.ttft_s, "tokens": list(_until_stop(e.tokens, receiver.stop_ids)),
            "reused_tokens": e.reused_tokens, "prefilled_tokens": e.prefilled_tokens, "inject_s": e.inject_s,
            "engine_first_token_s": e.first_token_s}


def _peer_trial(receiver: Agent, blob: bytes, ids: list[int], mode: str, setup: Setup, peer) -> dict:
    """``lmcache_vllm`` / ``vllm_text`` through ``peer`` (``bench.peers.lmcache_vllm.LmcacheVllm``)."""
    prompt = ids + receiver.prompt_ids(setup.question)
    peer.clear()
    export = {"tokens": 0, "pack_s": 0.0, "store_s": 0.0}
    t0 = time.perf_counter()
    if mode == LMCACHE_VLLM:
        export = peer.store(receiver.check(wire.decode(blob)))
    export_s = time.perf_counter() - t0
    r = peer.stream(prompt, setup.new_tokens)
    return {"ttft_s": export_s + r["ttft_s"], "tokens": list(_until_stop(r["answer_ids"], receiver.stop_ids)),
            "reused_tokens": export["tokens"], "prefilled_tokens": len(prompt) - export["tokens"],
            "export_s": export_s, "engine_first_token_s": r["ttft_s"]}


def lmcache_import(receiver: Agent, sender_payload, ids: list[int], setup: Setup, peer) -> dict:
    """The chunks vLLM stored for the whole request, read back as a payload: how far from the sender's K/V,
    and whether kvrelay's answer continuing it equals re-reading (untimed)."""
    prompt = ids + receiver.prompt_ids(setup.question)
    peer.clear()
    peer.stream(prompt, 1)
    got = None
    for _ in range(50):  # vLLM's connector stores after the request, off its critical path
        try:
            got = peer.fetch(ids, sender_payload.meta)
            break
        except (PeerUnavailable, InvalidInput):
            time.sleep(0.2)
    if got is None:
        return {"tokens": 0, "error": "LMCache held no chunk of the request after vLLM answered it"}
    n = got.num_tokens
    diff = max(float((a - b[:, :, :n]).abs().max()) for a, b in
               zip(got.keys + got.values, sender_payload.keys + sender_payload.values, strict=True))
    want = receiver.respond(setup.question, ids, max_new_tokens=setup.new_tokens).token_ids
    r = receiver.respond(setup.question, _extended(receiver, got, ids[n:]), max_new_tokens=setup.new_tokens)
    return {"tokens": n, "max_abs_diff": diff, "answer_equal_to_text": r.token_ids == want}


def _extended(receiver: Agent, p, rest: list[int]):
    return receiver.extend(p, rest) if rest else p


def bench_connector(lm, setup: Setup = Setup(), *, allow_load: bool = False, load_reader: LoadReader = load1,
                    progress: Callable[[str], None] | None = None, lmcache=None) -> dict:
    """Every mode ``setup.repeats`` interleaved times (after an untimed warm-up); the raw runs. ``lmcache``:
    a running ``bench.peers.lmcache_vllm.LmcacheVllm`` on the same model (its two modes join the others)."""
    say = progress or (lambda msg: None)
    threads = torch.get_num_threads()
    loads: list[float] = []

    def reading(when: str) -> None:
        load = load_reader()
        require_quiet(load, threads, allow_load, when)
        loads.append(load)

    reading("before the run")
    sender = Agent(lm, "sender", role=SENDER_ROLE)
    ids = context_ids(sender, setup.context_tokens)
    blob = wire.encode(sender.prefill(ids))
    if lmcache is None:
        modes, unavailable = list(MODES), {m: lmcache_vllm_reason() for m in PEER_MODES}
    else:
        modes, unavailable = [*MODES, *PEER_MODES], {}
    receiver = Agent(lm, "receiver", max_new_tokens=setup.new_tokens)
    imported = lmcache_import(receiver, wire.decode(blob), ids, setup, lmcache) if lmcache is not None else None
    for m in list(modes):  # untimed warm-up; a receiver the engine refuses is named, not run
        try:
            trial(receiver, blob, ids, m, setup, lmcache)
        except InvalidInput as err:
            if m == TEXT or m == DYNAMIC:
                raise
            modes.remove(m)
            unavailable[m] = str(err)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(setup.repeats):
        reading(f"before repeat {r + 1}")
        for m in modes[r % len(modes):] + modes[: r % len(modes)]:
            t = trial(receiver, blob, ids, m, setup, lmcache)
            runs[m].append(t)
            say(f"repeat {r + 1}/{setup.repeats} {m}: TTFT {t['ttft_s']:.3f}s")
    loads.append(load_reader())
    return {"context_tokens": len(ids), "new_tokens": setup.new_tokens, "repeats": setup.repeats,
            "page_size": setup.page_size, "max_batch_tokens": setup.max_batch_tokens, "question": setup.question,
            "payload_bytes": len(blob), "threads": threads, "load1": loads, "allow_load": allow_load,
            "unavailable": unavailable, "runs": runs, "lmcache_import": imported}


def rows(raw: dict, decode: Callable[[list[int]], str]) -> list[dict]:
    """Per mode: median TTFT, the answer (its tokens and text), whether every repeat equals ``text``'s."""
    want = raw["runs"][TEXT][0]["tokens"]
    out = []
    for m, runs in raw["runs"].items():
        out.append({"mode": m, "ttft_s": float(statistics.median(r["ttft_s"] for r in runs)),
                    "answer": decode(runs[0]["tokens"]),
                    "answer_equal_to_text": all(r["tokens"] == want for r in runs),
                    "reused_tokens": runs[0]["reused_tokens"], "prefilled_tokens": runs[0]["prefilled_tokens"],
                    "answer_tokens": runs[0]["tokens"], "ttft_s_each": [r["ttft_s"] for r in runs],
                    **{k: float(statistics.median(r[k] for r in runs))
                       for k in ("inject_s", "export_s", "engine_first_token_s") if k in runs[0]}})
    text_ttft = out[0]["ttft_s"]
    for row in out:
        row["ttft_speedup_vs_text"] = text_ttft / row["ttft_s"] if row["ttft_s"] > 0 else None
    return out


def report(raw: dict, *, model: str, command: str, decode: Callable[[list[int]], str],
           extra: dict | None = None) -> dict:
    """The ``bench connector`` JSON: what ran, the load, ``rows`` (``ROW_FIELDS`` first), ``unavailable``."""
    return {"model": model, "command": command, "context_tokens": raw["context_tokens"],
            "new_tokens": raw["new_tokens"], "repeats": raw["repeats"], "threads": raw["threads"],
            "page_size": raw["page_size"], "max_batch_tokens": raw["max_batch_tokens"],
            "question": raw["question"], "payload_bytes": raw["payload_bytes"],
            "load_average": {"load1": raw["load1"], **load_status(raw["load1"], raw["threads"])},
            "machine": extra or {}, "rows": rows(raw, decode), "unavailable": raw["unavailable"], "raw": raw,
            "lmcache_import": raw.get("lmcache_import")}
