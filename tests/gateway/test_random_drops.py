"""Clients of every door drop at random points, many at once: before or in the middle of a frame or a body,
right after sending, in the middle of a reply, with a clean close or an abort. Once they are gone and their
replies have ended, the gateway holds nothing for them: no stream or waiting slot in admission, no attached
stream, no counted connection, no paced peer; and nothing on the way logged an error.

Each leak found so far (a grant kept by a task cancelled before it ran; a resume point that failed after it
was admitted) let enough drops refuse a user every stream until a restart. The earlier tests each pin one
path; this one looks for the whole class, at random points of every door. A failure names its seed and the
counters that were left, and the same seed replays the same mix of clients (not the same interleaving).
It found a closing socket held for websockets' close timeout (egress.py), which the tests at the end pin."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import jwt
import msgpack
import pytest
import redis.asyncio as aioredis
import structlog
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.frames import Frame, Opcode
from websockets.typing import Subprotocol

from protocol.codec import JSON_SUBPROTOCOL
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import Running, running_server
from tests.gateway.raw_ws import BINARY, CLOSE, RawClient

TEXT = 0x1

SECRET = "jwt-test-secret-of-at-least-32-bytes!"


@dataclass(frozen=True)
class Who:
    """Who the clients are: ``keys``, their bearer strings (API keys, which are the owners while auth is
    off, SPEC §15.2; or JWTs of three users, whose every connection and request is one owner's), the
    first one's ``ids`` of responses that ended, to resume."""

    keys: tuple[str, ...]
    auth: bool
    ids: list[str] = field(default_factory=list)

    def hello(self, key: str) -> dict[str, Any]:
        """A hello as ``key``'s user (with auth off, a new anonymous session whatever the key)."""
        return {"type": "hello", "v": 1, **({"token": key} if self.auth else {})}


def who(auth: bool) -> Who:
    if not auth:
        return Who(("k-a", "k-b", "k-c"), auth)
    exp = int(time.time() + 600)
    return Who(
        tuple(jwt.encode({"sub": u, "exp": exp}, SECRET, algorithm="HS256") for u in ("a", "b", "c")), auth
    )


CLIENTS = 48  # per seed, AT_ONCE at a time
AT_ONCE = 8


@pytest.fixture
def auth(request: pytest.FixtureRequest) -> bool:
    return bool(getattr(request, "param", False))


@pytest.fixture
async def server(redis: aioredis.Redis, redis_url: str, keys: Keys, auth: bool) -> AsyncIterator[Running]:
    # Low per-user caps, so that a leak would also show as refusals, and replies short enough (40 words,
    # 5 ms a step) that every stream a dropped client left ends within a second.
    st = GatewaySettings(
        port=0, max_streams_per_user=16, max_streams_per_connection=4, auth_secret=SECRET if auth else None
    )
    async with running_server(redis, redis_url, keys, gateway=st) as s:
        s.engine.reply_len = 40
        s.engine.step_s = 0.005
        yield s


async def _drop(rng: random.Random, ws: ClientConnection, frame: str | None = None) -> None:
    """Leave ``ws`` at one of the points a real client leaves: half way through ``frame`` (a masked text
    frame cut at a random byte), after reading a few frames, or at once; by aborting the TCP connection,
    closing it, or with a closing handshake."""
    if frame is not None:
        raw = Frame(Opcode.TEXT, frame.encode()).serialize(mask=True)
        ws.transport.write(raw[: rng.randrange(1, len(raw))])
        await asyncio.sleep(rng.choice((0, 0, 0.01)))
    else:
        for _ in range(rng.choice((0, 0, 1, 3, 8))):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ws.recv(), 0.2)
    if rng.random() < 0.75:
        ws.transport.abort()
    elif frame is not None:
        ws.transport.close()  # a FIN half way through a frame (a close frame now would be read as its bytes)
    else:
        await ws.close()
    with contextlib.suppress(Exception):
        await ws.wait_closed()


def _chat(rng: random.Random, n: int) -> dict[str, Any]:
    frame: dict[str, Any] = {"type": "chat", "id": f"c{n}"}
    if rng.random() < 0.5:
        frame["content"] = "hello " * rng.randrange(1, 50)  # content mode: turns of a session wait in turn
    else:
        frame["messages"] = [{"role": "user", "content": "hi"}]
    if rng.random() < 0.5:
        frame["params"] = {"max_tokens": rng.randrange(1, 41)}
    return frame


