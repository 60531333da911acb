"""glibc's fixed mmap threshold (``app.return_freed_memory_to_the_os``) is set in a gateway process and
never in ``tokenwire serve``, whose engine would then mmap and unmap its large tensors on every step."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import server.app as app
from server.app import ServeConfig, StoreHandles
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from server.store.requests import Settings


def _cfg(redis_url: str, keys: Keys) -> ServeConfig:
    return ServeConfig(
        gateway=GatewaySettings(port=0), store=Settings(), redis_url=redis_url, key_prefix=keys.prefix
    )


@pytest.fixture
def tuned(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(app, "return_freed_memory_to_the_os", lambda: calls.append("mallopt"))
    return calls


async def _run_until_listening(coro: Any, listening: asyncio.Event) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(coro(stop))
    await asyncio.wait_for(listening.wait(), 30)
    stop.set()
    await asyncio.wait_for(task, 30)


async def test_a_gateway_process_returns_big_blocks_to_the_os(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, keys: Keys, redis: Any, tuned: list[str]
) -> None:
    listening = asyncio.Event()
    real = app.start_gateway

    async def spy(*a: Any, **kw: Any) -> Any:
        g = await real(*a, **kw)
        listening.set()
        return g

    monkeypatch.setattr(app, "start_gateway", spy)
    await _run_until_listening(lambda stop: app.run_gateway(_cfg(redis_url, keys), stop=stop), listening)
    assert tuned == ["mallopt"]


async def test_serve_leaves_malloc_to_the_engine(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, keys: Keys, redis: Any, tuned: list[str]
) -> None:
    started = asyncio.Event()

    class Worker:
        store_ok, model_name = True, "recording"

        async def drain(self, deadline_s: float) -> int:
            return 0

    async def fake_start_worker(cfg: ServeConfig, h: StoreHandles, *_: Any) -> Worker:
        started.set()
        return Worker()

    monkeypatch.setattr(app, "start_worker", fake_start_worker)
    await _run_until_listening(lambda stop: app.serve(_cfg(redis_url, keys), stop=stop), started)
    assert tuned == []
