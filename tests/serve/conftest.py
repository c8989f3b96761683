"""A running gateway over two tiny models (qwen2 with two replicas, llama with one), a memory store,
and the official ``openai`` client pointed at it. The replicas are placed on one host that runs one busy
replica at full speed (``serve.hosts``), whatever machine the tests run on."""

from __future__ import annotations

import uuid

import pytest

openai = pytest.importorskip("openai")  # a dev dependency: present wherever `make test` runs


@pytest.fixture(scope="module")
def gateway():
    from kvrelay.models.tiny import tiny_lm
    from kvrelay.serve import handles
    from kvrelay.serve.hosts import Placement
    from kvrelay.serve.pool import Pool
    from kvrelay.serve.replica import Replica
    from kvrelay.serve.server import Gateway, ServeConfig
    from kvrelay.transport.stores import open_store

    secret = handles.new_secret()
    store = open_store(f"memory://serve-{uuid.uuid4().hex[:8]}")
    qwen, llama = tiny_lm("qwen2", name="tiny:qwen2"), tiny_lm("llama", name="tiny:llama")
    here = Placement(f"serve-tests-{uuid.uuid4().hex[:8]}", cores=2, threads=2)  # one slot
    pool = Pool({"tiny:qwen2": tuple(Replica("tiny:qwen2", qwen, store, secret, placement=here) for _ in range(2)),
                 "tiny:llama": (Replica("tiny:llama", llama, store, secret, placement=here),)})
    config = ServeConfig(models=("tiny:qwen2", "tiny:llama"), port=0, max_tokens=12, limit_max_tokens=64)
    g = Gateway(config, pool=pool, store=store, secret=secret)
    with g as url:
        yield {"url": url, "store": store, "secret": secret, "pool": pool, "server": g,
               "client": openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)}
