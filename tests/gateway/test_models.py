"""Several models behind one gateway (issue #16): two real tiny Llama folders, each behind its own worker
and queue; params.model and the HTTP ``model`` field choose, accepted.model says which model serves, and
under load new chats move to the fallback model and back (the degradation ladder, submit.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI, NotFoundError
from redis.asyncio.cluster import RedisCluster

from protocol import Accepted, Done, Error, Params, Resume
from server import metrics
from server.app import load_engine
from server.client import Client
from server.gateway.server import WS_PATH, Gateway, GatewaySettings
from server.store.keys import Keys
from server.store.requests import FINAL_STATES, RequestStore, Settings
from server.store.sessions import SessionStore
from server.worker.loop import Worker
from tests.gateway.conftest import ON_BOTH, client

# On the plain Redis and on the 3-master Valkey cluster: per-model queues live in every partition.
pytestmark = ON_BOTH


@dataclass
class TwoModels:
    url: str
    port: int
    store: RequestStore
    gateway: Gateway
    big: Worker
    light: Worker


@contextlib.asynccontextmanager
async def two_models(
    redis: aioredis.Redis,
    redis_url: str,
    keys: Keys,
    big_dir: Path,
    light_dir: Path,
    *,
    gateway: GatewaySettings | None = None,
    store: Settings | None = None,
    local: bool = True,
    pause_big: bool = False,
) -> AsyncIterator[TwoModels]:
    """Workers for "big" (the default model, route "") and "light" (its own queue) with real engines, and
    a gateway that knows them as serve's does (``local``) or only from the workers' advertisements, as a
    cluster's gateway does."""
    reader_r = client(redis_url, isinstance(redis, RedisCluster))
    st = RequestStore(redis, keys, store or Settings())
    sessions = SessionStore(redis, keys, b"test-secret", 60_000)
    engines = [
        load_engine(str(d), device="cpu", dtype="float32", kv_budget_mb=8)[1] for d in (big_dir, light_dir)
    ]
    big = Worker(st, engines[0], name=f"big-{keys.prefix}", model_name="big", route="")
    light = Worker(st, engines[1], name=f"light-{keys.prefix}", model_name="light", route="light")
    if pause_big:
        big.pause()  # before it starts: it reads nothing from its queue until resumed
    await big.start()
    await light.start()
    gw = Gateway(st, sessions, reader_r, gateway or GatewaySettings(port=0), name=f"gw-{keys.prefix}")
    if local:
        gw.models.local = ("big", "light")
    port = await gw.start()
    try:
        yield TwoModels(f"ws://127.0.0.1:{port}{WS_PATH}", port, st, gw, big, light)
    finally:
        await gw.stop()
        await big.stop()
        await light.stop()
        await reader_r.aclose()


async def accepted(c: Client, rid: str) -> Accepted | Error:
    async for f in c.frames_for(rid):
        if isinstance(f, Accepted | Error):
            return f
    raise AssertionError("no answer")


async def until_done(c: Client, rid: str) -> Done:
    async for f in c.frames_for(rid):
        if isinstance(f, Done):
            return f
        assert not isinstance(f, Error), f
    raise AssertionError("no done")


async def finished(store: RequestStore, c: Client, rids: list[str]) -> None:
    """Wait until these requests of this connection have ended (read from the store: their frames may
    have gone by while the test read another request's)."""
    assert c.welcome is not None
    owner = f"anon:{c.welcome.session}"
    for _ in range(600):
        infos = [await store.get(owner, rid) for rid in rids]
        if all(i is not None and i.state in FINAL_STATES for i in infos):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("requests did not finish")


def chat_params(**kw: Any) -> Params:
    return Params(max_tokens=kw.pop("max_tokens", 4), **kw)


async def send(
    c: Client, content: str, rid: str | None = None, **params: Any
) -> tuple[str, Accepted | Error]:
    from protocol import Chat, Message

    rid = rid or uuid.uuid4().hex
    await c.send(Chat(id=rid, messages=(Message("user", content),), params=chat_params(**params)))
    return rid, await accepted(c, rid)


async def ran_on(redis: aioredis.Redis, keys: Keys, c: Client, rid: str) -> str:
    """The worker that generated request ``rid`` of this connection (anonymous owner: its session)."""
    assert c.welcome is not None
    raw = await redis.hget(keys.request(f"anon:{c.welcome.session}", rid), "worker")
    return (raw or b"").decode()


