"""Closed connections' garbage goes back: the gateway's collector runs a full collection after connection
churn (the young-generation threshold of gctune makes full ones rare), and a closed WebSocket is not a
reference cycle through the front door's subprotocol hook."""

from __future__ import annotations

import asyncio
import gc
import weakref

import redis.asyncio as aioredis

from protocol import Chat, Params, Waiting
from server.client import Client
from server.gctune import ChurnCollector
from server.store.keys import Keys
from tests.fakes import FakeEngine
from tests.gateway.conftest import running_server


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_full_collection_comes_after_churn_and_frees_old_cycles() -> None:
    c = ChurnCollector(churn=3, min_interval_s=1.0, idle_interval_s=10.0)
    gc.collect()
    x = _Cycle()
    ref = weakref.ref(x)
    gc.collect()  # x survives: promoted to the oldest generation, as a long-lived connection would be
    del x
    assert ref() is not None  # garbage now, and only a full collection frees it
    assert not c.tick(1.0)  # no connection closed: nothing to do, however long it waits
    assert not c.tick(100.0)
    c.connection_closed()
    c.connection_closed()
    assert not c.tick(1.0)  # under the churn threshold and within the idle interval
    c.connection_closed()
    assert c.tick(1.0) and c.collections == 1 and c.closed == 0
    assert ref() is None


def test_a_single_closed_connection_is_collected_after_the_idle_interval() -> None:
    c = ChurnCollector(churn=64, min_interval_s=1.0, idle_interval_s=5.0)
    c.connection_closed()
    assert [c.tick(1.0) for _ in range(5)] == [False, False, False, False, True]
    assert [c.tick(1.0) for _ in range(10)] == [False] * 10  # nothing closed since


async def test_a_closed_websocket_is_freed_without_a_full_collection(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    """With the collector off, a connection that streamed, was cancelled mid-reply and closed must be
    freed by reference counting alone: no cycle through the send's timeout, the stream task or the
    websockets parser's last exception (each held the connection, and its last frames read, until a
    full collection)."""
    engine = FakeEngine(step_s=0.05, reply_len=200)  # still streaming when the client goes
    async with running_server(redis, redis_url, keys, engine=engine) as server:
        gc.collect()
        gc.disable()
        try:
            c = await Client.connect(server.url)
            chat = c.chat("a long reply please", id="long-1", params=Params(max_tokens=200))
            first = await anext(chat)  # accepted: the stream task runs
            assert first is not None
            conn = next(iter(server.gateway.connections))
            ref, ws_ref = weakref.ref(conn), weakref.ref(conn.ws)
            del conn, first
            await c.close()
            for _ in range(100):
                if ref() is None and ws_ref() is None:
                    break
                await asyncio.sleep(0.02)
            assert ref() is None, "the gateway's Connection outlived its close: a reference cycle holds it"
            assert ws_ref() is None, "websockets' ServerConnection outlived its close"
        finally:
            gc.enable()


async def test_a_closed_websocket_with_a_waiting_turn_is_freed_without_a_full_collection(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    """A content-mode turn waiting for the previous one is a task cancelled when its connection closes;
    its CancelledError's traceback holds the connection, so the connection must not hold that task."""
    engine = FakeEngine(step_s=0.05, reply_len=200)
    async with running_server(redis, redis_url, keys, engine=engine) as server:
        gc.collect()
        gc.disable()
        try:
            c = await Client.connect(server.url)
            await c.send(Chat(id="first", content="a long story", params=Params(max_tokens=200)))
            await c.send(Chat(id="second", content="and then?", params=Params(max_tokens=8)))
            seen: set[str] = set()
            while "second" not in seen:  # accepted, then waiting (SPEC §4.2)
                frame = await asyncio.wait_for(c.recv(), 5)
                if isinstance(frame, Waiting):
                    seen.add(frame.id)
            conn = next(iter(server.gateway.connections))
            assert conn._waiting, "the second turn should be waiting"
            ref = weakref.ref(conn)
            del conn, frame
            await c.close()
            for _ in range(100):
                if ref() is None:
                    break
                await asyncio.sleep(0.02)
            assert ref() is None, "the Connection outlived its close: its waiting turn's task holds it"
        finally:
            gc.enable()


async def test_the_gateway_counts_closed_connections_of_every_door_and_never_opened_ones(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    """Only closes make a full collection due: clients that connect and stay are never walked for nothing
    (a full collection with thousands of them held stalls every ping)."""
    async with running_server(redis, redis_url, keys) as server:
        collector = server.gateway.collector
        host, port = server.url.removeprefix("ws://").split("/", 1)[0].rsplit(":", 1)

        async def until_closed(n: int) -> None:
            for _ in range(250):
                if collector.closed >= n:
                    break
                await asyncio.sleep(0.02)
            assert collector.closed == n

        clients = [await Client.connect(server.url) for _ in range(3)]
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 ")
        silent = await asyncio.open_connection(host, int(port))  # no request line yet
        await asyncio.sleep(0.2)
        assert collector.closed == 0  # five open, none closed: nothing due
        await clients[0].close()
        await until_closed(1)  # a WebSocket
        writer.close()
        await writer.wait_closed()
        await until_closed(2)  # an HTTP connection
        silent[1].close()
        await silent[1].wait_closed()
        await until_closed(3)  # closed before its first request line
        for c in clients[1:]:
            await c.close()
        await until_closed(5)
