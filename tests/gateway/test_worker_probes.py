"""A worker's probe port: /healthz and /readyz follow the worker's real state, /metrics still parses."""

from __future__ import annotations

import asyncio
import http.client
import socket
import time
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from server.store.keys import Keys
from server.store.requests import RequestStore, Settings
from server.worker.loop import Worker
from server.worker.probes import serve_probes
from tests.fakes import FakeEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _get(port: int, path: str) -> tuple[int, str]:
    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    return await asyncio.get_running_loop().run_in_executor(None, get)


async def test_probes_follow_loading_ready_wedged_and_draining(redis: aioredis.Redis, keys: Keys) -> None:
    port = _free_port()
    probes = serve_probes(port, "127.0.0.1")
    assert await _get(port, "/healthz") == (200, "loading the model\n")  # alive: loading is not a failure
    assert await _get(port, "/readyz") == (503, "loading the model\n")

    engine = FakeEngine()
    worker = Worker(RequestStore(redis, keys, Settings(lease_ttl_ms=3000)), engine, name=f"w-{keys.prefix}")
    await worker.start()  # holds a lease (one heartbeat) before taking work
    probes.worker = worker
    try:
        assert await _get(port, "/healthz") == (200, "ok\n")
        assert await _get(port, "/readyz") == (200, "ok\n")
        status, body = await _get(port, "/metrics")
        assert status == 200 and any(
            f.name.startswith("tokenwire_") for f in text_string_to_metric_families(body)
        )

        worker.last_heartbeat = worker.last_heartbeat - 10  # type: ignore[operator]  # Redis went away
        status, body = await _get(port, "/readyz")
        assert status == 503 and "heartbeat" in body
        assert (await _get(port, "/healthz"))[0] == 200  # not restarted for it
        await asyncio.sleep(worker.lease_period_s + 0.5)  # the lease loop heartbeats again
        assert await _get(port, "/readyz") == (200, "ok\n")

        worker.last_tick -= 60  # the event loop has stopped running the lease loop
        assert (await _get(port, "/healthz"))[0] == 503
        assert (await _get(port, "/readyz"))[0] == 503
        await asyncio.sleep(worker.lease_period_s + 0.5)
        assert (await _get(port, "/healthz"))[0] == 200

        await worker.drain(1.0)  # takes no more work; the engine stops with the worker
        assert worker.draining
        status, body = await _get(port, "/readyz")
        assert status == 503
        status, body = await _get(port, "/healthz")
        assert status == 503 and "engine" in body  # a stopped engine thread
    finally:
        if engine.alive():
            await worker.stop()


def test_engine_alive_follows_its_thread() -> None:
    engine = FakeEngine()
    assert not engine.alive()
    engine.start(lambda outs: None)
    assert engine.alive()
    engine.stop()
    assert not engine.alive()


def test_readiness_reasons() -> None:
    probes = serve_probes(_free_port(), "127.0.0.1")
    w: Any = SimpleNamespace(
        engine_alive=lambda: True,
        last_tick=0.0,
        lease_period_s=1.0,
        lease_ttl_s=3.0,
        last_heartbeat=None,
        draining=False,
        store_ok=True,
    )
    probes.worker = w
    now = time.monotonic()
    w.last_tick = now
    assert probes.ready() == (False, "no heartbeat has reached Redis within the lease TTL")
    w.last_heartbeat = now
    assert probes.ready() == (True, "ok")
    w.store_ok = False
    assert probes.ready() == (False, "Redis is unreachable")
    w.store_ok = True
    w.draining = True
    assert probes.ready() == (False, "draining")
    assert probes.live() == (True, "ok")  # draining is not dying


async def test_probe_port_answers_404_for_other_paths_and_405_for_other_methods() -> None:
    port = _free_port()
    serve_probes(port, "127.0.0.1")

    def request(method: str, path: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request(method, path)
            return conn.getresponse().status
        finally:
            conn.close()

    loop = asyncio.get_running_loop()
    for method, path, status in [
        ("GET", "/", 404),
        ("GET", "/nope", 404),
        ("GET", "/metrics", 200),
        ("POST", "/metrics", 405),
        ("DELETE", "/healthz", 405),
        ("PUT", "/readyz", 405),
    ]:
        assert await loop.run_in_executor(None, request, method, path) == status, (method, path)


async def test_a_cluster_gateway_is_ready_without_workers_and_says_so(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    """A gateway of a cluster answers /readyz 200 as soon as it reaches the store (it accepts, resumes
    and queues), and its body says when no live worker serves the default model yet (issue 29)."""
    from redis.asyncio.cluster import RedisCluster

    from server.gateway.server import Gateway, GatewaySettings
    from server.store.sessions import SessionStore
    from tests.gateway.conftest import client

    store = RequestStore(redis, keys, Settings())
    reader = client(redis_url, isinstance(redis, RedisCluster))
    gw = Gateway(store, SessionStore(redis, keys, b"s", 60_000), reader, GatewaySettings(port=0), name="g")
    port = await gw.start()
    worker: Worker | None = None
    try:
        status, body = await _get(port, "/readyz")
        assert status == 200 and "no live worker serves the default model" in body
        worker = Worker(store, FakeEngine(), name=f"w-{keys.prefix}", model_name="tiny")
        await worker.start()
        deadline = time.monotonic() + 15
        while (await _get(port, "/readyz")) != (200, "ready\n"):
            assert time.monotonic() < deadline, "the gateway never saw the worker's model"
            await asyncio.sleep(0.2)
    finally:
        if worker is not None:
            await worker.stop()
        await gw.stop()
        await reader.aclose()


async def test_an_empty_step_does_not_mark_an_unreachable_store_reachable(
    redis: aioredis.Redis, keys: Keys
) -> None:
    """After a shed, the engine's last outputs of the dropped requests make a step with nothing to write:
    it asks Redis nothing, so it must not say Redis answered (the worker would report ready, and take
    work, in the middle of an outage)."""
    worker = Worker(RequestStore(redis, keys, Settings()), FakeEngine(), name=f"w-{keys.prefix}empty")
    worker._store_failed(ConnectionError("Redis is away"))
    assert await worker._write([]) == []
    assert not worker.store_ok
    assert not worker._store_up.is_set()
