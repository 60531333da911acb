"""A request refused before it generated anything keeps only a short tombstone (issue 24, finding 7): its
state, error, fingerprint and owner for idempotent retries, none of its prompt, expiring after
``refused_ttl_ms`` rather than the retention. A retry within that time gets the same refusal, never a
generation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from protocol import Params
from server.client import Client, collect
from server.engine.api import GenerationRequest
from server.engine.prompt import PromptTooLarge
from server.store.keys import Keys
from server.store.requests import Settings
from tests.fakes import FakeEngine
from tests.gateway.conftest import ON_BOTH, running_server

pytestmark = ON_BOTH

FITS = 1000  # characters of prompt the engine takes
BIG = "lorem ipsum " * 20_000  # about 240 KB: refused too_large by the worker's prompt fitting
REFUSED_TTL_MS = 60_000
RETENTION_MS = 3_600_000


class SmallContextEngine(FakeEngine):
    """A fake engine whose prompt fitting (``prepare``, run by the worker) refuses long prompts as the
    real ones do, and counts the prompts it was asked to prepare."""

    def __init__(self) -> None:
        super().__init__()
        self.prepares = 0

    def prepare(self, request: GenerationRequest) -> GenerationRequest:
        self.prepares += 1
        used = sum(len(m["content"]) for m in request.messages)
        if used > FITS:
            raise PromptTooLarge(f"prompt is {used} characters; this server takes at most {FITS}")
        return request


def _settings() -> Settings:
    return Settings(refused_ttl_ms=REFUSED_TTL_MS, retention_ms=RETENTION_MS)


async def _record(redis: aioredis.Redis, key: str) -> tuple[dict[bytes, bytes], int]:
    return await redis.hgetall(key), await redis.pttl(key)


async def test_a_refused_chat_leaves_a_short_tombstone_and_a_retry_gets_the_same_refusal(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    engine = SmallContextEngine()
    async with running_server(redis, redis_url, keys, engine=engine, store=_settings()) as server:
        client = await Client.connect(server.url)
        # Content mode: the payload holds the message and the record the user message for the history.
        _, deltas, done, errors = await collect(client.chat(BIG, id="big", params=Params(max_tokens=8)))
        assert [e.code for e in errors] == ["too_large"] and not deltas
        assert done is not None and done.finish_reason == "error" and done.offset == 0
        [req_key] = [k async for k in redis.scan_iter(match=f"{keys.prefix}*req:*:big")]
        running = keys.worker_requests(server.workers[0].name, keys.partition_of(req_key.decode()))
        assert not await redis.hexists(running, keys.log_of(req_key.decode()))
        record, ttl = await _record(redis, req_key)
        assert record[b"state"] == b"failed" and record[b"error_code"] == b"too_large"
        assert record[b"fp"] and record[b"owner"]  # what an idempotent retry needs
        assert b"user_msg" not in record and b"lorem" not in b"".join(record.values())
        assert "messages" not in json.loads(record[b"payload"])
        assert sum(len(v) for v in record.values()) < 2000  # a few hundred bytes, not the 240 KB asked
        assert 0 < ttl <= REFUSED_TTL_MS
        log_key = server.store.keys.log_of(req_key.decode())
        assert 0 < await redis.pttl(log_key) <= REFUSED_TTL_MS
        assert [f[b"e"] for _, f in await redis.xrange(log_key)] == [b"too_large"]  # only the end entry
        assert engine.prepares == 1 and engine.requests_started == 0

        # A retry (same id, same payload) attaches to the tombstone: the same refusal, nothing prepared.
        _, deltas, done, errors = await collect(client.chat(BIG, id="big", params=Params(max_tokens=8)))
        assert [e.code for e in errors] == ["too_large"] and not deltas
        assert done is not None and done.finish_reason == "error"
        assert engine.prepares == 1 and engine.requests_started == 0
        # Nothing was added to the session's history for the refused turn.
        for h in [k async for k in redis.scan_iter(match=f"{keys.prefix}*hist:*")]:
            assert b"lorem" not in b"".join(await redis.lrange(h, 0, -1))

        # A chat that fits is kept as before: its payload, for the whole retention.
        _, _, done, errors = await collect(client.chat("short one", id="ok", params=Params(max_tokens=4)))
        assert not errors and done is not None and done.finish_reason == "length"
        [ok_key] = [k async for k in redis.scan_iter(match=f"{keys.prefix}*req:*:ok")]
        record, ttl = await _record(redis, ok_key)
        assert json.loads(record[b"payload"])["messages"] and ttl > REFUSED_TTL_MS
        await client.close()


async def test_a_refused_response_is_still_found_by_the_responses_door(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    # The tombstone's payload keeps the door's own fields (``api``): retrieving the refused response
    # answers "failed, too_large", not "no such response", while it lasts.
    engine = SmallContextEngine()
    async with running_server(redis, redis_url, keys, engine=engine, store=_settings()) as server:
        sdk = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k", max_retries=0)
        try:
            created: Any = await sdk.responses.create(
                model="default", input=BIG, background=True, instructions="be brief"
            )
            for _ in range(200):
                got: Any = await sdk.responses.retrieve(created.id)
                if got.status not in ("queued", "in_progress"):
                    break
                await asyncio.sleep(0.05)
            assert got.status == "failed" and got.error is not None and got.error.code == "too_large"
            [req_key] = [k async for k in redis.scan_iter(match=f"{keys.prefix}*req:*")]
            payload = json.loads(await redis.hget(req_key, "payload"))
            assert payload["api"] == "responses"
            assert "messages" not in payload and "instructions" not in payload
            assert 0 < await redis.pttl(req_key) <= REFUSED_TTL_MS
            # Waited for (neither background nor streamed), it is the 400 chat completions gives (§15.6).
            with pytest.raises(openai.BadRequestError) as ei:
                await sdk.responses.create(model="default", input=BIG)
            assert (ei.value.code, ei.value.param) == ("context_length_exceeded", "input")
            with pytest.raises(openai.BadRequestError) as ei:
                await sdk.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": BIG}]
                )
            assert (ei.value.code, ei.value.param) == ("context_length_exceeded", "messages")
        finally:
            await sdk.close()
