"""``kvrelay bench engine``: kvrelay's engine modes next to llama.cpp on the same GGUF, threads and text.

One process, one thread count for both engines, the same token ids: a context of exactly
``context_tokens`` tokens of real prose (the sender reading it), then one question. Per repeat,
in an order that rotates between repeats (so drifting machine load hits every engine alike):

* **text** — a receiver re-reads the context and the question: ``text_ttft_s``; its token rate is
  the prefill rate (``prefill_tokens_per_s``).
* **relay** — the receiver starts from the relayed bytes: kvrelay's kvrelay/1 payload (codec
  ``codec``, unpacked and turned into a cache) or llama.cpp's saved state (restored); it reads the
  question (``relay_ttft_s``) and writes ``new_tokens`` greedy tokens (``decode_tokens_per_s`` over
  the ``new_tokens - 1`` decode steps; the first token is the prefill's argmax).
* **pipeline** — the ``doc5`` workload (five agents in a line over one document), each agent
  writing exactly ``pipeline_tokens`` tokens: kvrelay relaying caches; llama.cpp re-reading the
  text (``handoff="text"``) and restoring the predecessor's state (``handoff="state"``).

Medians of the repeats; the machine's limits (``bench.limits``) are measured in the same run. The
1-minute load is read before every repeat and pipeline run; a reading above the benchmark's own
threads + 0.5 stops the run with ``MachineLoaded`` unless ``allow_load`` (``bench.quiet``), and then
the report labels every figure ``loaded``.
``bench.engine_report`` turns the raw measurements into the report.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kvrelay.agents.agent import Agent
from kvrelay.bench.limits import BANDWIDTH_BYTES, Geometry, measure_limits
from kvrelay.bench.quiet import LoadReader, load1, require_quiet
from kvrelay.bench.relay import QUESTION, context_ids
from kvrelay.kv import wire
from kvrelay.kv.codecs import Compressed, compress
from kvrelay.models.engine import decode_weight_bytes, precisions
from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.workloads import Workload, build_workload

PIPELINE_WORKLOAD = "doc5"
SENDER_ROLE = "You are a careful reader."


@dataclass(frozen=True, slots=True)
class Inputs:
    """What every engine reads: the same token ids."""

    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    stop_ids: frozenset[int]
    new_tokens: int


def make_inputs(lm, context_tokens: int, new_tokens: int, question: str = QUESTION) -> Inputs:
    sender = Agent(lm, "sender", role=SENDER_ROLE)
    receiver = Agent(lm, "receiver")
    ids = context_ids(sender, context_tokens)
    return Inputs(tuple(ids), tuple(receiver.prompt_ids(question)), frozenset(receiver.stop_ids), new_tokens)


# ---- kvrelay ---------------------------------------------------------------------------------------

class KvrelaySide:
    """One engine mode: the sender's payload as relayed bytes, a receiver, and one trial at a time."""

    def __init__(self, lm, mode: str, inputs: Inputs, codec: str):
        self.lm, self.mode, self.inputs, self.codec = lm, mode, inputs, codec
        self.sender = Agent(lm, "sender", role=SENDER_ROLE)
        self.receiver = Agent(lm, "receiver", max_new_tokens=inputs.new_tokens)
        t0 = time.perf_counter()
        payload = self.sender.prefill(list(inputs.context_ids))
        t1 = time.perf_counter()
        self.blob = wire.pack(*compress(payload, codec).to_wire())
        self.sender_prefill_s, self.pack_s = t1 - t0, time.perf_counter() - t1

    def _unpack(self):
        return Compressed.from_wire(*wire.unpack(self.blob)).decompress()

    def check(self) -> dict:
        """Untimed: the greedy answers from the text and from the relayed bytes (also a warm-up)."""
        n = self.inputs.new_tokens
        text = self.receiver.respond(QUESTION, list(self.inputs.context_ids), max_new_tokens=n, min_new_tokens=n)
        relay = self.receiver.respond(QUESTION, self._unpack(), max_new_tokens=n, min_new_tokens=n)
        return {"text_answer_ids": list(text.token_ids), "relay_answer_ids": list(relay.token_ids),
                "relay_identical": text.token_ids == relay.token_ids,
                "text_answer": text.text, "relay_answer": relay.text}

    def trial(self) -> dict:
        n = self.inputs.new_tokens
        text = self.receiver.respond(QUESTION, list(self.inputs.context_ids), max_new_tokens=1)
        t0 = time.perf_counter()
        payload = self._unpack()
        unpack_s = time.perf_counter() - t0
        relay = self.receiver.respond(QUESTION, payload, max_new_tokens=n, min_new_tokens=n)
        return {"text_ttft_s": text.ttft_s, "text_prefill_tokens": text.prefill_tokens,
                "relay_ttft_s": unpack_s + relay.ttft_s, "relay_unpack_s": unpack_s,
                "relay_cache_build_s": relay.cache_build_s, "relay_prefill_s": relay.prefill_s,
                "decode_s": relay.decode_s, "decode_tokens": len(relay.token_ids)}

    def raw(self, trials: list[dict], pipelines: list[dict], check: dict) -> dict:
        from kvrelay.models.engine_auto import cached_entry

        resolved = self.lm.identity.engine
        prefill, decode = precisions(resolved)
        picked = {"auto": cached_entry(self.lm)} if self.mode == "auto" else {}  # the measurements and why
        return {"engine": "kvrelay", "mode": self.mode, "resolved_mode": resolved, "prefill_precision": prefill,
                "decode_precision": decode, **picked, "codec": self.codec, "relay_bytes": len(self.blob),
                "weight_bytes": decode_weight_bytes(self.lm.model), "sender_prefill_s": self.sender_prefill_s,
                "pack_s": self.pack_s, "check": check, "trials": trials, "pipeline": {"kv": pipelines}}


