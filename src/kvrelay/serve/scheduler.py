"""Which model, and which channel, answers a request sent to ``model: "auto"``: the policy per model, under the SLO.

For each served model ``m`` the scheduler plans the request with the policy (``kvrelay.policy``):

* **cost model** — a ``policy.cost.CostProfile`` of ``m`` built from what this server measures
  (``Costs``: the prefill as a fixed cost plus seconds per token, decode seconds per token, mean answer
  length; two warm-up requests of different lengths per model at start-up, then every answer,
  exponentially weighted averages ``ALPHA``), so ``CostProfile.latency_s``
  prices each channel: ``kv`` prefills only the request's own turn (the first handle's cache is
  continued; fetching it is folded into the measured prefill rate), ``text_full`` re-encodes the
  handles' messages too, ``none`` answers without them;
* **predicted remaining output** — the model's mean answer length so far, capped by ``max_tokens``;
* **queue** — ``waiting(m) / replicas(m) × mean service seconds(m)`` ahead of the request;
* **host contention** — replicas placed on one host share its cores (``serve.hosts``, processor
  sharing): when more replicas would be busy than the host runs at full speed, the channel's latency
  is stretched by ``(busy + 1) / slots`` and the plan carries the delay its work **imposes** on the
  requests of the other busy replicas there (``Plan.imposed_s``). Rates are learned at full speed:
  each answer's seconds are divided by the contention it ran under (``Result.host_busy``), and the
  start-up warm-ups run one model at a time;
* **value model** — when the server was given audits of ``m`` (``fit_value_models``), the channel is
  ``policy.decide`` under the SLO budget left after queueing (``Slo(slo − queue)``): P(success) per
  channel from the request's features (how much of the handles' words the request's own messages
  already hold, the context length), the fastest channel among those not credibly worse, and its
  one-line reason. Without a value model (or when no audited channel covers the request) the rule is
  mechanical: ``kv`` when ``m`` can continue the first handle (signed, unexpired, made by ``m``),
  else ``text_full``.

Token counts are estimated from characters (``CHARS_PER_TOKEN``). The request's SLO is its
``kv_slo_s`` or the server's default. Among the models whose plan (queue + channel latency) meets it:

* when every one of them has a value model's P(success) for its channel, the policy's own rule picks
  across models as it picks across channels (``policy.decide.not_credibly_worse``): among the models
  whose P(success) the audits cannot show below the best one's by more than the tolerance (the
  audit's equivalence margin; the two models' bootstrap draws, ``policy.value.difference_of``), the
  fastest to the whole host (its predicted seconds plus the delay it imposes, ``Plan.cost_s``) — so a
  smaller model answers where its audit finds it as good and it costs less, the larger where it does
  not, and an idle replica is not free when it would only take cores from a busy one;
* otherwise (a request without handles, a model without audits, a request outside every audited
  range) the most accurate wins — a measured accuracy per model when given (``quality=``), else the
  parameter count (a bigger model of one family answers better); ties go to the higher predicted
  P(success) of its channel, then the cheaper to the host.

When none meets the SLO, the fastest. The decision and
every model's plan are in the response (``Decision.to_json``) and counted in the metrics.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvrelay.core.errors import InvalidInput
from kvrelay.core.jsonl import read_json_lines
from kvrelay.core.records_file import DESCRIBED, ENGINE_BEFORE_RECORDED, records_engine, records_file
from kvrelay.policy.cost import CodecCost, CostProfile
from kvrelay.policy.decide import Request, Slo, not_credibly_worse
from kvrelay.policy.decide import decide as policy_decide
from kvrelay.policy.features import Features, channel_key
from kvrelay.policy.value import Prediction, ValueModel, difference_of, observations_from_records
from kvrelay.serve.chat import Message
from kvrelay.serve.handles import Opened
from kvrelay.serve.hosts import ALONE, Sharing, destretch
from kvrelay.serve.pool import Pool
from kvrelay.serve.protocol import ChatRequest

CHARS_PER_TOKEN = 4.0  # English text and code with BPE tokenizers, roughly
ALPHA = 0.3  # weight of the newest observation in the running averages
SPREAD = 0.1  # prompt lengths must spread this much (std / mean) before the prefill line gets a fixed part
WARMUP = "Read this and reply with one word. " * 24  # ~200 tokens
WARMUPS = (WARMUP, WARMUP * 4)  # two prompt lengths: the prefill's fixed cost apart from its per-token rate
RAW = CodecCost("raw", 1.0, 0.0, 0.0, lossless=True)  # the served cache: continued as stored, no codec
EXHAUSTED_S = 1e-9  # the SLO budget left when the queue alone uses it up: no channel meets it


@dataclass(slots=True)
class Costs:
    """A model's measured rates. Prefill seconds are a line in the prefilled tokens, ``prefill_fixed_s`` +
    ``prefill_s_per_token`` × tokens, fitted by least squares on exponentially weighted moments (``ALPHA``)
    of what answers took: a turn of 40 tokens costs little more than its fixed part, a 2,000-token
    document mostly its tokens, and a rate through the origin fitted to the one would misprice the other."""

    prefill_s_per_token: float
    decode_s_per_token: float
    answer_tokens: float
    service_s: float
    prefill_fixed_s: float = 0.0
    moments: tuple[float, float, float, float] | None = None  # weighted means of x, y, x², xy (x tokens, y s)

    @classmethod
    def first(cls, prefill_tokens: int, prefill_s: float, answer_tokens: int, decode_s: float,
              service_s: float) -> Costs:
        """The rates one answer shows: the line through the origin and it, until answers of other lengths come."""
        x = max(prefill_tokens, 1)
        return cls(prefill_s / x, decode_s / max(answer_tokens - 1, 1), answer_tokens, service_s, 0.0,
                   moments_of(x, prefill_s))

    def update(self, prefill_tokens: int, prefill_s: float, answer_tokens: int, decode_s: float, total_s: float,
               queue_s: float) -> None:
        def ewma(old: float, new: float) -> float:
            return (1 - ALPHA) * old + ALPHA * new

        if prefill_tokens > 0:
            point = moments_of(prefill_tokens, prefill_s)
            self.moments = tuple(ewma(a, b) for a, b in zip(self.moments or point, point, strict=True))
            self.prefill_fixed_s, self.prefill_s_per_token = prefill_line(self.moments)
        if answer_tokens > 1:
            self.decode_s_per_token = ewma(self.decode_s_per_token, decode_s / (answer_tokens - 1))
        self.answer_tokens = ewma(self.answer_tokens, answer_tokens)
        self.service_s = ewma(self.service_s, max(total_s - queue_s, 0.0))

    def profile(self, model: str) -> CostProfile:
        """This model's measured rates as a policy cost profile (in process: no link, no codec)."""
        return CostProfile(model=model, prefill_fixed_s=self.prefill_fixed_s, prefill_s_per_token=self.prefill_s_per_token,
                           decode_s_per_token=self.decode_s_per_token, raw_bytes_per_token=0.0,
                           text_bytes_per_token=CHARS_PER_TOKEN, codecs=(RAW,))


