"""``kvrelay bench speculative``: speculative decoding from relayed caches next to plain decoding.

One sender reads exactly ``context_tokens`` tokens of real prose with the target model and, for
``relay_draft``, with the draft model too (the draft's payload is relayed beside the target's). The
receiver answers one prompt per workload, writing exactly ``new_tokens`` greedy tokens, in four modes:

* ``text`` — re-reads the context and the prompt, decodes plainly;
* ``relay`` — starts from the relayed bytes (unpacked, turned into a cache), decodes plainly;
* ``relay_lookup`` — as ``relay``, drafts found in the relayed token ids and its own output
  (``models.speculative.PromptLookup``);
* ``relay_draft`` — as ``relay``, drafts written by the draft model from its own relayed cache
  (``agents.draft.DraftModel``).

Workloads: ``quote`` (the receiver quotes the document, as a reviewer citing it does — drafts from
the relayed tokens should be accepted) and ``answer`` (it answers a question in its own words).
Per repeat the modes run in an order that rotates between repeats; medians are reported. Every
mode's tokens are compared with ``text``'s (``outputs_identical``). The 1-minute load is read before
every repeat (``bench.quiet``): a busy machine stops the run unless ``allow_load``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch

from kvrelay.agents.agent import Agent
from kvrelay.agents.draft import DraftModel
from kvrelay.bench.quiet import LoadReader, load1, load_status, require_quiet
from kvrelay.bench.relay import QUESTION, context_ids
from kvrelay.kv import wire
from kvrelay.kv.codecs import Compressed, compress
from kvrelay.models.speculative import PromptLookup, check_draft_lengths

MODES = ("text", "relay", "relay_lookup", "relay_draft")
WORKLOADS = {
    "quote": "Quote the text above word for word, from its first sentence on, without any comment.",
    "answer": QUESTION,
}
ROW_FIELDS = ("workload", "mode", "total_s", "ttft_s", "decode_tokens_per_s", "acceptance", "outputs_identical")
SENDER_ROLE = "You are a careful reader."


@dataclass(frozen=True, slots=True)
class Setup:
    """What the run measures: the prompt set, lengths and the drafters' settings."""

    context_tokens: int = 2048
    new_tokens: int = 64
    repeats: int = 3
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    codec: str = "raw"
    lookup: PromptLookup = PromptLookup()
    num_draft: int = 4
    min_draft: int = 1  # the draft model's fewest tokens per verify forward (the lookup's is in ``lookup``)

    def __post_init__(self):
        if self.repeats < 1 or self.new_tokens < 2 or self.context_tokens < 16:
            raise ValueError(f"expected repeats >= 1, new_tokens >= 2, context_tokens >= 16; got {self.repeats}, "
                             f"{self.new_tokens}, {self.context_tokens}")
        unknown = sorted(set(self.workloads) - set(WORKLOADS))
        if unknown or not self.workloads:
            raise ValueError(f"workloads must be among {list(WORKLOADS)}, got {list(self.workloads)}")
        check_draft_lengths(self.min_draft, self.num_draft)


class Relay:
    """The sender's payloads as relayed bytes (target's, and the draft's beside it)."""

    def __init__(self, target, draft, ids: list[int], codec: str):
        self.blob = wire.pack(*compress(Agent(target, "sender", role=SENDER_ROLE).prefill(ids), codec).to_wire())
        self.draft_blob = None if draft is None else \
            wire.pack(*compress(Agent(draft, "sender", role=SENDER_ROLE).prefill(ids), codec).to_wire())

    @staticmethod
    def unpack(blob: bytes):
        return Compressed.from_wire(*wire.unpack(blob)).decompress()


def trial(target, draft, relay: Relay, ids: list[int], mode: str, prompt: str, setup: Setup) -> dict:
    """One answer in ``mode``: its times (unpacking counted in the TTFT), tokens and draft statistics."""
    n = setup.new_tokens
    receiver = Agent(target, "receiver", max_new_tokens=n)
    t0 = time.perf_counter()
    if mode == "text":
        context, speculate = ids, None
    else:
        context = relay.unpack(relay.blob)
        speculate = None
        if mode == "relay_lookup":
            speculate = setup.lookup
        elif mode == "relay_draft":
            speculate = DraftModel(draft, relay.unpack(relay.draft_blob), setup.num_draft, setup.min_draft)
    unpack_s = time.perf_counter() - t0
    r = receiver.respond(prompt, context, max_new_tokens=n, min_new_tokens=n, speculate=speculate)
    s = r.speculation
    return {"ttft_s": unpack_s + r.ttft_s, "decode_s": r.decode_s, "total_s": unpack_s + r.ttft_s + r.decode_s,
            "tokens": list(r.token_ids), "drafted": s.drafted if s else 0, "accepted": s.accepted if s else 0,
            "verify_forwards": s.verify_forwards if s else len(r.token_ids) - 1}


