"""The scheduler's rule: the most accurate model predicted to meet the SLO, else the fastest; a
handle's own model is cheaper by the context it need not prefill; ``model: "auto"`` end to end."""

from __future__ import annotations

import time

import pytest

from kvrelay.serve import handles
from kvrelay.serve.chat import Message
from kvrelay.serve.protocol import ChatRequest
from kvrelay.serve.scheduler import Costs, Scheduler

openai = pytest.importorskip("openai")

BIG, SMALL = "tiny:qwen2", "tiny:llama"


@pytest.fixture
def scheduler(gateway):
    s = Scheduler(gateway["pool"], quality={BIG: 0.8, SMALL: 0.5})
    # costs as a calibration would measure them: the big model is 4x slower per token
    s.costs = {BIG: Costs(0.004, 0.02, 10, 1.0), SMALL: Costs(0.001, 0.005, 10, 0.25)}
    yield s
    for r in gateway["pool"].all():
        r.observers.remove(s.observe)


def req(text: str, slo: float | None) -> ChatRequest:
    return ChatRequest("auto", (Message("user", text),), 10, slo_s=slo)


def test_the_most_accurate_model_that_meets_the_slo_else_the_fastest(scheduler):
    long = "word " * 400  # ~500 tokens: BIG ~2.2 s, SMALL ~0.55 s
    assert scheduler.decide(req(long, 10.0), []).model == BIG
    tight = scheduler.decide(req(long, 1.0), [])
    assert tight.model == SMALL and tight.met
    hopeless = scheduler.decide(req(long, 0.01), [])
    assert hopeless.model == SMALL and not hopeless.met
    assert scheduler.decide(req(long, None), []).model == BIG  # no SLO: accuracy alone


def test_a_handle_makes_its_own_model_cheaper_by_the_context(scheduler, gateway):
    context = (Message("user", "word " * 2000), Message("assistant", "ok"))  # ~2.5k tokens
    h = handles.Handle("key", BIG, gateway["pool"].pick(BIG).fingerprint, time.time() + 60, context)
    opened = [handles.Opened(h, signed=True)]
    d = scheduler.decide(req("and then?", 1.0), opened)
    assert d.model == BIG and d.channel == "kv"  # continuing costs only the new turn
    assert scheduler.decide(req("and then?", 1.0), [handles.Opened(h, signed=False)]).model == SMALL
    expired = handles.Opened(handles.Handle("key", BIG, h.fingerprint, time.time() - 1, context), signed=True)
    assert scheduler.predict(BIG, req("and then?", 1.0), [expired])[1] == "text"


def test_auto_answers_with_the_chosen_model_and_says_which(gateway):
    c = gateway["client"]
    assert "auto" in [m.id for m in c.models.list()]
    r = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": "what is the key"}],
                                  max_tokens=8, extra_body={"kv_slo_s": 30.0})
    d = r.model_extra["kvrelay"]["scheduler"]
    assert r.model == d["model"] and d["slo_met"] and set(d["predicted"]) == {BIG, SMALL}
    direct = c.chat.completions.create(model=d["model"], messages=[{"role": "user", "content": "what is the key"}],
                                       max_tokens=8)
    assert r.choices[0].message.content == direct.choices[0].message.content
