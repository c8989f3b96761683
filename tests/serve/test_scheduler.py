"""The scheduler's rule: per model, the policy's channel (value model + cost model) under the SLO budget
left after queueing; across models, the fastest not credibly worse when every model has an audit, else
the most accurate predicted to meet the SLO, else the fastest; a
handle's own model is cheaper by the context it need not prefill; ``model: "auto"`` end to end, with
the reason in the response and the decision in the metrics."""

from __future__ import annotations

import random
import time

import pytest

from kvrelay.policy.features import Features
from kvrelay.policy.value import Observation, ValueModel
from kvrelay.serve import handles
from kvrelay.serve.chat import Message
from kvrelay.serve.hosts import ALONE, destretch
from kvrelay.serve.pool import Pool
from kvrelay.serve.protocol import ChatRequest, Usage
from kvrelay.serve.replica import Result
from kvrelay.serve.scheduler import Costs, Scheduler

openai = pytest.importorskip("openai")

BIG, SMALL = "tiny:qwen2", "tiny:llama"
FACTS = "the vault code of gallery seven is ruby falcon and the guard is named orlov"


def audited(private: float, shared: float, seed: int = 0) -> ValueModel:
    """Audit-like observations: a private task succeeds with the context ``private`` of the time and
    fails without it; a shared one succeeds ``shared`` of the time either way; kv and text_full read the
    same tokens (identical outcomes)."""
    rng = random.Random(seed)
    obs = []
    for i in range(200):
        is_shared = i % 2 == 1
        f = Features(rng.uniform(0.7, 1.0) if is_shared else rng.uniform(0.0, 0.2),
                     rng.choice([16, 64, 256, 1024, 4096]))
        ok = float(rng.random() < (shared if is_shared else private))
        for key, y in (("kv", ok), ("text_full", ok), ("none", ok if is_shared else float(rng.random() < 0.1))):
            obs.append(Observation(f"t{i}", "synthetic", key, f, y))
    return ValueModel.fit(obs, n_boot=100, seed=0)


@pytest.fixture(scope="module")
def value() -> ValueModel:
    return audited(0.8, 0.8)


def _scheduler(gateway, value):
    s = Scheduler(gateway["pool"], quality={BIG: 0.8, SMALL: 0.5}, value=value)
    # costs as a calibration would measure them: the big model is 4x slower per token
    s.costs = {BIG: Costs(0.004, 0.02, 10, 1.0), SMALL: Costs(0.001, 0.005, 10, 0.25)}
    yield s
    for r in gateway["pool"].all():
        r.observers.remove(s.observe)


@pytest.fixture
def scheduler(gateway, value):
    """BIG has a value model (the policy picks its channels), SMALL none (the mechanical rule)."""
    yield from _scheduler(gateway, {BIG: value})


@pytest.fixture
def mechanical(gateway):
    yield from _scheduler(gateway, None)


def req(text: str, slo: float | None) -> ChatRequest:
    return ChatRequest("auto", (Message("user", text),), 10, slo_s=slo)


def opened_for(gateway, model: str, messages, *, signed=True, ttl=60.0) -> list[handles.Opened]:
    h = handles.Handle("key", model, gateway["pool"].pick(model).fingerprint, time.time() + ttl, tuple(messages))
    return [handles.Opened(h, signed=signed)]


