"""A worker reconciles what the store says it runs with what it runs (issue 24, finding 2): a request
whose `start` committed in Redis while its reply was lost, or one left running under the worker's name
by an earlier process, is re-queued and run to the end, once; one whose start is merely slow is not."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from protocol import Params
from server.client import Client, collect
from server.engine.api import GenerationRequest, SamplingParams
from server.store.keys import Keys
from server.store.requests import RequestStore, Settings, StepOp, WorkItem
from server.worker.loop import Worker
from tests.fakes import FakeEngine, reply_words
from tests.gateway.conftest import ON_BOTH, Running, running_server

pytestmark = ON_BOTH

LEASE_TTL_MS = 1500  # the lease loop (and so the reconcile) runs every TTL / 3
TOKENS = 10  # under the fake engine's reply length (12): ends by max_tokens


def _patch_start(server: Running, monkeypatch: pytest.MonkeyPatch, after_commit: Any) -> list[str]:
    """Wrap the store's start so that its first call commits in Redis and then runs ``after_commit``
    (which raises to lose the reply, or sleeps to delay it); later calls are untouched. Returns the
    request keys of the starts whose reply was tampered with."""
    real = server.store.start
    tampered: list[str] = []

    async def start(worker: str, entry_id: str, req_key: str, *a: Any, **kw: Any) -> WorkItem | None:
        item = await real(worker, entry_id, req_key, *a, **kw)
        if not tampered:
            tampered.append(req_key)
            await after_commit()
        return item

    monkeypatch.setattr(server.store, "start", start)
    return tampered


async def _check_one_generation(server: Running, redis: aioredis.Redis, req_key: str, text: str) -> None:
    """The request is done, its log is contiguous from 0, and the engine ran it exactly once."""
    assert await redis.hget(req_key, "state") == b"done"
    offsets = [
        (int(f[b"o"]), int(f[b"n"]))
        for _, f in await redis.xrange(server.store.keys.log_of(req_key))
        if b"n" in f
    ]
    pos = 0
    for o, n in offsets:
        assert o == pos  # nothing repeated, nothing missing
        pos += n
    assert pos == TOKENS and text.startswith("re[1] hello")
    assert server.engine.started_keys.count(req_key) == 1


async def test_a_start_whose_reply_is_lost_is_requeued_and_run_once(
    redis: aioredis.Redis, redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_server(redis, redis_url, keys, store=Settings(lease_ttl_ms=LEASE_TTL_MS)) as server:

        async def lose_reply() -> None:
            raise ConnectionError("the reply to start was lost")

        tampered = _patch_start(server, monkeypatch, lose_reply)
        client = await Client.connect(server.url)
        # Bounded: the lease TTL plus a few seconds; before the fix it waited forever (running, nobody
        # running it, the client's touches keeping it from the detach timeout).
        frames = client.chat("hello there", id="lost", params=Params(max_tokens=TOKENS, seed=1))
        text, _, done, errors = await asyncio.wait_for(collect(frames), LEASE_TTL_MS / 1000 + 10)
        assert not errors and done is not None and done.offset == TOKENS
        [req_key] = tampered
        await _check_one_generation(server, redis, req_key, text)
        assert await redis.hget(req_key, "requeues") == b"1"  # by the reconcile, not a reaper
        await client.close()


async def test_a_slow_start_reply_is_not_mistaken_for_an_orphan(
    redis: aioredis.Redis, redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_server(redis, redis_url, keys, store=Settings(lease_ttl_ms=LEASE_TTL_MS)) as server:
        period = server.workers[0].lease_period_s

        async def slow_reply() -> None:
            await asyncio.sleep(4 * period)  # several reconciles see it running in Redis only

        tampered = _patch_start(server, monkeypatch, slow_reply)
        client = await Client.connect(server.url)
        frames = client.chat("hello there", id="slow", params=Params(max_tokens=TOKENS, seed=1))
        text, _, done, errors = await asyncio.wait_for(collect(frames), 30)
        assert not errors and done is not None and done.offset == TOKENS
        [req_key] = tampered
        await _check_one_generation(server, redis, req_key, text)
        assert await redis.hget(req_key, "requeues") is None  # never taken away from its starter
        await client.close()


async def test_a_request_left_running_under_the_workers_name_is_continued(
    redis: aioredis.Redis, keys: Keys
) -> None:
    # An earlier process under the same name (a pod restarted with a fixed name) started a request and
    # logged its first tokens; the new process renews the same lease, so no reaper would ever take it.
    store = RequestStore(redis, keys, Settings(lease_ttl_ms=LEASE_TTL_MS))
    name = f"w-{keys.prefix}"
    await store.ensure_group(name)
    payload = {
        "owner": "u1",
        "id": "left",
        "session": "",
        "messages": [{"role": "user", "content": "hello there"}],
        "params": {"max_tokens": TOKENS, "seed": 1},
    }
    assert (await store.submit("u1", "left", "fp", payload)).outcome == "new"
    [(queue, entry, req_key)] = await store.take(name, 10, 100, partition=keys.partition("u1"))
    item = await store.start(name, entry, req_key, queue)
    assert item is not None
    await store.touch([req_key])
    request = GenerationRequest(
        key="", messages=item.payload["messages"], params=SamplingParams(max_tokens=TOKENS, seed=1)
    )
    logged = "".join(reply_words(request)[:3])
    assert await store.write_step([StepOp(item, 0, 3, logged, 1, (1, 2, 3))], name) == [True]

    engine = FakeEngine(reply_len=TOKENS)
    worker = Worker(store, engine, name=name)
    await worker.start()
    try:
        for _ in range(int(10 / 0.05)):
            if await redis.hget(req_key, "state") == b"done":
                break
            await asyncio.sleep(0.05)
        assert await redis.hget(req_key, "state") == b"done"
        deltas = [(int(f[b"o"]), int(f[b"n"])) for _, f in await redis.xrange(item.log_key) if b"n" in f]
        # The earlier process's 3 tokens, then the rest from offset 3: continued, not generated again.
        assert deltas[0] == (0, 3) and deltas[1][0] == 3
        pos = 0
        for o, n in deltas:
            assert o == pos
            pos += n
        assert pos == TOKENS
        assert engine.started_keys == [req_key] and await redis.hget(req_key, "requeues") == b"1"
    finally:
        await worker.stop()