async def protocol_ws(server: Running, rng: random.Random, w: Who) -> None:
    """/v1/ws (SPEC §4): a hello, then chats (of one session, so content turns wait), repeats, resumes
    and cancels of their ids, and a drop anywhere, the hello included."""
    # max_queue None: a client that closes with a handshake reads on until it ends (websockets' own stops
    # reading once 16 frames wait unread, and its close() would then wait 10 s for the server's reply).
    ws = await websockets.connect(server.url, subprotocols=[Subprotocol(JSON_SUBPROTOCOL)], max_queue=None)
    hello = json.dumps(w.hello(rng.choice(w.keys)))
    if rng.random() < 0.1:
        return await _drop(rng, ws, hello)
    await ws.send(hello)
    frames: list[dict[str, Any]] = []
    for n in range(rng.randrange(1, 5)):
        pick = rng.random()
        if pick < 0.6 or not frames:
            frames.append(_chat(rng, n))
        elif pick < 0.75:
            frames.append(rng.choice(frames))  # the same chat again: a re-attach (SPEC §10.2)
        elif pick < 0.9:
            frames.append({"type": "resume", "id": f"c{rng.randrange(n)}", "offset": rng.randrange(4)})
        else:
            frames.append({"type": "cancel", "id": f"c{rng.randrange(n)}"})
    cut = rng.randrange(len(frames) + 1)  # a frame cut half way, or none (len)
    for f in frames[:cut]:
        await ws.send(json.dumps(f))
    await _drop(rng, ws, json.dumps(frames[cut]) if cut < len(frames) else None)


def _http(method: str, path: str, key: str, body: dict[str, Any] | None = None, extra: str = "") -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n{extra}"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    return head.encode() + b"\r\n" + data


async def _send_and_drop(server: Running, rng: random.Random, request: bytes) -> None:
    """One HTTP request, cut at a random byte (the request line, the headers or the body) or sent whole
    and then left after reading a random part of the answer (a stream's events included)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    if rng.random() < 0.25:
        writer.write(request[: rng.randrange(1, len(request))])
        await asyncio.sleep(rng.choice((0, 0.01)))
    else:
        writer.write(request)
        want = rng.choice((0, 1, 200, 800, 3000))
        got = 0
        with contextlib.suppress(TimeoutError):
            while got < want:
                chunk = await asyncio.wait_for(reader.read(want - got), 0.3)
                if not chunk:
                    break
                got += len(chunk)
    if rng.random() < 0.75:
        writer.transport.abort()
    else:
        writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


async def chat_completions(server: Running, rng: random.Random, w: Who) -> None:
    """POST /v1/chat/completions (SPEC §15.3), streamed or not, some with a shared Idempotency-Key (a
    retry that attaches to the request before it)."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "hi " * rng.randrange(1, 30)}],
        "stream": rng.random() < 0.7,
        "max_tokens": rng.randrange(1, 41),
    }
    extra = f"Idempotency-Key: chat-{rng.randrange(3)}\r\n" if rng.random() < 0.3 else ""
    await _send_and_drop(server, rng, _http("POST", "/v1/chat/completions", rng.choice(w.keys), body, extra))


async def responses_http(server: Running, rng: random.Random, w: Who) -> None:
    """POST /v1/responses, streamed or not, in the background or not (SPEC §15.4), or a response's events
    read again from a point (GET ...?stream=true&starting_after=N, §15.5)."""
    if rng.random() < 0.3:
        path = f"/v1/responses/{rng.choice(w.ids)}?stream=true&starting_after={rng.randrange(6)}"
        return await _send_and_drop(server, rng, _http("GET", path, w.keys[0]))
    body: dict[str, Any] = {"model": "default", "input": "hi", "max_output_tokens": rng.randrange(1, 41)}
    body["stream"] = rng.random() < 0.7
    if rng.random() < 0.2:
        body["background"] = True
    await _send_and_drop(server, rng, _http("POST", "/v1/responses", rng.choice(w.keys), body))