def decisions(gateway, channel: str) -> float:
    """The scheduler decisions counted for BIG on ``channel`` with the SLO met (GET /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(gateway["url"] + "/metrics").text):
        for smp in fam.samples:
            if smp.name == "kvrelay_scheduler_decisions_total" and smp.labels == {"model": BIG, "channel": channel,
                                                                                 "slo": "met"}:
                return smp.value
    return 0.0


def test_the_most_accurate_model_that_meets_the_slo_else_the_fastest(scheduler):
    long = "word " * 400  # ~500 tokens: BIG ~2.2 s, SMALL ~0.55 s
    assert scheduler.decide(req(long, 10.0), []).model == BIG
    tight = scheduler.decide(req(long, 1.0), [])
    assert tight.model == SMALL and tight.met
    hopeless = scheduler.decide(req(long, 0.01), [])
    assert hopeless.model == SMALL and not hopeless.met and "fastest" in hopeless.reason
    assert scheduler.decide(req(long, None), []).model == BIG  # no SLO: accuracy alone


def test_a_handle_makes_its_own_model_cheaper_by_the_context(mechanical, scheduler, gateway):
    context = (Message("user", "word " * 2000), Message("assistant", "ok"))  # ~2.5k tokens
    d = mechanical.decide(req("and then?", 1.0), opened_for(gateway, BIG, context))
    assert d.model == BIG and d.channel == "kv"  # continuing costs only the new turn
    assert mechanical.decide(req("and then?", 1.0), opened_for(gateway, BIG, context, signed=False)).model == SMALL
    assert mechanical.predict(BIG, req("and then?", 1.0), opened_for(gateway, BIG, context, ttl=-1))[1] == "text_full"
    # with its value model, BIG may still meet the SLO without the context it cannot continue; the
    # policy says what that costs in P(success)
    d = scheduler.decide(req("and then?", 1.0), opened_for(gateway, BIG, context, signed=False))
    assert (d.model, d.channel) == (BIG, "none") and d.expected_success < 0.5
    assert "no kv: the pair is not compatible" in d.reason


def test_the_policy_picks_the_channel_with_its_reason(scheduler, gateway):
    ctx = [Message("user", f"Remember this. {FACTS}"), Message("assistant", "Noted.")]
    private = scheduler.plan(BIG, req("What is the answer to my question?", None), opened_for(gateway, BIG, ctx))
    assert private.channel == "kv" and private.reason.startswith("policy: kv") and private.expected_success > 0.5
    # a handle this model cannot continue: the policy may only re-encode it (or leave it out)
    other = scheduler.plan(BIG, req("What is the answer to my question?", None),
                           opened_for(gateway, BIG, ctx, signed=False))
    assert other.channel == "text_full" and "not compatible" in other.reason
    assert other.latency_s > private.latency_s
    # the request's own message holds the whole context: the policy predicts no loss without it, so it
    # does not pay for re-encoding the handle; a cache it can continue costs no more than none here
    shared_q = req(f"{FACTS}. What is the vault code?", None)
    shared = scheduler.plan(BIG, shared_q, opened_for(gateway, BIG, ctx, signed=False))
    assert shared.channel == "none" and shared.reason.startswith("policy: none")
    assert shared.latency_s < other.latency_s
    assert scheduler.plan(BIG, shared_q, opened_for(gateway, BIG, ctx)).channel == "kv"
    # the model without a value model follows the mechanical rule, and says so
    small = scheduler.plan(SMALL, req("What is the answer?", None), opened_for(gateway, SMALL, ctx))
    assert small.channel == "kv" and small.expected_success is None and small.reason.startswith("no value model")


def test_with_both_models_audited_the_fastest_not_credibly_worse_answers(gateway, value):
    """Across models the policy's own rule: SMALL's audit finds it as good as BIG on shared requests (the
    question repeats the facts) and far worse on private ones, so SMALL answers the first, BIG the second."""
    gen = _scheduler(gateway, {BIG: value, SMALL: audited(0.25, 0.8, seed=1)})
    s = next(gen)
    try:
        ctx = [Message("user", f"Remember this. {FACTS}"), Message("assistant", "Noted.")]
        shared = s.decide(req(f"{FACTS}. What is the vault code?", 60.0), opened_for(gateway, BIG, ctx))
        assert shared.model == SMALL and shared.channel == "none" and shared.met
        assert "not credibly below the best's" in shared.reason
        private = s.decide(req("What is the answer to my question?", 60.0), opened_for(gateway, BIG, ctx))
        assert (private.model, private.channel) == (BIG, "kv") and private.expected_success > 0.6
        small = next(p for p in private.plans if p.model == SMALL)
        assert small.channel == "text_full" and small.expected_success < 0.45  # credibly worse: not taken
        # a request without handles has no P(success): the most accurate model, as before
        assert s.decide(req("what is the key", 60.0), []).model == BIG
    finally:
        gen.close()


def test_an_idle_replica_beside_a_busy_one_on_the_host_is_not_free(gateway, value):
    """BIG (one replica) and SMALL share a one-slot host and are equally good. Alone, SMALL is a little
    faster and answers; while BIG is busy, SMALL would run at half speed and slow BIG's request by its
    own length, which costs more than waiting for BIG: BIG answers."""
    big, small = gateway["pool"].replicas[BIG][0], gateway["pool"].replicas[SMALL][0]
    s = Scheduler(Pool({BIG: (big,), SMALL: (small,)}), value={BIG: value, SMALL: value})
    s.costs = {BIG: Costs(0.004, 0.02, 10, 0.3), SMALL: Costs(0.0036, 0.018, 10, 0.27)}  # SMALL 10% faster
    try:
        ctx = [Message("user", f"Remember this. {FACTS}"), Message("assistant", "Noted.")]
        r, o = req(f"{FACTS}. What is the vault code?", 60.0), opened_for(gateway, BIG, ctx)
        idle = s.decide(r, o)
        assert idle.model == SMALL and all(p.sharing == ALONE and p.imposed_s == 0 for p in idle.plans)
        with big._lock:
            big._busy = 1
        try:
            busy = s.decide(r, o)
        finally:
            with big._lock:
                big._busy = 0
        alone, beside = (next(p for p in d.plans if p.model == SMALL) for d in (idle, busy))
        assert beside.sharing.stretch == 2.0 and beside.latency_s == pytest.approx(2 * alone.latency_s)
        assert beside.imposed_s == pytest.approx(alone.latency_s)  # BIG's one request waits SMALL's length
        waits = next(p for p in busy.plans if p.model == BIG)
        assert waits.sharing == ALONE and waits.queue_s == pytest.approx(0.3)
        assert busy.model == BIG and "cheapest to the host" in busy.reason
        assert busy.to_json()["plans"][SMALL]["imposed_s"] == pytest.approx(beside.imposed_s)
    finally:
        for rep in (big, small):
            rep.observers.remove(s.observe)


def test_rates_are_learned_at_full_speed(gateway):
    """An answer that ran beside another busy replica on a one-slot host took twice its full-speed time."""
    s = Scheduler(gateway["pool"])
    try:
        res = Result("ok", (1, 2, 3), "stop", Usage(110, 3, 10), (), None, 0.5, 1.0, 0.4, 0.2, 1.7, host_busy=2.0)
        s.observe(BIG, res)
        c = s.costs[BIG]
        assert c.prefill_s_per_token == pytest.approx(0.2 / 100)  # 100 prefilled tokens, 0.4 s at half speed
        assert c.decode_s_per_token == pytest.approx(0.1 / 2) and c.service_s == pytest.approx(1.2 / 2)
    finally:
        for rep in gateway["pool"].all():
            rep.observers.remove(s.observe)


def test_prefill_is_a_fixed_cost_plus_a_rate():
    """Short relayed turns and long documents together: the fitted line prices both."""
    def took(x):
        return 0.5 + 0.01 * x  # seconds: 0.5 fixed, 10 ms per token

    c = Costs.first(200, took(200), 8, 0.8, 3.0)
    assert c.prefill_fixed_s == 0 and c.prefill_s_per_token == pytest.approx(took(200) / 200)  # one length only
    for x in (800, 40, 2000, 40):
        c.update(x, took(x), 8, 0.8, 3.0, 0.0)
    assert c.prefill_fixed_s == pytest.approx(0.5) and c.prefill_s_per_token == pytest.approx(0.01)
    assert c.profile(BIG).prefill_s(2000) == pytest.approx(took(2000))  # through the origin: 0.0125/token, 25 s
    same = Costs.first(300, 1.0, 8, 0.8, 3.0)
    same.update(300, 1.2, 8, 0.8, 3.0, 0.0)  # one length: no slope to tell, the line through the origin
    assert same.prefill_fixed_s == 0 and same.prefill_s_per_token == pytest.approx(1.06 / 300)


def test_calibration_warms_up_with_two_prompt_lengths(gateway):
    """Each model answers a short and a long warm-up, observed before calibrate returns; they seed its rates."""
    pool = gateway["pool"]
    s = Scheduler(pool)
    seen: list = []

    def record(model, res):
        seen.append((model, res))

    for rep in pool.all():
        rep.observers.append(record)
    try:
        s.calibrate()
        for model in pool.models:
            short, long = [r for m, r in seen if m == model]  # both observed already: nothing waits on a thread
            assert long.usage.prompt_tokens > 3 * short.usage.prompt_tokens
            want = None
            for r in (short, long):
                k = destretch(r.host_busy, s.slots[model])
                args = (r.usage.prompt_tokens - r.usage.relayed_tokens, r.prefill_s / k, r.usage.completion_tokens,
                        r.decode_s / k)
                if want is None:
                    want = Costs.first(*args, (r.total_s - r.queue_s) / k)
                else:
                    want.update(*args, (r.total_s - r.queue_s) / k, 0.0)
            got = s.costs[model]
            assert (got.prefill_fixed_s, got.prefill_s_per_token, got.service_s) == \
                pytest.approx((want.prefill_fixed_s, want.prefill_s_per_token, want.service_s), rel=1e-9)
    finally:
        for rep in pool.all():
            rep.observers.remove(record)
            rep.observers.remove(s.observe)


def test_the_queue_eats_the_slo_budget(scheduler, gateway):
    ctx = [Message("user", f"Remember this. {FACTS}"), Message("assistant", "Noted.")]
    r = req("What is the answer to my question?", 2.0)
    calm = scheduler.plan(BIG, r, opened_for(gateway, BIG, ctx), 2.0)
    assert calm.queue_s == 0 and "no channel meets the SLO" not in calm.reason
    scheduler.costs[BIG].service_s = 5.0  # one request ahead would take 5 s
    replica = gateway["pool"].replicas[BIG][0]
    busy = replica._lock, replica._busy
    with replica._lock:
        replica._busy = 2  # two waiting on one of the two replicas: 1 per replica
    try:
        late = scheduler.plan(BIG, r, opened_for(gateway, BIG, ctx), 2.0)
        assert late.queue_s == pytest.approx(5.0) and "no channel meets the SLO" in late.reason
        assert scheduler.decide(r, opened_for(gateway, BIG, ctx)).model == SMALL
    finally:
        with busy[0]:
            replica._busy = 0


def test_auto_answers_with_the_chosen_model_and_says_which(gateway):
    c = gateway["client"]
    assert "auto" in [m.id for m in c.models.list()]
    r = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": "what is the key"}],
                                  max_tokens=8, extra_body={"kv_slo_s": 30.0})
    d = r.model_extra["kvrelay"]["scheduler"]
    assert r.model == d["model"] and d["slo_met"] and set(d["predicted"]) == {BIG, SMALL} and d["reason"]
    assert set(d["plans"]) == {BIG, SMALL} and d["plans"][d["model"]]["channel"] == "none"
    direct = c.chat.completions.create(model=d["model"], messages=[{"role": "user", "content": "what is the key"}],
                                       max_tokens=8)
    assert r.choices[0].message.content == direct.choices[0].message.content


def test_auto_leaves_out_a_handle_the_policy_calls_useless_and_counts_it(gateway, value):
    """End to end: with a value model the scheduler answers a shared-regime request without the handle
    (the answer is the request's alone, and says so), continues the cache for a private one."""
    c, server = gateway["client"], gateway["server"]
    remember = [{"role": "user", "content": f"Remember this. {FACTS}"}]
    from_small = c.chat.completions.create(model=SMALL, messages=remember, max_tokens=6).model_extra["kvrelay"]
    from_big = c.chat.completions.create(model=BIG, messages=remember, max_tokens=6).model_extra["kvrelay"]
    s = server.scheduler
    counted = {ch: decisions(gateway, ch) for ch in ("none", "kv")}
    before = s.value, s.quality
    s.value, s.quality = {BIG: value}, {BIG: 0.8, SMALL: 0.5}
    try:
        # SMALL's cache cannot be continued by BIG; the question repeats the facts: BIG answers without it
        shared_q = [{"role": "user", "content": f"{FACTS}. What is the vault code?"}]
        r = c.chat.completions.create(model="auto", messages=shared_q, max_tokens=6,
                                      extra_body={"kv_context": [from_small["handle"]], "kv_slo_s": 60.0})
        ext = r.model_extra["kvrelay"]
        assert r.model == BIG and ext["scheduler"]["channel"] == "none"
        assert ext["context"] == [{"index": 0, "channel": "none", "tokens": 0, "detail": ext["context"][0]["detail"]}]
        assert ext["relayed_tokens"] == 0 and ext["scheduler"]["reason"].count("policy: none") == 1
        alone = c.chat.completions.create(model=BIG, messages=shared_q, max_tokens=6)
        assert r.choices[0].message.content == alone.choices[0].message.content
        assert r.usage.prompt_tokens == alone.usage.prompt_tokens  # the handle's turn was not read
        # a private question on BIG's own handle: the policy continues the cache
        r2 = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": "And what did I say?"}],
                                       max_tokens=6, extra_body={"kv_context": [from_big["handle"]], "kv_slo_s": 60.0})
        ext2 = r2.model_extra["kvrelay"]
        assert r2.model == BIG and ext2["scheduler"]["channel"] == "kv" and ext2["context"][0]["channel"] == "kv"
        assert ext2["relayed_tokens"] > 0 and ext2["scheduler"]["reason"].count("policy: kv") == 1
        assert {ch: decisions(gateway, ch) - n for ch, n in counted.items()} == {"none": 1, "kv": 1}
    finally:
        s.value, s.quality = before