def pipeline_workload(lm, context_tokens: int, tokens: int) -> Workload:
    wl = build_workload(PIPELINE_WORKLOAD, lm.tokenizer, context_tokens)
    return replace(wl, workflow=wl.workflow.with_tokens(tokens, tokens))


def kvrelay_pipeline(lm, wl: Workload) -> dict:
    t = run_workflow(lm, wl.workflow, wl.context, mode="kv")
    return {"handoff": "kv", "total_s": t.wall_s,
            "agents": [{"agent": a.name, "prefill_s": a.prefill_s, "decode_s": a.decode_s, "relay_s": a.relay_s,
                        "decode_tokens": a.decode_tokens, "wall_s": a.wall_s, "relay_bytes": a.relay_bytes,
                        "answer_ids": list(a.token_ids)} for a in t.agents]}


# ---- llama.cpp --------------------------------------------------------------------------------------

def chain_turns(lm, wl: Workload):
    """The pipeline's tokens for a peer: the context as the root reads it, then each agent's own turn."""
    from kvrelay.bench.peers.llamacpp import Turn

    wf = wl.workflow
    if wf.layout != "continue":
        raise ValueError(f"the peer pipeline runs the continue layout, got {wf.layout!r}")
    for prev, spec in zip(wf.agents, wf.agents[1:], strict=False):
        if [e.src for e in wf.incoming(spec.name)] != [prev.name]:
            raise ValueError(f"the peer pipeline runs agents in a line; {spec.name} does not read only {prev.name}")
    agents = [Agent(lm, a.name, a.role) for a in wf.agents]
    ctx = agents[0].encode(agents[0].fmt.user(wl.context))
    turns = [Turn(s.name, tuple(a.prompt_ids(s.prompt)), tuple(a.encode(a.fmt.assistant_end)))
             for s, a in zip(wf.agents, agents, strict=True)]
    return ctx, turns


