"""A replica answering concurrent requests together in transformers' continuous batching (tiny models):
the same greedy answers as alone, really in one batch, relayed caches entering as prefix pages, and the
turn's cache read back from the engine's pages."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvrelay.core.errors import InvalidInput
from kvrelay.serve import handles
from kvrelay.serve.chat import Message
from kvrelay.serve.protocol import ChatRequest
from kvrelay.serve.replica import Replica
from kvrelay.transport.payloads import get_payload
from kvrelay.transport.stores import open_store

MODEL = "tiny:qwen2"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def question(i: int, n: int) -> ChatRequest:
    text = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + 9 * i))
    return ChatRequest(MODEL, (Message("user", text),), max_tokens=n)


class Fed:
    """Tokens per forward of the model (the engine's steps: prefill chunks and decodes of all requests)."""

    def __init__(self, model):
        self.calls: list[int] = []
        self.hook = model.register_forward_pre_hook(
            lambda _m, args, kw: self.calls.append(int(kw.get("input_ids", args[0] if args else None).shape[-1])),
            with_kwargs=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.hook.remove()


@pytest.fixture(scope="module")
def replicas():
    from kvrelay.models.tiny import tiny_lm

    secret = handles.new_secret()
    store = open_store(f"memory://batch-{uuid.uuid4().hex[:8]}")
    lm = tiny_lm("qwen2", seed=2, name=MODEL)  # a seed whose answers differ by prompt
    fifo = Replica(MODEL, lm, store, secret)
    batched = Replica(MODEL, lm, store, secret, batch=True, kv_tokens=4096)
    yield {"fifo": fifo, "batched": batched, "lm": lm, "secret": secret, "store": store}
    batched.close(10)
    fifo.close(10)


def test_concurrent_requests_run_in_one_batch_and_answer_as_alone(replicas):
    b, lm = replicas["batched"], replicas["lm"]
    reqs = [question(i, 12) for i in range(5)]
    alone = [b.submit(r, []).result(60) for r in reqs]
    with Fed(lm.model) as fed_alone:
        for r in reqs:
            b.submit(r, []).result(60)
    with Fed(lm.model) as fed:
        with b.batcher.with_model():  # hold the engine while all five join, so they share its steps
            futs = [b.submit(r, []) for r in reqs]
            while b.depth < len(reqs) or b._q.qsize():  # every request planned and handed to the engine
                threading.Event().wait(0.005)
        together = [f.result(60) for f in futs]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert len({r.token_ids for r in alone}) > 1  # different prompts, different answers: no request saw another's
    # alone each request needs its own steps; together they share them (one decode step serves all five)
    assert len(fed.calls) * 3 < len(fed_alone.calls)
    assert max(fed.calls) > max(len(r.token_ids) for r in alone)  # some step read several requests' tokens


def test_batched_answers_equal_kvrelays_own_loop(replicas):
    reqs = [question(i, 12) for i in range(3)]
    assert ([replicas["batched"].submit(r, []).result(60).token_ids for r in reqs]
            == [replicas["fifo"].submit(r, []).result(60).token_ids for r in reqs])


def test_a_handle_enters_as_prefix_pages_and_continues_as_the_text_would(replicas):
    b, f, lm, secret = replicas["batched"], replicas["fifo"], replicas["lm"], replicas["secret"]
    first = b.submit(question(3, 10), []).result(60)
    opened = handles.decode(first.handle, secret)
    follow = ChatRequest(MODEL, (Message("user", "and then what"),), max_tokens=10, kv_handle=False)
    resent = ChatRequest(MODEL, opened.handle.messages + follow.messages, max_tokens=10, kv_handle=False)
    b.batcher.close()  # a fresh engine: nothing of the first turn left in its pages
    b.batcher = type(b.batcher)(lm, MODEL, b.agent.stop_ids, kv_tokens=4096)
    with Fed(lm.model) as fed:
        relayed = b.submit(follow, [opened]).result(60)
    as_text = f.submit(resent, []).result(60)
    assert relayed.uses[0].channel == "kv" and relayed.usage.relayed_tokens > 16
    assert relayed.token_ids == as_text.token_ids
    held = relayed.usage.relayed_tokens
    # the engine read only the tokens after the cache's whole pages of 16, then one per decode step
    assert fed.calls == [held % 16 + relayed.usage.prompt_tokens - held] + [1] * (len(relayed.token_ids) - 1)


def test_the_turn_cache_read_back_from_pages_matches_kvrelays_own(replicas):
    b, f, store, lm = replicas["batched"], replicas["fifo"], replicas["store"], replicas["lm"]
    req = question(4, 10)
    hb = handles.decode(b.submit(req, []).result(60).handle, replicas["secret"]).handle
    pb = get_payload(store, hb.key, expect=lm.identity)
    store.delete(hb.key)  # content-addressed: kvrelay's own turn would land under the same key
    hf = handles.decode(f.submit(req, []).result(60).handle, replicas["secret"]).handle
    pf = get_payload(store, hf.key, expect=lm.identity)
    assert hb.messages == hf.messages and hb.key == hf.key
    assert torch.equal(pb.token_ids, pf.token_ids) and torch.equal(pb.positions, pf.positions)
    for kb, kf, vb, vf in zip(pb.keys, pf.keys, pb.values, pf.values, strict=True):
        torch.testing.assert_close(kb, kf, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(vb, vf, rtol=1e-4, atol=1e-5)


def test_a_repeated_prompt_takes_the_pages_of_the_first_until_they_are_dropped(replicas):
    b, lm = replicas["batched"], replicas["lm"]
    req = ChatRequest(MODEL, question(5, 4).messages, max_tokens=4, kv_handle=False)
    b.batcher.drop_cached_pages()
    with Fed(lm.model) as cold:
        first = b.submit(req, []).result(60)
    with Fed(lm.model) as warm:
        again = b.submit(req, []).result(60)
    assert b.batcher.drop_cached_pages() > 0
    with Fed(lm.model) as dropped:
        third = b.submit(req, []).result(60)
    assert first.token_ids == again.token_ids == third.token_ids
    prompt = first.usage.prompt_tokens
    assert cold.calls[0] == prompt and dropped.calls[0] == prompt  # the whole prompt read
    assert warm.calls[0] == prompt - (prompt - 1) // 16 * 16  # whole pages before its last token reused


def test_batching_refuses_what_it_cannot_answer_as_alone(tiny_by_arch):
    from kvrelay.models.loader import with_engine
    from kvrelay.models.tiny import tiny_lm

    store = open_store(f"memory://batch-{uuid.uuid4().hex[:8]}")
    with pytest.raises(InvalidInput, match="sliding-window"):
        Replica("g", tiny_by_arch["gemma3"], store, b"k" * 16, batch=True)
    lm = with_engine(tiny_lm("llama", seed=1), "int8")
    with pytest.raises(InvalidInput, match="same weights"):
        Replica("l", lm, store, b"k" * 16, batch=True)


def test_concurrent_clients_through_the_gateway(replicas):
    openai = pytest.importorskip("openai")
    from kvrelay.serve.pool import Pool
    from kvrelay.serve.server import Gateway, ServeConfig

    pool = Pool({MODEL: (replicas["batched"],)})
    config = ServeConfig(models=(MODEL,), port=0, max_tokens=12, limit_max_tokens=64)
    g = Gateway(config, pool=pool, store=replicas["store"], secret=replicas["secret"])
    msgs = [[{"role": "user", "content": question(i, 12).messages[0].content}] for i in range(4)]
    with g as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def ask(m):
            return c.chat.completions.create(model=MODEL, messages=m, max_tokens=12).choices[0].message.content

        def stream(m):
            return "".join(ch.choices[0].delta.content or "" for ch in
                           c.chat.completions.create(model=MODEL, messages=m, max_tokens=12, stream=True)
                           if ch.choices)

        alone = [ask(m) for m in msgs]
        with ThreadPoolExecutor(8) as ex:
            together = list(ex.map(ask, msgs))
            streamed = list(ex.map(stream, msgs))
    assert together == alone and streamed == alone
