"""--log-flush-ms (issue 28: the store's cost per token): the worker writes a request's tokens of several
engine steps as one log entry. The log still holds every token once, in order, at exact offsets, and a
reader sees the same text; only the number of entries (XADDs) drops."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from server.engine.api import StepOutput
from server.store.keys import Keys
from server.store.requests import RequestStore, Settings
from server.worker.loop import Worker, merge_steps
from tests.fakes import FakeEngine

WORDS = 40


def test_merge_steps_joins_each_requests_contiguous_outputs() -> None:
    outs = [
        StepOutput("a", 0, 1, "x", (1,)),
        StepOutput("b", 5, 1, "p", (7,)),
        StepOutput("a", 1, 2, "yz", (2, 3)),
        StepOutput("b", 6, 0, "", (), finish="stop", prompt_tokens=4),
        StepOutput("a", 3, 1, "w", (4,), finish="length", prompt_tokens=9),
    ]
    a, b = merge_steps(outs)
    assert (a.key, a.offset, a.n, a.text, a.token_ids, a.finish, a.prompt_tokens) == (
        "a", 0, 4, "xyzw", (1, 2, 3, 4), "length", 9,
    )  # fmt: skip
    assert (b.key, b.offset, b.n, b.text, b.finish) == ("b", 5, 1, "p", "stop")
    # Not contiguous (never produced by an engine): kept apart, for the store's offset check to refuse.
    kept = merge_steps([StepOutput("a", 0, 1, "x"), StepOutput("a", 5, 1, "y")])
    assert [(o.offset, o.n) for o in kept] == [(0, 1), (5, 1)]


async def _run(redis: aioredis.Redis, keys: Keys, flush_ms: float, id: str) -> list[tuple[int, int, str]]:
    store = RequestStore(redis, keys, Settings())
    engine = FakeEngine(step_s=0.01, reply_len=WORDS)
    worker = Worker(store, engine, name=f"w-{keys.prefix}{id}", log_flush_ms=flush_ms)
    await worker.start()
    try:
        payload = {
            "owner": "u1",
            "id": id,
            "session": "",
            "messages": [{"role": "user", "content": "go"}],
            "params": {"max_tokens": 100},
        }
        assert (await store.submit("u1", id, f"fp-{id}", payload)).outcome == "new"
        deadline = time.monotonic() + 30
        while (info := await store.get("u1", id)) is None or info.state != "done":
            assert time.monotonic() < deadline, "the request never finished"
            await asyncio.sleep(0.05)
        entries = await redis.xrange(keys.log("u1", id))
        return [(int(f[b"o"]), int(f[b"n"]), f[b"t"].decode()) for _, f in entries if b"n" in f]
    finally:
        await worker.stop()


async def test_a_flush_interval_puts_several_steps_in_one_entry(redis: aioredis.Redis, keys: Keys) -> None:
    every_step = await _run(redis, keys, 0.0, "each")
    gathered = await _run(redis, keys, 100.0, "gathered")  # 10 ms steps: about 10 tokens per entry
    for log in (every_step, gathered):
        pos = 0
        for offset, n, _ in log:
            assert offset == pos  # contiguous: nothing lost, nothing repeated
            pos += n
        assert pos == WORDS
    assert "".join(t for *_, t in gathered) == "".join(t for *_, t in every_step)
    # Several steps per entry (without the interval, steps that queue behind a slow write are joined
    # too, so only the gathered run's count is certain).
    assert len(gathered) <= WORDS // 3
