"""Racing retries, identity and isolation, epochs, the detach timeout — over real sockets."""

from __future__ import annotations

import asyncio
import time

import jwt
import pytest
import redis.asyncio as aioredis

from protocol import Accepted, Cancel, Chat, Delta, Done, Error, Message, Params, Resume
from server.client import Client, ServerError, collect
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from server.store.requests import Settings
from tests.gateway.conftest import ON_BOTH, Running, running_server

SECRET = "jwt-test-secret-of-at-least-32-bytes!"

# Idempotency, isolation and resume are properties of the store: proven on a cluster too.
pytestmark = ON_BOTH


def token(sub: str, ttl: float = 60) -> str:
    return jwt.encode({"sub": sub, "exp": int(time.time() + ttl)}, SECRET, algorithm="HS256")


async def test_racing_retries_from_five_connections_make_one_generation(server: Running) -> None:
    first = await Client.connect(server.url)
    assert first.welcome is not None
    clients = [first] + [
        await Client.connect(server.url, session_token=first.welcome.session_token) for _ in range(4)
    ]
    chat = Chat(id="race", content="same question", params=Params(max_tokens=10, seed=3))

    async def fire(c: Client, times: int) -> tuple[str, int]:
        for _ in range(times):
            await c.send(chat)
        # Every chat gets an accepted, and each re-attach replaces this connection's stream of that id
        # (replay from 0), so the text counts from the last accepted up to done.
        text, accepted = "", 0
        while True:
            f = await c.recv()
            if isinstance(f, Accepted):
                accepted += 1
                text = ""
            elif isinstance(f, Delta):
                text += f.text
            elif isinstance(f, Done) and accepted == times:
                return text, accepted
            elif isinstance(f, Error):
                raise AssertionError(f)

    results = await asyncio.gather(*(fire(c, 4) for c in clients))  # 20 chat frames in all
    texts = {t for t, _ in results}
    assert len(texts) == 1 and next(iter(texts)).startswith("re[1] same question")
    assert all(a == 4 for _, a in results)
    assert server.engine.requests_started == 1
    for c in clients:
        await c.close()


async def test_jwt_users_are_isolated(redis: aioredis.Redis, redis_url: str, keys: Keys) -> None:
    async with running_server(
        redis, redis_url, keys, gateway=GatewaySettings(port=0, auth_secret=SECRET)
    ) as server:
        server.engine.step_s = 0.05
        server.engine.reply_len = 200
        alice = await Client.connect(server.url, token=token("alice"))
        await alice.send(Chat(id="a1", content="alice's secret", params=Params(max_tokens=100)))
        assert isinstance(await alice.recv(), Accepted)

        # Alice on a new connection, without the session token, still reaches her request: it is hers.
        alice2 = await Client.connect(server.url, token=token("alice"))
        await alice2.send(Resume(id="a1", offset=0))
        assert isinstance(await alice2.recv(), Accepted)

        mallory = await Client.connect(server.url, token=token("mallory"))
        answers = []
        for frame in (Resume(id="a1", offset=0), Cancel(id="a1"), Resume(id="nope", offset=0)):
            await mallory.send(frame)
            answers.append(await mallory.recv())
        assert [(type(a), getattr(a, "code", None)) for a in answers] == [(Error, "not_found")] * 3
        assert answers[0].message == answers[2].message  # type: ignore[union-attr]
        # Alice's session token is useless to mallory.
        assert alice.welcome is not None
        with pytest.raises(ServerError) as exc:
            await Client.connect(
                server.url, token=token("mallory"), session_token=alice.welcome.session_token
            )
        assert exc.value.frame.code == "unauthorized"
        # Mallory's cancel did nothing: alice's request still runs.
        info = await server.store.get("alice", "a1")
        assert info is not None and info.state in ("queued", "running")
        for bad in (None, "not-a-jwt", token("alice", ttl=-120)):  # expired past the 60-s leeway
            with pytest.raises(ServerError) as exc:
                await Client.connect(server.url, token=bad)
            assert exc.value.frame.code == "unauthorized"
        await alice.send(Cancel(id="a1"))
        for c in (alice, alice2, mallory):
            await c.close()


async def test_anonymous_session_token_reclaims_requests(server: Running) -> None:
    a = await Client.connect(server.url)
    await collect(a.chat("keep me", id="k1"))
    assert a.welcome is not None
    back = await Client.connect(server.url, session_token=a.welcome.session_token)
    assert back.welcome is not None and back.welcome.session == a.welcome.session
    await back.send(Resume(id="k1", offset=0))
    text, _, done, _ = await collect(back.frames_for("k1"))
    assert done is not None and text.startswith("re[1] keep me")
    forged = a.welcome.session_token[:-1] + ("0" if a.welcome.session_token[-1] != "0" else "1")
    with pytest.raises(ServerError) as exc:
        await Client.connect(server.url, session_token=forged)
    assert exc.value.frame.code == "unauthorized"
    await a.close()
    await back.close()


