"""The audit of one edge of a user's workflow: ``kvrelay audit --workflow FILE.toml --edge SENDER->RECEIVER``.

Each input line (``{"context": ..., "reference": ...}``, ``reference`` a string or a list of them; an
optional ``id``) runs the workflow of ``workflows.spec`` over its context once per arm. The arm
decides only what RECEIVER gets from SENDER; every other agent runs as written:

* ``kv`` — SENDER's whole-turn cache (the edge is run as a ``kv`` edge whatever the file says);
* ``text_full`` — SENDER's whole turn re-encoded (the text channel: the same tokens);
* ``none`` — nothing from SENDER: RECEIVER reads its own turn only;
* ``kv_mismatched`` — SENDER's whole-turn cache of another input (by context length, the one
  ``seeding.partner_shift(seed)`` places later in run order: the next one under seed 0, another one
  under each seed, as in the task-set audit), cut or extended to exactly the matched cache's length,
  so position and presence are equal; its record names that input (``partner``);
* ``kv_zeroed``, ``kv_random``, ``kv_noise:σ``, ``kv_layers:SPEC``, ``kv_tokens:…``, ``kv_codec:NAME``
  — the matched cache through the same transforms and codecs as the task-set audit (``audit.arms``);
* ``kv_adapter:A`` — another model's cache of SENDER's whole turn, through adapter artefact ``A``
  (``audit.channels``; the artefact names that model, the sharer, and must be made for the audited
  one). The sharer prefills the same turn: its tokens, or with another tokenizer the turn's text
  (special tokens kept) in its own tokens; the receiver reads what the adapter makes of that;
* ``kv_adapter_mismatched:A`` — the sharer's cache of the mismatch partner's turn (the input
  ``kv_mismatched`` takes under that seed), cut or extended to the matched sharer cache's length and
  labelled with its tokens (``channels.relabelled``), through the same adapter: every token the
  receiver and the adapter see is this input's; only the sharer's cache is another's;
* ``kv_variant:NAME:REPAIR``, ``kv_variant_mismatched:NAME:REPAIR`` — the same two with the sharer
  ``BASE+NAME``, a fine-tuned sibling of the audited model, its cache passed through the repair the
  arm names (``channels.open_variant``, ``channels.variant_adapter``), as in the task-set audit.

An adapter whose output holds some layers only (``fuse.layers``) is read by the receiver itself, so its
arm needs the continue layout and a receiver whose own turn no later agent continues from as a cache.
``text_message`` is refused: on an edge SENDER's turn is the message (``text_full`` re-encodes it).

The workflow's final answer (its last agent's) is scored against the reference with ``--score``
(``exact``, ``contains``, ``f1`` from ``audit.tasks.scoring``, or ``python:MODULE:FUNC``, a function
``(answer, references) -> float in [0, 1]``). Agents before RECEIVER run once per input (greedy, so
every arm sees the same upstream turns); a trial whose input does not depend on the seed (everything
but the mismatch partner and the random draws) runs once and is recorded for each seed (``reused``).
A folder made before the partner varied with the seed (``config.json`` without ``seed_design``) is not
resumed. Records have the task-set audit's fields with ``task`` = the edge name, so
``report.rebuild`` gives the same statistics, verdict and HTML report. ``latency_s``, ``prefill_tokens``
and ``relay_bytes`` are RECEIVER's (the arm's transform + its cache build, prefill and decode);
``relay_bytes`` of a sharer arm is the sharer cache's, and its ``sender_s`` adds the sharer's prefill.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvrelay.audit.arms import build_kv, parse_arm
from kvrelay.audit.channels import open_channel, open_variant, relabelled, variant_adapter
from kvrelay.audit.partners import mismatch_partners
from kvrelay.audit.seeding import SEED_DESIGN
from kvrelay.audit.tasks import scoring
from kvrelay.audit.vocab import REGIMES
from kvrelay.core.errors import InvalidInput
from kvrelay.core.jsonl import append_json_lines, read_json_lines
from kvrelay.core.records_file import records_file, unpack_records
from kvrelay.kv.payload import KVPayload
from kvrelay.workflows.executors import InProcessExecutor
from kvrelay.workflows.run import needs_payload, run_workflow
from kvrelay.workflows.spec import Workflow

EDGE_ARMS = ("none", "text_full", "kv", "kv_mismatched", "kv_zeroed")  # the default arms
SCORES = {"exact": scoring.exact_match, "contains": scoring.contains, "f1": scoring.token_f1}
#: arms an edge cannot run, and why
REFUSED_ARMS = {"text_message": "on a workflow edge the sender's turn is the message (text_full re-encodes it); "
                                "text_message asks the sender for a separate note, which a workflow agent "
                                "does not write"}
_PARTIAL_WHY = ("the selection is driven by the receiver's prompt, which on a workflow edge is the receiver's turn "
                "that the workflow builds during the run, after the arm's cache is chosen (the task-set audit "
                "runs kv_partial)")
REFUSED_ARMS |= {"kv_partial": _PARTIAL_WHY, "kv_partial_mismatched": _PARTIAL_WHY}
EDGE_ARM_HELP = ("none, text_full, kv, kv_mismatched, kv_zeroed, kv_random, kv_noise:S, kv_layers:SPEC, kv_tokens:…, "
                 "kv_codec:NAME, kv_adapter:ARTEFACT, kv_adapter_mismatched:ARTEFACT, kv_variant:NAME:REPAIR, "
                 "kv_variant_mismatched:NAME:REPAIR")


@dataclass(frozen=True, slots=True)
class EdgeInput:
    id: str
    context: str
    references: tuple[str, ...]

    def __post_init__(self):
        if not self.context.strip():
            raise ValueError(f"input {self.id}: empty context")
        if not self.references or not all(isinstance(r, str) and r.strip() for r in self.references):
            raise ValueError(f"input {self.id}: reference must be a non-empty string or list of strings")


def load_inputs(path: Path | str) -> list[EdgeInput]:
    """The inputs of a JSONL file; ``InvalidInput`` naming the line that is not ``{"context", "reference"}``."""
    try:
        rows = read_json_lines(path)
    except (OSError, ValueError) as err:
        raise InvalidInput(f"--inputs {path}: {err}", 'one JSON object per line: {"context": ..., "reference": ...}') \
            from None
    out = []
    for i, row in enumerate(rows, 1):
        ref = row.get("reference")
        refs = (ref,) if isinstance(ref, str) else tuple(ref) if isinstance(ref, list) else ()
        try:
            if not isinstance(row.get("context"), str):
                raise ValueError("no string 'context'")
            out.append(EdgeInput(str(row.get("id", i)), row["context"], refs))
        except ValueError as err:
            raise InvalidInput(f"--inputs {path}:{i}: {err}", '{"context": "...", "reference": "..." or [...]}') \
                from None
    if len(out) < 2:
        raise InvalidInput(f"--inputs {path} holds {len(out)} input(s)", "at least 2 (kv_mismatched pairs each "
                           "input with another)")
    if len({x.id for x in out}) != len(out):
        raise InvalidInput(f"--inputs {path}: ids repeat", "a distinct id per line (or none: line numbers)")
    return out


def parse_edge(wf: Workflow, edge: str) -> tuple[str, str]:
    """``"SENDER->RECEIVER"`` -> (sender, receiver), an edge of ``wf`` whose receiver has that one sender."""
    src, sep, dst = edge.partition("->")
    names = [a.name for a in wf.agents]
    if not sep or not src or not dst:
        raise InvalidInput(f"--edge {edge!r}", "SENDER->RECEIVER, two agent names of the workflow")
    ins = wf.incoming(dst) if dst in names else ()
    if not any(e.src == src for e in ins):
        have = ", ".join(f"{e.src}->{e.dst}" for e in wf.edges) or "none"
        raise InvalidInput(f"--edge {edge!r} is not an edge of workflow {wf.name!r}", f"one of: {have}")
    if len(ins) > 1:
        raise InvalidInput(f"--edge {edge!r}: {dst} reads several senders (a fan-in)",
                           "an edge whose receiver has one sender (its whole turn is what the arms replace)")
    return src, dst


def scorer(spec: str) -> Callable[[str, Sequence[str]], float]:
    """``exact`` | ``contains`` | ``f1`` | ``python:MODULE:FUNC`` -> ``score(answer, references)``."""
    if spec in SCORES:
        return SCORES[spec]
    kind, _, rest = spec.partition(":")
    module, _, func = rest.partition(":")
    if kind != "python" or not module or not func:
        raise InvalidInput(f"--score {spec!r}", f"one of {', '.join(SCORES)} or python:MODULE:FUNC")
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as err:
        raise InvalidInput(f"--score {spec!r}: {err}", "python:MODULE:FUNC naming an importable function") from None
    return fn


def check_arms(arms: Sequence[str]) -> tuple[str, ...]:
    for a in arms:
        arm = parse_arm(a)
        if arm.base in REFUSED_ARMS:
            raise InvalidInput(f"--arms {a!r} with --workflow: {REFUSED_ARMS[arm.base]}",
                               f"arms an edge can run: {EDGE_ARM_HELP}")
    return tuple(arms)


def length_matched_ids(n: int, ids: Sequence[int], tail: Sequence[int]) -> list[int]:
    """``ids`` (a whole turn ending with ``tail``, its end-of-turn marker) cut or extended, by repeating its
    body, to exactly ``n`` tokens that still end with ``tail``: a mismatched turn of a matched one's length."""
    body = list(ids[: len(ids) - len(tail)]) or list(ids)
    want = max(n - len(tail), 1)
    while len(body) < want:
        body = body + body
    return (body[:want] + list(tail))[:n]


