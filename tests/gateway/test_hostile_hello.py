"""Hostile `hello` frames through the real gateway (not only the codec): whatever a field holds, the answer
is `welcome` or a documented error with its documented close, never `internal` (which tells a client to
retry) and never a crash."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import jwt
import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from protocol import Error, ErrorCode, Pong, Welcome, parse_server_frame
from protocol.codec import JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL, codec_for
from server.client import Client
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import running_server

SECRET = "hello-fuzz-secret-of-at-least-32-bytes"


def _jwt(sub: object = "alice", exp_in: float = 3600) -> str:
    return jwt.encode({"sub": sub, "exp": int(time.time() + exp_in)}, SECRET, algorithm="HS256")


async def _hello(
    url: str, hello: dict[str, Any], subprotocol: str = MSGPACK_SUBPROTOCOL
) -> tuple[Any, int | None]:
    """Send one raw hello; return the first frame the server answers and the close code if it closed
    (None if the connection is still open after the answer)."""
    codec = codec_for(subprotocol)
    async with connect(url, subprotocols=[subprotocol], max_size=None) as ws:  # type: ignore[list-item]
        await ws.send(codec.encode(hello))
        first = parse_server_frame(codec.decode(await ws.recv()))
        if isinstance(first, Welcome) or (isinstance(first, Error) and first.code == ErrorCode.BAD_FRAME):
            # Open: the connection answers a ping (after a bad hello it still awaits a hello, §8).
            await ws.send(codec.encode({"type": "ping", "ts": 7}))
            while True:
                frame = parse_server_frame(codec.decode(await asyncio.wait_for(ws.recv(), 30)))
                if isinstance(frame, Pong) or (isinstance(frame, Error) and frame.id is None):
                    return first, None
        try:
            # A refused hello is followed by a close, and nothing else.
            extra = await asyncio.wait_for(ws.recv(), 30)
        except ConnectionClosed as exc:
            return first, exc.rcvd.code if exc.rcvd is not None else -1
        raise AssertionError(f"{first} was followed by {extra!r}, not a close")


# Malformed session tokens: every length class and alphabet. Each must be `unauthorized` + 1008.
_MALFORMED = [
    "abc.é",  # the finding: hmac.compare_digest raised TypeError on non-ASCII str -> internal + 1011
    "é",
    "é.abc",
    "abc.\u00e9\u00e9\u00e9\u00e9",
    "\u6771\u4eac.\u6771\u4eac",
    "🚀.🚀",
    "a" * 16 + "." + "é" * 32,
    ".",
    "..",
    "a.",
    ".a",
    "a.b.c",
    "x",
    "a\x00b.c",
    "a\nb.c",
    "\x7f.\x7f",
    " " * 10,
    "A" * 4096,
    "é" * 4096,
    ("q" * 16 + "." + "0" * 32)[:49],
    "q" * 16 + "." + "0" * 32,  # the right shape, the wrong MAC
    "q" * 65 + "." + "0" * 32,  # a session id longer than any we issue
    "\ud7ff.\ue000",
]


@pytest.mark.parametrize("auth", [False, True], ids=["auth_off", "auth_on"])
async def test_malformed_session_token_is_unauthorized_and_closed_1008(
    redis: aioredis.Redis, redis_url: str, keys: Keys, auth: bool
) -> None:
    gw = GatewaySettings(port=0, auth_secret=SECRET if auth else None)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        token = _jwt() if auth else None
        valid = await Client.connect(server.url, token=token)
        assert valid.welcome is not None
        good = valid.welcome.session_token
        await valid.close()
        # A valid token with one character changed anywhere (including to a non-ASCII one).
        tampered = [
            good[:i] + ("é" if i % 2 else "A" if good[i] != "A" else "B") + good[i + 1 :]
            for i in range(len(good))
        ]
        for st in [*_MALFORMED, *tampered, good + "é", good + "0"]:
            hello: dict[str, Any] = {"type": "hello", "v": 1, "session_token": st}
            if token:
                hello["token"] = token
            for sub in (MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL):
                first, close = await _hello(server.url, hello, sub)
                assert isinstance(first, Error) and first.code == ErrorCode.UNAUTHORIZED, (st, first)
                assert close == 1008, (st, close)
        # The genuine token still works after all that.
        again = await Client.connect(server.url, token=token, session_token=good)
        assert again.welcome is not None and again.welcome.session_token == good
        await again.close()


def _text(rng: random.Random, n: int) -> str:
    alphabet = rng.choice(
        [
            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_",
            "0123456789abcdef.",
            "é東🚀\u0301\u200b\ufeff.",
            "".join(map(chr, range(0, 32))) + ".",
            "".join(map(chr, range(0x80, 0x100))),
        ]
    )
    return "".join(rng.choice(alphabet) for _ in range(n))


def _value(rng: random.Random, good: list[object]) -> object:
    """A value for a hello field: one of the field's good values, or anything else a client might send."""
    kind = rng.randrange(10)
    if kind < 3 or rng.random() < 0.5:
        return rng.choice(good)
    if kind == 3:
        return _text(rng, rng.choice([0, 1, 2, 17, 49, 64, 65, 4096, 4097]))
    if kind == 4:
        return rng.choice([0, 1, -1, 2, 2**63 - 1, -(2**63), 2**64 - 1, 1.0, 0.5, True, False])
    if kind == 5:
        return rng.choice([[], {}, [1], {"a": 1}, [[[]]]])
    if kind == 6:
        return None
    if kind == 7:
        return b"\x00\xffbytes"
    if kind == 8:
        return _text(rng, rng.randrange(1, 40)) + "." + _text(rng, rng.randrange(1, 40))
    return rng.choice(good) + _text(rng, 1) if good and isinstance(good[0], str) else rng.choice(good)