@pytest.mark.parametrize("local", [True, False], ids=["serve", "cluster-gateway"])
async def test_params_model_chooses_the_model_and_accepted_says_which(
    redis: aioredis.Redis,
    redis_url: str,
    keys: Keys,
    tiny_model_dir: Path,
    peaky_model_dir: Path,
    local: bool,
) -> None:
    async with two_models(redis, redis_url, keys, tiny_model_dir, peaky_model_dir, local=local) as s:
        c = await Client.connect(s.url)
        assert c.welcome is not None and c.welcome.models == ("big", "light")  # the default first
        plain, a = await send(c, "hello")
        assert isinstance(a, Accepted) and a.model == "big"
        await until_done(c, plain)
        named, a = await send(c, "hello", model="light")
        assert isinstance(a, Accepted) and a.model == "light"
        await until_done(c, named)
        alias, a = await send(c, "hello", model="default")
        assert isinstance(a, Accepted) and a.model == "big"
        await until_done(c, alias)
        assert await ran_on(redis, keys, c, plain) == s.big.name
        assert await ran_on(redis, keys, c, alias) == s.big.name
        assert await ran_on(redis, keys, c, named) == s.light.name
        await c.close()


async def test_unknown_model_is_refused_and_creates_nothing(
    redis: aioredis.Redis, redis_url: str, keys: Keys, tiny_model_dir: Path, peaky_model_dir: Path
) -> None:
    async with two_models(redis, redis_url, keys, tiny_model_dir, peaky_model_dir) as s:
        c = await Client.connect(s.url)
        rid, err = await send(c, "hello", model="gpt-9")
        assert isinstance(err, Error) and err.code == "model_not_found" and err.id == rid
        assert "big" in err.message and "light" in err.message
        # Nothing was created under that id: the same id with a served model is a new request.
        _, a = await send(c, "hello", rid, model="light")
        assert isinstance(a, Accepted) and a.model == "light"
        await until_done(c, rid)
        # A name of the wrong type is a bad frame; the connection stays usable.
        await c.send_raw({"type": "chat", "id": "t", "content": "x", "params": {"model": 7}})
        bad = await c.recv()
        assert isinstance(bad, Error) and bad.code == "bad_frame" and "params.model" in bad.message
        _, a = await send(c, "still here")
        assert isinstance(a, Accepted)
        await c.close()


async def test_idempotency_and_cache_include_the_model(
    redis: aioredis.Redis, redis_url: str, keys: Keys, tiny_model_dir: Path, peaky_model_dir: Path
) -> None:
    async with two_models(redis, redis_url, keys, tiny_model_dir, peaky_model_dir) as s:
        c = await Client.connect(s.url)
        rid, a = await send(c, "same words", model="light", temperature=0.0)
        assert isinstance(a, Accepted)
        await until_done(c, rid)
        # Same id, other model: a different request.
        _, err = await send(c, "same words", rid, model="big", temperature=0.0)
        assert isinstance(err, Error) and err.code == "idempotency_conflict"
        # Same id, same everything: attached, and told the model it was given.
        _, again = await send(c, "same words", rid, model="light", temperature=0.0)
        assert isinstance(again, Accepted) and again.model == "light" and again.state == "done"
        await until_done(c, rid)
        await c.send(Resume(id=rid, offset=0))  # a resume says so too
        resumed = await accepted(c, rid)
        assert isinstance(resumed, Accepted) and resumed.model == "light"
        await until_done(c, rid)
        # The response cache answers the same model's identical greedy chat at once (state done) ...
        same, hit = await send(c, "same words", model="light", temperature=0.0)
        assert isinstance(hit, Accepted) and hit.state == "done" and hit.model == "light"
        await until_done(c, same)
        # ... and never another model's.
        other, miss = await send(c, "same words", model="big", temperature=0.0)
        assert isinstance(miss, Accepted) and miss.state != "done" and miss.model == "big"
        await until_done(c, other)
        assert await ran_on(redis, keys, c, other) == s.big.name
        await c.close()


def fallbacks(model: str, to: str) -> float:
    return float(metrics.FALLBACKS.labels(model, to)._value.get())


