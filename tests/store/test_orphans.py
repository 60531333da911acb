"""RequestStore.unheld and requeue_orphan (orphan.lua): what a worker's reconcile reads and does, fenced by
the holder and the start it saw, on a plain Redis and on a cluster (conftest.py)."""

from __future__ import annotations

import redis.asyncio as aioredis

from server.store.keys import Keys
from server.store.requests import RequestStore, WorkItem

PAYLOAD = {
    "owner": "u1",
    "id": "r1",
    "session": "",
    "messages": [{"role": "user", "content": "hi"}],
    "params": {},
}


async def _started(store: RequestStore, worker: str, route: str = "") -> WorkItem:
    await store.ensure_group(worker, routes=(route,))
    assert (await store.submit("u1", "r1", "fp", PAYLOAD, model=route, route=route)).outcome == "new"
    p = store.keys.partition("u1")
    [(queue, entry, req_key)] = await store.take(worker, 10, 100, partition=p, routes=(route,))
    item = await store.start(worker, entry, req_key, queue, route)
    assert item is not None
    return item


async def test_an_orphan_goes_back_to_its_models_queue_once(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys)
    item = await _started(store, "w1", route="light")
    assert await store.unheld("w1", {item.req_key}) == {}  # held: nothing to report
    [(key, (started_ms, route))] = (await store.unheld("w1", set())).items()
    assert key == item.req_key and route == "light" and started_ms > 0
    assert await store.unheld("w2", set()) == {}  # another worker's running set is its own

    assert not await store.requeue_orphan("w1", key, started_ms - 1, route)  # another start than seen
    assert await redis.hget(key, "state") == b"running"
    assert await store.requeue_orphan("w1", key, started_ms, "")  # wrong route: read again, right queue
    assert not await store.requeue_orphan("w1", key, started_ms, route)  # twice is once
    state, worker, epoch, requeues = await redis.hmget(key, ["state", "worker", "epoch", "requeues"])
    assert (state, worker, epoch, requeues) == (b"queued", b"", b"1", b"1")
    assert await store.queued("light") == 1 and await store.queued("") == 0
    assert await store.unheld("w1", set()) == {}  # no longer in w1's running set
    # Its model's worker takes it again (same epoch: it continues after its logged tokens).
    p = keys.partition("u1")
    [(queue, entry, req_key)] = await store.take("w2", 10, 100, partition=p, routes=("light",))
    again = await store.start("w2", entry, req_key, queue, "light")
    assert again is not None and again.epoch == 1 and req_key == key


async def test_a_stale_member_is_dropped_and_an_ended_request_left_alone(
    redis: aioredis.Redis, keys: Keys
) -> None:
    store = RequestStore(redis, keys)
    item = await _started(store, "w1")
    assert await store.cancel("u1", "r1") == "running"  # ended: cancel.lua removes it from the hash
    assert await store.unheld("w1", set()) == {}
    # A field whose request is no longer running for w1 (a hash left inconsistent) is not reported, and
    # requeue_orphan removes it without touching the request.
    wreqs = keys.worker_requests("w1", keys.partition("u1"))
    await redis.hset(wreqs, item.log_key, 0)
    assert await store.unheld("w1", set()) == {}
    assert not await store.requeue_orphan("w1", item.req_key, 0, "")
    assert not await redis.hexists(wreqs, item.log_key)
    assert await redis.hget(item.req_key, "state") == b"cancelled"
