"""A gateway's /readyz follows its store: 503 while the store is unreachable (so the load balancer and
Kubernetes take it out of rotation), 200 again once it answers. The store is reached through a TCP proxy
the test stops and restarts, so Redis really is unreachable from the gateway."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import redis.asyncio as aioredis

from server.gateway.server import Gateway, GatewaySettings
from server.store.keys import Keys
from server.store.requests import RequestStore, Settings
from server.store.sessions import SessionStore
from tests.gateway.proxy import DropProxy


async def _get(port: int, path: str) -> tuple[int, str]:
    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    return await asyncio.get_running_loop().run_in_executor(None, get)


async def _until(port: int, want: tuple[int, str], within_s: float = 20.0) -> None:
    """Until /readyz answers ``want``'s status with a body starting with ``want``'s text (a gateway with
    no live worker adds what it waits for: test_worker_probes.py)."""
    deadline = time.monotonic() + within_s
    got = await _get(port, "/readyz")
    while not (got[0] == want[0] and got[1].startswith(want[1])) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        got = await _get(port, "/readyz")
    assert got[0] == want[0] and got[1].startswith(want[1]), got


async def test_gateway_readyz_is_503_while_its_store_is_unreachable(redis_url: str, keys: Keys) -> None:
    target = urlsplit(redis_url)
    proxy = DropProxy(target.port or 6379)
    proxy_port = await proxy.start()
    url = f"redis://127.0.0.1:{proxy_port}{target.path or '/0'}"
    r = aioredis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    reader = aioredis.from_url(url, socket_connect_timeout=2)
    store = RequestStore(r, keys, Settings())
    gw = Gateway(store, SessionStore(r, keys, b"s", 60_000), reader, GatewaySettings(port=0), name="gw-ready")
    port = await gw.start()
    try:
        await _until(port, (200, "ready"))
        await proxy.stop()  # Redis is now unreachable from this gateway
        await _until(port, (503, "store unreachable\n"))
        assert (await _get(port, "/healthz"))[0] == 200  # alive, just not ready: no restart wanted
        await proxy.start(proxy_port)
        await _until(port, (200, "ready"))
    finally:
        await gw.stop()
        await proxy.stop()
        await r.aclose()
        await reader.aclose()
