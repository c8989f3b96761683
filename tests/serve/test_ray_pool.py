"""Replicas as Ray actors: the same answers, streams and handles as replicas in process."""

from __future__ import annotations

import pytest

from tests.conftest import missing_service

openai = pytest.importorskip("openai")
try:
    import ray
except ImportError as e:  # ray is in the dev extra: missing only on a partial install
    missing_service("ray", str(e))

MODEL = "tiny:qwen2"
FIRST = [{"role": "user", "content": "what is the key in the vault and which file has the bug"}]
SECOND = [{"role": "user", "content": "which function has the error"}]


@pytest.fixture(scope="module")
def both(redis_url):
    from kvrelay.models.loader import load_model
    from kvrelay.serve import handles
    from kvrelay.serve.pool import in_process_pool
    from kvrelay.serve.server import Gateway, ServeConfig
    from kvrelay.transport.stores import open_store

    secret = handles.new_secret()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False,
             configure_logging=False)
    try:
        cfg = ServeConfig(models=(MODEL,), port=0, store=redis_url, max_tokens=10, ray=True, threads=1, replicas=2)
        store = open_store(redis_url)
        local = in_process_pool([(MODEL, load_model(MODEL))], store, secret)
        with Gateway(cfg, secret=secret) as ray_url, \
                Gateway(ServeConfig(models=(MODEL,), port=0, max_tokens=10), pool=local, store=store,
                        secret=secret) as local_url:
            yield [openai.OpenAI(base_url=u + "/v1", api_key="unused", max_retries=0) for u in (ray_url, local_url)]
    finally:
        ray.shutdown()


def test_actors_answer_stream_and_continue_like_in_process(both):
    on_ray, local = both
    a, b = (c.chat.completions.create(model=MODEL, messages=FIRST) for c in both)
    assert a.choices[0].message.content == b.choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       on_ray.chat.completions.create(model=MODEL, messages=FIRST, stream=True) if ch.choices)
    assert streamed == a.choices[0].message.content
    # a handle made by an actor continues on an actor and in process alike (one Redis store, one key)
    h = a.model_extra["kvrelay"]["handle"]
    c1, c2 = (c.chat.completions.create(model=MODEL, messages=SECOND, extra_body={"kv_context": [h]}) for c in both)
    assert c1.model_extra["kvrelay"]["context"][0]["channel"] == "kv"
    assert c2.model_extra["kvrelay"]["context"][0]["channel"] == "kv"
    assert c1.choices[0].message.content == c2.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        on_ray.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the " * 4100}])
    assert info.value.body["code"] == "context_length_exceeded"
