"""Hostile clients: chat floods, foreign origins, slow readers, more work than the queue allows."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from protocol import Accepted, Chat, Done, Error, Message, Params, Resume
from server.client import Client, collect
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from server.store.requests import Settings
from tests.gateway.conftest import running_server
from tests.gateway.raw_ws import RawClient


async def test_chat_flood_is_rate_limited_with_retry_after(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    async with running_server(
        redis, redis_url, keys, gateway=GatewaySettings(port=0, chat_rate_per_connection=5)
    ) as server:
        c = await Client.connect(server.url)
        flood = (Message("user", "flood"),)  # messages mode: never waits, so only the bucket decides
        for i in range(30):
            await c.send(Chat(id=f"f{i}", messages=flood, params=Params(max_tokens=2)))
        limited, accepted = [], []
        while len(limited) + len(accepted) < 30:
            f = await c.recv()
            if isinstance(f, Error):
                limited.append(f)
            elif isinstance(f, Accepted):
                accepted.append(f)
        assert 10 <= len(accepted) < 30  # the burst (2 x rate) gets through, the rest is refused
        assert all(e.code == "rate_limited" and e.retry_after_ms and e.retry_after_ms > 0 for e in limited)
        await asyncio.sleep(0.5)  # tokens refill: the same connection works again
        _, _, done, errors = await collect(c.chat("after the flood", params=Params(max_tokens=2)))
        assert errors == [] and done is not None
        await c.close()


async def test_origin_allowlist(redis: aioredis.Redis, redis_url: str, keys: Keys) -> None:
    gw = GatewaySettings(port=0, allowed_origins=("https://chat.example",))
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        with pytest.raises(InvalidStatus) as exc:
            await connect(server.url, subprotocols=["tokenwire.v1.msgpack"], origin="https://evil.example")  # type: ignore[list-item,arg-type]
        assert exc.value.response.status_code == 403
        ok = await connect(server.url, subprotocols=["tokenwire.v1.msgpack"], origin="https://chat.example")  # type: ignore[list-item,arg-type]
        await ok.close()
        app = await Client.connect(server.url)  # no Origin header: a native app or a script
        await app.close()


async def _raw_client_that_never_reads(port: int, frames: list[dict[str, object]]) -> asyncio.StreamWriter:
    """Handshake, send frames, then never read again: the kernel buffers fill and stay full."""
    sock = socket.socket()
    # A small receive buffer turns off autotuning: like a phone on a bad link, it takes almost nothing.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    c = await RawClient.connect(port, sock=sock)
    for frame in frames:
        c.send_frame(frame)
    await c.writer.drain()
    return c.writer


async def test_slow_reader_is_closed_and_can_resume(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, slow_reader_timeout_s=1.0)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        server.engine.reply_len = 400
        server.engine.step_s = 0.001
        server.engine.pad = "x" * 65536  # 400 deltas of 64 KiB: far more than the socket buffers hold
        token_holder = await Client.connect(server.url)  # only to own a session the slow client joins
        assert token_holder.welcome is not None
        token = token_holder.welcome.session_token
        await token_holder.close()
        hello = {"type": "hello", "v": 1, "session_token": token}
        chat = {"type": "chat", "id": "big", "content": "send a lot", "params": {"max_tokens": 400}}
        writer = await _raw_client_that_never_reads(server.port, [hello, chat])
        closed = False
        for _ in range(100):
            await asyncio.sleep(0.1)
            if not server.gateway.connections:
                closed = True
                break
        writer.transport.abort()
        assert closed  # the gateway closed it rather than buffer the stream without bound
        # The request ran on, and the client resumes it after reconnecting.
        back = await Client.connect(server.url, session_token=token)
        await back.send(Resume(id="big", offset=0))
        text, _, done, _ = await collect(back.frames_for("big"))
        assert done is not None and done.offset == 400 and len(text) > 400 * 65536
        await back.close()


async def test_overload_refuses_excess_and_completes_the_rest(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    async with running_server(redis, redis_url, keys, store=Settings(max_queued=3)) as server:
        for w in server.workers:
            w.max_running = 1  # one at a time, so the queue fills
        server.engine.step_s = 0.02
        clients = [await Client.connect(server.url) for _ in range(12)]
        results = await asyncio.gather(
            *(
                collect(c.chat(f"user {i}", id=f"o{i}", params=Params(max_tokens=5)))
                for i, c in enumerate(clients)
            )
        )
        refused = [r for r in results if r[3]]
        served = [r for r in results if not r[3]]
        assert refused and served
        for _, _, done, errors in refused:
            assert done is None and [e.code for e in errors] == ["overloaded"]
            assert errors[0].retry_after_ms is not None and errors[0].retry_after_ms > 0
        assert all(isinstance(done, Done) and done.offset == 5 for _, _, done, _ in served)
        for c in clients:
            await c.close()


async def test_degradation_clamps_and_truncates_past_the_queue_threshold(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, degrade_queue_depth=10, degrade_max_tokens=4, degrade_context_messages=2)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        history = [{"role": "system", "content": "be brief"}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(9)
        ]
        c = await Client.connect(server.url)
        text, _, done, _ = await collect(c.chat(messages=history, params=Params(max_tokens=10, seed=1)))
        assert done is not None and done.offset == 10 and text.startswith("re[10]")  # calm: untouched
        await redis.set(keys.queued_count(), 50)  # a deep queue
        await asyncio.sleep(1.1)  # the gateway reads the depth at most once a second
        text, _, done, _ = await collect(c.chat(messages=history, params=Params(max_tokens=10, seed=1)))
        assert done is not None and done.offset == 4 and done.finish_reason == "length"
        assert text.startswith("re[3]")  # the system prompt and the latest two messages
        await c.close()


async def test_requests_in_flight_per_user_are_capped(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    async with running_server(redis, redis_url, keys, store=Settings(max_inflight_per_user=2)) as server:
        server.engine.step_s = 0.02
        c = await Client.connect(server.url)
        # messages mode: content-mode turns of one session run one after another (SPEC §4.2), so only
        # independent chats can be in flight together.
        go = (Message(role="user", content="go"),)
        for i in range(2):
            await c.send(Chat(id=f"long{i}", messages=go, params=Params(max_tokens=10)))
        await c.send(Chat(id="third", messages=go, params=Params(max_tokens=10)))
        frames = []
        while not any(isinstance(f, Error) for f in frames):
            frames.append(await c.recv())
        [refused] = [f for f in frames if isinstance(f, Error)]
        assert (refused.id, refused.code) == ("third", "rate_limited")
        assert refused.retry_after_ms and "at most 2 requests" in refused.message
        other = await Client.connect(server.url)  # another user (another anonymous session)
        _, _, done, errors = await collect(other.chat("me too", params=Params(max_tokens=2)))
        assert errors == [] and done is not None
        dones = sum(isinstance(f, Done) for f in frames)
        while dones < 2:
            dones += isinstance(await c.recv(), Done)
        # Both have finished: the same id goes through now (nothing was created the first time).
        await c.send(Chat(id="third", messages=go, params=Params(max_tokens=10)))
        done = None
        while done is None:
            f = await c.recv()
            assert not isinstance(f, Error), f
            if isinstance(f, Done) and f.id == "third":
                done = f
        await c.close()
        await other.close()