async def responses_ws(server: Running, rng: random.Random, w: Who) -> None:
    """The Responses WebSocket (SPEC §15.7): a handshake that may resume a response (tw_resume), then
    creates (a second one while the first streams is refused), and a drop anywhere."""
    query = f"?tw_resume={rng.choice(w.ids)}:{rng.randrange(6)}" if rng.random() < 0.3 else ""
    headers = {"Authorization": f"Bearer {w.keys[0]}"}
    url = f"ws://127.0.0.1:{server.port}/v1/responses{query}"
    ws = await websockets.connect(url, additional_headers=headers, max_queue=None)
    creates = [
        {
            "type": "response.create",
            "model": "default",
            "input": "hi",
            "max_output_tokens": rng.randrange(1, 41),
        }
        for _ in range(rng.randrange(0 if query else 1, 3))
    ]
    cut = rng.randrange(len(creates) + 1)
    for c in creates[:cut]:
        await ws.send(json.dumps(c))
    await _drop(rng, ws, json.dumps(creates[cut]) if cut < len(creates) else None)


Door = Callable[[Running, random.Random, Who], Awaitable[None]]
DOORS: tuple[Door, ...] = (protocol_ws, chat_completions, responses_http, responses_ws)


async def _created(server: Running, key: str) -> list[str]:
    """Responses of ``key`` that end, to resume from: read whole, over a connection the server closes."""
    ids = []
    for _ in range(2):
        body = {"model": "default", "input": "hi", "max_output_tokens": 5}
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(_http("POST", "/v1/responses", key, body, "Connection: close\r\n"))
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        ids.append(json.loads(answer.split(b"\r\n\r\n", 1)[1])["id"])
    return ids


def _held(server: Running) -> dict[str, Any]:
    """Everything the gateway holds for clients; all of it is empty once they are gone."""
    gw = server.gateway
    adm = gw.core.admission
    held = {
        "streams_by_owner": {k: v for k, v in adm.streams_by_owner.items() if v},
        "waiting_by_session": {k: v for k, v in adm.waiting_by_session.items() if v},
        "waiting_bytes": adm.waiting_bytes,
        "attached": dict(gw.core.streams.attached),
        "ws_connections": gw.ws_caps.total,
        "http_connections": gw.http.caps.total,
        "paced_peers": adm.ingress.peers,
        "protocol_sockets": len(gw.connections),
        "responses_sockets": len(gw.response_sockets),
    }
    return {k: v for k, v in held.items() if v}