async def test_resume_with_an_old_epoch_fails_loudly(server: Running) -> None:
    c = await Client.connect(server.url)
    await collect(c.chat("epoch", id="e1"))
    assert c.welcome is not None
    await server.store.r.hincrby(server.store.keys.request(f"anon:{c.welcome.session}", "e1"), "epoch", 1)
    await c.send(Resume(id="e1", offset=3, epoch=1))
    err = await c.recv()
    assert isinstance(err, Error) and err.code == "resume_failed" and err.id == "e1"
    await c.send(Resume(id="e1", offset=0, epoch=1))  # starting over from 0 is always allowed
    acc = await c.recv()
    assert isinstance(acc, Accepted) and acc.epoch == 2
    # A resume offset that splits a delta cannot be honoured either.
    await c.close()


async def test_detach_timeout_cancels_when_nobody_is_attached(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    async with running_server(redis, redis_url, keys, store=Settings(detach_timeout_ms=300)) as server:
        server.engine.step_s = 0.02
        server.engine.reply_len = 400
        stays = await Client.connect(server.url)
        leaves = await Client.connect(server.url)
        await stays.send(Chat(id="s", content="stay", params=Params(max_tokens=60)))
        await leaves.send(Chat(id="l", content="leave", params=Params(max_tokens=300)))
        assert isinstance(await leaves.recv(), Accepted)
        assert leaves.welcome is not None
        leaves.ws.transport.abort()
        _, _, done, _ = await collect(stays.frames_for("s"))  # ~1.2 s: four detach timeouts
        assert done is not None and done.finish_reason == "length" and done.offset == 60
        info = await server.store.get(f"anon:{leaves.welcome.session}", "l")
        assert info is not None and info.state == "cancelled" and info.completion_tokens < 300
        await stays.close()


async def test_the_detach_timeout_says_so_and_a_chat_may_ask_for_longer(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    """SPEC 10.5: the end the detach timeout writes says why (done.cancel_reason), which a cancel's does
    not, so an app back from the background can tell it from its user's Stop; and a chat's
    params.detach_timeout_ms keeps it running with nobody attached, lowered to welcome.limits' cap."""
    gateway = GatewaySettings(port=0, max_detach_timeout_ms=60_000)
    async with running_server(
        redis, redis_url, keys, gateway=gateway, store=Settings(detach_timeout_ms=300)
    ) as server:
        server.engine.step_s = 0.02
        server.engine.reply_len = 400
        c = await Client.connect(server.url)
        assert c.welcome is not None and c.welcome.limits["max_detach_timeout_ms"] == 60_000
        # Messages mode: three requests at once, none waiting for another's turn.
        msgs = (Message(role="user", content="hi"),)
        await c.send(Chat(id="short", messages=msgs, params=Params(max_tokens=300)))
        # Over the cap: lowered to it (60 s), still far past this test.
        await c.send(
            Chat(id="long", messages=msgs, params=Params(max_tokens=100, detach_timeout_ms=3_600_000))
        )
        await c.send(Chat(id="stop", messages=msgs, params=Params(max_tokens=300)))
        await c.send(Cancel(id="stop"))
        _, _, stopped, _ = await collect(c.frames_for("stop"))
        assert stopped is not None and stopped.finish_reason == "cancelled" and stopped.cancel_reason is None
        token = c.welcome.session_token
        c.ws.transport.abort()
        await asyncio.sleep(3.0)  # ten default detach timeouts, and the worker's sweeps (about 1 s apart)
        back = await Client.connect(server.url, session_token=token)
        await back.send(Resume(id="short", offset=0))
        _, _, short, _ = await collect(back.frames_for("short"))
        assert short is not None and short.finish_reason == "cancelled" and 0 < short.offset < 300
        assert short.cancel_reason == "detach_timeout"
        await back.send(Resume(id="long", offset=0))
        _, deltas, long, _ = await collect(back.frames_for("long"))
        assert long is not None and long.finish_reason == "length" and long.offset == 100
        assert long.cancel_reason is None and sum(d.n for d in deltas) == 100
        # Lowered to the cap: a deadline 60 s after its last touch, not an hour.
        owner = f"anon:{c.welcome.session}"
        until = int(await redis.hget(keys.request(owner, "long"), "attached_until") or 0)
        assert 0 < until - time.time() * 1000 <= 60_000
        await back.close()
