"""``tokenwire serve``: gateway and worker in one process, over the same store code as a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis
import structlog

from server.gateway.server import WS_PATH, Gateway, GatewaySettings
from server.store.keys import Keys
from server.store.requests import RequestStore, Settings
from server.store.sessions import SessionStore, shared_secret

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ServeConfig:
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    store: Settings = field(default_factory=Settings)
    redis_url: str | None = None
    data_dir: Path = Path(".tokenwire")
    key_prefix: str = "tw:"
    model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    session_secret: str | None = None
    max_running: int = 64


async def serve(cfg: ServeConfig, *, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (or SIGINT/SIGTERM)."""
    from server.store.embedded import EmbeddedValkey

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    valkey: EmbeddedValkey | None = None
    url = cfg.redis_url
    if url is None:
        valkey = EmbeddedValkey(cfg.data_dir)
        url = await loop.run_in_executor(None, valkey.start)
    r = aioredis.from_url(url)
    reader_r = aioredis.from_url(url)
    keys = Keys(cfg.key_prefix)
    store = RequestStore(r, keys, cfg.store)
    secret = await shared_secret(r, keys, cfg.session_secret)
    sessions = SessionStore(r, keys, secret, cfg.store.session_ttl_ms)

    state: dict[str, object] = {}
    gateway = Gateway(store, sessions, reader_r, cfg.gateway, ready=lambda: "worker" in state)
    port = await gateway.start()
    # The line tests and scripts wait for; stdout, unbuffered.
    print(f"tokenwire listening on ws://{cfg.gateway.host}:{port}{WS_PATH}", flush=True)

    async def start_worker() -> None:
        from server.engine.model import load_model
        from server.engine.simple import SimpleEngine
        from server.worker.loop import Worker

        loaded = await loop.run_in_executor(
            None, lambda: load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
        )
        engine = SimpleEngine(loaded)
        worker = Worker(store, engine, max_running=cfg.max_running)
        await worker.start()
        state["worker"] = worker
        state["engine"] = engine
        print(f"tokenwire ready: model {loaded.name} on {loaded.device}", flush=True)

    worker_task = asyncio.create_task(start_worker())
    stop_task = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({worker_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if worker_task in done and worker_task.exception() is not None:
            exc = worker_task.exception()
            print(f"tokenwire: cannot start the worker: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        await stop.wait()
    finally:
        log.info("serve.stopping")
        worker_task.cancel()
        await gateway.stop()
        worker = state.get("worker")
        if worker is not None:
            await worker.stop()  # type: ignore[attr-defined]
        await r.aclose()
        await reader_r.aclose()
        if valkey is not None:
            valkey.stop()
