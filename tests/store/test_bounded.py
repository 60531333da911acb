"""Bounded memory: queues hold only work not yet started, reaping moves only unacknowledged work, and a
dead worker leaves nothing behind (against a real Redis/Valkey)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from server.store.keys import Keys
from server.store.requests import RequestStore, Settings, StepOp

PAYLOAD = {"owner": "u", "session": "", "messages": [{"role": "user", "content": "hi"}], "params": {}}


async def _run_one(store: RequestStore, worker: str, id: str) -> None:
    await store.submit("u", id, "fp", {**PAYLOAD, "id": id})
    [(queue, entry_id, req_key)] = await store.take(
        worker, partition=store.keys.partition("u"), count=1, block_ms=200
    )
    item = await store.start(worker, entry_id, req_key, queue)
    assert item is not None
    done = StepOp(item, 0, 1, "x", 2, token_ids=(7,), finish="stop", reply_text="x")
    assert await store.write_step([done], worker) == [True]


async def test_started_entries_leave_the_queues(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys)
    await store.ensure_group("w1")
    await store.heartbeat("w1")
    for i in range(20):
        await _run_one(store, "w1", f"r{i}")
    # Before: every request ever made stayed in the stream (XADD without a bound, XACK only).
    assert await redis.xlen(keys.queue(keys.partition("u"))) == 0
    assert await redis.xlen(keys.worker_queue("w1", keys.partition("u"))) == 0
    # An entry whose request expired is consumed too.
    await store.submit("u", "gone", "fp", {**PAYLOAD, "id": "gone"})
    await redis.delete(keys.request("u", "gone"))
    [(queue, entry_id, req_key)] = await store.take(
        "w1", partition=store.keys.partition("u"), count=1, block_ms=200
    )
    assert await store.start("w1", entry_id, req_key, queue) is None
    assert await redis.xlen(keys.queue(keys.partition("u"))) == 0
    assert await store.queued() == 1  # the counter is the submit's (the hash was removed by hand)


async def test_reaping_moves_only_unstarted_work(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings(lease_ttl_ms=150))
    await store.ensure_group("w1")
    await store.heartbeat("w1")
    for i in range(5):
        await _run_one(store, "w1", f"old{i}")
    # Routed to w1 by affinity and not started; and one it read from the shared queue but never started.
    await store.submit("u", "mine", "fp", {**PAYLOAD, "id": "mine"}, prefer="w1")
    await store.submit("u", "read", "fp", {**PAYLOAD, "id": "read"})
    got = await store.take("w1", partition=store.keys.partition("u"), count=10, block_ms=200)
    assert sorted(r for _, _, r in got) == sorted([keys.request("u", "mine"), keys.request("u", "read")])
    await asyncio.sleep(0.2)  # w1 dies: its lease lapses
    assert await store.heartbeat("w2") == ["w1"]
    assert await store.reap("w1") == 0  # nothing was running
    # Before: the five finished requests' history was re-added too, and the read entry stayed pending to
    # a consumer that is gone, so its request was queued forever.
    entries = await redis.xrange(keys.queue(keys.partition("u")))
    assert sorted(f[b"req"].decode() for _, f in entries) == sorted(r for _, _, r in got)
    consumers = await redis.xinfo_consumers(keys.queue(keys.partition("u")), RequestStore.GROUP)
    assert [c["name"] for c in consumers] == []
    await store.ensure_group("w2")
    again = await store.take("w2", partition=store.keys.partition("u"), count=10, block_ms=200)
    started = [await store.start("w2", e, r, q) for q, e, r in again]
    assert all(s is not None for s in started) and len(started) == 2
    assert await redis.xlen(keys.queue(keys.partition("u"))) == 0


async def test_entries_read_but_not_started_are_read_again(redis: aioredis.Redis, keys: Keys) -> None:
    # A worker that failed between reading an entry and starting it (Redis went away) reads it again,
    # instead of leaving its request queued until the worker dies.
    store = RequestStore(redis, keys)
    await store.ensure_group("w1")
    await store.submit("u", "a", "fp", {**PAYLOAD, "id": "a"})
    [(queue, entry_id, req_key)] = await store.take(
        "w1", partition=store.keys.partition("u"), count=5, block_ms=100
    )
    assert (
        await store.take("w1", partition=store.keys.partition("u"), count=5, block_ms=100) == []
    )  # ">" delivers it once
    assert await store.take(
        "w1", partition=store.keys.partition("u"), count=5, block_ms=100, pending=True
    ) == [(queue, entry_id, req_key)]
    assert await store.start("w1", entry_id, req_key, queue) is not None
    assert (
        await store.take("w1", partition=store.keys.partition("u"), count=5, block_ms=100, pending=True) == []
    )
