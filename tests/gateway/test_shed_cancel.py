"""Shedding stops in the engine everything it drops (issue 24, finding 5): a request still being
prepared (tokenised on the prompt pool) when the worker sheds never reaches the engine afterwards, and
one already generating is cancelled, so nothing generates to max_tokens for nobody."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from server.engine.api import GenerationRequest, SamplingParams
from server.store.keys import Keys
from server.store.requests import RequestStore, Settings, StepOp
from server.worker.loop import Worker
from tests.fakes import FakeEngine

MAX_TOKENS = 390  # the fake engine's replies are 400 words: long enough to outlive the test


class GatedEngine(FakeEngine):
    """A fake engine whose ``prepare`` (run on the worker's prompt pool) holds requests asking "slow"
    until the test opens the gate: a request caught in tokenising."""

    def __init__(self) -> None:
        super().__init__(step_s=0.01, reply_len=MAX_TOKENS)
        self.gate = threading.Event()
        self.preparing = threading.Event()  # a slow request is inside prepare now
        self.prepared: list[str] = []  # keys whose prepare returned

    def prepare(self, request: GenerationRequest) -> GenerationRequest:
        if request.messages[-1]["content"] == "slow":
            self.preparing.set()
            assert self.gate.wait(30)
        self.prepared.append(request.key)
        return request

    def running(self) -> set[str]:
        return set(self._runs)  # read from the test's thread: a copy of the keys, never iterated live


async def _until(cond: Any, what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_shedding_cancels_running_and_preparing_requests(
    redis: aioredis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long lease: no hand-back (nor reconcile) during the test, so the shed requests stay shed.
    store = RequestStore(redis, keys, Settings(lease_ttl_ms=120_000))
    engine = GatedEngine()
    worker = Worker(store, engine, name=f"w-{keys.prefix}", max_buffered_steps=5)
    await worker.start()
    try:
        req_keys = {}
        for id, content in (("fast", "go"), ("slow", "slow")):
            payload = {
                "owner": "u1",
                "id": id,
                "session": "",
                "messages": [{"role": "user", "content": content}],
                "params": {"max_tokens": MAX_TOKENS},
            }
            assert (await store.submit("u1", id, f"fp-{id}", payload)).outcome == "new"
            req_keys[id] = keys.request("u1", id)
        await _until(lambda: req_keys["fast"] in engine.running(), "the fast one to generate")
        await _until(engine.preparing.is_set, "the slow one to be in prepare")

        async def unreachable(ops: list[StepOp], worker_name: str) -> list[bool]:
            raise ConnectionError("Redis is away")

        # Redis goes away for writes: the backlog passes max_buffered_steps and the worker sheds.
        monkeypatch.setattr(store, "write_step", unreachable)
        await _until(lambda: worker._hand_back, "the worker to shed")
        engine.gate.set()  # the slow one's prompt is done: after the shed
        await _until(lambda: req_keys["slow"] in engine.prepared, "the slow prepare to return")
        await _until(lambda: not worker._preparing, "the prepare task to end")
        # Everything submitted or cancelled before now has left the engine's inbox once a marker sent
        # after it has been taken in (the inbox is one FIFO).
        engine.submit(GenerationRequest(key="marker", messages=[], params=SamplingParams(max_tokens=1)))
        await _until(lambda: "marker" in engine.started_keys, "the engine to take the marker in")
        await _until(lambda: req_keys["fast"] not in engine.running(), "the fast one to be cancelled")
        assert req_keys["slow"] not in engine.started_keys  # never reached the engine after the shed
        assert not engine.running() & set(req_keys.values())
    finally:
        engine.gate.set()
        await worker.stop()