class PeerSide:
    """llama.cpp on the GGUF kvrelay's weights came from: its state is the relay."""

    def __init__(self, lm, gguf, inputs: Inputs, threads: int):
        from kvrelay.bench.limits import gguf_decode_weight_bytes
        from kvrelay.bench.peers.llamacpp import LlamaCppPeer, make_state

        self.inputs = inputs
        self.peer = LlamaCppPeer(gguf, threads)
        self.state, self.sender_prefill_s, self.save_s = make_state(self.peer, inputs.context_ids)
        self.weight_bytes = gguf_decode_weight_bytes(gguf)
        text = lm.tokenizer.decode(list(inputs.context_ids), skip_special_tokens=False)
        ours = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.tokenization_identical = self.peer.tokenize(text) == list(ours)

    def check(self) -> dict:
        from kvrelay.bench.peers.llamacpp import trial

        n, stops, q = self.inputs.new_tokens, set(self.inputs.stop_ids), list(self.inputs.question_ids)
        self.peer.prefill(list(self.inputs.context_ids) + q)
        text_ids, _ = self.peer.generate(n, stops, n)
        relay_ids = trial(self.peer, self.state, q, n, stops)["answer_ids"]
        return {"text_answer_ids": text_ids, "relay_answer_ids": relay_ids, "relay_identical": text_ids == relay_ids}

    def trial(self) -> dict:
        from kvrelay.bench.peers.llamacpp import trial

        r = trial(self.peer, self.state, self.inputs.question_ids, self.inputs.new_tokens, set(self.inputs.stop_ids))
        r.pop("answer_ids")
        return r

    def raw(self, trials: list[dict], pipelines: dict[str, list[dict]], check: dict) -> dict:
        import gguf as gguf_pkg

        p = self.peer
        return {"engine": "llama.cpp", "mode": gguf_file_type(p.gguf), "version": p.version, "gguf": Path(p.gguf).name,
                "params": p.params, "system_info": p.system_info(), "relay_bytes": self.state.nbytes,
                "weight_bytes": self.weight_bytes, "sender_prefill_s": self.sender_prefill_s,
                "save_s": self.save_s, "tokenization_identical": self.tokenization_identical,
                "gguf_package": getattr(gguf_pkg, "__version__", None), "check": check, "trials": trials,
                "pipeline": pipelines}


class VllmSide:
    """vLLM's CPU build (bf16, automatic prefix caching) on the model's folder, over HTTP on loopback."""

    def __init__(self, lm, folder: Path, name: str, inputs: Inputs, threads: int):
        from kvrelay.bench.peers.vllm import VllmPeer

        self.inputs = inputs
        self.peer = VllmPeer(folder, name, threads).__enter__()
        self.weight_bytes = bf16_weight_bytes(lm.model)

    def close(self) -> None:
        self.peer.__exit__(None, None, None)

    def check(self) -> dict:
        i = self.inputs
        return self.peer.check(i.context_ids, i.question_ids, i.new_tokens)

    def trial(self) -> dict:
        i = self.inputs
        r = self.peer.trial(i.context_ids, i.question_ids, i.new_tokens)
        r.pop("answer_ids")
        return r

    def raw(self, trials: list[dict], pipelines: dict[str, list[dict]], check: dict) -> dict:
        return {"engine": "vllm", "mode": "bf16", "version": self.peer.version, "ready_s": self.peer.ready_s,
                "relay_bytes": 0, "weight_bytes": self.weight_bytes, "check": check, "trials": trials,
                "pipeline": pipelines}


def bf16_weight_bytes(model) -> int:
    """Bytes a one-token forward reads from bf16 weights: every parameter once, the embedding only where it
    is also the head (tied), since a token reads one row of it otherwise."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # shared parameters counted once
    return 2 * (total - (emb.numel() if emb is not head else 0))


def gguf_file_type(path) -> str:
    """The GGUF's declared quantization mix (``general.file_type``), e.g. ``Q4_K_M``."""
    from gguf import GGUFReader, LlamaFileType

    f = GGUFReader(str(path)).fields.get("general.file_type")
    if f is None:
        return "gguf"
    return LlamaFileType(int(f.parts[f.data[0]][0])).name.removeprefix("MOSTLY_")


# ---- the run ----------------------------------------------------------------------------------------