def _resume(rng: random.Random) -> object:
    kind = rng.randrange(6)
    if kind == 0:
        return None
    if kind == 1:
        return _value(rng, [[]])
    n = rng.choice([0, 1, 3, 256, 257]) if kind == 2 else rng.randrange(0, 5)
    points: list[object] = []
    for _ in range(n):
        p: dict[str, object] = {}
        if rng.random() < 0.9:
            p["id"] = _value(rng, ["r-1", "x" * 64, "missing"])
        if rng.random() < 0.9:
            p["offset"] = _value(rng, [0, 1, 5])
        if rng.random() < 0.3:
            p["epoch"] = _value(rng, [1, 2, 2**31])
        points.append(p if rng.random() < 0.95 else _value(rng, [p]))
    return points


@pytest.mark.parametrize("auth", [False, True], ids=["auth_off", "auth_on"])
async def test_fuzzed_hello_fields_get_documented_answers(
    redis: aioredis.Redis, redis_url: str, keys: Keys, auth: bool
) -> None:
    """300 hellos per case, each field (v, token, session_token, resume, unknown keys) drawn at random
    from good values and hostile ones; seeded, so a failure names a reproducible case."""
    gw = GatewaySettings(port=0, auth_secret=SECRET if auth else None)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        first_token = _jwt() if auth else None
        owner = await Client.connect(server.url, token=first_token)
        assert owner.welcome is not None
        good_st = owner.welcome.session_token
        await owner.close()
        tokens = [_jwt(), _jwt(exp_in=-600), _jwt(sub=""), _jwt(sub=5), "a.b.c", _jwt()[:-2] + "é"]
        rng = random.Random(13 if auth else 31)
        outcomes: dict[str, int] = {}
        for case in range(300):
            hello: dict[str, Any] = {"type": "hello"}
            if rng.random() < 0.95:
                hello["v"] = _value(rng, [1, 1, 1, 2])
            if rng.random() < (0.9 if auth else 0.5):
                hello["token"] = _value(rng, tokens)
            if rng.random() < 0.7:
                hello["session_token"] = _value(rng, [good_st, ""])
            if rng.random() < 0.5:
                hello["resume"] = _resume(rng)
            if rng.random() < 0.1:
                hello[_text(rng, 5)] = _value(rng, [1])
            sub = MSGPACK_SUBPROTOCOL
            if not any(isinstance(v, bytes) for v in hello.values()) and rng.random() < 0.3:
                sub = JSON_SUBPROTOCOL
            try:
                first, close = await _hello(server.url, hello, sub)
            except (ValueError, TypeError):
                continue  # JSON cannot carry this value (e.g. a lone surrogate): nothing was sent
            what = type(first).__name__ if isinstance(first, Welcome) else getattr(first, "code", "?")
            outcomes[what] = outcomes.get(what, 0) + 1
            ctx = (case, hello)
            if isinstance(first, Welcome):
                assert close is None, ctx
                continue
            assert isinstance(first, Error), ctx
            assert first.code in (
                ErrorCode.BAD_FRAME,
                ErrorCode.UNAUTHORIZED,
                ErrorCode.UNSUPPORTED_VERSION,
            ), ctx
            expected_close = {ErrorCode.UNAUTHORIZED: 1008, ErrorCode.UNSUPPORTED_VERSION: 1002}
            assert close == expected_close.get(first.code), ctx
        # Not vacuous: the draw reached every kind of answer.
        assert {"Welcome", "bad_frame", "unauthorized", "unsupported_version"} <= set(outcomes), outcomes
