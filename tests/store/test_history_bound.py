"""A session's history is bounded in messages and in bytes: the oldest turns go first (history.lua)."""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from server.store.keys import Keys
from server.store.requests import RequestStore, Settings, StepOp


async def _turn(store: RequestStore, n: int, user: str, reply: str) -> None:
    """One content-mode turn of session s1, run to its normal end by worker w1."""
    id = f"r{n}"
    payload = {"owner": "u1", "id": id, "session": "s1", "messages": [], "params": {}}
    res = await store.submit(
        "u1", id, f"fp{n}", payload, session="s1", user_message={"role": "user", "content": user}
    )
    assert res.outcome == "new"
    [(queue, entry_id, req_key)] = await store.take("w1", 10, 100, partition=store.keys.partition("u1"))
    item = await store.start("w1", entry_id, req_key, queue)
    assert item is not None
    done = await store.write_step([StepOp(item, 0, 1, reply, 3, finish="stop", reply_text=reply)], "w1")
    assert done == [True]


async def _history(redis: aioredis.Redis, keys: Keys) -> list[str]:
    return [json.loads(m)["content"] for m in await redis.lrange(keys.history("s1", "u1"), 0, -1)]


async def test_oldest_turns_go_first_when_bytes_run_over(redis: aioredis.Redis, keys: Keys) -> None:
    # Each turn's two messages weigh a little over 2,000 bytes as stored (JSON): 5,000 holds two turns.
    store = RequestStore(redis, keys, Settings(history_max_bytes=5_000))
    await store.ensure_group()
    for n in range(4):
        await _turn(store, n, f"q{n}" + "x" * 1000, f"a{n}" + "y" * 1000)
    history = await _history(redis, keys)
    assert [m[:2] for m in history] == ["q2", "a2", "q3", "a3"]  # whole turns, oldest dropped
    raw = await redis.lrange(keys.history("s1", "u1"), 0, -1)
    # The byte count the script keeps is the history's true size.
    assert int(await redis.hget(keys.session("s1", "u1"), "hist_bytes")) == sum(len(m) for m in raw)
    assert sum(len(m) for m in raw) <= 5_000
    # Both keys live as long as the session.
    assert 0 < await redis.pttl(keys.session("s1", "u1")) <= Settings().session_ttl_ms


async def test_the_newest_turn_stays_even_when_it_alone_is_over(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings(history_max_bytes=1_000))
    await store.ensure_group()
    await _turn(store, 0, "small", "reply")
    await _turn(store, 1, "q" + "x" * 3000, "big reply")
    history = await _history(redis, keys)
    assert [m[:1] for m in history] == ["q", "b"]  # the small turn went; the big one is kept whole
    await _turn(store, 2, "next", "ok")
    assert await _history(redis, keys) == ["next", "ok"]


async def test_message_bound_and_a_history_without_a_byte_count(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings(history_max_messages=4))
    await store.ensure_group()
    # A history written before the byte count existed is measured once, then kept up to date.
    hist = keys.history("s1", "u1")
    await redis.rpush(
        hist,
        json.dumps({"role": "user", "content": "old"}),
        json.dumps({"role": "assistant", "content": "o"}),
    )
    for n in range(3):
        await _turn(store, n, f"q{n}", f"a{n}")
    assert await _history(redis, keys) == ["q1", "a1", "q2", "a2"]
    raw = await redis.lrange(hist, 0, -1)
    assert int(await redis.hget(keys.session("s1", "u1"), "hist_bytes")) == sum(len(m) for m in raw)
