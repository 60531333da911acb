"""The store tests run twice: on a plain Redis (REDIS_URL or an embedded Valkey: one partition) and on a
real 3-master Valkey cluster (the session's ``cluster_url``: CLUSTER_PARTITIONS partitions, redis-py's
cluster client), so every script is proven single-slot and the partitioned work queue correct."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from server.store.keys import CLUSTER_PARTITIONS, Keys
from tests.conftest import delete_prefix, delete_prefix_cluster


@pytest.fixture(params=["redis", "cluster"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(backend: str, request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("cluster_url" if backend == "cluster" else "redis_url"))


@pytest.fixture
def keys(backend: str) -> Keys:
    prefix = f"twtest:{uuid.uuid4().hex[:10]}:"
    return Keys(prefix, CLUSTER_PARTITIONS if backend == "cluster" else 1)


@pytest.fixture
def new_client(backend: str, store_url: str) -> Callable[[], Any]:
    """Another client of the test's store (a log reader holds one of its own)."""
    if backend == "cluster":
        return lambda: RedisCluster.from_url(store_url)
    return lambda: aioredis.from_url(store_url)


@pytest.fixture
async def redis(
    backend: str, store_url: str, keys: Keys, new_client: Callable[[], Any]
) -> AsyncIterator[Any]:
    r = new_client()
    yield r
    await r.aclose()
    (delete_prefix_cluster if backend == "cluster" else delete_prefix)(store_url, keys.prefix)