async def test_under_load_new_chats_move_to_the_fallback_model_and_back(
    redis: aioredis.Redis, redis_url: str, keys: Keys, tiny_model_dir: Path, peaky_model_dir: Path
) -> None:
    settings = GatewaySettings(
        port=0, degrade_queue_depth=2, degrade_max_tokens=3, fallbacks=(("big", "light"),)
    )
    async with two_models(
        redis, redis_url, keys, tiny_model_dir, peaky_model_dir, gateway=settings, pause_big=True
    ) as s:
        c = await Client.connect(s.url)
        before = fallbacks("big", "light")
        # A backlog on big: its worker takes nothing; chats that refuse the fallback stay there.
        stuck = []
        for _ in range(2):
            rid, a = await send(c, "wait for me", fallback=False)
            assert isinstance(a, Accepted) and a.model == "big" and a.state == "queued"
            stuck.append(rid)
        assert await s.store.queued("") == 2
        # The gateway reads the queue depth at most once a second: new chats move once it has seen it.
        moved = None
        for _ in range(50):
            rid, a = await send(c, "move me", max_tokens=20)
            assert isinstance(a, Accepted)
            if a.model == "light":
                moved = rid
                break
            stuck.append(rid)
            await asyncio.sleep(0.1)
        assert moved is not None, "no chat fell back while big's queue was past the threshold"
        done = await until_done(c, moved)
        assert done.offset <= 3  # rung 1 applied too: max_tokens clamped to --degrade-max-tokens
        assert await ran_on(redis, keys, c, moved) == s.light.name
        assert fallbacks("big", "light") == before + 1
        # A retry of the moved chat attaches to it, on the model it was given.
        _, again = await send(c, "move me", moved, max_tokens=20)
        assert isinstance(again, Accepted) and again.model == "light"
        await until_done(c, moved)
        # A chat that refuses the fallback stays, even now.
        rid, a = await send(c, "stay", fallback=False)
        assert isinstance(a, Accepted) and a.model == "big"
        stuck.append(rid)
        # The load falls: big takes its backlog, and new chats go to big again.
        s.big.resume()
        await finished(s.store, c, stuck)
        assert await s.store.queued("") == 0
        back = None
        for _ in range(50):
            rid, a = await send(c, "back home")
            assert isinstance(a, Accepted)
            await until_done(c, rid)
            if a.model == "big":
                back = rid
                break
            await asyncio.sleep(0.1)
        assert back is not None, "new chats did not go back to big after its queue drained"
        assert await ran_on(redis, keys, c, back) == s.big.name
        await c.close()


async def test_a_full_queue_falls_back_before_refusing(
    redis: aioredis.Redis, redis_url: str, keys: Keys, tiny_model_dir: Path, peaky_model_dir: Path
) -> None:
    settings = GatewaySettings(port=0, fallbacks=(("big", "light"),))
    async with two_models(
        redis,
        redis_url,
        keys,
        tiny_model_dir,
        peaky_model_dir,
        gateway=settings,
        store=Settings(max_queued=1),
        pause_big=True,
    ) as s:
        c = await Client.connect(s.url)
        first, a = await send(c, "one", fallback=False)
        assert isinstance(a, Accepted) and a.model == "big"
        moved, a = await send(c, "two")  # big's queue is full: the light model, not overloaded
        assert isinstance(a, Accepted) and a.model == "light"
        await until_done(c, moved)
        _, err = await send(c, "three", fallback=False)  # the last rung
        assert isinstance(err, Error) and err.code == "overloaded" and err.retry_after_ms
        s.big.resume()
        await finished(s.store, c, [first])
        await c.close()


async def test_http_model_field_chooses_like_params_model(
    redis: aioredis.Redis, redis_url: str, keys: Keys, tiny_model_dir: Path, peaky_model_dir: Path
) -> None:
    async with two_models(redis, redis_url, keys, tiny_model_dir, peaky_model_dir, local=False) as s:
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="k", max_retries=0)
        try:
            assert [m.id for m in (await client.models.list()).data] == ["big", "light", "default"]
            msgs: Any = [{"role": "user", "content": "hi"}]
            h = {"Idempotency-Key": "http-1"}
            r = await client.chat.completions.create(
                model="light", messages=msgs, max_tokens=3, extra_headers=h
            )
            assert r.model == "light"
            owner = await _http_owner(redis, keys, "http-1")
            assert (await redis.hget(keys.request(owner, "http-1"), "worker")).decode() == s.light.name
            r = await client.chat.completions.create(model="default", messages=msgs, max_tokens=3)
            assert r.model == "big"
            with pytest.raises(NotFoundError) as exc:
                await client.chat.completions.create(model="gpt-9", messages=msgs, max_tokens=3)
            assert exc.value.body["code"] == "model_not_found"  # type: ignore[index]
            # Same key, other model: another request.
            with pytest.raises(Exception) as conflict:
                await client.chat.completions.create(
                    model="big", messages=msgs, max_tokens=3, extra_headers=h
                )
            assert getattr(conflict.value, "status_code", None) == 409
            resp = await client.responses.create(model="light", input="hi", max_output_tokens=3)
            assert resp.model == "light"
        finally:
            await client.close()


async def _http_owner(redis: aioredis.Redis, keys: Keys, rid: str) -> str:
    """The owner an HTTP caller's key maps to, found by the request id (the only one in this test)."""
    async for k in redis.scan_iter(match=f"{keys.prefix}*req:*:{rid}"):  # partitioned: {pN}:req
        payload = json.loads(await redis.hget(k, "payload"))
        return str(payload["owner"])
    raise AssertionError("no such request")
