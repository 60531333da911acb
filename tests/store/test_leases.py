"""Worker leases, re-queue with fencing, the detach timeout and epochs, against a real Redis/Valkey."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis

from server.store.keys import Keys
from server.store.requests import RequestStore, Settings, StepOp, WorkItem

PAYLOAD = {
    "owner": "u",
    "id": "r",
    "session": "",
    "messages": [{"role": "user", "content": "hi"}],
    "params": {},
}


async def _take_start(store: RequestStore, worker: str) -> WorkItem | None:
    [(queue, entry_id, req_key)] = await store.take(
        worker, partition=store.keys.partition("u"), count=1, block_ms=200
    )
    return await store.start(worker, entry_id, req_key, queue)


async def test_dead_worker_requests_are_requeued_fenced_and_continued(
    redis: aioredis.Redis, keys: Keys
) -> None:
    store = RequestStore(redis, keys, Settings(lease_ttl_ms=200))
    await store.ensure_group()
    assert await store.heartbeat("w1") == []
    await store.submit("u", "r", "fp", PAYLOAD)
    item = await _take_start(store, "w1")
    assert item is not None and item.completion_tokens == 0
    ops = [StepOp(item, 0, 1, "Hel", 4, token_ids=(11,)), StepOp(item, 1, 2, "lo", 4, token_ids=(12, 13))]
    assert await store.write_step(ops, "w1") == [True, True]

    # w2's heartbeat sees no dead worker while w1's lease is live, and reaping a live worker does nothing.
    assert await store.heartbeat("w2") == []
    assert await store.reap("w1") == -1
    await asyncio.sleep(0.3)  # w1 stops heartbeating: its lease lapses
    assert await store.heartbeat("w2") == ["w1"]
    assert await store.reap("w1") == 1
    assert await store.reap("w1") == 0  # a second reaper finds nothing left to re-queue
    info = await store.get("u", "r")
    assert info is not None and info.state == "queued" and info.epoch == 1

    # The old worker is fenced out, even if it was only slow, not dead.
    assert await store.write_step([StepOp(item, 3, 1, "!", 4, token_ids=(14,))], "w1") == [False]

    again = await _take_start(store, "w2")
    assert again is not None and again.completion_tokens == 3 and again.epoch == 1
    assert await store.logged_tokens(again.log_key) == ([11, 12, 13], "Hello")
    done = StepOp(again, 3, 1, "!", 4, token_ids=(14,), finish="stop", reply_text="Hello!")
    assert await store.write_step([done], "w2") == [True]
    entries = await redis.xrange(again.log_key)
    assert [e[0] for e in entries] == [b"0-1", b"1-1", b"3-1", b"4-2"]


async def test_a_requeued_request_nobody_waits_for_ends_with_its_prompts_length(
    redis: aioredis.Redis, keys: Keys
) -> None:
    # Cancelled as a worker would start it again (start.lua): its logged tokens came from a prompt whose
    # length the first entry carries, so its done says so (SPEC §5: 0 only if generation never started).
    store = RequestStore(redis, keys, Settings(lease_ttl_ms=200, detach_timeout_ms=150))
    await store.ensure_group()
    await store.heartbeat("w1")
    await store.submit("u", "r", "fp", PAYLOAD)
    item = await _take_start(store, "w1")
    assert item is not None
    assert await store.write_step([StepOp(item, 0, 2, "Hi", 9, token_ids=(11, 12))], "w1") == [True]
    await asyncio.sleep(0.3)  # w1's lease lapses, and nobody is attached past the detach timeout
    assert await store.heartbeat("w2") == ["w1"] and await store.reap("w1") == 1
    assert await _take_start(store, "w2") is None
    info = await store.get("u", "r")
    assert info is not None and (info.state, info.prompt_tokens, info.completion_tokens) == (
        "cancelled",
        9,
        2,
    )
    last = (await redis.xrange(item.log_key))[-1]
    assert last[1][b"d"] == b"cancelled" and last[1][b"pt"] == b"9"


async def test_requeued_request_whose_log_is_lost_restarts_under_a_new_epoch(
    redis: aioredis.Redis, keys: Keys
) -> None:
    store = RequestStore(redis, keys, Settings(lease_ttl_ms=100))
    await store.ensure_group()
    await store.heartbeat("w1")
    await store.submit("u", "r", "fp", PAYLOAD)
    item = await _take_start(store, "w1")
    assert item is not None
    await store.write_step([StepOp(item, 0, 2, "ab", 4, token_ids=(1, 2))], "w1")
    await asyncio.sleep(0.2)
    await store.heartbeat("w2")
    assert await store.reap("w1") == 1
    await redis.delete(item.log_key)  # e.g. a store restored from an older snapshot
    again = await _take_start(store, "w2")
    assert again is not None and (again.epoch, again.completion_tokens) == (2, 0)


async def test_detach_timeout_cancels_running_and_queued(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings(detach_timeout_ms=150))
    await store.ensure_group()
    await store.submit("u", "r", "fp", PAYLOAD)
    item = await _take_start(store, "w1")
    assert item is not None
    # Touched (a client is attached): it keeps running past the timeout.
    for _ in range(3):
        await asyncio.sleep(0.08)
        assert await store.touch([item.req_key]) == 1
    assert await store.write_step([StepOp(item, 0, 1, "a", 7)], "w1") == [True]
    assert await store.detach_sweep("w1") == 0  # attached: nothing to do
    await asyncio.sleep(0.2)  # nobody attached for longer than the timeout
    assert await store.detach_sweep("w1") == 1  # the worker's sweep (about every second)
    assert await store.write_step([StepOp(item, 1, 1, "b", 1)], "w1") == [False]
    info = await store.get("u", "r")
    assert info is not None and (info.state, info.finish_reason) == ("cancelled", "cancelled")
    assert info.prompt_tokens == 7
    last = (await redis.xrange(item.log_key))[-1]
    assert last[0] == b"1-2" and last[1][b"d"] == b"cancelled"
    assert last[1][b"pt"] == b"7"  # the prompt's length, from the log's first entry
    assert last[1][b"c"] == b"detach_timeout"  # done.cancel_reason: not the client's cancel (SPEC 10.5)

    # A queued request nobody waits for any more is cancelled when a worker would start it.
    await store.submit("u", "q", "fp", {**PAYLOAD, "id": "q"})
    await asyncio.sleep(0.2)
    assert await _take_start(store, "w1") is None
    info = await store.get("u", "q")
    assert info is not None and info.state == "cancelled"
    end = (await redis.xrange(keys.log("u", "q")))[-1][1]
    assert (end[b"d"], end[b"c"]) == (b"cancelled", b"detach_timeout")
    # touch never resurrects an expired or unknown request
    assert await store.touch([keys.request("u", "gone")]) == 0
    assert not await redis.exists(keys.request("u", "gone"))


async def test_detach_sweep_reads_an_attached_request_once_per_deadline(
    redis: aioredis.Redis, keys: Keys
) -> None:
    """The sweep runs every second, but a request whose client keeps touching it is read only when its
    attached_until can have passed (issue 28: a held stream costs the store per detach timeout, not per
    second); once the client is gone it is still cancelled on time."""
    store = RequestStore(redis, keys, Settings(detach_timeout_ms=400))
    await store.ensure_group()
    await store.submit("u", "r", "fp", PAYLOAD)
    item = await _take_start(store, "w1")
    assert item is not None
    scripts: list[int] = []
    run = store._run_scripts

    async def counting(calls: list[Any]) -> list[Any]:
        scripts.append(len(calls))
        return await run(calls)

    store._run_scripts = counting  # type: ignore[method-assign]
    assert await store.detach_sweep("w1") == 0 and scripts == [1]  # read: due in about 400 ms
    for _ in range(3):
        assert await store.detach_sweep("w1") == 0
    assert scripts == [1]  # not due yet: no script call at all
    await asyncio.sleep(0.5)
    assert await store.detach_sweep("w1") == 1  # due, read again, nobody touched it: cancelled
    assert scripts == [1, 1]
    info = await store.get("u", "r")
    assert info is not None and info.finish_reason == "cancelled"


async def test_affinity_queue_and_its_reaping(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings(lease_ttl_ms=300))
    for w in ("w1", "w2"):
        await store.ensure_group(w)
        await store.heartbeat(w, running=1, capacity=8)
    assert await store.live_workers() == {"w1": (1, 8), "w2": (1, 8)}
    await store.submit("u", "a", "fp", {**PAYLOAD, "id": "a"}, prefer="w1")
    assert (
        await store.take("w2", partition=store.keys.partition("u"), count=5, block_ms=50) == []
    )  # routed to w1's own queue
    [(queue, _, _)] = await store.take("w1", partition=store.keys.partition("u"), count=5, block_ms=50)
    assert queue == keys.worker_queue("w1", keys.partition("u"))

    # Routed to w1, then w1 dies before starting it (and before starting "a", which it had only read):
    # reaping moves both to the shared queue, where w2 starts them.
    await store.submit("u", "b", "fp", {**PAYLOAD, "id": "b"}, prefer="w1")
    await asyncio.sleep(0.35)
    await store.heartbeat("w2")
    assert await store.live_workers() == {"w2": (0, 0)}
    assert await store.reap("w1") == 0  # nothing was running
    taken = await store.take("w2", partition=store.keys.partition("u"), count=5, block_ms=50)
    assert [(q, k) for q, _, k in taken] == [
        (keys.queue(keys.partition("u")), keys.request("u", x)) for x in ("a", "b")
    ]
    for queue, entry_id, req_key in taken:
        assert await store.start("w2", entry_id, req_key, queue) is not None
    # With w1's lease gone, a request preferring it goes to the shared queue, never to a dead queue.
    await store.submit("u", "c", "fp", {**PAYLOAD, "id": "c"}, prefer="w1")
    [(queue, _, _)] = await store.take("w2", partition=store.keys.partition("u"), count=5, block_ms=50)
    assert queue == keys.queue(keys.partition("u"))
    assert not await redis.exists(keys.worker_queue("w1", keys.partition("u")))


async def test_draining_worker_hands_its_requests_back(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings(lease_ttl_ms=10_000))
    await store.ensure_group("w1")
    await store.heartbeat("w1")
    await store.submit("u", "r", "fp", PAYLOAD)
    item = await _take_start(store, "w1")
    assert item is not None
    assert await store.reap("w1") == -1  # live lease: another worker may not take it
    assert await store.reap("w1", own=True) == 1  # but the worker itself may hand it back
    info = await store.get("u", "r")
    assert info is not None and info.state == "queued"
    assert await store.live_workers() == {}


async def test_offset_mismatch_requeues_then_fails_never_stays_running(
    redis: aioredis.Redis, keys: Keys
) -> None:
    # Before: append.lua answered -1, the worker forgot the request, and it stayed `running` under a live
    # lease with no end entry: attached clients waited forever.
    store = RequestStore(redis, keys)
    await store.ensure_group()
    await store.heartbeat("w1")
    await store.submit("u", "r", "fp", PAYLOAD)
    item = await _take_start(store, "w1")
    assert item is not None
    assert await store.write_step([StepOp(item, 0, 2, "ab", 4, token_ids=(1, 2))], "w1") == [True]
    assert await store.write_step([StepOp(item, 5, 1, "c", 4, token_ids=(3,))], "w1") == [False]
    info = await store.get("u", "r")
    assert info is not None and (info.state, info.completion_tokens) == ("queued", 2)
    assert not await redis.hexists(keys.worker_requests("w1", keys.partition("u")), item.log_key)
    # Another worker continues it after the two logged tokens.
    again = await _take_start(store, "w2")
    assert again is not None and again.completion_tokens == 2
    for _ in range(2):  # a worker that keeps getting it wrong...
        assert await store.write_step([StepOp(again, 9, 1, "x", 4, token_ids=(3,))], "w2") == [False]
        again = await _take_start(store, "w2")
        assert again is not None and again.completion_tokens == 2
    assert await store.write_step([StepOp(again, 9, 1, "x", 4, token_ids=(3,))], "w2") == [False]
    # ... makes it fail visibly, with an end entry every attached reader gets.
    info = await store.get("u", "r")
    assert info is not None and (info.state, info.finish_reason) == ("failed", "error")
    last = (await redis.xrange(item.log_key))[-1]
    assert last[0] == b"2-2" and last[1][b"e"] == b"internal"
    assert await redis.xlen(keys.queue(keys.partition("u"))) == 0


async def test_touch_and_retry_only_extend_the_detach_deadline(redis: aioredis.Redis, keys: Keys) -> None:
    # A background HTTP response gets a long deadline; a WebSocket resume (touch) or a retry of the same
    # request (submit → attach) with the usual 30 s must not shorten it (it would then be cancelled 30 s
    # after that client left, though nobody needs to stay attached to a background response).
    store = RequestStore(redis, keys, Settings(detach_timeout_ms=30_000))
    await store.submit("u", "r", "fp", PAYLOAD, detach_timeout_ms=3_600_000)
    req = keys.request("u", "r")
    long = int(await redis.hget(req, "attached_until") or 0)
    assert await store.touch([req]) == 1
    assert int(await redis.hget(req, "attached_until") or 0) == long
    assert (await store.submit("u", "r", "fp", PAYLOAD)).outcome == "attach"
    assert int(await redis.hget(req, "attached_until") or 0) == long
    # An ordinary request's deadline still moves forward with each touch.
    await store.submit("u", "s", "fp", {**PAYLOAD, "id": "s"})
    short = keys.request("u", "s")
    before = int(await redis.hget(short, "attached_until") or 0)
    await asyncio.sleep(0.01)
    assert await store.touch([short]) == 1
    assert int(await redis.hget(short, "attached_until") or 0) > before


async def test_a_chats_own_detach_timeout_is_what_every_touch_extends_by(
    redis: aioredis.Redis, keys: Keys
) -> None:
    # params.detach_timeout_ms (SPEC 4.2): the client is away for up to that long after its last touch,
    # not after its chat: a reply it followed for minutes still has that long once it leaves.
    store = RequestStore(redis, keys, Settings(detach_timeout_ms=30_000))
    await store.submit("u", "own", "fp", PAYLOAD, detach_timeout_ms=600_000, keep_detach_timeout=True)
    await store.submit("u", "bg", "fp", {**PAYLOAD, "id": "bg"}, detach_timeout_ms=600_000)
    own, bg = keys.request("u", "own"), keys.request("u", "bg")
    for req in (own, bg):
        await redis.hset(req, "attached_until", 0)  # as if submitted long ago
    assert await store.touch([own, bg]) == 2
    now_ms = int(time.time() * 1000)
    own_until = int(await redis.hget(own, "attached_until") or 0)
    bg_until = int(await redis.hget(bg, "attached_until") or 0)
    assert now_ms + 590_000 < own_until <= now_ms + 601_000
    # A background response's deadline was its submit's alone: a touch gives it the usual 30 s.
    assert now_ms + 25_000 < bg_until <= now_ms + 31_000
