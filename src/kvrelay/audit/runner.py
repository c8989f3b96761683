"""Paired audit runner: every task under every arm, same seeds, resumable, one JSONL record per trial.

Protocol (stated once):

* Seeds vary something (``audit.seeding``): a multiple-choice task's option order (the answer's
  slot balanced across seeds), the mismatch partner, and with ``temperature`` > 0 the receiver's
  sampling draw. Each record says what its seed showed: ``option_order`` (original option index
  per slot), ``partner`` (the mismatch partner's task id), ``temperature``.
* The sender reads each task's context once per distinct text (once per task when the seed does
  not change it); every cache arm starts from that payload. Tasks run in batches of similar
  length; the mismatched payload of a task is the reading of the task ``partner_shift(seed)``
  places after it in run order (the next one under seed 0, as in the paper), as that seed shows
  it, cut or extended with further real contexts to *exactly* the matched payload's length, with
  the same wrapper tokens. Its cache is reused from the partner's own payload when it was read.
* Adapter arms (``kv_adapter:NAME``, ``audit.channels``): the sharer model of artefact NAME reads
  each task's context with the sender's role, once per task; ``kv_adapter_mismatched:NAME`` gets
  its length-matched reading of the partner task (the same shift), labelled with the matched
  task's tokens. ``relay_bytes`` is the sharer payload's size; ``sender_s`` the sharer's reading;
  the adapter's own work is part of ``relay_s``. Variant arms (``kv_variant:NAME:REPAIR``) read the
  same way with the sibling ``BASE+NAME`` as sharer, once per variant whatever the repairs, and its
  cache goes through each arm's repair (its time is in ``relay_s``).
* Greedy decoding (``temperature`` 0): a trial whose input is the same under two seeds (same
  text shown, same partner, no random draw) gives the same answer; it is computed once and
  recorded for each seed (``reused``). Seeds also drive the random draws and the arm order; the
  statistics bootstrap over tasks (clusters, all their seeds together), so repeated seeds never
  inflate the evidence and varied ones add the within-task variation they create.
* Tasks run in batches (one padded forward per arm); arm order is rotated per batch and seed
  (counterbalanced). Latencies of a batched trial are the batch's time divided by its rows, the
  same accounting for every arm.
* ``latency_s`` = relay build + receiver prefill + receiver decode (+ the sender's decode for
  ``text_message``). ``relay_bytes`` = payload bytes for cache arms, UTF-8 bytes of the text for
  text arms, 0 for ``none``. ``prefill_tokens`` = tokens the receiver prefilled.
* Resumable: records already in ``records.jsonl`` (same task, arm, seed) are skipped; a folder holding
  ``records.jsonl.gz`` instead is read as well and unpacked before its first new trial is appended
  (``core.records_file``). A run may
  add task sets, arms or seeds to a folder; it must keep the model (fingerprint), the batch size,
  the message length, the temperature, the seed design (``seeding.SEED_DESIGN``) and each set's
  task count, since those decide which tasks share a batch, what a seed shows and who is whose
  mismatch partner (``AuditResumeMismatch`` otherwise). ``config.json`` holds
  the union of what ran, with each set's task count under ``sets``.
* A task set may carry its own cap: ``squad:160`` runs the first 160 tasks of SQuAD's fixed
  order whatever ``limit`` says.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvrelay.agents.agent import Agent
from kvrelay.audit.arms import Arm, build_kv, parse_arm
from kvrelay.audit.channels import open_channel, open_variant, relabelled, variant_adapter
from kvrelay.audit.config import AuditConfig, split_task_spec  # noqa: F401 (re-exported)
from kvrelay.audit.partners import mismatch_partners, run_order
from kvrelay.audit.seeding import SEED_DESIGN, row_seed, seeded
from kvrelay.audit.tasks import Task, load_tasks, score
from kvrelay.audit.vocab import PARTIAL_ARMS
from kvrelay.core.errors import KVRelayError
from kvrelay.core.jsonl import append_json_lines, resume_json_lines
from kvrelay.core.records_file import records_engine, records_file, unpack_records
from kvrelay.kv.payload import KVPayload
from kvrelay.kv.transforms import select_tokens

SENDER_ROLE = "You are the reader. Study the material below carefully; a colleague will ask about it."
RECEIVER_ROLE = "You are the answerer. Answer briefly and exactly."
MESSAGE_PROMPT = ("Write a short note for a colleague who must answer the question below without seeing the "
                  "material. Include every fact they need.\n\n{question}")
MAX_NEW = {"qa_success": 16, "exact_match": 16, "token_f1": 16, "contains": 16, "choice_letter": 6,
           "yes_no": 4, "final_number": 160}


class AuditResumeMismatch(KVRelayError, ValueError):
    """A run was asked to continue a folder whose records were made under different settings."""


@dataclass
class _TaskState:
    task: Task
    index: int
    payload: KVPayload
    sender_s: float
    mismatched: KVPayload | None = None
    shared: dict = field(default_factory=dict)  # channel -> (sharer payload, sharer seconds, mismatched or None)
    order: tuple[int, ...] | None = None  # option order this seed shows (``seeding.seeded``), None if unchanged
    partner: str | None = None  # task id of the mismatch partner under this seed


def _records_done(path: Path) -> set[tuple[str, str, int]]:
    """(task id, arm, seed) of every record in ``path`` (``core.jsonl.resume_json_lines``: a last line cut
    short by a killed run is dropped and that trial runs again). Any other unreadable line is an error
    naming its number."""
    try:
        rows = resume_json_lines(path)
    except ValueError as err:
        raise AuditResumeMismatch(f"{err}: not an audit record; fix or remove that line to resume") from None
    done: set[tuple[str, str, int]] = set()
    for i, r in enumerate(rows, 1):
        try:
            done.add((r["task_id"], r["arm"], int(r["seed"])))
        except (KeyError, TypeError, ValueError) as err:
            raise AuditResumeMismatch(f"{path}: record {i}: not an audit record ({err}); fix or remove it to "
                                      "resume") from None
    return done


def wrapper_ids(agent: Agent) -> tuple[list[int], list[int]]:
    """The tokens ``agent`` reads before and after a context's text (role as system prompt, user turn)."""
    user_head, _, user_tail = agent.fmt.user_tpl.partition("{text}")
    return agent.system_ids() + agent.encode(user_head), agent.encode(user_tail)


