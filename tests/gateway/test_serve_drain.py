"""``serve`` drains its worker for --drain-timeout, as ``worker`` does (it used to cap the drain at 2 s)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import server.app as app
from server.app import ServeConfig, StoreHandles
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from server.store.requests import Settings


class _RecordingWorker:
    def __init__(self) -> None:
        self.drained_for: float | None = None
        self.store_ok = True  # read by serve's /readyz
        self.model_name = "recording"  # shown by serve's UI config

    async def drain(self, deadline_s: float) -> int:
        self.drained_for = deadline_s
        return 0


async def test_serve_drains_for_drain_timeout(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, keys: Keys, redis: Any
) -> None:
    worker = _RecordingWorker()
    started = asyncio.Event()

    async def fake_start_worker(cfg: ServeConfig, h: StoreHandles, *_: Any) -> _RecordingWorker:
        started.set()
        return worker

    monkeypatch.setattr(app, "start_worker", fake_start_worker)
    cfg = ServeConfig(
        gateway=GatewaySettings(port=0),
        store=Settings(),
        redis_url=redis_url,
        key_prefix=keys.prefix,
        drain_timeout_s=37.5,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(app.serve(cfg, stop=stop))
    await asyncio.wait_for(started.wait(), 30)
    stop.set()
    await asyncio.wait_for(task, 30)
    assert worker.drained_for == 37.5
