"""A real gateway on port 0 over a real store, with the fake engine behind a real worker loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from server.gateway.server import WS_PATH, Gateway, GatewaySettings
from server.store.keys import Keys
from server.store.requests import RequestStore
from server.store.sessions import SessionStore
from server.worker.loop import Worker
from tests.fakes import FakeEngine


@dataclass
class Running:
    url: str
    port: int
    engine: FakeEngine
    store: RequestStore
    gateway: Gateway


@pytest.fixture
async def server(redis: aioredis.Redis, redis_url: str, keys: Keys) -> AsyncIterator[Running]:
    reader_r = aioredis.from_url(redis_url)
    store = RequestStore(redis, keys)
    sessions = SessionStore(redis, keys, b"test-secret", 60_000)
    engine = FakeEngine()
    worker = Worker(store, engine, name="test-worker")
    await worker.start()
    gw = Gateway(store, sessions, reader_r, GatewaySettings(port=0), name="test-gw")
    port = await gw.start()
    yield Running(f"ws://127.0.0.1:{port}{WS_PATH}", port, engine, store, gw)
    await gw.stop()
    await worker.stop()
    await reader_r.aclose()