def length_matched(agent: Agent, tasks: list[Task], j: int, length: int, partner: KVPayload | None = None) -> KVPayload:
    """``agent``'s reading of task ``j`` (extended with ``j + 1``'s, ...), cut to exactly ``length`` tokens,
    same wrapper: a mismatched payload of the same length as a matched one.

    With ``partner`` (task ``j``'s own payload) the cache is reused: a prefix of a causal cache is
    the exact cache of that prefix, so only the wrapper tail (and any extension) is prefilled.
    """
    head, tail = wrapper_ids(agent)
    want = length - len(head) - len(tail)
    if partner is not None and want > 0:
        have = partner.num_tokens - len(head) - len(tail)  # partner's own body tokens
        try:
            prefix = select_tokens(partner, list(range(len(head) + min(want, have))))
        except ValueError:  # sliding-window layers no longer hold the early slots: prefill instead
            prefix = None
        if prefix is not None:
            extra: list[int] = []
            k = j
            while len(extra) < want - have:
                k = (k + 1) % len(tasks)
                extra += agent.encode("\n\n" + tasks[k].context)
            return agent.extend(prefix, extra[:max(want - have, 0)] + tail)
    body: list[int] = []
    k = j
    while len(body) < want:
        body += agent.encode(tasks[k].context + "\n\n")
        k = (k + 1) % len(tasks)
    ids = head + body[:max(want, 0)] + tail
    return agent.prefill(ids[:length])


