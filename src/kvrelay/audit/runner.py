"""Paired audit runner: every task under every arm, same seeds, resumable, one JSONL record per trial.

Protocol (stated once):

* The sender reads each task's context once (one prefill per task); every cache arm starts
  from that payload. Tasks run in batches of similar length; the mismatched payload of a task is
  the reading of the *next* task in run order (a fixed shift within the batch, as in the paper),
  cut or extended with further real contexts to *exactly* the matched payload's length, with
  the same wrapper tokens. Its cache is reused from the partner's own payload when it was read.
* Adapter arms (``kv_adapter:NAME``, ``audit.channels``): the sharer model of artefact NAME reads
  each task's context with the sender's role, once per task; ``kv_adapter_mismatched:NAME`` gets
  its length-matched reading of the partner task (the same shift), labelled with the matched
  task's tokens. ``relay_bytes`` is the sharer payload's size; ``sender_s`` the sharer's reading;
  the adapter's own work is part of ``relay_s``. Variant arms (``kv_variant:NAME:REPAIR``) read the
  same way with the sibling ``BASE+NAME`` as sharer, once per variant whatever the repairs, and its
  cache goes through each arm's repair (its time is in ``relay_s``).
* Decoding is greedy, so an arm whose input does not depend on the seed (everything but
  ``kv_random`` and ``kv_noise``) gives the same answer under every seed: it is computed once
  per task and recorded for each seed. Seeds drive the random draws and the arm order; the
  statistics bootstrap over tasks (clusters), so repeated seeds never inflate the evidence.
* Tasks run in batches (one padded forward per arm); arm order is rotated per batch and seed
  (counterbalanced). Latencies of a batched trial are the batch's time divided by its rows, the
  same accounting for every arm.
* ``latency_s`` = relay build + receiver prefill + receiver decode (+ the sender's decode for
  ``text_message``). ``relay_bytes`` = payload bytes for cache arms, UTF-8 bytes of the text for
  text arms, 0 for ``none``. ``prefill_tokens`` = tokens the receiver prefilled.
* Resumable: records already in ``records.jsonl`` (same task, arm, seed) are skipped. A run may
  add task sets, arms or seeds to a folder; it must keep the model (fingerprint), the batch size,
  the message length and each set's task count, since those decide which tasks share a batch
  and who is whose mismatch partner (``AuditResumeMismatch`` otherwise). ``config.json`` holds
  the union of what ran, with each set's task count under ``sets``.
* A task set may carry its own cap: ``squad:160`` runs the first 160 tasks of SQuAD's fixed
  order whatever ``limit`` says.
"""

from __future__ import annotations

import json
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvrelay.agents.agent import Agent
from kvrelay.audit.arms import Arm, build_kv, parse_arm
from kvrelay.audit.channels import open_channel, open_variant, relabelled, variant_adapter
from kvrelay.audit.config import AuditConfig, split_task_spec  # noqa: F401 (re-exported)
from kvrelay.audit.partners import mismatch_partners, run_order
from kvrelay.audit.tasks import Task, load_tasks, score
from kvrelay.audit.vocab import PARTIAL_ARMS
from kvrelay.core.errors import KVRelayError
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


