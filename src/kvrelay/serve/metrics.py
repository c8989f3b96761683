"""Prometheus metrics of one server (its own registry, so several servers can live in one process).

``GET /metrics`` serves them in the Prometheus text format:

* ``kvrelay_queue_depth{model}`` — requests waiting or running on a model's replicas
* ``kvrelay_ttft_seconds{model,channel}`` — arrival to first token (channel ``kv``: a cache was continued)
* ``kvrelay_decode_tokens_per_second{model}`` — completion tokens / decode time, per request
* ``kvrelay_completion_tokens_total{model}``, ``kvrelay_requests_total{model,status}``
* ``kvrelay_relay_hits_total{model}`` — handles whose cache was continued
* ``kvrelay_relay_fallbacks_total{model,reason}`` — handles read as text, by reason (``serve.replica.REASONS``)
* ``kvrelay_scheduler_decisions_total{model,channel,slo}`` — ``auto`` requests by the scheduler's choice
  (``slo``: ``met``, ``missed`` or ``none``; the reason is in each response)
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, depth: Callable[[str], int], models: list[str]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue = Gauge("kvrelay_queue_depth", "requests waiting or running", ["model"], registry=r)
        for m in models:  # read at scrape time
            self.queue.labels(m).set_function(lambda m=m: depth(m))
        self.ttft = Histogram("kvrelay_ttft_seconds", "arrival to first token", ["model", "channel"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.rate = Histogram("kvrelay_decode_tokens_per_second", "completion tokens per decode second", ["model"],
                              buckets=RATE_BUCKETS, registry=r)
        self.tokens = Counter("kvrelay_completion_tokens", "completion tokens written", ["model"], registry=r)
        self.requests = Counter("kvrelay_requests", "chat requests answered or refused", ["model", "status"],
                                registry=r)
        self.hits = Counter("kvrelay_relay_hits", "handles whose cache was continued", ["model"], registry=r)
        self.fallbacks = Counter("kvrelay_relay_fallbacks", "handles read as text instead", ["model", "reason"],
                                 registry=r)
        self.decisions = Counter("kvrelay_scheduler_decisions", "requests to auto by the scheduler's model and "
                                 "channel", ["model", "channel", "slo"], registry=r)

    def observe(self, model: str, res) -> None:
        """One answered request (a ``serve.replica.Result``)."""
        kv = any(u.channel == "kv" for u in res.uses)
        self.ttft.labels(model, "kv" if kv else "text").observe(res.ttft_s)
        n = res.usage.completion_tokens
        self.tokens.labels(model).inc(n)
        if n > 1 and res.decode_s > 0:
            self.rate.labels(model).observe((n - 1) / res.decode_s)  # the first token comes from the prefill
        for u in res.uses:
            if u.channel == "kv":
                self.hits.labels(model).inc()
            else:
                self.fallbacks.labels(model, u.reason).inc()
        self.requests.labels(model, "200").inc()

    def decided(self, decision) -> None:
        """One ``auto`` request routed (a ``serve.scheduler.Decision``)."""
        slo = "none" if decision.slo_s is None else ("met" if decision.met else "missed")
        self.decisions.labels(decision.model, decision.channel, slo).inc()

    def refused(self, model: str, status: int) -> None:
        self.requests.labels(model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
