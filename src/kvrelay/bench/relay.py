"""``kvrelay bench relay``: receiver time-to-first-token with a relayed cache vs re-encoding the context.

For each context size, in one process and interleaved (text, kv, kv, text, ...), medians over
repeats:

* ``text_ttft_s``  — the receiver prefills the sender's tokens plus its own prompt.
* ``kv_ttft_s``    — the receiver builds a cache from the payload (copy) and prefills its prompt.
* ``ideal_ttft_speedup`` — text time over the receiver's own prompt prefill with the relayed
  context already in place: what is left if the relay (encode, transfer, cache build) cost nothing.
* ``encode_s``/``decode_s`` — the payload through the ``kvrelay/1`` wire format, in memory.
* ``outputs_identical`` — the greedy answers of both modes are the same tokens.

The run records the machine's 1-minute load before every repeat and after the last
(``load_average``, labelled by ``bench.quiet.load_status``): other work on the cores slows both
sides of each ratio unevenly.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvrelay.agents.agent import Agent
from kvrelay.bench.pipeline import above_ideal
from kvrelay.bench.quiet import LoadReader, load1, repeat_loads
from kvrelay.core.corpus import prose

QUESTION = "In one sentence, what is the main topic of the text above?"


@dataclass(frozen=True, slots=True)
class RelayRow:
    context_tokens: int
    text_ttft_s: float
    kv_ttft_s: float
    ttft_speedup: float
    ideal_ttft_speedup: float
    receiver_prefill_s: float  # the kv receiver's own prompt prefill (cache already built)
    cache_build_s: float
    payload_bytes: int
    encode_s: float
    decode_s: float
    outputs_identical: bool
    text_answer: str
    kv_answer: str
    repeats: int
    speedup_per_repeat: tuple[float, ...] = ()  # text / kv TTFT of each repeat (they ran back to back)
    noise: str | None = None  # set when the speedup beats its ideal (machine load, see bench.pipeline.above_ideal)


def context_ids(agent: Agent, n_tokens: int, offset: int = 0) -> list[int]:
    """Exactly ``n_tokens`` token ids: the sender's role/user wrapper around real prose cut to fit."""
    wrapper = len(agent.reading_ids(""))
    body = agent.encode(prose(offset))
    while len(body) < n_tokens:
        body = body + body
    text = agent.decode(body[: max(n_tokens - wrapper, 1)])
    ids = agent.reading_ids(text)
    return ids[:n_tokens] if len(ids) >= n_tokens else ids


def _wire_roundtrip(payload):
    from kvrelay.kv import wire

    t0 = time.perf_counter()
    blob = wire.encode(payload)
    t1 = time.perf_counter()
    back = wire.decode(blob)
    t2 = time.perf_counter()
    return back, len(blob), t1 - t0, t2 - t1


def bench_one(lm, n_tokens: int, repeats: int = 3, max_new_tokens: int = 16, question: str = QUESTION,
              progress=None, before_repeat: Callable[[], None] | None = None) -> RelayRow:
    """One context size: ``repeats`` interleaved text and kv answers; ``before_repeat`` is called as each
    repeat starts (``bench_relay`` reads the load there)."""
    sender = Agent(lm, "sender", role="You are a careful reader.")
    receiver = Agent(lm, "receiver", max_new_tokens=max_new_tokens)
    ids = context_ids(sender, n_tokens)
    payload = sender.prefill(ids)
    payload, nbytes, enc_s, dec_s = _wire_roundtrip(payload)
    text_t, kv_t, recv_t, build_t, encs, decs = [], [], [], [], [enc_s], [dec_s]
    text_ans = kv_ans = None
    for r in range(repeats):
        if before_repeat:
            before_repeat()
        order = ("text", "kv") if r % 2 == 0 else ("kv", "text")
        for mode in order:
            if mode == "text":
                res = receiver.respond(question, payload.token_ids)
                text_t.append(res.ttft_s)
                text_ans = res.token_ids
            else:
                res = receiver.respond(question, payload)
                kv_t.append(res.ttft_s)
                recv_t.append(res.prefill_s)
                build_t.append(res.cache_build_s)
                kv_ans = res.token_ids
            if progress:
                progress()
        if r:
            _, _, e, d = _wire_roundtrip(payload)
            encs.append(e)
            decs.append(d)
    med = statistics.median
    text_s, kv_s, recv_s = med(text_t), med(kv_t), med(recv_t)
    per_repeat = tuple(t / k for t, k in zip(text_t, kv_t, strict=True))
    return RelayRow(
        context_tokens=payload.num_tokens, text_ttft_s=text_s, kv_ttft_s=kv_s, ttft_speedup=text_s / kv_s,
        ideal_ttft_speedup=text_s / recv_s, receiver_prefill_s=recv_s, cache_build_s=med(build_t),
        payload_bytes=nbytes, encode_s=med(encs), decode_s=med(decs), outputs_identical=text_ans == kv_ans,
        text_answer=receiver.decode(text_ans), kv_answer=receiver.decode(kv_ans), repeats=repeats,
        speedup_per_repeat=per_repeat, noise=above_ideal(text_s / kv_s, text_s / recv_s, list(per_repeat)),
    )


def bench_relay(lm, sizes: list[int], repeats: int = 3, max_new_tokens: int = 16, show_progress: bool = True,
                load: LoadReader = load1) -> dict:
    """The `bench relay` JSON (docs/json.md): one row per context size, and ``load_average``
    ({load1_before_repeat: every size's repeats in order, load1_after, status, limit, max})."""
    from tqdm import tqdm

    threads = torch.get_num_threads()
    rows: list[dict] = []
    before: list[float] = []
    with tqdm(total=len(sizes) * repeats * 2, desc="bench relay", unit="run", disable=not show_progress) as bar:
        for n in sizes:
            bar.set_postfix_str(f"{n} tokens")
            rows.append(asdict(bench_one(lm, n, repeats, max_new_tokens, progress=bar.update,
                                         before_repeat=lambda: before.append(round(load(), 2)))))
    after = round(load(), 2)
    return {"model": lm.name, "fingerprint": lm.identity.fingerprint, "threads": threads,
            "repeats": repeats, "max_new_tokens": max_new_tokens, "rows": rows,
            "load_average": repeat_loads(before, after, threads)}

