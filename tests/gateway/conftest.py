"""A real gateway on port 0 over a real store, with the fake engine (or any engine) behind a real worker."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from server.engine.api import Engine
from server.gateway.server import WS_PATH, Gateway, GatewaySettings
from server.store.keys import CLUSTER_PARTITIONS, Keys
from server.store.requests import RequestStore, Settings
from server.store.sessions import SessionStore
from server.worker.loop import Worker
from tests.conftest import delete_prefix, delete_prefix_cluster
from tests.fakes import FakeEngine

# Tests marked with ON_BOTH run twice: on the plain test Redis and on the session's 3-master Valkey
# cluster (tests/conftest.py), where every request lives in one of CLUSTER_PARTITIONS partitions.
ON_BOTH = pytest.mark.parametrize("backend", ["redis", "cluster"], indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return str(getattr(request, "param", "redis"))


@pytest.fixture
def redis_url(redis_url: str, backend: str, request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("cluster_url")) if backend == "cluster" else redis_url


@pytest.fixture
def keys(backend: str) -> Keys:
    import uuid

    return Keys(f"twtest:{uuid.uuid4().hex[:10]}:", CLUSTER_PARTITIONS if backend == "cluster" else 1)


def client(url: str, cluster: bool) -> Any:
    return RedisCluster.from_url(url) if cluster else aioredis.from_url(url)


@pytest.fixture
async def redis(redis_url: str, keys: Keys, backend: str) -> AsyncIterator[Any]:
    r = client(redis_url, backend == "cluster")
    yield r
    await r.aclose()
    (delete_prefix_cluster if backend == "cluster" else delete_prefix)(redis_url, keys.prefix)


@dataclass
class Running:
    url: str
    port: int
    engine: Any
    store: RequestStore
    gateway: Gateway
    workers: list[Worker] = field(default_factory=list)


@contextlib.asynccontextmanager
async def running_server(
    redis: aioredis.Redis,
    redis_url: str,
    keys: Keys,
    *,
    engine: Engine | None = None,
    gateway: GatewaySettings | None = None,
    store: Settings | None = None,
) -> AsyncIterator[Running]:
    reader_r = client(redis_url, isinstance(redis, RedisCluster))
    st = RequestStore(redis, keys, store or Settings())
    sessions = SessionStore(redis, keys, b"test-secret", 60_000)
    eng: Any = engine or FakeEngine()
    worker = Worker(st, eng, name=f"worker-{keys.prefix}")
    await worker.start()
    gw = Gateway(st, sessions, reader_r, gateway or GatewaySettings(port=0), name=f"gw-{keys.prefix}")
    port = await gw.start()
    try:
        yield Running(f"ws://127.0.0.1:{port}{WS_PATH}", port, eng, st, gw, [worker])
    finally:
        await gw.stop()
        await worker.stop()
        await reader_r.aclose()


@pytest.fixture
async def server(redis: aioredis.Redis, redis_url: str, keys: Keys) -> AsyncIterator[Running]:
    async with running_server(redis, redis_url, keys) as s:
        yield s
