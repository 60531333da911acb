"""Repeated deterministic questions are answered from the response cache: same text, ordinary deltas,
and the engine is not called."""

from __future__ import annotations

import redis.asyncio as aioredis

from protocol import Accepted, Params
from server.client import Client, collect
from server.store.keys import Keys
from tests.gateway.conftest import Running, running_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def _ask(url: str, params: Params, id: str) -> tuple[str, int, str]:
    c = await Client.connect(url)
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


async def test_repeated_greedy_question_is_served_from_cache(server: Running) -> None:
    greedy = Params(temperature=0, max_tokens=6)
    first = await _ask(server.url, greedy, "q1")
    assert server.engine.requests_started == 1
    again = await _ask(server.url, greedy, "q2")
    assert server.engine.requests_started == 1  # the engine was not called
    assert again[:2] == first[:2] and again[2] == "done"
    # A fixed seed is deterministic too; another seed is another answer.
    await _ask(server.url, Params(temperature=0.8, seed=5, max_tokens=6), "s1")
    await _ask(server.url, Params(temperature=0.8, seed=5, max_tokens=6), "s2")
    assert server.engine.requests_started == 2
    await _ask(server.url, Params(temperature=0.8, seed=6, max_tokens=6), "s3")
    assert server.engine.requests_started == 3
    # Opt-out, and sampling without a seed, always run the model.
    await _ask(server.url, Params(temperature=0, max_tokens=6, cache=False), "o1")
    await _ask(server.url, Params(temperature=0.8, max_tokens=6), "r1")
    await _ask(server.url, Params(temperature=0.8, max_tokens=6), "r2")
    assert server.engine.requests_started == 6


async def test_cached_answers_are_served_under_overload(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    from server.store.requests import Settings

    async with running_server(redis, redis_url, keys, store=Settings(max_queued=1)) as server:
        greedy = Params(temperature=0, max_tokens=5)
        first = await _ask(server.url, greedy, "warm")
        await redis.set(keys.queued_count, 100)  # the queue is "full" from now on
        c = await Client.connect(server.url)
        _, _, done, errors = await collect(c.chat("something new", params=greedy))
        assert done is None and [e.code for e in errors] == ["overloaded"]
        await c.close()
        assert (await _ask(server.url, greedy, "hot"))[:2] == first[:2]
        assert server.engine.requests_started == 1