@pytest.mark.parametrize(("seed", "auth"), [(1, False), (2, False), (3, True)], indirect=["auth"])
async def test_clients_dropped_anywhere_at_every_door_leave_nothing_held(
    server: Running, seed: int, auth: bool, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(seed)
    w = who(auth)
    w.ids.extend(await _created(server, w.keys[0]))
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(door: Door, r: random.Random) -> None:
        async with gate:
            await door(server, r, w)

    with structlog.testing.capture_logs() as events:
        await asyncio.gather(*(one(rng.choice(DOORS), random.Random(rng.random())) for _ in range(CLIENTS)))
        await _let_go_within(server, 15, f"seed {seed}")
    # Nothing failed on the way there: no handler died (websockets logs "connection handler failed") and
    # no door caught an internal error of its own.
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    failed += [e["event"] for e in events if e.get("log_level") in ("error", "critical", "exception")]
    assert failed == [], f"seed {seed}"
    # And the server still serves every owner a whole stream, on both kinds of door (once the one-second
    # windows of the users' chat rates, which the drops may have filled, have passed).
    await asyncio.sleep(1.1)
    for key in w.keys:
        async with websockets.connect(server.url, subprotocols=[Subprotocol(JSON_SUBPROTOCOL)]) as ws:
            await ws.send(json.dumps(w.hello(key)))
            await ws.send(json.dumps({"type": "chat", "id": "after", "content": "still there?"}))
            while (f := json.loads(await asyncio.wait_for(ws.recv(), 10)))["type"] != "done":
                assert f["type"] != "error", f
        assert len(await _created(server, key)) == 2


def _frames(door: str) -> list[dict[str, Any]]:
    if door == "/v1/ws":
        return [{"type": "hello", "v": 1}] + [
            {"type": "chat", "id": f"c{n}", "content": "hi"} for n in range(3)
        ]
    # One lane: the door itself refuses the second create while the first streams (SPEC §15.7), so it is
    # the door, the socket's reader, that sends.
    return [{"type": "response.create", "model": "default", "input": "hi"}] * 4


async def _let_go_within(server: Running, seconds: float, what: str = "") -> None:
    """Wait until the gateway holds nothing for clients, and fail (saying ``what``) if it still does after
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while _held(server) and time.monotonic() < deadline:  # noqa: ASYNC110 (counters, not an event)
        await asyncio.sleep(0.05)
    assert _held(server) == {}, what


@pytest.mark.parametrize("door", ["/v1/ws", "/v1/responses"])
async def test_a_client_that_closes_right_after_sending_is_let_go_at_once(server: Running, door: str) -> None:
    """Frames sent just before a closing handshake, with no frame read: the server read two of them ahead
    of the door (max_queue) and then nothing more, so it never saw the TCP close that websockets' send
    waited for, and held the connection, and its requests' streams and grants, for websockets' close
    timeout (10 s then; egress.py)."""
    if door == "/v1/ws":
        ws = await websockets.connect(
            server.url, subprotocols=[Subprotocol(JSON_SUBPROTOCOL)], max_queue=None
        )
    else:
        url = f"ws://127.0.0.1:{server.port}/v1/responses"
        ws = await websockets.connect(url, additional_headers={"Authorization": "Bearer k-a"}, max_queue=None)
    for f in _frames(door):
        await ws.send(json.dumps(f))
    await ws.close()
    # Below the close timeout (egress.CLOSE_TIMEOUT_S, 2 s), which alone would let it go too, far above
    # the let-go (about 0.01 s).
    await _let_go_within(server, 1.5)
    assert not server.gateway.connections and not server.gateway.response_sockets


async def _raw_door(port: int, door: str) -> RawClient:
    """A raw client of ``door`` whose door is reading: on /v1/ws past its hello (the welcome read)."""
    c = await RawClient.connect(port, path=door)
    if door == "/v1/ws":
        c.send(BINARY, msgpack.packb({"type": "hello", "v": 1}))
        assert (await asyncio.wait_for(c.recv(), 10))[0] == BINARY  # welcome
    return c


@contextlib.asynccontextmanager
async def _reading_on(c: RawClient) -> AsyncIterator[asyncio.Event]:
    """A client that has sent its close and keeps its end of the TCP connection, reading on; the event is
    set once the server closes the connection. Aborted at the end of the block."""
    lost = asyncio.Event()

    async def read_on() -> None:
        with contextlib.suppress(Exception):
            while await c.reader.read(1 << 16):
                pass
        lost.set()

    reading = asyncio.create_task(read_on())
    try:
        yield lost
    finally:
        reading.cancel()
        c.writer.transport.abort()


@pytest.mark.parametrize("door", ["/v1/ws", "/v1/responses"])
async def test_a_client_that_sends_its_close_and_keeps_the_tcp_connection_is_let_go(
    server: Running, door: str
) -> None:
    """As above, but the client never closes its end of the TCP connection (it reads on): the door stops
    at the close, drops what is left, and aborts the connection egress.CLOSE_TIMEOUT_S (2 s) later. It was
    held for the close timeout (10 s) on /v1/ws, and for ever on the Responses WebSocket."""
    c = await _raw_door(server.port, door)
    if door == "/v1/ws":
        frames = [msgpack.packb(f) for f in _frames(door)[1:]]
        opcode = BINARY
    else:
        frames = [json.dumps(f).encode() for f in _frames(door)]
        opcode = TEXT
    for f in frames:
        c.send(opcode, f)
    c.send(CLOSE, struct.pack("!H", 1000))
    async with _reading_on(c):
        await _let_go_within(server, 6)


@pytest.mark.parametrize("door", ["/v1/ws", "/v1/responses"])
async def test_a_client_that_closes_an_idle_door_and_keeps_the_tcp_connection_is_let_go(
    redis: aioredis.Redis, redis_url: str, keys: Keys, door: str
) -> None:
    """The door is waiting for a frame when the client's close comes, so it never drains: the keepalive
    sweep aborts the socket once its close deadline has passed. That deadline was websockets' close
    timeout, 10 s; it is egress.CLOSE_TIMEOUT_S (2 s) now, so with a sweep every 0.5 s (ping interval 2 s)
    the connection goes within about 2.5 s."""
    st = GatewaySettings(port=0, ping_interval_s=2)
    async with running_server(redis, redis_url, keys, gateway=st) as server:
        c = await _raw_door(server.port, door)
        if door != "/v1/ws":
            await asyncio.sleep(0.2)  # the door is reading (on /v1/ws its welcome says so)
        c.send(CLOSE, struct.pack("!H", 1000))
        async with _reading_on(c) as lost:
            await _let_go_within(server, 6)
            assert not server.gateway.connections and not server.gateway.response_sockets
            await asyncio.wait_for(lost.wait(), 2)  # the server closed the TCP connection
