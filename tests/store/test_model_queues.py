"""Each model has its own work queue and counter (Keys.model_queue; route "" is the default model's, the
original keys); workers advertise the model they hold next to their lease; a request re-queued by a
reaper or cancelled while queued moves its own model's queue and counter, never another's."""

from __future__ import annotations

import redis.asyncio as aioredis

from server.store.keys import Keys
from server.store.requests import RequestStore, Settings, StepOp

PAYLOAD = {"owner": "u", "session": "", "messages": [{"role": "user", "content": "hi"}], "params": {}}


async def test_model_queues_advertisements_reap_and_cancel(redis: aioredis.Redis, keys: Keys) -> None:
    store = RequestStore(redis, keys, Settings())
    p = keys.partition("u")  # the owner's partition (on a cluster; 0 on a plain Redis)
    assert keys.model_queue("", p) == keys.queue(p) and keys.model_queued_count("", p) == keys.queued_count(p)
    assert keys.queue(p, "b") != keys.queue(p)
    await store.ensure_group("wa", routes=("",))
    await store.ensure_group("wb", routes=("b",))
    await store.heartbeat("wa", model="a", route="")
    await store.heartbeat("wb", model="b", route="b")
    assert await store.served_models() == {"wa": ("a", ""), "wb": ("b", "b")}

    await store.submit("u", "ra", "fp", {**PAYLOAD, "id": "ra"}, model="a")
    await store.submit("u", "rb", "fp", {**PAYLOAD, "id": "rb"}, model="b", route="b", prefer="wa")
    assert await store.queued("") == 1 and await store.queued("b") == 1
    # A worker reads only the queues of the model it holds (affinity, ``prefer``, is the default's only).
    taken_a = await store.take("wa", count=10, block_ms=100, partition=p, routes=("",))
    assert [k for _, _, k in taken_a] == [keys.request("u", "ra")]
    taken_b = await store.take("wb", count=10, block_ms=100, partition=p, routes=("b",))
    assert [(q, k) for q, _, k in taken_b] == [(keys.queue(p, "b"), keys.request("u", "rb"))]
    queue, entry, req = taken_b[0]
    item = await store.start("wb", entry, req, queue, "b")
    assert item is not None and item.route == "b"
    assert await store.queued("b") == 0 and await store.queued("") == 1
    info = await store.get("u", "rb")
    assert info is not None and info.model == "b" and info.state == "running"
    assert await store.write_step([StepOp(item, 0, 1, "x", 3, token_ids=(5,))], "wb") == [True]

    # wb hands its work back: rb returns to b's queue (not the default one) and wb is no longer listed.
    assert await store.reap("wb", own=True) == 1
    assert await store.queued("b") == 1 and await store.queued("") == 1
    assert await redis.xlen(keys.queue(p, "b")) == 1
    assert "wb" not in await store.served_models()

    await store.ensure_group("wb2", routes=("b",))
    [(queue, entry, req)] = await store.take("wb2", count=10, block_ms=100, partition=p, routes=("b",))
    again = await store.start("wb2", entry, req, queue, "b")
    assert again is not None and again.completion_tokens == 1  # continued after its logged token
    # wb2 never said which model it holds (an older worker, or its entry lost): its requests still go
    # back to their own model's queue, which each request records.
    assert await store.reap("wb2", own=True) == 1
    assert await store.queued("b") == 1 and await store.queued("") == 1
    assert await redis.xlen(keys.queue(p)) == 1  # only ra's entry (read by wa, not yet started)

    await store.ensure_group("wb3", routes=("b",))
    [(queue, entry, req)] = await store.take("wb3", count=10, block_ms=100, partition=p, routes=("b",))
    third = await store.start("wb3", entry, req, queue, "b")
    assert third is not None
    # An offset mismatch re-queues it on its own model's queue too.
    assert await store.write_step([StepOp(third, 5, 1, "y", 3, token_ids=(6,))], "wb3") == [False]
    assert await store.queued("b") == 1 and await store.queued("") == 1

    # Cancelling a queued request counts down its own model's queue.
    assert await store.cancel("u", "rb") == "queued"
    assert await store.queued("b") == 0 and await store.queued("") == 1
