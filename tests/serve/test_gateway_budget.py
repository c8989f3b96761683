"""A receiver under a byte budget: the gateway's replicas store each turn's cache in a store opened with
``?max_bytes=N&evict=POLICY``. Under ``lru`` a new conversation's cache pushes out the least recently used
one, whose handle then falls back to text and says its cache is missing; under ``refuse`` a cache that does
not fit is not stored, and the response says why instead of giving a handle. Either way the answers are
the ones the model gives without a budget."""

from __future__ import annotations

import uuid
from contextlib import contextmanager

import pytest

from tests.serve.test_gateway import FIRST, QWEN, SECOND, ask, ext

openai = pytest.importorskip("openai")

OTHER = [{"role": "system", "content": "you check the plan"}, {"role": "user", "content": "who wrote the plan"}]


@contextmanager
def gateway(query: str = ""):
    from kvrelay.models.tiny import tiny_lm
    from kvrelay.serve import handles
    from kvrelay.serve.pool import Pool
    from kvrelay.serve.replica import Replica
    from kvrelay.serve.server import Gateway, ServeConfig
    from kvrelay.transport.stores import open_store

    secret = handles.new_secret()
    store = open_store(f"memory://serve-budget-{uuid.uuid4().hex[:8]}{query}")
    pool = Pool({QWEN: (Replica(QWEN, tiny_lm("qwen2", name=QWEN), store, secret),)})
    g = Gateway(ServeConfig(models=(QWEN,), port=0, max_tokens=12, limit_max_tokens=64), pool=pool, store=store,
                secret=secret)
    with g as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), store, secret


def _key(resp, secret) -> str:
    from kvrelay.serve import handles

    return handles.decode(ext(resp)["handle"], secret).handle.key


def _continue(client, handle):
    return client.chat.completions.create(model=QWEN, messages=[SECOND], max_tokens=12,
                                          extra_body={"kv_context": [handle], "kv_handle": False})


@pytest.fixture(scope="module")
def unbudgeted():
    """Answers and cache sizes without a budget: FIRST, OTHER, and SECOND continuing each."""
    with gateway() as (c, store, secret):
        a, b = ask(c, FIRST), ask(c, OTHER)
        sizes = [store.get_bytes(_key(r, secret)).nbytes for r in (a, b)]
        follow = [_continue(c, ext(r)["handle"]).choices[0].message.content for r in (a, b)]
    assert all(ext(_)["handle"] for _ in (a, b))
    return {"answers": [a.choices[0].message.content, b.choices[0].message.content], "sizes": sizes,
            "follow": follow}


def _one_not_two(sizes) -> int:
    assert max(sizes) + 64 < sum(sizes)
    return max(sizes) + 64


def test_lru_pushes_out_the_least_recently_used_cache(unbudgeted):
    with gateway(f"?max_bytes={_one_not_two(unbudgeted['sizes'])}&evict=lru") as (c, store, secret):
        a, b = ask(c, FIRST), ask(c, OTHER)  # OTHER's cache pushes FIRST's out
        assert [a.choices[0].message.content, b.choices[0].message.content] == unbudgeted["answers"]
        assert not store.contains(_key(a, secret)) and store.contains(_key(b, secret))
        got_a, got_b = _continue(c, ext(a)["handle"]), _continue(c, ext(b)["handle"])
    assert ext(got_a)["context"][0]["channel"] == "text" and ext(got_a)["context"][0]["fallback"] == "missing"
    assert ext(got_b)["context"][0]["channel"] == "kv" and got_b.usage.prompt_tokens_details.cached_tokens > 0
    assert [got_a.choices[0].message.content, got_b.choices[0].message.content] == unbudgeted["follow"]


def test_refuse_answers_without_a_handle_and_says_why(unbudgeted):
    with gateway(f"?max_bytes={_one_not_two(unbudgeted['sizes'])}&evict=refuse") as (c, store, secret):
        a, b = ask(c, FIRST), ask(c, OTHER)
        assert [a.choices[0].message.content, b.choices[0].message.content] == unbudgeted["answers"]
        assert ext(b)["handle"] is None and ext(b)["handle_error"].startswith("OverBudget: ")
        assert "handle_error" not in ext(a)
        got_a = _continue(c, ext(a)["handle"])  # what was stored first is still there
    assert ext(got_a)["context"][0]["channel"] == "kv"
    assert got_a.choices[0].message.content == unbudgeted["follow"][0]