def bench_engine(lms: dict, *, context_tokens: int = 2048, repeats: int = 3, new_tokens: int = 64,
                 pipeline_tokens: int = 64, codec: str = "fp16", peer_gguf=None, pipeline: bool = True,
                 progress=None, array_bytes: int = BANDWIDTH_BYTES, pipeline_modes=None, allow_load: bool = False,
                 load_reader: LoadReader = load1, vllm: tuple[Path, str] | None = None) -> dict:
    """Measure every kvrelay mode in ``lms`` (mode -> loaded model) and, with ``peer_gguf``, llama.cpp.

    ``vllm``: (model folder, model name) — also vLLM's CPU build on the same token ids (``bench.peers.vllm``;
    its "relay" is its prefix cache holding the sender's context, no pipeline).

    ``pipeline_modes``: the kvrelay modes that also run the pipeline (default: every mode).
    ``load_reader``: the 1-minute load now (read before each timed repeat); a reading above the threads
    + 0.5 raises ``MachineLoaded`` unless ``allow_load``.

    Returns the raw measurements (``bench.engine_report.report`` makes the report of them).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    say = progress or (lambda msg: None)
    first = next(iter(lms.values()))
    threads = torch.get_num_threads()

    def reading(when: str) -> float:
        load = load_reader()
        require_quiet(load, threads, allow_load, when)
        return load

    reading("before the run")  # fail before any model time is spent
    inputs = make_inputs(first, context_tokens, new_tokens)
    geometry = Geometry.from_config(first.model.config)
    say("measuring the machine's limits")
    limits = measure_limits(geometry, len(inputs.context_ids), array_bytes=array_bytes)
    sides: dict[str, object] = {}
    try:
        for mode, lm in lms.items():
            say(f"kvrelay {mode}: sender prefill, payload")
            sides[f"kvrelay:{mode}"] = KvrelaySide(lm, mode, inputs, codec)
        if peer_gguf is not None:
            say("llama.cpp: loading the GGUF, sender prefill, state")
            sides["llama.cpp"] = PeerSide(first, peer_gguf, inputs, threads)
        if vllm is not None:
            say("vllm: starting its server (loading and warming up takes minutes)")
            sides["vllm"] = VllmSide(first, *vllm, inputs, threads)
        checks = {}
        for key, side in sides.items():
            say(f"{key}: text and relay answers (untimed)")
            checks[key] = side.check()
        trials: dict[str, list[dict]] = {k: [] for k in sides}
        loads = []
        keys = list(sides)
        for r in range(repeats):
            loads.append(reading(f"before repeat {r + 1}"))
            for key in keys[r % len(keys):] + keys[: r % len(keys)]:
                trials[key].append(sides[key].trial())
                say(f"repeat {r + 1}/{repeats} {key}: text {trials[key][-1]['text_ttft_s']:.2f}s "
                    f"relay {trials[key][-1]['relay_ttft_s']:.2f}s")
        modes = list(lms) if pipeline_modes is None else list(pipeline_modes)
        unknown = sorted(set(modes) - set(lms))
        if unknown:
            raise ValueError(f"pipeline modes {unknown} are not among the measured modes {list(lms)}")
        pipe_lms = {m: lms[m] for m in modes}
        pipes = _pipelines(first, pipe_lms, sides, context_tokens, pipeline_tokens, repeats, say, reading) \
            if pipeline else {}
        raws = []
        for key, side in sides.items():
            mine = pipes.get(key, {})
            raws.append(side.raw(trials[key], mine.get("kv", []), checks[key]) if key.startswith("kvrelay")
                        else side.raw(trials[key], mine, checks[key]))
    finally:
        for side in sides.values():
            if isinstance(side, VllmSide):
                side.close()
    return {"limits": limits.to_dict(), "geometry": asdict(geometry),
            "context_tokens": len(inputs.context_ids), "question_tokens": len(inputs.question_ids),
            "new_tokens": new_tokens, "pipeline_tokens": pipeline_tokens, "pipeline_workload": PIPELINE_WORKLOAD,
            "threads": threads, "repeats": repeats, "codec": codec, "load1_before_repeat": loads,
            "allow_load": allow_load, "engines": raws}


def _pipelines(first, lms: dict, sides: dict, context_tokens: int, tokens: int, repeats: int, say,
               reading) -> dict:
    """Every pipeline variant ``repeats`` times, interleaved: {side key: {handoff: [runs]}}."""
    from kvrelay.bench.peers.llamacpp import pipeline as peer_pipeline

    wl = pipeline_workload(first, context_tokens, tokens)
    jobs = [(f"kvrelay:{m}", "kv", lambda lm=lm: kvrelay_pipeline(lm, wl)) for m, lm in lms.items()]
    if "llama.cpp" in sides:
        ctx, turns = chain_turns(first, wl)
        stops, peer = set(sides["llama.cpp"].inputs.stop_ids), sides["llama.cpp"].peer
        for handoff in ("text", "state"):
            jobs.append(("llama.cpp", handoff,
                         lambda h=handoff: peer_pipeline(peer, ctx, turns, tokens, stops, h)))
    out: dict = {}
    for r in range(repeats):
        for key, handoff, job in jobs[r % len(jobs):] + jobs[: r % len(jobs)]:
            load = reading(f"before pipeline repeat {r + 1} ({key} {handoff})")
            run = job()
            run["load1_before"] = load
            out.setdefault(key, {}).setdefault(handoff, []).append(run)
            say(f"pipeline repeat {r + 1}/{repeats} {key} {handoff}: {run['total_s']:.1f}s")
    return out
