"""Which model answers a request sent to ``model: "auto"``: the most accurate one predicted to meet the SLO.

For each served model ``m`` the scheduler predicts the request's latency:

    prefill_tokens(m) = own tokens + (0 if m can continue the first handle's cache else the handles' tokens)
    service(m)        = prefill_tokens(m) * prefill_s_per_token(m) + answer_tokens(m) * decode_s_per_token(m)
    latency(m)        = waiting(m) / replicas(m) * mean_service_s(m) + service(m)

where a model "can continue" a handle when the handle is signed, unexpired and made by ``m`` (the
relay channel; otherwise its text is re-encoded), token counts are estimated from characters
(``CHARS_PER_TOKEN``), ``answer_tokens`` is the model's mean answer length so far (capped by
``max_tokens``), and the per-token costs and mean service time start from one warm-up request per
model (``calibrate``) and follow every answer (exponential average, ``ALPHA``). The SLO is the
request's ``kv_slo_s`` or the server's default. Among models whose predicted latency meets it, the
one with the highest predicted accuracy wins (ties: the faster); when none meets it, the fastest.
Predicted accuracy is a measured value per model when given (``quality=``), else the parameter
count (a bigger model of one family answers better). The channel follows the model: relay when it
can continue the cache, text otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvrelay.serve.chat import Message
from kvrelay.serve.handles import Opened
from kvrelay.serve.pool import Pool
from kvrelay.serve.protocol import ChatRequest

CHARS_PER_TOKEN = 4.0  # English text and code with BPE tokenizers, roughly
ALPHA = 0.3  # weight of the newest observation in the running averages
WARMUP = "Read this and reply with one word. " * 24  # ~200 tokens


@dataclass(slots=True)
class Costs:
    prefill_s_per_token: float
    decode_s_per_token: float
    answer_tokens: float
    service_s: float

    def update(self, prefill_tokens: int, prefill_s: float, answer_tokens: int, decode_s: float, total_s: float,
               queue_s: float) -> None:
        def ewma(old: float, new: float) -> float:
            return (1 - ALPHA) * old + ALPHA * new

        if prefill_tokens > 0:
            self.prefill_s_per_token = ewma(self.prefill_s_per_token, prefill_s / prefill_tokens)
        if answer_tokens > 1:
            self.decode_s_per_token = ewma(self.decode_s_per_token, decode_s / (answer_tokens - 1))
        self.answer_tokens = ewma(self.answer_tokens, answer_tokens)
        self.service_s = ewma(self.service_s, max(total_s - queue_s, 0.0))


@dataclass(frozen=True, slots=True)
class Decision:
    model: str
    channel: str  # "kv" when the model continues the first handle's cache, else "text"
    predicted_s: float
    slo_s: float | None
    met: bool  # the chosen model's prediction meets the SLO
    predictions: tuple[tuple[str, float], ...]

    def to_json(self) -> dict:
        return {"model": self.model, "channel": self.channel, "predicted_s": self.predicted_s, "slo_s": self.slo_s,
                "slo_met": self.met, "predicted": dict(self.predictions)}


def _tokens(messages: Sequence[Message]) -> int:
    return round(sum(len(m.content) + 16 for m in messages) / CHARS_PER_TOKEN)  # +16: the turn markers


class Scheduler:
    def __init__(self, pool: Pool, *, slo_s: float | None = None, quality: Mapping[str, float] | None = None):
        self.pool = pool
        self.slo_s = slo_s
        reps = {m: rs[0] for m, rs in pool.replicas.items()}
        self.fingerprints = {m: r.fingerprint for m, r in reps.items()}
        self.quality = dict(quality) if quality else {m: float(r.params) for m, r in reps.items()}
        self.costs: dict[str, Costs] = {}
        self._lock = threading.Lock()
        for r in pool.all():
            r.observers.append(self.observe)

    def observe(self, model: str, res) -> None:
        with self._lock:
            c = self.costs.get(model)
            prefilled = res.usage.prompt_tokens - res.usage.relayed_tokens
            n = res.usage.completion_tokens
            if c is None:  # the first answer seeds the averages
                self.costs[model] = Costs(res.prefill_s / max(prefilled, 1), res.decode_s / max(n - 1, 1), n,
                                          max(res.total_s - res.queue_s, 0.0))
            else:
                c.update(prefilled, res.prefill_s, n, res.decode_s, res.total_s, res.queue_s)

    def calibrate(self, max_tokens: int = 8) -> None:
        """One warm-up request per model, so predictions start from measured costs."""
        futs = [self.pool.pick(m).submit(ChatRequest(m, (Message("user", WARMUP),), max_tokens, kv_handle=False), [])
                for m in self.pool.models if m not in self.costs]
        for f in futs:
            f.result()

    def predict(self, model: str, req: ChatRequest, opened: Sequence[Opened]) -> tuple[float, str]:
        c = self.costs.get(model)
        if c is None:
            return float("inf"), "text"
        first = opened[0].handle if opened else None
        reuse = bool(opened) and opened[0].signed and first.fingerprint == self.fingerprints[model] \
            and first.expires > time.time()
        context = [m for o in opened[(1 if reuse else 0):] for m in o.handle.messages]
        prefill = _tokens(list(context) + list(req.messages)) + 2
        answer = min(float(req.max_tokens), max(c.answer_tokens, 1.0))
        service = prefill * c.prefill_s_per_token + answer * c.decode_s_per_token
        waiting = self.pool.depth(model) / len(self.pool.replicas[model]) * c.service_s
        return waiting + service, ("kv" if reuse else "text")

    def decide(self, req: ChatRequest, opened: Sequence[Opened]) -> Decision:
        slo = req.slo_s if req.slo_s is not None else self.slo_s
        with self._lock:
            preds = {m: self.predict(m, req, opened) for m in self.pool.models}
        ok = [m for m, (s, _) in preds.items() if slo is None or s <= slo]
        if ok:
            best = max(ok, key=lambda m: (self.quality[m], -preds[m][0]))
        else:
            best = min(preds, key=lambda m: preds[m][0])
        return Decision(best, preds[best][1], preds[best][0], slo, bool(ok),
                        tuple((m, s) for m, (s, _) in preds.items()))
