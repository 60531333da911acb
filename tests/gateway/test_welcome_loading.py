"""``welcome.loading`` (SPEC §5, issue 29): which models no worker serves yet, so that a client can say
why a reply waits ("queued: the model is still loading") instead of a plain "Connected"."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from protocol import Accepted, Chat
from server.client import Client
from server.gateway.server import WS_PATH, Gateway, GatewaySettings
from server.store.keys import Keys
from server.store.requests import RequestStore, Settings
from server.store.sessions import SessionStore
from server.worker.loop import Worker
from tests.fakes import FakeEngine
from tests.gateway.conftest import client


async def _welcome_loading(url: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    c = await Client.connect(url)
    try:
        assert c.welcome is not None
        return c.welcome.models, c.welcome.loading
    finally:
        await c.close()


async def test_a_cluster_gateway_says_the_default_model_is_loading_until_a_worker_serves_it(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    store = RequestStore(redis, keys, Settings())
    reader = client(redis_url, isinstance(redis, RedisCluster))
    gw = Gateway(store, SessionStore(redis, keys, b"s", 60_000), reader, GatewaySettings(port=0), name="g")
    port = await gw.start()
    url = f"ws://127.0.0.1:{port}{WS_PATH}"
    worker: Worker | None = None
    try:
        # No worker: the default model's name is unknown, and it is loading.
        assert await _welcome_loading(url) == ((), ("default",))
        # A chat is accepted all the same: it waits in the queue.
        c = await Client.connect(url)
        await c.send(Chat(id="r1", content="hi"))
        async for f in c.frames_for("r1"):
            assert isinstance(f, Accepted) and f.state == "queued"
            break
        await c.close()
        worker = Worker(store, FakeEngine(), name=f"w-{keys.prefix}", model_name="tiny")
        await worker.start()
        deadline = time.monotonic() + 15
        while (got := await _welcome_loading(url)) != (("tiny",), ()):
            assert time.monotonic() < deadline, f"the gateway never saw the worker's model: {got}"
            await asyncio.sleep(0.2)
    finally:
        if worker is not None:
            await worker.stop()
        await gw.stop()
        await reader.aclose()


async def test_serve_says_which_of_its_own_models_still_load(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    """serve knows its models from the command line and loads them one after another: each is listed
    in ``loading`` until its worker in this process has started."""
    store = RequestStore(redis, keys, Settings())
    reader = client(redis_url, isinstance(redis, RedisCluster))
    gw = Gateway(store, SessionStore(redis, keys, b"s", 60_000), reader, GatewaySettings(port=0), name="g")
    gw.models.local = ("big", "light")
    started: list[str] = []
    gw.models.started = lambda: started
    port = await gw.start()
    url = f"ws://127.0.0.1:{port}{WS_PATH}"
    try:
        assert await _welcome_loading(url) == (("big", "light"), ("big", "light"))
        started.append("big")
        assert await _welcome_loading(url) == (("big", "light"), ("light",))
        started.append("light")
        assert await _welcome_loading(url) == (("big", "light"), ())
    finally:
        await gw.stop()
        await reader.aclose()
