"""A real gateway on port 0 over a real store, with the fake engine (or any engine) behind a real worker."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis

from server.engine.api import Engine
from server.gateway.server import WS_PATH, Gateway, GatewaySettings
from server.store.keys import Keys
from server.store.requests import RequestStore, Settings
from server.store.sessions import SessionStore
from server.worker.loop import Worker
from tests.fakes import FakeEngine


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
    reader_r = aioredis.from_url(redis_url)
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