def bench_speculative(target, draft, setup: Setup = Setup(), *, modes=MODES, allow_load: bool = False,
                      load_reader: LoadReader = load1, progress=None) -> dict:
    """Every mode in ``modes`` on every workload, ``setup.repeats`` interleaved times; the raw runs."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown or "text" not in modes:
        raise ValueError(f"modes must include text and be among {list(MODES)}, got {list(modes)}")
    if "relay_draft" in modes and draft is None:
        raise ValueError("relay_draft needs a draft model")
    say = progress or (lambda msg: None)
    threads = torch.get_num_threads()
    loads = []

    def reading(when: str) -> float:
        load = load_reader()
        require_quiet(load, threads, allow_load, when)
        loads.append(load)
        return load

    reading("before the run")
    ids = context_ids(Agent(target, "sender", role=SENDER_ROLE), setup.context_tokens)
    say("sender: prefill and payloads")
    relay = Relay(target, draft if "relay_draft" in modes else None, ids, setup.codec)
    jobs = [(w, m) for w in setup.workloads for m in modes]
    for w, m in jobs:  # untimed warm-up (and the first allocation of every cache size)
        trial(target, draft, relay, ids, m, WORKLOADS[w], replace(setup, new_tokens=2))
    runs: dict[str, dict[str, list[dict]]] = {w: {m: [] for m in modes} for w in setup.workloads}
    for r in range(setup.repeats):
        reading(f"before repeat {r + 1}")
        for w, m in jobs[r % len(jobs):] + jobs[: r % len(jobs)]:
            t = trial(target, draft, relay, ids, m, WORKLOADS[w], setup)
            runs[w][m].append(t)
            say(f"repeat {r + 1}/{setup.repeats} {w} {m}: total {t['total_s']:.2f}s")
    return {"context_tokens": len(ids), "new_tokens": setup.new_tokens, "repeats": setup.repeats,
            "codec": setup.codec, "threads": threads, "relay_bytes": len(relay.blob),
            "draft_relay_bytes": None if relay.draft_blob is None else len(relay.draft_blob),
            "lookup": {"num_draft": setup.lookup.num_draft, "max_ngram": setup.lookup.max_ngram,
                       "min_ngram": setup.lookup.min_ngram, "min_draft": setup.lookup.min_draft},
            "num_draft": setup.num_draft, "min_draft": setup.min_draft, "load1": loads, "allow_load": allow_load, "runs": runs}


def _median(xs) -> float:
    return float(statistics.median(list(xs)))


def rows(raw: dict) -> list[dict]:
    """Per workload x mode: medians of the repeats, acceptance, identity with ``text``'s tokens."""
    out = []
    for w, by_mode in raw["runs"].items():
        text_tokens = by_mode["text"][0]["tokens"]
        relay = by_mode.get("relay")
        relay_rate = None
        for m, runs in by_mode.items():
            steps = len(runs[0]["tokens"]) - 1  # the first token is the prefill's argmax
            rate = _median(steps / r["decode_s"] for r in runs)
            drafted = sum(r["drafted"] for r in runs)
            row = {"workload": w, "mode": m, "total_s": _median(r["total_s"] for r in runs),
                   "ttft_s": _median(r["ttft_s"] for r in runs), "decode_tokens_per_s": rate,
                   "acceptance": sum(r["accepted"] for r in runs) / drafted if drafted else None,
                   "outputs_identical": all(r["tokens"] == text_tokens for r in runs),
                   "decode_tokens": steps + 1, "total_s_each": [r["total_s"] for r in runs],
                   "verify_forwards": _median(r["verify_forwards"] for r in runs)}
            if m == "relay":
                relay_rate = rate
            out.append(row)
        if relay:
            for row in out:
                if row["workload"] == w:
                    row["decode_speedup_vs_relay"] = row["decode_tokens_per_s"] / relay_rate
    return out


def report(raw: dict, *, target: str, draft: str | None, command: str, extra: dict | None = None) -> dict:
    """The ``bench speculative`` JSON: what ran, the load, ``rows`` (``ROW_FIELDS`` first) and the raw runs."""
    return {"target": target, "draft": draft, "command": command, "threads": raw["threads"],
            "repeats": raw["repeats"], "context_tokens": raw["context_tokens"], "new_tokens": raw["new_tokens"],
            "codec": raw["codec"], "lookup": raw["lookup"], "num_draft": raw["num_draft"],
            "min_draft": raw["min_draft"],
            "relay_bytes": raw["relay_bytes"], "draft_relay_bytes": raw["draft_relay_bytes"],
            "load_average": {"load1": raw["load1"], **load_status(raw["load1"], raw["threads"])},
            "machine": extra or {}, "rows": rows(raw), "raw": raw}