class AuditRunner:
    """Runs an ``AuditConfig`` into ``out_dir/records.jsonl``; stateless between runs except that file."""

    def __init__(self, cfg: AuditConfig, lm, out_dir: Path, progress: Callable[[int], None] | None = None,
                 load_sharer: Callable[[str], object] | None = None):
        self.cfg, self.lm, self.out = cfg, lm, Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.sender = Agent(lm, "sender", role=SENDER_ROLE)
        self.receiver = Agent(lm, "receiver", role=RECEIVER_ROLE)
        self.arms = [parse_arm(a) for a in cfg.arms]
        names = list(dict.fromkeys(a.adapter for a in self.arms if a.adapter))
        self.channels = {n: open_channel(n, lm, SENDER_ROLE, load_sharer) for n in names}  # adapter arms' sharers
        for v in dict.fromkeys(a.variant for a in self.arms if a.variant):  # variant arms' siblings
            ch = open_variant(v, cfg.model, lm, SENDER_ROLE, load_sharer)
            self.channels[ch.name] = ch
        self.adapters = {a.name: variant_adapter(a.repair, self.channels[a.channel].agent.lm, lm)
                         for a in self.arms if a.variant}
        self.progress = progress or (lambda n: None)
        self.versions = {"kvrelay": _version(), "torch": torch.__version__, "python": platform.python_version(),
                         "model_fingerprint": lm.identity.fingerprint, "engine": lm.identity.engine}
        self._memo: dict[tuple[str, str], dict] = {}

    # -- payloads -----------------------------------------------------------------------------
    def _mismatched(self, tasks: list[Task], j: int, length: int, partner: KVPayload | None = None) -> KVPayload:
        """The sender's length-matched reading of task ``j`` (``length_matched``)."""
        return length_matched(self.sender, tasks, j, length, partner)

    # -- one batch ----------------------------------------------------------------------------
    def _contexts(self, arm: Arm, states: list[_TaskState], seed: int) -> tuple[list, list[int], float]:
        """Receiver contexts for ``arm``, their relay bytes, and any sender-side seconds it cost."""
        gen = torch.Generator().manual_seed(10_007 * seed + 17)
        if arm.base == "none":
            return [None] * len(states), [0] * len(states), 0.0
        if arm.base == "text_full":
            ctx = [s.payload.token_ids for s in states]
            return ctx, [len(s.task.context.encode()) for s in states], 0.0
        if arm.base == "text_message":
            prompts = [MESSAGE_PROMPT.format(question=s.task.prompt) for s in states]
            t0 = time.perf_counter()
            notes = self.sender.respond_batch(prompts, [s.payload for s in states],
                                              max_new_tokens=self.cfg.message_tokens)
            spent = time.perf_counter() - t0
            return [n.text for n in notes], [len(n.text.encode()) for n in notes], spent
        if arm.channel:
            adapter = self._adapter(arm)
            sent = [s.shared[arm.channel][2 if arm.mismatched_control else 0] for s in states]
            if getattr(adapter, "partial", False):  # some layers only: the receiver maps each row (``_run_arm``)
                return sent, [adapter.adapt(p, self.lm.identity).nbytes for p in sent], 0.0
            return [adapter.adapt(p, self.lm.identity) for p in sent], [p.nbytes for p in sent], 0.0
        out, sizes = [], []
        for s in states:
            q = self.receiver.prompt_ids(s.task.prompt) if arm.base in PARTIAL_ARMS else None
            p, nbytes = build_kv(arm, s.payload, s.mismatched, gen, model=self.lm.model, question_ids=q)
            out.append(p)
            sizes.append(nbytes)
        return out, sizes, 0.0

    def _adapter(self, arm: Arm):
        """The adapter of a channel arm: its variant repair, else its channel's."""
        return self.adapters.get(arm.name) or self.channels[arm.channel].adapter

    def _partial_adapter(self, arm: Arm):
        """The arm's adapter when its output holds some layers only (``fuse.layers``), else None."""
        adapter = self._adapter(arm) if arm.channel else None
        return adapter if getattr(adapter, "partial", False) else None

    def _run_arm(self, arm: Arm, states: list[_TaskState], seed: int, max_new: int) -> list[dict]:
        t0 = time.perf_counter()
        contexts, sizes, sender_extra = self._contexts(arm, states, seed)
        relay_s = time.perf_counter() - t0 - sender_extra
        prompts = [s.task.prompt for s in states]
        partial = self._partial_adapter(arm)
        temp = self.cfg.temperature
        if partial is None:
            seeds = [row_seed(seed, s.task.id, arm.name) for s in states] if temp > 0 else None
            responses = self.receiver.respond_batch(prompts, contexts, max_new_tokens=max_new, temperature=temp,
                                                    seeds=seeds)
        elif temp > 0:
            raise ValueError(f"{arm.name}: a cache for some layers only is read greedily, one row at a time; "
                             "run it with temperature 0")
        else:  # a cache for some layers only is read one row at a time (no padded batch)
            reader = Agent(self.lm, "receiver", role=RECEIVER_ROLE, adapter=partial)
            responses = [reader.respond(p, c, max_new_tokens=max_new) for p, c in zip(prompts, contexts, strict=True)]
        B = len(states)
        per = 1 if partial is not None else B  # a batched response's times are the whole batch's
        rows = []
        for s, r, nbytes in zip(states, responses, sizes, strict=True):
            rows.append({
                "task_id": s.task.id, "task": s.task.task, "regime": s.task.regime, "arm": arm.name, "seed": seed,
                "covariates": s.task.covariate_dict(), "answer": r.text, "gold": list(s.task.answers),
                "score": score(s.task, r.text), "prefill_tokens": r.prefill_tokens, "relayed_tokens": r.relayed_tokens,
                "relay_bytes": nbytes, "relay_s": relay_s / B,
                "sender_s": (s.shared[arm.channel][1] if arm.channel else s.sender_s) + sender_extra / B,
                "ttft_s": r.ttft_s / per, "decode_s": r.decode_s / per,
                "latency_s": (relay_s + sender_extra) / B + (r.ttft_s + r.decode_s) / per, "batch": per,
            })
            if s.order is not None:
                rows[-1]["option_order"] = list(s.order)
            if arm.needs_mismatch or arm.mismatched_control:
                rows[-1]["partner"] = s.partner
            if temp > 0:
                rows[-1]["temperature"] = temp
        return rows

    def read_batch(self, tasks: list[Task], batch: list[int], partners: list[int],
                   readings: dict | None = None) -> list[_TaskState]:
        """The sender reads each task of ``batch`` (indices into ``tasks``); with a mismatch arm, each
        state also gets its length-matched mismatched payload from task ``partners[i]``.

        ``readings`` (``{(reader, task id, text): (payload, seconds)}``) keeps the readings of earlier
        seeds: a text a seed shows unchanged is not read again."""
        readings = {} if readings is None else readings
        states = []
        for i in batch:
            p, secs = self._reading(readings, "sender", tasks[i], self.sender.read)
            states.append(_TaskState(tasks[i], i, p, secs, partner=tasks[partners[i]].id))
        if any(a.needs_mismatch for a in self.arms):
            for st in states:
                j = partners[st.index]
                read = readings.get(("sender", tasks[j].id, tasks[j].context))
                st.mismatched = self._mismatched(tasks, j, st.payload.num_tokens, read and read[0])
        for name, ch in self.channels.items():
            self._share(name, ch, tasks, states, partners, readings)
        return states

    @staticmethod
    def _reading(readings: dict, reader: str, task: Task, read) -> tuple[KVPayload, float]:
        """``read(task.context)`` and its seconds, from ``readings`` when this text was read already."""
        key = (reader, task.id, task.context)
        if key not in readings:
            t0 = time.perf_counter()
            p = read(task.context)
            readings[key] = (p, time.perf_counter() - t0)
        return readings[key]

    def _share(self, name: str, ch, tasks: list[Task], states: list[_TaskState], partners: list[int],
               readings: dict) -> None:
        """The sharer of channel ``name`` reads each task; its length-matched reading of the partner for the control."""
        for st in states:
            p, secs = self._reading(readings, name, st.task, ch.read)
            st.shared[name] = (p, secs, None)
        if any(a.mismatched_control and a.channel == name for a in self.arms):
            for st in states:
                p, secs, _ = st.shared[name]
                j = partners[st.index]
                read = readings.get((name, tasks[j].id, tasks[j].context))
                other = length_matched(ch.agent, tasks, j, p.num_tokens, read and read[0])
                st.shared[name] = (p, secs, relabelled(other, p))

    def run_set(self, name: str, done: set, sink, limit: int | None = None) -> None:
        tasks = load_tasks(name, limit=limit, seed=0)
        if len(tasks) < 2:
            raise ValueError(f"task set {name!r} has {len(tasks)} task(s); the mismatched arm needs at least 2")
        max_new = MAX_NEW.get(tasks[0].scorer, 16)
        bs = self.cfg.batch_size
        order = run_order(tasks)  # by length, which no seed changes (a reordering keeps the characters)
        views = {s: [seeded(t, s) for t in tasks] for s in self.cfg.seeds}  # (task as seed s shows it, order)
        partners = {s: mismatch_partners(order, s) for s in self.cfg.seeds}
        for b0 in range(0, len(tasks), bs):
            batch = order[b0:b0 + bs]
            todo = {(tasks[i].id, a.name, s) for i in batch for a in self.arms for s in self.cfg.seeds} - done
            if not todo:
                continue
            readings: dict = {}  # this batch's readings, shared by the seeds that show the same text
            for k, seed in enumerate(self.cfg.seeds):
                if not any(key[2] == seed for key in todo):
                    continue
                shown = [t for t, _ in views[seed]]
                states = self.read_batch(shown, batch, partners[seed], readings)
                for st in states:
                    st.order = views[seed][st.index][1]
                rot = (b0 // bs + k) % len(self.arms)
                for arm in self.arms[rot:] + self.arms[:rot]:
                    need = [st for st in states if (st.task.id, arm.name, seed) in todo]
                    if not need:
                        continue
                    keys = [self._memo_key(arm, st) for st in need]
                    if all(key is not None and key in self._memo for key in keys):
                        rows = [dict(self._memo[key], seed=seed, reused=True) for key in keys]
                    else:
                        rows = self._run_arm(arm, need, seed, max_new)
                        for key, r in zip(keys, rows, strict=True):
                            if key is not None:
                                self._memo[key] = r
                    for r in rows:
                        sink(r)
                    self.progress(len(rows))

    def _memo_key(self, arm: Arm, st: _TaskState) -> tuple | None:
        """What a trial's answer depends on besides the model: the text shown and, for a control, the
        partner; None when it also depends on the seed itself (random draws, sampling)."""
        if arm.stochastic or self.cfg.temperature > 0:
            return None
        partner = st.partner if arm.needs_mismatch or arm.mismatched_control else None
        return st.task.id, arm.name, st.task.context, st.task.prompt, partner

    @property
    def records_path(self) -> Path:
        """The folder's records: ``records.jsonl``, or ``records.jsonl.gz`` until a trial is added
        (``core.records_file``)."""
        return records_file(self.out)

    def set_sizes(self) -> dict[str, int]:
        """Tasks per set this run covers, ``{name: count}``."""
        return {name: len(load_tasks(name, limit=n, seed=0)) for name, n in self.cfg.task_sets()}

    def total_trials(self) -> int:
        return sum(self.set_sizes().values()) * len(self.arms) * len(self.cfg.seeds)

    def done_trials(self) -> int:
        """Trials of this run already in ``records.jsonl`` (a resumed run starts its count here)."""
        ids = {t.id for name, n in self.cfg.task_sets() for t in load_tasks(name, limit=n, seed=0)}
        arms, seeds = {a.name for a in self.arms}, set(self.cfg.seeds)
        return sum(1 for t, a, s in _records_done(self.records_path) if t in ids and a in arms and s in seeds)

    def _merged_config(self, sizes: dict[str, int], done: set) -> dict:
        """This run's config merged with the folder's ``config.json``; raises if they cannot share records."""
        path = self.out / "config.json"
        if not path.exists():
            prev: dict = {}
        else:
            try:
                prev = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise AuditResumeMismatch(f"{path} is not valid JSON ({err}); fix or remove it to resume") from None
        fp = (prev.get("versions") or {}).get("model_fingerprint")
        if fp is not None and fp != self.versions["model_fingerprint"]:
            raise AuditResumeMismatch(f"{self.out} holds records of another model ({prev.get('model')!r}, "
                                      f"fingerprint {fp[:12]}…); this run loads {self.cfg.model!r} "
                                      f"({self.versions['model_fingerprint'][:12]}…): use a new --out")
        made_in = records_engine(self.out)
        if done and made_in is not None and made_in != self.versions["engine"]:
            raise AuditResumeMismatch(f"{self.out} holds records made in engine mode {made_in!r}; this run loads "
                                      f"{self.versions['engine']!r} (modes may answer differently): pass --engine "
                                      f"{made_in} or use a new --out")
        if done and prev.get("seed_design") != SEED_DESIGN:
            made = prev.get("seed_design") or "an earlier version, whose seeds repeated the same trials"
            raise AuditResumeMismatch(f"{self.out} holds records made under seed design {made!r}; this version's "
                                      f"seeds vary {SEED_DESIGN!r} (docs/audit.md): use a new --out")
        for key in ("batch_size", "message_tokens", "temperature"):
            if key in prev and prev[key] != getattr(self.cfg, key):
                raise AuditResumeMismatch(f"{self.out} was run with {key}={prev[key]}; this run asks for "
                                          f"{getattr(self.cfg, key)}: pass --{key.replace('_', '-')} {prev[key]} "
                                          "or use a new --out")
        old_sets = prev.get("sets") or {t: len(load_tasks(t, limit=prev.get("limit"), seed=0))
                                        for t in prev.get("tasks", ()) if ":" not in t}
        started = {tid.partition("/")[0] for tid, _, _ in done}
        for name, n in sizes.items():
            if name in old_sets and old_sets[name] != n and name in started:
                raise AuditResumeMismatch(f"{self.out}: task set {name!r} was run with {old_sets[name]} tasks; this "
                                          f"run asks for {n} (batches and mismatch partners depend on the count): "
                                          f"pass --tasks {name}:{old_sets[name]} or use a new --out")

        def union(a, b):
            return list(dict.fromkeys([*a, *b]))

        sets = {**old_sets, **sizes}
        return {**prev, **asdict(self.cfg), "seed_design": SEED_DESIGN, "tasks": list(sets),
                "arms": union(prev.get("arms", ()), self.cfg.arms),
                "seeds": union(prev.get("seeds", ()), self.cfg.seeds), "sets": sets, "versions": self.versions}

    def check_resume(self) -> None:
        """``AuditResumeMismatch`` now (before any trial) if this run cannot continue the folder's records."""
        self._merged_config(self.set_sizes(), _records_done(self.records_path))

    def run(self) -> Path:
        done = _records_done(self.records_path)
        sizes = self.set_sizes()
        config = self._merged_config(sizes, done)
        (self.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, n in self.cfg.task_sets():
            self.run_set(name, done, lambda row: append_json_lines(unpack_records(self.out), [row]), limit=n)
        return self.records_path


def _version() -> str:
    from kvrelay import __version__

    return __version__