def check_resume(out: Path | str) -> None:
    """Refuse a folder whose records were made under another seed design (their partners ignore the seed);
    cheap, so the CLI calls it before the model loads."""
    from kvrelay.audit.runner import _records_done

    out = Path(out)
    if not _records_done(records_file(out)):
        return
    cfg = out / "config.json"
    made = json.loads(cfg.read_text()).get("seed_design") if cfg.exists() else None
    if made != SEED_DESIGN:
        raise InvalidInput(f"{out} holds records made under seed design "
                           f"{made or 'an earlier version, whose seeds repeated the same partner'!r}",
                           f"a new --out (this version's seeds vary {SEED_DESIGN!r}: docs/audit.md)")


class _Stop(Exception):  # noqa: N818 - control flow: the prefix run has what it needs
    pass


class _EdgeExecutor:
    """The in-process executor, with the receiver's input replaced by the current arm's and the agents
    before it memoised per input (``prefix`` mode stops at the receiver, keeping what it would read)."""

    def __init__(self, lm, receiver: str, before: set[str]):
        self.inner = InProcessExecutor(lm)
        self.receiver, self.before = receiver, before
        self.memo: dict[str, object] = {}
        self.arm: Callable[[KVPayload, list[int]], tuple[KVPayload | None, list[int]]] | None = None
        self.seen: tuple[KVPayload, list[int]] | None = None
        self.reader_adapter = None  # the receiver's adapter for this run (a partial adapter's arm), else None

    def start(self, wf: Workflow) -> None:
        self.inner.start(wf)  # fresh agents every run: the adapter below never outlives its arm's run
        if self.reader_adapter is not None:
            self.inner.agents[self.receiver].adapter = self.reader_adapter

    def context_ids(self, agent: str, context: str) -> list[int]:
        return self.inner.context_ids(agent, context)

    def turn(self, agent, prompt, base, cache, **kw):
        if agent in self.before:
            if agent not in self.memo:
                self.memo[agent] = self.inner.turn(agent, prompt, base, cache, **kw)
            return self.memo[agent]
        if agent == self.receiver:
            if self.arm is None:
                self.seen = (cache, list(base))
                raise _Stop
            cache, base = self.arm(cache, list(base))
        return self.inner.turn(agent, prompt, base, cache, **kw)

    def release(self, handle) -> None:
        pass


