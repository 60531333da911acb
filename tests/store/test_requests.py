"""The request state machine and token logs against a real Redis/Valkey."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from server.store.keys import Keys
from server.store.logs import LogEntry, LogReader
from server.store.requests import RequestStore, Settings, StepOp

PAYLOAD = {
    "owner": "u1",
    "id": "r1",
    "session": "s1",
    "messages": [{"role": "user", "content": "hi"}],
    "params": {},
}


async def _started(store: RequestStore, worker: str = "w1"):  # type: ignore[no-untyped-def]
    await store.ensure_group()
    res = await store.submit(
        "u1", "r1", "fp1", PAYLOAD, session="s1", user_message={"role": "user", "content": "hi"}
    )
    assert res.outcome == "new"
    [(queue, entry_id, req_key)] = await store.take(
        worker, partition=store.keys.partition("u1"), count=10, block_ms=100
    )
    item = await store.start(worker, entry_id, req_key, queue)
    assert item is not None
    return item


async def test_submit_is_idempotent_by_fingerprint(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys)
    await store.ensure_group()
    first = await store.submit("u1", "r1", "fp1", PAYLOAD)
    again = await store.submit("u1", "r1", "fp1", PAYLOAD)
    other = await store.submit("u1", "r1", "fp2", PAYLOAD)
    other_user = await store.submit("u2", "r1", "fp2", PAYLOAD)
    assert (first.outcome, first.state, first.epoch) == ("new", "queued", 1)
    assert (again.outcome, again.state) == ("attach", "queued")
    assert other.outcome == "conflict"
    assert other_user.outcome == "new"  # ids are scoped by owner
    # Only the two new requests were queued: an attach never queues a second generation.
    taken = [
        e
        for p in {keys.partition("u1"), keys.partition("u2")}
        for e in await store.take("w1", 10, 100, partition=p)
    ]
    assert len(taken) == 2


async def test_queue_limit_counts_every_partition(redis: aioredis.Redis, keys: Keys) -> None:
    # The limit is global: owners in different partitions (on a cluster) share it.
    store = RequestStore(redis, keys, Settings(max_queued=3))
    await store.ensure_group()
    outcomes = [(await store.submit(f"u{i}", "r", "fp", PAYLOAD)).outcome for i in range(5)]
    assert outcomes == ["new", "new", "new", "overloaded", "overloaded"]
    assert await store.queued() == 3


async def test_lifecycle_log_and_history(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys)
    item = await _started(store)
    info = await store.get("u1", "r1")
    assert info is not None and info.state == "running"
    # A second start of the same request is refused: it is no longer queued.
    assert await store.start("w2", "0-0", item.req_key) is None

    held = await store.write_step([StepOp(item, 0, 1, "Hel", 5), StepOp(item, 1, 2, "lo!", 5)], "w1")
    assert held == [True, True]
    # Out-of-order or repeated offsets are refused (no gap, no repeat): the request goes back to the queue
    # and is continued after the tokens logged.
    assert await store.write_step([StepOp(item, 1, 1, "x", 5)], "w1") == [False]
    [(queue, entry_id, req_key)] = await store.take(
        "w1", partition=store.keys.partition("u1"), count=10, block_ms=100
    )
    item = await store.start("w1", entry_id, req_key, queue)
    assert item is not None and item.completion_tokens == 3
    # A worker that does not hold the request cannot write.
    assert await store.write_step([StepOp(item, 3, 1, "x", 5)], "intruder") == [False]
    done = await store.write_step(
        [StepOp(item, 3, 1, " Bye", 5, finish="stop", reply_text="Hello! Bye", cached_tokens=2)], "w1"
    )
    assert done == [True]

    entries = await redis.xrange(item.log_key)
    assert [e[0] for e in entries] == [b"0-1", b"1-1", b"3-1", b"4-2"]
    assert entries[-1][1][b"d"] == b"stop" and entries[-1][1][b"o"] == b"4"
    assert LogEntry.parse(entries[-1][1]).cached_tokens == 2  # the end entry carries the usage
    info = await store.get("u1", "r1")
    assert info is not None
    assert (info.state, info.completion_tokens, info.prompt_tokens, info.finish_reason) == (
        "done",
        4,
        5,
        "stop",
    )
    assert info.cached_tokens == 2
    view = await store.view("u1", "r1")
    assert view is not None and view.info.cached_tokens == 2
    history = await redis.lrange(keys.history("s1", "u1"), 0, -1)
    assert [json.loads(h) for h in history] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! Bye"},
    ]
    # Finished requests are kept for the retention period, then expire.
    assert 0 < await redis.pttl(item.req_key) <= Settings().retention_ms


async def test_cancel_queued_running_finished_unknown(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys)
    item = await _started(store)
    assert await store.write_step([StepOp(item, 0, 1, "a", 3)], "w1") == [True]
    assert await store.cancel("u1", "r1") == "running"
    # The worker learns at its next write that the request is no longer its to generate.
    assert await store.write_step([StepOp(item, 1, 1, "b", 3)], "w1") == [False]
    assert await store.cancel("u1", "r1") == "cancelled"  # idempotent, nothing changes
    entries = await redis.xrange(item.log_key)
    assert [e[0] for e in entries] == [b"0-1", b"1-2"]
    assert entries[-1][1][b"d"] == b"cancelled"
    # The prompt's length, which only finish.lua writes to the request, comes from the first entry: a
    # cancelled reply's usage counts the prompt its tokens were generated from (SPEC §5).
    assert entries[-1][1][b"pt"] == b"3" and entries[0][1][b"p"] == b"3"
    info = await store.get("u1", "r1")
    assert info is not None and (info.prompt_tokens, info.completion_tokens) == (3, 1)
    assert await store.cancel("u1", "nope") is None
    # A cancelled turn leaves no history.
    assert await redis.llen(keys.history("s1", "u1")) == 0

    await store.submit("u1", "q", "fp", {**PAYLOAD, "id": "q"})
    assert await store.cancel("u1", "q") == "queued"
    [(queue, entry_id, req_key)] = await store.take(
        "w1", partition=store.keys.partition("u1"), count=10, block_ms=100
    )
    assert await store.start("w1", entry_id, req_key, queue) is None  # cancelled while waiting: never runs
    assert int(await redis.get(keys.queued_count(keys.partition("u1"))) or 0) == 0


async def test_queue_limit_refuses_with_overloaded(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings(max_queued=2))
    await store.ensure_group()
    outcomes = [(await store.submit("u", f"r{i}", "fp", PAYLOAD)).outcome for i in range(3)]
    assert outcomes == ["new", "new", "overloaded"]
    assert await store.get("u", "r2") is None  # a refused request leaves nothing behind


async def test_log_reader_replays_then_follows(
    redis: aioredis.Redis, keys: Keys, new_client: Callable[[], Any]
) -> None:
    store = RequestStore(redis, keys)
    item = await _started(store)
    await store.write_step([StepOp(item, 0, 1, "a", 1), StepOp(item, 1, 1, "b", 1)], "w1")
    reader_r = new_client()
    reader = LogReader(reader_r, keys, "test", block_ms=1000)
    reader.start()
    try:
        from_start = reader.subscribe(item.log_key, 0)
        from_one = reader.subscribe(item.log_key, 1)
        got0 = [await asyncio.wait_for(from_start.queue.get(), 5) for _ in range(2)]
        got1 = [await asyncio.wait_for(from_one.queue.get(), 5)]
        assert [e.text for e in got0] == ["a", "b"] and [e.offset for e in got0] == [0, 1]
        assert [e.text for e in got1] == ["b"]
        # Live entries reach both subscribers through the same blocking read.
        await store.write_step([StepOp(item, 2, 1, "c", 1, finish="length", reply_text="abc")], "w1")
        for sub in (from_start, from_one):
            c = await asyncio.wait_for(sub.queue.get(), 5)
            end = await asyncio.wait_for(sub.queue.get(), 5)
            assert (c.offset, c.text) == (2, "c")
            assert (end.finish, end.offset, end.prompt_tokens) == ("length", 3, 1)
        reader.unsubscribe(from_start)
        reader.unsubscribe(from_one)
    finally:
        await reader.stop()
        await reader_r.aclose()


async def _soon(check: Callable[[], Awaitable[object]]) -> None:
    """Poll ``check`` until it answers something true, for up to 2 s (the caller asserts afterwards)."""
    for _ in range(100):
        if await check():
            return
        await asyncio.sleep(0.02)


async def test_log_reader_wake_stream_expires_and_renews_its_expiry_rarely(
    redis: aioredis.Redis, keys: Keys, new_client: Callable[[], Any]
) -> None:
    """A gateway killed without stop() leaves its wake stream behind: it must carry an expiry from the
    first wake-up on, renewed once per WAKE_RENEW_S rather than with every stream attached."""
    from server.store import logs

    store = RequestStore(redis, keys)
    item = await _started(store)
    reader_r = new_client()
    reader = LogReader(reader_r, keys, "test", block_ms=1000)
    wake = reader.reader_for(item.log_key).wake_key

    def attach_one() -> None:  # a stream attached and gone: the reader XADDs a wake-up
        reader.unsubscribe(reader.subscribe(item.log_key, 0))

    reader.start()
    try:
        attach_one()
        await _soon(lambda: redis.exists(wake))
        assert 0 < await redis.pttl(wake) <= logs.WAKE_TTL_MS
        await redis.persist(wake)  # as a lost key comes back from the next XADD: no expiry
        entries = await redis.xlen(wake)
        attach_one()

        async def grew() -> bool:
            return bool(await redis.xlen(wake) > entries)

        await _soon(grew)
        assert await redis.xlen(wake) > entries  # woken again ...
        assert await redis.pttl(wake) == -1  # ... without another PEXPIRE within the renewal period
        reader.reader_for(item.log_key)._renew_at = 0.0  # the period is over
        attach_one()

        async def expires() -> bool:
            return bool(await redis.pttl(wake) > 0)

        await _soon(expires)
        assert 0 < await redis.pttl(wake) <= logs.WAKE_TTL_MS
    finally:
        await reader.stop()
        await reader_r.aclose()


async def test_log_reader_subscriber_joining_mid_read_still_starts_at_its_offset(
    redis: aioredis.Redis, keys: Keys, new_client: Callable[[], Any]
) -> None:
    """A subscription made while the blocking read waits past its position must still get every entry
    from its own offset, in order (the in-flight read's batch skips what it needs)."""
    store = RequestStore(redis, keys)
    item = await _started(store)
    await store.write_step([StepOp(item, i, 1, f"t{i}", 1) for i in range(5)], "w1")
    reader_r = new_client()
    reader = LogReader(reader_r, keys, "test", block_ms=1000)
    reader.start()
    try:
        ahead = reader.subscribe(item.log_key, 5)  # the read now blocks waiting for offset 5
        await asyncio.sleep(0.2)
        # Join without waking the reader, so that the in-flight read (from offset 5) returns the next
        # entry first: the worst case of a wake-up that arrives after the write.
        part = reader.reader_for(item.log_key)
        wake = part._wake
        part._wake = asyncio.Event()
        late = reader.subscribe(item.log_key, 0)
        part._wake = wake
        await store.write_step([StepOp(item, 5, 1, "t5", 1)], "w1")
        got = [await asyncio.wait_for(late.queue.get(), 5) for _ in range(6)]
        assert [e.offset for e in got] == [0, 1, 2, 3, 4, 5]
        assert (await asyncio.wait_for(ahead.queue.get(), 5)).offset == 5
    finally:
        await reader.stop()
        await reader_r.aclose()


async def test_per_user_limit_counts_queued_and_running_requests(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings(max_inflight_per_user=2))
    await store.ensure_group()
    a = await store.submit("u1", "a", "fp", PAYLOAD)
    b = await store.submit("u1", "b", "fp", PAYLOAD)
    c = await store.submit("u1", "c", "fp", PAYLOAD)
    assert (a.outcome, b.outcome, c.outcome, c.queued) == ("new", "new", "user_limit", 2)
    assert await store.get("u1", "c") is None  # a refused request leaves nothing behind
    assert (await store.submit("u1", "a", "fp", PAYLOAD)).outcome == "attach"  # retries are not new work
    assert (await store.submit("u2", "x", "fp", PAYLOAD)).outcome == "new"  # per user

    # Running counts too; a request that ends in any way frees its place: finished, cancelled, expired.
    entries = await store.take("w1", partition=store.keys.partition("u1"), count=10, block_ms=100)
    items = {i.req_key: i for q, e, k in entries if (i := await store.start("w1", e, k, q)) is not None}
    item_a = items[keys.request("u1", "a")]
    assert (await store.submit("u1", "c", "fp", PAYLOAD)).outcome == "user_limit"
    await store.write_step([StepOp(item_a, 0, 1, "x", 1, finish="stop", reply_text="x")], "w1")
    assert (await store.submit("u1", "c", "fp", PAYLOAD)).outcome == "new"
    assert (await store.submit("u1", "d", "fp", PAYLOAD)).outcome == "user_limit"
    assert await store.cancel("u1", "b") == "running"
    assert (await store.submit("u1", "d", "fp", PAYLOAD)).outcome == "new"
    await redis.delete(keys.request("u1", "c"))  # as if its record had expired
    assert (await store.submit("u1", "e", "fp", PAYLOAD)).outcome == "new"
    assert await redis.scard(keys.inflight("u1")) == 2  # d and e: the ended ones were pruned


async def test_a_user_at_its_limit_is_not_held_by_queued_requests_nobody_waits_for(
    redis: aioredis.Redis, keys: Keys
) -> None:
    """A queued request nobody is attached to past its detach timeout is cancelled when a worker would
    start it; until then it counted against its user's limit, so while no worker took work (all of them
    restarting or loading) a user who dropped off was refused every new request. At the limit, submit
    first cancels those, with the end a worker would have given them (SPEC 10.5); a running one is left to
    its worker's sweep, and one within its timeout still counts."""
    store = RequestStore(redis, keys, Settings(max_inflight_per_user=2))
    await store.ensure_group()
    assert (await store.submit("u1", "a", "fp", PAYLOAD, detach_timeout_ms=1)).outcome == "new"
    assert (await store.submit("u1", "b", "fp", PAYLOAD)).outcome == "new"  # the default 30 s
    assert await store.queued() == 2
    await asyncio.sleep(0.05)  # a: nobody attached for its timeout
    assert (await store.submit("u1", "c", "fp", PAYLOAD)).outcome == "new"
    info = await store.get("u1", "a")
    assert info is not None and (info.state, info.finish_reason) == ("cancelled", "cancelled")
    end = (await redis.xrange(keys.log("u1", "a")))[-1][1]
    assert (end[b"d"], end[b"o"], end[b"c"]) == (b"cancelled", b"0", b"detach_timeout")
    assert await store.queued() == 2  # b and c
    assert (await store.submit("u1", "d", "fp", PAYLOAD)).outcome == "user_limit"  # b and c within 30 s
    # The same chat sent again at the limit, past its timeout, is a client back: it attaches, and is kept.
    await redis.hset(keys.request("u1", "b"), "attached_until", 0)
    assert (await store.submit("u1", "b", "fp", PAYLOAD)).outcome == "attach"
    info = await store.get("u1", "b")
    assert info is not None and info.state == "queued"

    # A worker reaches the queue: a's entry starts nothing (and is not counted off twice); b and c run.
    entries = await store.take("w1", partition=store.keys.partition("u1"), count=10, block_ms=100)
    started = [i.req_key for q, e, k in entries if (i := await store.start("w1", e, k, q)) is not None]
    assert sorted(started) == [keys.request("u1", "b"), keys.request("u1", "c")]
    assert await store.queued() == 0
    await redis.hset(keys.request("u1", "c"), "attached_until", 0)  # c runs past its timeout: its
    # worker's sweep ends it, not a submit
    assert (await store.submit("u1", "d", "fp", PAYLOAD)).outcome == "user_limit"
    info = await store.get("u1", "c")
    assert info is not None and info.state == "running"


async def test_no_per_user_limit_by_default(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys)
    await store.ensure_group()
    assert {(await store.submit("u1", f"r{i}", "fp", PAYLOAD)).outcome for i in range(20)} == {"new"}
    assert not await redis.exists(keys.inflight("u1"))


async def test_one_step_spans_partitions_and_a_shared_cache_entry_crosses_slots(
    redis: aioredis.Redis, keys: Keys
) -> None:
    """One engine step writes requests of owners in several partitions (on a cluster: several masters,
    one pipeline), and the shared response-cache entry of one of them is written after its transition
    (another slot) and answers another owner's identical request."""
    store = RequestStore(redis, keys)
    await store.ensure_group("w1")
    owners = [f"u{i}" for i in range(6)]
    for o in owners:
        cache = "same-question" if o == "u0" else ""
        res = await store.submit(o, "r", "fp", {**PAYLOAD, "owner": o}, cache_key=cache, shared_cache=True)
        assert res.outcome == "new"
    items = []
    for p in sorted({keys.partition(o) for o in owners}):
        for queue, entry_id, req_key in await store.take("w1", 10, 100, partition=p):
            item = await store.start("w1", entry_id, req_key, queue)
            assert item is not None
            items.append(item)
    assert len(items) == len(owners)
    ops = [StepOp(it, 0, 2, "ok", 3, token_ids=(1, 2), finish="stop", reply_text="ok") for it in items]
    assert await store.write_step(ops, "w1") == [True] * len(owners)
    for o in owners:
        info = await store.get(o, "r")
        assert info is not None and (info.state, info.completion_tokens) == ("done", 2)
        assert info.cached_tokens == 0
        end = LogEntry.parse((await redis.xrange(keys.log(o, "r")))[-1][1])
        assert (end.prompt_tokens, end.cached_tokens) == (3, 0)
    # The cache entry written after u0's finish answers another owner at once, without a worker.
    hit = await store.submit(
        "v", "r", "fp", {**PAYLOAD, "owner": "v"}, cache_key="same-question", shared_cache=True
    )
    assert (hit.outcome, hit.state) == ("cached", "done")
    assert [e[1][b"t"] for e in await redis.xrange(keys.log("v", "r")) if b"t" in e[1]] == [b"ok"]
    # Nothing was computed for it: its whole prompt counts as cached.
    end = LogEntry.parse((await redis.xrange(keys.log("v", "r")))[-1][1])
    assert (end.finish, end.prompt_tokens, end.cached_tokens) == ("stop", 3, 3)
    info = await store.get("v", "r")
    assert info is not None and (info.prompt_tokens, info.cached_tokens) == (3, 3)


async def test_a_length_end_keeps_which_limit_ended_it_also_through_the_cache(
    redis: aioredis.Redis, keys: Keys
) -> None:
    """The end entry of a "length" carries its length_reason ("lr", done.length_reason, SPEC 12), and a
    response-cache hit answered from it replays the same reason; other ends carry none."""
    store = RequestStore(redis, keys)
    await store.ensure_group("w1")
    for rid, cache in (("full", "long-question"), ("plain", "")):
        assert (await store.submit("u", rid, "fp", PAYLOAD, cache_key=cache)).outcome == "new"
    items = {}
    for queue, entry_id, req_key in await store.take("w1", 10, 100, partition=keys.partition("u")):
        item = await store.start("w1", entry_id, req_key, queue)
        assert item is not None
        items[req_key] = item
    full = items[keys.request("u", "full")]
    plain = items[keys.request("u", "plain")]
    ops = [
        StepOp(
            full, 0, 2, "ab", 3, token_ids=(1, 2), finish="length", reply_text="ab", length_reason="context"
        ),
        # A reason with another finish is not written (only a length has one).
        StepOp(plain, 0, 1, "a", 3, token_ids=(1,), finish="stop", reply_text="a", length_reason="context"),
    ]
    assert await store.write_step(ops, "w1") == [True, True]
    end = LogEntry.parse((await redis.xrange(keys.log("u", "full")))[-1][1])
    assert (end.finish, end.length_reason) == ("length", "context")
    plain_end = (await redis.xrange(keys.log("u", "plain")))[-1][1]
    assert b"lr" not in plain_end and LogEntry.parse(plain_end).length_reason == ""
    hit = await store.submit("u", "again", "fp", PAYLOAD, cache_key="long-question")
    assert (hit.outcome, hit.state) == ("cached", "done")
    end = LogEntry.parse((await redis.xrange(keys.log("u", "again")))[-1][1])
    assert (end.finish, end.offset, end.length_reason) == ("length", 2, "context")


async def test_a_reader_following_many_logs_pauses_so_that_writes_gather(
    redis: aioredis.Redis, keys: Keys, new_client: Callable[[], Any]
) -> None:
    """A read names every followed log, so a reader following many pauses after a read that brought
    entries (logs.READ_PAUSE_S_PER_LOG) and the next read gathers what was written meanwhile: fewer reads
    than writes, and every entry still delivered in order. A small reader does not pause."""
    from server.store import logs

    assert logs.read_pause_s(32) == 0.0  # under a millisecond: skipped
    assert logs.read_pause_s(600) == 600 * logs.READ_PAUSE_S_PER_LOG
    assert logs.read_pause_s(10**6) == logs.MAX_READ_PAUSE_S
    reader_r = new_client()
    reads = 0
    xread = reader_r.xread

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal reads
        reads += 1
        return await xread(*args, **kwargs)

    reader_r.xread = counted
    reader = logs.LogReader(reader_r, keys, "fanin", block_ms=1000)
    names = [keys.log("u1", f"r{i}") for i in range(600)]  # 12 ms after a read that brought entries
    reader.start()
    try:
        subs = [reader.subscribe(k, 0) for k in names]
        await _soon(lambda: asyncio.sleep(0, reads > 0))
        before = reads
        writes = 120
        for i in range(writes):  # one entry to each of 60 logs, twice: each write would wake a read
            await redis.xadd(names[i % 60], {"o": i // 60, "n": 1, "t": str(i)}, id=f"{i // 60 + 1}-1")
            await asyncio.sleep(0.002)
        got = [[(await asyncio.wait_for(s.queue.get(), 5)).text for _ in range(2)] for s in subs[:60]]
        assert got == [[str(i), str(i + 60)] for i in range(60)]
        assert all(s.queue.empty() for s in subs)
        # At least 120 x 2 ms of writes against a 12 ms pause: some 20 reads; without it, about 120.
        assert reads - before <= writes // 2, f"{reads - before} reads for {writes} writes"
    finally:
        await reader.stop()
        await reader_r.aclose()
