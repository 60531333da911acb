"""Repeated deterministic questions are answered from the response cache: same text, ordinary deltas,
and the engine is not called. The cache is each user's own unless the operator shares it."""

from __future__ import annotations

import time

import jwt
import redis.asyncio as aioredis

from protocol import Accepted, Params
from server.client import Client, collect
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import ON_BOTH, Running, running_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SECRET = "jwt-test-secret-of-at-least-32-bytes!"


def _token(sub: str) -> str:
    return jwt.encode({"sub": sub, "exp": int(time.time() + 60)}, SECRET, algorithm="HS256")


async def _ask(url: str, params: Params, id: str, user: str | None = None) -> tuple[str, int, str]:
    # Without auth every connection is its own anonymous owner; the tests that expect hits ask as one user.
    c = await Client.connect(url, token=_token(user) if user else None)
    frames = [f async for f in c.chat(messages=QUESTION, id=id, params=params)]
    await c.close()
    text, deltas, done, errors = await collect(_aiter(frames))
    assert errors == [] and done is not None
    pos = 0
    for d in deltas:
        assert d.offset == pos
        pos += d.n
    assert done.offset == pos
    accepted = [f for f in frames if isinstance(f, Accepted)]
    return text, done.offset, accepted[0].state


async def _aiter(frames):  # type: ignore[no-untyped-def]
    for f in frames:
        yield f


def _auth(**kw: object) -> GatewaySettings:
    return GatewaySettings(port=0, auth_secret=SECRET, **kw)  # type: ignore[arg-type]


async def test_repeated_greedy_question_is_served_from_cache(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    async with running_server(redis, redis_url, keys, gateway=_auth()) as server:
        greedy = Params(temperature=0, max_tokens=6)
        first = await _ask(server.url, greedy, "q1", "ann")
        assert server.engine.requests_started == 1
        again = await _ask(server.url, greedy, "q2", "ann")
        assert server.engine.requests_started == 1  # the engine was not called
        assert again[:2] == first[:2] and again[2] == "done"
        # A fixed seed is deterministic too; another seed is another answer.
        await _ask(server.url, Params(temperature=0.8, seed=5, max_tokens=6), "s1", "ann")
        await _ask(server.url, Params(temperature=0.8, seed=5, max_tokens=6), "s2", "ann")
        assert server.engine.requests_started == 2
        await _ask(server.url, Params(temperature=0.8, seed=6, max_tokens=6), "s3", "ann")
        assert server.engine.requests_started == 3
        # Opt-out, and sampling without a seed, always run the model.
        await _ask(server.url, Params(temperature=0, max_tokens=6, cache=False), "o1", "ann")
        await _ask(server.url, Params(temperature=0.8, max_tokens=6), "r1", "ann")
        await _ask(server.url, Params(temperature=0.8, max_tokens=6), "r2", "ann")
        assert server.engine.requests_started == 6


@ON_BOTH
async def test_one_users_cache_never_answers_another_user(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    # A shared cache is a side channel: bob's chat answered at once ("accepted state done") would tell him
    # that someone asked the same question in the last minutes. By default each user has their own.
    async with running_server(redis, redis_url, keys, gateway=_auth()) as server:
        greedy = Params(temperature=0, max_tokens=6)
        alice = await _ask(server.url, greedy, "a1", "alice")
        assert alice[2] == "queued"
        bob = await _ask(server.url, greedy, "b1", "bob")
        assert bob[2] == "queued" and server.engine.requests_started == 2  # bob's ran on the engine
        assert bob[:2] == alice[:2]  # and it is the same answer
        assert (await _ask(server.url, greedy, "b2", "bob"))[2] == "done"  # bob's own cache serves bob
        assert server.engine.requests_started == 2


async def test_anonymous_sessions_do_not_share_a_cache(server: Running) -> None:
    greedy = Params(temperature=0, max_tokens=6)
    assert (await _ask(server.url, greedy, "n1"))[2] == "queued"
    assert (await _ask(server.url, greedy, "n2"))[2] == "queued"  # another connection, another session
    assert server.engine.requests_started == 2


@ON_BOTH
async def test_a_shared_cache_is_the_operators_choice(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    async with running_server(redis, redis_url, keys, gateway=_auth(shared_response_cache=True)) as server:
        greedy = Params(temperature=0, max_tokens=6)
        alice = await _ask(server.url, greedy, "a1", "alice")
        bob = await _ask(server.url, greedy, "b1", "bob")
        assert bob[2] == "done" and bob[:2] == alice[:2] and server.engine.requests_started == 1


async def test_cached_answers_are_served_under_overload(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    from server.store.requests import Settings

    async with running_server(
        redis, redis_url, keys, store=Settings(max_queued=1), gateway=_auth()
    ) as server:
        greedy = Params(temperature=0, max_tokens=5)
        first = await _ask(server.url, greedy, "warm", "ann")
        await redis.set(keys.queued_count(), 100)  # the queue is "full" from now on
        c = await Client.connect(server.url, token=_token("ann"))
        _, _, done, errors = await collect(c.chat("something new", params=greedy))
        assert done is None and [e.code for e in errors] == ["overloaded"]
        await c.close()
        assert (await _ask(server.url, greedy, "hot", "ann"))[:2] == first[:2]
        assert server.engine.requests_started == 1