@dataclass
class _Prefix:
    """One input's run up to the receiver: what it reads from the sender, and the memoised turns."""

    payload: KVPayload  # the sender's whole-turn cache
    ids: list[int]  # the same tokens
    memo: dict
    sender_s: float
    shared: dict = field(default_factory=dict)  # channel -> (the sharer's cache of the same turn, its seconds)


class EdgeAudit:
    """Runs every input under every arm and seed into ``out/records.jsonl`` (resumable, like ``AuditRunner``)."""

    def __init__(self, wf: Workflow, edge: str, inputs: list[EdgeInput], score: str, arms: Sequence[str],
                 seeds: Sequence[int], lm, out: Path | str, *, regime: str = "private", progress=None,
                 model: str | None = None, load_sharer: Callable[[str], object] | None = None):
        """``model``: the name ``lm`` was loaded by (default ``lm.name``), whose siblings variant arms load;
        ``load_sharer``: how sharer models are loaded (default ``models.loader.load_model``)."""
        if regime not in REGIMES:
            raise InvalidInput(f"--regime {regime!r}", f"one of {', '.join(REGIMES)}")
        self.src, self.dst = parse_edge(wf, edge)
        self.edge = f"{self.src}->{self.dst}"
        # the edge runs as kv, so the sender always leaves its whole-turn cache for the arms to work from
        self.wf = replace(wf, edges=tuple(replace(e, channel="kv") if (e.src, e.dst) == (self.src, self.dst) else e
                                          for e in wf.edges))
        self.inputs, self.score_spec, self.score = inputs, score, scorer(score)
        self.arms = [parse_arm(a) for a in check_arms(arms)]
        self.seeds, self.lm, self.out, self.regime = tuple(seeds), lm, Path(out), regime
        self.progress = progress or (lambda n: None)
        names = [a.name for a in wf.agents]
        self.ex = _EdgeExecutor(lm, self.dst, set(names[:names.index(self.dst)]))
        self._tail = None
        self._open_channels(model or lm.name, next(a.role for a in wf.agents if a.name == self.src), load_sharer)

    def _open_channels(self, model: str, role: str, load) -> None:
        """The sharers of the adapter and variant arms (``audit.channels``), loaded once, and each variant
        arm's repair; ``InvalidInput`` for an artefact or variant that cannot serve this edge."""
        self.channels: dict = {}
        try:
            for name in dict.fromkeys(a.adapter for a in self.arms if a.adapter):
                self.channels[name] = open_channel(name, self.lm, role, load)
            for v in dict.fromkeys(a.variant for a in self.arms if a.variant):
                ch = open_variant(v, model, self.lm, role, load)
                self.channels[ch.name] = ch
        except (ValueError, FileNotFoundError) as err:  # an AdapterMismatch is typed already and passes
            raise InvalidInput(f"--arms: {err}", "an adapter artefact made for the audited model (artefacts/fuse/) "
                               "or a variant BASE+NAME of it") from None
        self.adapters = {a.name: variant_adapter(a.repair, self.channels[a.channel].agent.lm, self.lm)
                         for a in self.arms if a.variant}
        for a in self.arms:
            if a.channel and getattr(self.adapter(a), "partial", False):
                why = ("the workflow's layout is replace" if self.wf.layout != "continue" else
                       f"{self.dst}'s own turn is continued from as a cache" if needs_payload(self.wf, self.dst)
                       else "")
                if why:
                    raise InvalidInput(f"--arms {a.name!r} on edge {self.edge}: its adapter's output holds some "
                                       f"layers only, which the receiver reads in the continue layout without "
                                       f"passing its own cache on, but {why}", "a full adapter (ridge, fuser), "
                                       "or an edge whose receiver's turn later agents read as text")

    def adapter(self, arm):
        """The adapter a sharer arm's cache goes through: its variant's repair, else its artefact's."""
        return self.adapters.get(arm.name) or self.channels[arm.channel].adapter

    # -- one input ---------------------------------------------------------------------------
    def prefix(self, x: EdgeInput) -> _Prefix:
        self.ex.memo, self.ex.arm = {}, None
        t0 = time.perf_counter()
        try:
            run_workflow(self.ex, self.wf, x.context)
        except _Stop:
            pass
        payload, ids = self.ex.seen
        return _Prefix(payload, ids, dict(self.ex.memo), time.perf_counter() - t0)

    def _end_marker(self) -> list[int]:
        if self._tail is None:
            agent = self.ex.inner.agents[self.src]
            self._tail = agent.encode(agent.fmt.assistant_end)
        return self._tail

    def mismatched(self, mine: _Prefix, partner: _Prefix) -> KVPayload:
        """The sender's cache of ``partner``'s whole turn cut or extended (repeating its body) to exactly
        ``mine``'s length, ending with the end-of-turn marker as a whole turn does."""
        ids = length_matched_ids(mine.payload.num_tokens, partner.ids, self._end_marker())
        agent = self.ex.inner.agents[self.src]
        return replace(agent.prefill(ids), meta=mine.payload.meta)

    # -- the sharer arms (adapter, variant) ---------------------------------------------------
    def _sharer_ids(self, channel: str, ids: Sequence[int]) -> list[int]:
        """The sharer's tokens of the sender's tokens ``ids``: the same ids under one tokenizer, else its
        encoding of their text (special tokens kept, so the chat markers stay markers)."""
        agent = self.channels[channel].agent
        if agent.identity.tokenizer_hash == self.lm.identity.tokenizer_hash:
            return list(ids)
        return agent.encode(self.lm.tokenizer.decode(list(ids), skip_special_tokens=False))

    def shared(self, channel: str, pre: _Prefix) -> tuple[KVPayload, float]:
        """The sharer of ``channel``'s cache of ``pre``'s sender turn and its seconds (once per input)."""
        if channel not in pre.shared:
            t0 = time.perf_counter()
            p = self.channels[channel].agent.prefill(self._sharer_ids(channel, pre.ids))
            pre.shared[channel] = (p, time.perf_counter() - t0)
        return pre.shared[channel]

    def shared_mismatched(self, channel: str, mine: _Prefix, partner: _Prefix) -> KVPayload:
        """The sharer's cache of ``partner``'s sender turn, cut or extended to the length of its cache of
        ``mine``'s and labelled with ``mine``'s tokens and positions (``channels.relabelled``): the control."""
        matched, _ = self.shared(channel, mine)
        tail = self._sharer_ids(channel, self._end_marker())
        ids = length_matched_ids(matched.num_tokens, self._sharer_ids(channel, partner.ids), tail)
        return relabelled(self.channels[channel].agent.prefill(ids), matched)

    def _sharer_input(self, arm, pre: _Prefix, other: KVPayload | None):
        """(receiver cache, base tokens, relay bytes, seconds, sharer seconds) of a sharer arm: the sharer's
        cache of this turn, or the control's ``other``, through the arm's adapter. A partial adapter's
        cache goes as it is, the receiver mapping it (``_EdgeExecutor.reader_adapter``)."""
        sent, sharer_s = self.shared(arm.channel, pre)
        if arm.mismatched_control:
            sent = other
        adapter = self.adapter(arm)
        t0 = time.perf_counter()
        mapped = adapter.adapt(sent, self.lm.identity)
        base = mapped.token_ids[0].tolist()
        if getattr(adapter, "partial", False):
            return sent, base, mapped.nbytes, time.perf_counter() - t0, sharer_s
        return mapped, base, sent.nbytes, time.perf_counter() - t0, sharer_s

    def _arm_input(self, arm, pre: _Prefix, other: KVPayload | None, seed: int):
        """(receiver cache or None, its base tokens, relay bytes, transform seconds, sharer seconds) for ``arm``;
        ``other``: the mismatched cache a control arm sends (the sender's, or for a sharer arm the sharer's)."""
        t0 = time.perf_counter()
        if arm.base == "none":
            return None, [], 0, 0.0, 0.0
        if arm.base == "text_full":
            agent = self.ex.inner.agents[self.src]
            return None, pre.ids, len(agent.decode(pre.ids).encode()), 0.0, 0.0
        if arm.channel:
            return self._sharer_input(arm, pre, other)
        gen = torch.Generator().manual_seed(10_007 * seed + 17)
        p, nbytes = build_kv(arm, pre.payload, other, gen, model=self.lm.model)
        return p, p.token_ids[0].tolist(), nbytes, time.perf_counter() - t0, 0.0

    def run_arm(self, arm, x: EdgeInput, pre: _Prefix, other: KVPayload | None, seed: int) -> dict:
        """One trial: the workflow over ``x`` with RECEIVER reading ``arm``'s input (``other``: the
        mismatched cache of a control arm, ``mismatched`` or ``shared_mismatched``)."""
        cache, base, nbytes, relay_s, sharer_s = self._arm_input(arm, pre, other, seed)
        self.ex.memo = dict(pre.memo)
        self.ex.arm = lambda _cache, _base: (cache, base)
        partial = arm.channel is not None and getattr(self.adapter(arm), "partial", False)
        self.ex.reader_adapter = self.adapter(arm) if partial else None
        try:
            trace = run_workflow(self.ex, self.wf, x.context)
        finally:
            self.ex.reader_adapter = None
        rec = next(a for a in trace.agents if a.name == self.dst)
        answer = trace.final_text
        value = float(self.score(answer, list(x.references)))
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"--score {self.score_spec} returned {value} for input {x.id}; expected a number in [0, 1]")
        return {"task_id": f"{self.edge}/{x.id}", "task": self.edge, "regime": self.regime, "arm": arm.name,
                "seed": seed, "covariates": {"context_tokens": pre.payload.num_tokens}, "answer": answer,
                "gold": list(x.references), "score": value, "prefill_tokens": rec.prefill_tokens,
                "relayed_tokens": rec.relayed_tokens, "relay_bytes": nbytes, "relay_s": relay_s,
                "sender_s": pre.sender_s + sharer_s, "ttft_s": rec.relay_decode_s + rec.prefill_s, "decode_s": rec.decode_s,
                "latency_s": relay_s + rec.relay_decode_s + rec.prefill_s + rec.decode_s, "batch": 1}

    # -- the run -----------------------------------------------------------------------------
    def order(self) -> list[int]:
        return sorted(range(len(self.inputs)), key=lambda i: (len(self.inputs[i].context), i))

    def total_trials(self) -> int:
        return len(self.inputs) * len(self.arms) * len(self.seeds)

    def partners(self) -> dict[int, list[int]]:
        """``{seed: partners}``: input ``i``'s mismatch partner under each seed (``partners.mismatch_partners``)."""
        order = self.order()
        return {s: mismatch_partners(order, s) for s in self.seeds}

    def run(self) -> Path:
        from kvrelay.audit.runner import _records_done

        check_resume(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        done = _records_done(records_file(self.out))
        order = self.order()
        rank = {i: k for k, i in enumerate(order)}
        partners = self.partners()
        needs_other = any(a.needs_mismatch or a.mismatched_control for a in self.arms)
        last_use = {i: k for k, i in enumerate(order)}  # the last run-order place an input's prefix is needed
        if needs_other:
            for ps in partners.values():
                for i, j in enumerate(ps):
                    last_use[j] = max(last_use[j], rank[i])
        cache: dict[int, _Prefix] = {}

        def prefix(j: int) -> _Prefix:
            if j not in cache:
                cache[j] = self.prefix(self.inputs[j])
            return cache[j]

        for k, i in enumerate(order):
            x = self.inputs[i]
            todo = [(a, s) for a in self.arms for s in self.seeds
                    if (f"{self.edge}/{x.id}", a.name, s) not in done]
            if todo:
                self._run_input(x, prefix(i), todo, {s: partners[s][i] for s in self.seeds}, prefix)
            for j in [j for j in cache if last_use[j] <= k]:  # keep only prefixes a later input needs
                del cache[j]
        return records_file(self.out)

    def _run_input(self, x: EdgeInput, pre: _Prefix, todo, partner: dict[int, int], prefix) -> None:
        """``x``'s trials ``todo`` ((arm, seed) pairs), appended to the folder's records (a ``records.jsonl.gz``
        unpacked first: ``core.records_file``); a trial whose input another seed already ran (same arm, and
        for a mismatch arm the same partner; never a random draw) is copied (``reused``)."""
        others: dict[tuple, KVPayload] = {}  # (sharer channel or None, partner index) -> its length-matched cache
        memo: dict[tuple, dict] = {}
        for arm, seed in todo:
            j = partner[seed] if arm.needs_mismatch or arm.mismatched_control else None
            whose = arm.channel if arm.mismatched_control else None  # the sharer's control, or the sender's
            if j is not None and (whose, j) not in others:
                others[(whose, j)] = (self.shared_mismatched(whose, pre, prefix(j)) if whose else
                                      self.mismatched(pre, prefix(j)))
            key = (arm.name, j)
            if not arm.stochastic and key in memo:
                row = dict(memo[key], seed=seed, reused=True)
            else:
                row = self.run_arm(arm, x, pre, others.get((whose, j)), seed)
                if j is not None:
                    row["partner"] = f"{self.edge}/{self.inputs[j].id}"
                memo[key] = row
            append_json_lines(unpack_records(self.out), [row])
            self.progress(1)

    def config(self) -> dict:
        return {"workflow": self.wf.name, "edge": self.edge, "inputs": len(self.inputs), "score": self.score_spec,
                "arms": [a.name for a in self.arms], "seeds": list(self.seeds), "regime": self.regime,
                "seed_design": SEED_DESIGN}


def run_edge_audit(wf: Workflow, edge: str, inputs: list[EdgeInput], score: str, out: Path | str, lm, *,
                   arms: Sequence[str] = EDGE_ARMS, seeds: Sequence[int] = (0,), regime: str = "private",
                   margin: float = 2.8, n_boot: int = 2000, progress=None, command: str = "",
                   model: str | None = None, load_sharer: Callable[[str], object] | None = None) -> dict:
    """Run the edge audit into ``out`` (records, config.json, run.json, summary.json, report.*); the summary.
    ``command``: the command line to add to ``run.json``'s ``commands``; ``model``, ``load_sharer``: as
    ``EdgeAudit`` takes them."""
    from kvrelay.audit.report import rebuild

    audit = EdgeAudit(wf, edge, inputs, score, arms, seeds, lm, out, regime=regime, progress=progress, model=model,
                      load_sharer=load_sharer)
    t0 = time.time()
    audit.run()
    out = Path(out)
    cfg = audit.config()
    prev = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    if prev and prev.get("edge") not in (None, audit.edge):
        raise InvalidInput(f"{out} holds the audit of edge {prev['edge']!r}", "a new --out for another edge")
    (out / "config.json").write_text(json.dumps({**cfg, "model": lm.name}, indent=2) + "\n")
    run = {"model": lm.name, "preset": "workflow", "tasks": [audit.edge], "arms": cfg["arms"], "seeds": cfg["seeds"],
           "limit": {audit.edge: len(inputs)}, **cfg, "fingerprint": lm.identity.fingerprint, "engine": lm.engine,
           "elapsed_s": prev.get("elapsed_s", 0.0) + time.time() - t0,
           "commands": [*prev.get("commands", []), *([command] if command else [])]}
    (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    paths = rebuild(out, margin=margin, n_boot=n_boot)
    return json.loads(Path(paths["summary.json"]).read_text())
