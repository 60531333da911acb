"""finish.lua's tombstone: a failure with no token logged keeps a small record for refused_ttl_ms; a
failure after tokens were logged is an ordinary end (payload and retention), on both backends."""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from server.store.keys import Keys
from server.store.requests import RequestStore, Settings, StepOp, WorkItem

RETENTION_MS = 3_600_000
REFUSED_TTL_MS = 30_000


async def _started(store: RequestStore, id: str) -> WorkItem:
    await store.ensure_group("w1")
    payload = {
        "owner": "u1",
        "id": id,
        "session": "s1",
        "messages": [{"role": "user", "content": "x" * 10_000}],
        "params": {"max_tokens": 5},
        "api": "responses",
        "instructions": "y" * 10_000,
    }
    res = await store.submit(
        "u1", id, f"fp-{id}", payload, session="s1", user_message={"role": "user", "content": "x" * 10_000}
    )
    assert res.outcome == "new"
    [(queue, entry, req_key)] = await store.take("w1", 10, 100, partition=store.keys.partition("u1"))
    item = await store.start("w1", entry, req_key, queue)
    assert item is not None
    return item


def _error(item: WorkItem, offset: int, n: int = 0, text: str = "") -> StepOp:
    return StepOp(
        item, offset, n, text, 7, (1,) * n, finish="error", error_code="too_large", error_message="too long"
    )


async def test_refused_before_any_token_leaves_a_tombstone(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings(retention_ms=RETENTION_MS, refused_ttl_ms=REFUSED_TTL_MS))
    item = await _started(store, "refused")
    assert await store.write_step([_error(item, 0)], "w1") == [True]
    assert await store.write_step([_error(item, 0)], "w1") == [True]  # a retried write: the same end
    record = await redis.hgetall(item.req_key)
    assert record[b"state"] == b"failed" and record[b"fp"] == b"fp-refused" and record[b"owner"] == b"u1"
    assert b"user_msg" not in record and sum(len(v) for v in record.values()) < 1000
    assert json.loads(record[b"payload"]) == {
        "owner": "u1",
        "id": "refused",
        "session": "s1",
        "params": {"max_tokens": 5},
        "api": "responses",
    }
    assert 0 < await redis.pttl(item.req_key) <= REFUSED_TTL_MS
    assert 0 < await redis.pttl(item.log_key) <= REFUSED_TTL_MS
    view = await store.view("u1", "refused")
    assert view is not None and (view.error_code, view.error_message) == ("too_large", "too long")
    # A retry of the same id and payload attaches to it: never queued again.
    again = await store.submit("u1", "refused", "fp-refused", {})
    assert (again.outcome, again.state) == ("attach", "failed") and await store.queued() == 0


async def test_a_failure_after_tokens_is_kept_for_the_retention(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings(retention_ms=RETENTION_MS, refused_ttl_ms=REFUSED_TTL_MS))
    item = await _started(store, "partial")
    assert await store.write_step([_error(item, 0, 2, "ab")], "w1") == [True]
    record = await redis.hgetall(item.req_key)
    assert record[b"state"] == b"failed" and record[b"user_msg"]
    assert json.loads(record[b"payload"])["messages"]
    assert REFUSED_TTL_MS < await redis.pttl(item.req_key) <= RETENTION_MS