def _records_done(path: Path) -> set[tuple[str, str, int]]:
    """(task id, arm, seed) of every record in ``path``.

    A run killed mid-write leaves a last line without its newline: it is cut off (that trial runs
    again) so appending stays valid JSONL. Any other unreadable line is an error naming its number.
    """
    done: set[tuple[str, str, int]] = set()
    if not path.exists():
        return done
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        warnings.warn(f"{path}: dropping an unfinished last record ({len(data) - cut} bytes); it will be re-run",
                      stacklevel=2)
        with path.open("r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    for i, line in enumerate(data.decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            done.add((r["task_id"], r["arm"], int(r["seed"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise AuditResumeMismatch(f"{path}:{i}: not an audit record ({err}); fix or remove that line to resume") \
                from None
    return done


def wrapper_ids(agent: Agent) -> tuple[list[int], list[int]]:
    """The tokens ``agent`` reads before and after a context's text (role as system prompt, user turn)."""
    user_head, _, user_tail = agent.fmt.user_tpl.partition("{text}")
    return agent.encode(agent.fmt.system(agent.role)) + agent.encode(user_head), agent.encode(user_tail)


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
        self.records_path = self.out / "records.jsonl"
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
                         "model_fingerprint": lm.identity.fingerprint}
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
        if partial is None:
            responses = self.receiver.respond_batch(prompts, contexts, max_new_tokens=max_new)
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
        return rows

    def read_batch(self, tasks: list[Task], batch: list[int], partners: list[int]) -> list[_TaskState]:
        """The sender reads each task of ``batch`` (indices into ``tasks``); with a mismatch arm, each
        state also gets its length-matched mismatched payload from task ``partners[i]``."""
        states = []
        for i in batch:
            t0 = time.perf_counter()
            p = self.sender.read(tasks[i].context)
            states.append(_TaskState(tasks[i], i, p, time.perf_counter() - t0))
        if any(a.needs_mismatch for a in self.arms):
            read = {st.index: st.payload for st in states}
            for st in states:
                j = partners[st.index]
                st.mismatched = self._mismatched(tasks, j, st.payload.num_tokens, read.get(j))
        for name, ch in self.channels.items():
            self._share(name, ch, tasks, states, partners)
        return states

    def _share(self, name: str, ch, tasks: list[Task], states: list[_TaskState], partners: list[int]) -> None:
        """The sharer of channel ``name`` reads each task; its length-matched reading of the partner for the control."""
        for st in states:
            t0 = time.perf_counter()
            st.shared[name] = (ch.read(st.task.context), time.perf_counter() - t0, None)
        if any(a.mismatched_control and a.channel == name for a in self.arms):
            read = {st.index: st.shared[name][0] for st in states}
            for st in states:
                p, secs, _ = st.shared[name]
                other = length_matched(ch.agent, tasks, partners[st.index], p.num_tokens, read.get(partners[st.index]))
                st.shared[name] = (p, secs, relabelled(other, p))

    def run_set(self, name: str, done: set, sink, limit: int | None = None) -> None:
        tasks = load_tasks(name, limit=limit, seed=0)
        if len(tasks) < 2:
            raise ValueError(f"task set {name!r} has {len(tasks)} task(s); the mismatched arm needs at least 2")
        max_new = MAX_NEW.get(tasks[0].scorer, 16)
        bs = self.cfg.batch_size
        order = run_order(tasks)
        partners = mismatch_partners(order)
        for b0 in range(0, len(tasks), bs):
            batch = order[b0:b0 + bs]
            todo = {(tasks[i].id, a.name, s) for i in batch for a in self.arms for s in self.cfg.seeds} - done
            if not todo:
                continue
            states = self.read_batch(tasks, batch, partners)
            for k, seed in enumerate(self.cfg.seeds):
                rot = (b0 // bs + k) % len(self.arms)
                for arm in self.arms[rot:] + self.arms[:rot]:
                    need = [st for st in states if (st.task.id, arm.name, seed) in todo]
                    if not need:
                        continue
                    reusable = not arm.stochastic
                    if reusable and all((st.task.id, arm.name) in self._memo for st in need):
                        rows = [dict(self._memo[(st.task.id, arm.name)], seed=seed, reused=True) for st in need]
                    else:
                        rows = self._run_arm(arm, need, seed, max_new)
                        if reusable:
                            for st, r in zip(need, rows, strict=True):
                                self._memo[(st.task.id, arm.name)] = r
                    for r in rows:
                        sink(r)
                    self.progress(len(rows))

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
        for key in ("batch_size", "message_tokens"):
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
        return {**prev, **asdict(self.cfg), "tasks": list(sets), "arms": union(prev.get("arms", ()), self.cfg.arms),
                "seeds": union(prev.get("seeds", ()), self.cfg.seeds), "sets": sets, "versions": self.versions}

    def check_resume(self) -> None:
        """``AuditResumeMismatch`` now (before any trial) if this run cannot continue the folder's records."""
        self._merged_config(self.set_sizes(), _records_done(self.records_path))

    def run(self) -> Path:
        done = _records_done(self.records_path)
        sizes = self.set_sizes()
        config = self._merged_config(sizes, done)
        (self.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        with self.records_path.open("a") as f:
            def sink(row: dict) -> None:
                f.write(json.dumps(row) + "\n")
                f.flush()

            for name, n in self.cfg.task_sets():
                self.run_set(name, done, sink, limit=n)
        return self.records_path


def _version() -> str:
    from kvrelay import __version__

    return __version__

