"""Shared fixtures: tiny random models (no download), zoo models for integration tests, and a real Redis
(``$KVRELAY_REDIS_URL`` when CI started one, else a private server)."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

torch.set_num_threads(int(os.environ.get("KVRELAY_TEST_THREADS", "2")))  # 1 under mutation testing (fork-safe)

ARCHS = ("llama", "qwen2", "gemma3")


@pytest.fixture(scope="session", params=ARCHS)
def tiny(request):
    from kvrelay.models.tiny import tiny_lm

    return tiny_lm(request.param)


@pytest.fixture(scope="session")
def tiny_by_arch():
    from kvrelay.models.tiny import tiny_lm

    return {a: tiny_lm(a) for a in ARCHS}


def random_ids(n: int, seed: int, vocab: int = 60, low: int = 9) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n,), generator=g).tolist()

def missing_service(what: str, why: str) -> None:
    """A test cannot get a service it needs: skip on a developer's machine, FAIL under ``CI`` (.ci/run
    provides every service, so a missing one there is a broken CI, not a reason to pass)."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is needed but unavailable, and CI is set ({why}): .ci/run must provide it",
                    pytrace=False)
    pytest.skip(f"{what} unavailable: {why}", allow_module_level=True)


@pytest.fixture(scope="session")
def redis_url():
    url = os.environ.get("KVRELAY_REDIS_URL")
    if url:
        import redis

        try:
            redis.Redis.from_url(url, socket_connect_timeout=5).ping()
        except redis.RedisError as e:
            missing_service("Redis", f"KVRELAY_REDIS_URL={url} does not answer PING: {e}")
        yield url
        return
    from kvrelay.transport.redis_server import RedisServer, RedisServerError

    try:
        server = RedisServer().start()
    except RedisServerError as e:
        missing_service("redis-server", str(e))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_namespace():
    """A namespace of our own: the server may be shared with other test runs."""
    return f"kvrelay-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_store(redis_url, redis_namespace):
    from kvrelay.transport.stores import RedisStore

    store = RedisStore(redis_url, namespace=redis_namespace)
    yield store
    store.clear()
    store.close()
