"""A real Redis for the transport tests: ``$KVRELAY_REDIS_URL`` (CI starts one) or a private server."""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture(scope="session")
def redis_url():
    url = os.environ.get("KVRELAY_REDIS_URL")
    if url:
        yield url
        return
    from kvrelay.relay.redis_server import RedisServer, RedisServerError

    try:
        server = RedisServer().start()
    except RedisServerError as e:
        pytest.skip(str(e))
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
    from kvrelay.relay.stores import RedisStore

    store = RedisStore(redis_url, namespace=redis_namespace)
    yield store
    store.clear()
    store.close()