def moments_of(tokens: float, seconds: float) -> tuple[float, float, float, float]:
    """One prefill's contribution to the moments ``prefill_line`` fits: (x, y, x², xy)."""
    return tokens, seconds, tokens * tokens, tokens * seconds


def prefill_line(moments: tuple[float, float, float, float]) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of the least-squares line through weighted moments (mean x, y, x², xy).
    Lengths too alike to tell a slope (spread under ``SPREAD`` of the mean), or a fit with a negative slope
    or fixed part, fall back to the line through the origin."""
    mx, my, mxx, mxy = moments
    var, cov = mxx - mx * mx, mxy - mx * my
    if var > (SPREAD * mx) ** 2 and cov > 0:
        slope = cov / var
        fixed = my - slope * mx
        if fixed >= 0:
            return fixed, slope
    return 0.0, mxy / mxx if mxx > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Plan:
    """One model's answer to a request: the channel for its handles and what it is predicted to cost."""

    model: str
    channel: str  # "kv" (continue the first handle's cache), "text_full" (re-encode), "none" (without them)
    queue_s: float
    latency_s: float  # the channel's latency by the cost model, after the queue, stretched by host sharing
    expected_success: float | None  # the value model's P(success) of the channel; None without one
    reason: str  # one line
    draws: np.ndarray | None = field(default=None, repr=False, compare=False)  # (B,) its P(success) bootstrap
    sharing: Sharing = ALONE  # what it shares of its host's cores (``serve.hosts``)
    imposed_s: float = 0.0  # the delay its work adds to the requests of the host's other busy replicas

    def versus(self, other: Plan) -> Prediction:
        """P(success) of this plan's channel minus ``other``'s, with a bootstrap interval (both need draws)."""
        return difference_of(Prediction(self.expected_success, 0.0, 0.0), self.draws,
                             Prediction(other.expected_success, 0.0, 0.0), other.draws)

    @property
    def predicted_s(self) -> float:
        return self.queue_s + self.latency_s

    @property
    def cost_s(self) -> float:
        """What sending the request here costs the host's requests together: its own seconds and those it imposes."""
        return self.predicted_s + self.imposed_s

    def to_json(self) -> dict:
        return {"channel": self.channel, "predicted_s": self.predicted_s, "queue_s": self.queue_s,
                "stretch": self.sharing.stretch, "imposed_s": self.imposed_s,
                "expected_success": self.expected_success, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Decision:
    model: str
    channel: str  # the chosen plan's channel
    predicted_s: float
    slo_s: float | None
    met: bool  # the chosen model's prediction meets the SLO
    predictions: tuple[tuple[str, float], ...]
    reason: str = ""
    plans: tuple[Plan, ...] = ()

    @property
    def expected_success(self) -> float | None:
        return next((p.expected_success for p in self.plans if p.model == self.model), None)

    def to_json(self) -> dict:
        return {"model": self.model, "channel": self.channel, "predicted_s": self.predicted_s, "slo_s": self.slo_s,
                "slo_met": self.met, "predicted": dict(self.predictions), "reason": self.reason,
                "expected_success": self.expected_success, "plans": {p.model: p.to_json() for p in self.plans}}


def _tokens(messages: Sequence[Message]) -> int:
    return round(sum(len(m.content) + 16 for m in messages) / CHARS_PER_TOKEN)  # +16: the turn markers


def _text(messages: Iterable[Message]) -> str:
    return "\n".join(m.content for m in messages)


def fit_value_models(folders: Iterable[str | Path]) -> dict[str, ValueModel]:
    """One value model per audited model, fitted on the audits' records (``records.jsonl`` or
    ``records.jsonl.gz``: ``core.records_file``) of ``kvrelay audit --out`` folders (their ``config.json``
    names the model). Overlap comes from each record's regime."""
    by_model: dict[str, list] = {}
    for f in map(Path, folders):
        cfg, recs = f / "config.json", records_file(f)
        if not (cfg.is_file() and recs.is_file()):
            raise InvalidInput(f"audit folder {f} has no config.json and {DESCRIBED}",
                               "a folder written by kvrelay audit --out")
        conf = json.loads(cfg.read_text(encoding="utf-8"))
        engine = records_engine(f) or ENGINE_BEFORE_RECORDED
        by_model.setdefault(conf["model"], []).extend(
            observations_from_records(read_json_lines(recs, cut_tail_ok=True), engine=engine, source=str(f)))
    return {m: ValueModel.fit(obs, sources=tuple(sorted({o.source for o in obs}))) for m, obs in by_model.items()}


class Scheduler:
    def __init__(self, pool: Pool, *, slo_s: float | None = None, quality: Mapping[str, float] | None = None,
                 value: Mapping[str, ValueModel] | None = None):
        self.pool = pool
        self.slo_s = slo_s
        reps = {m: rs[0] for m, rs in pool.replicas.items()}
        self.fingerprints = {m: r.fingerprint for m, r in reps.items()}
        self.slots = {m: r.placement.slots for m, r in reps.items()}
        self.quality = dict(quality) if quality else {m: float(r.params) for m, r in reps.items()}
        self.value = {m: v for m, v in (value or {}).items() if m in self.fingerprints}
        self.costs: dict[str, Costs] = {}
        self._lock = threading.Lock()
        for r in pool.all():
            r.observers.append(self.observe)

    def observe(self, model: str, res) -> None:
        """Learn ``model``'s full-speed rates from an answer: its seconds divided by the host contention it met."""
        k = destretch(res.host_busy, self.slots[model])
        prefill_s, decode_s, service_s = res.prefill_s / k, res.decode_s / k, max(res.total_s - res.queue_s, 0.0) / k
        prefilled = res.usage.prompt_tokens - res.usage.relayed_tokens
        n = res.usage.completion_tokens
        with self._lock:
            c = self.costs.get(model)
            if c is None:  # the first answer seeds the averages
                self.costs[model] = Costs.first(prefilled, prefill_s, n, decode_s, service_s)
            else:
                c.update(prefilled, prefill_s, n, decode_s, service_s, 0.0)

    def calibrate(self, max_tokens: int = 8) -> None:
        """Two warm-up requests per model, a short prompt and one four times as long, one model at a time, so
        predictions start from rates measured alone and the prefill's fixed cost is told from its per-token
        rate (each answer is observed before its caller sees it: ``Replica``)."""
        for m in self.pool.models:
            if m not in self.costs:
                for text in WARMUPS:
                    self.pool.pick(m).submit(ChatRequest(m, (Message("user", text),), max_tokens, kv_handle=False),
                                             []).result()

    def can_continue(self, model: str, opened: Sequence[Opened]) -> bool:
        """Whether ``model`` may continue the first handle's cache (what its replica checks first)."""
        if not opened:
            return False
        h = opened[0].handle
        return opened[0].signed and h.fingerprint == self.fingerprints[model] and h.expires > time.time()

    def plan(self, model: str, req: ChatRequest, opened: Sequence[Opened], slo_s: float | None = None) -> Plan:
        """``model``'s channel for the request and its predicted latency (module docstring)."""
        c = self.costs.get(model)
        if c is None:
            return Plan(model, "text_full" if opened else "none", 0.0, float("inf"), None, "no measured costs yet")
        cost = c.profile(model)
        queue_s = self.pool.depth(model) / len(self.pool.replicas[model]) * c.service_s
        answer = round(min(float(req.max_tokens), max(c.answer_tokens, 1.0)))
        own = _tokens(list(req.messages)) + 2  # + the answer's opening markers
        sh = self.pool.sharing(model)

        def priced(channel: str, full_speed_s: float, expected: float | None, reason: str,
                   draws: np.ndarray | None = None) -> Plan:
            return Plan(model, channel, queue_s, sh.stretch * full_speed_s, expected, reason, draws, sh,
                        sh.imposed_per_s * full_speed_s)

        if not opened:
            lat = cost.latency_s("none", None, context_tokens=1, prompt_tokens=own, answer_tokens=answer)
            return priced("none", lat, None, "no context handles")
        first = list(opened[0].handle.messages)
        later = [m for o in opened[1:] for m in o.handle.messages]  # always re-encoded (only the first is cached)
        context, prompt = _tokens(first) + 1, own + (_tokens(later) if later else 0)
        reuse = self.can_continue(model, opened)
        vm = self.value.get(model)
        if vm is not None:
            feats = Features.of(_text(first + later), _text(req.messages), context)
            budget = None if slo_s is None else max((slo_s - queue_s) / sh.stretch, EXHAUSTED_S)  # at full speed
            ask = Request(feats, prompt_tokens=prompt, answer_tokens=answer, compatible=reuse, codecs=("raw",))
            try:
                d = policy_decide(ask, Slo(budget), vm, cost)
            except InvalidInput:
                why = "no audited channel covers this request"
            else:
                if d.channel != "none" or req.messages:  # a request of handles only cannot leave them out
                    return priced(d.channel, d.latency_s, d.expected_success, f"policy: {d.reason}",
                                  vm.draws(channel_key(d.channel, d.codec), feats))
                why = "the policy would leave out every message"
        else:
            why = "no value model"
        channel = "kv" if reuse else "text_full"
        lat = cost.latency_s(channel, "raw" if reuse else None, context_tokens=context, prompt_tokens=prompt,
                             answer_tokens=answer)
        return priced(channel, lat, None, f"{why}: kv when this model can continue the first handle's cache, else text_full")

    def predict(self, model: str, req: ChatRequest, opened: Sequence[Opened]) -> tuple[float, str]:
        """(predicted seconds, channel) of ``model`` under the request's SLO."""
        with self._lock:
            p = self.plan(model, req, opened, req.slo_s if req.slo_s is not None else self.slo_s)
        return p.predicted_s, p.channel

    def decide(self, req: ChatRequest, opened: Sequence[Opened]) -> Decision:
        slo = req.slo_s if req.slo_s is not None else self.slo_s
        with self._lock:
            plans = [self.plan(m, req, opened, slo) for m in self.pool.models]
        ok = [p for p in plans if slo is None or p.predicted_s <= slo]
        met = f"{len(ok)}/{len(plans)} models predicted to meet the SLO" if slo is not None else \
            f"{len(plans)} models (no SLO)"
        if len(ok) > 1 and all(p.draws is not None for p in ok):
            top = max(ok, key=lambda p: p.expected_success)
            as_good = [p for p in ok if p is top or not_credibly_worse(p.versus(top))]
            best = min(as_good, key=lambda p: (p.cost_s, -p.expected_success))
            why = (f"{best.model}: the cheapest to the host of the {len(as_good)} whose P(success) is not credibly"
                   f" below the best's ({top.model} {top.expected_success:.2f}), among {met}")
            if best is not top:
                d = top.versus(best)
                why += f", {100 * d.mean:+.0f} pts [{100 * d.ci_low:+.0f}, {100 * d.ci_high:+.0f}] over it"
        elif ok:
            best = max(ok, key=lambda p: (self.quality[p.model], -1.0 if p.expected_success is None
                                          else p.expected_success, -p.cost_s))
            why = f"{best.model}: the most accurate of {met}"
        else:
            best = min(plans, key=lambda p: p.predicted_s)
            why = f"{best.model}: no model is predicted to meet the SLO {slo:g} s, the fastest taken"
        return Decision(best.model, best.channel, best.predicted_s, slo, bool(ok),
                        tuple((p.model, p.predicted_s) for p in plans), f"{why}; {best.reason}", tuple(plans))
