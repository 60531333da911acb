"""Hostile clients that attach more streams than `welcome.limits.max_streams` by any route (chat, resume,
`hello.resume`, a retried chat) or replay logs in a loop: every attached stream counts, resumes are
rate-limited like chats."""

from __future__ import annotations

import asyncio
import json
import time

import redis.asyncio as aioredis
import websockets
from websockets.typing import Subprotocol

from protocol import Accepted, Chat, Error, ErrorCode, Message, Params, Resume, ResumePoint, ServerFrame
from protocol.codec import JSON_SUBPROTOCOL
from server.client import Client, collect
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import Running, running_server

CAP = 4
LONG = Params(max_tokens=400)  # with the slow fake engine below: runs for about a minute
# Messages mode: content-mode turns of one session run one after another (SPEC §4.2), so only
# messages-mode chats of one session are in flight together.
ASK = (Message(role="user", content="long"),)


async def _answers(c: Client, ids: list[str]) -> dict[str, ServerFrame]:
    """The first `accepted` or `error` for each id (deltas and other frames skipped)."""
    got: dict[str, ServerFrame] = {}
    while len(got) < len(ids):
        f = await asyncio.wait_for(c.recv(), 30)
        fid = getattr(f, "id", None)
        if fid in ids and fid not in got and isinstance(f, Accepted | Error):
            got[fid] = f
    return got


def _count(answers: dict[str, ServerFrame]) -> tuple[int, list[Error]]:
    accepted = sum(1 for f in answers.values() if isinstance(f, Accepted))
    refused = [f for f in answers.values() if isinstance(f, Error)]
    return accepted, refused


async def test_every_attached_stream_counts_against_max_streams(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, max_streams_per_connection=CAP, chat_rate_per_connection=1000)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        server.engine.step_s = 0.15  # every request below is still running when the test ends
        server.engine.reply_len = 400
        # 2 x CAP running requests of one session, started from two connections (CAP each).
        first = await Client.connect(server.url)
        assert first.welcome is not None and first.welcome.limits["max_streams"] == CAP
        token = first.welcome.session_token
        second = await Client.connect(server.url, session_token=token)
        ids = [f"r{i}" for i in range(2 * CAP)]
        for i, rid in enumerate(ids):
            await (first if i < CAP else second).send(Chat(id=rid, messages=ASK, params=LONG))
        assert _count(await _answers(first, ids[:CAP]))[0] == CAP
        assert _count(await _answers(second, ids[CAP:]))[0] == CAP

        # resume frames: only CAP of the 2 x CAP attach.
        third = await Client.connect(server.url, session_token=token)
        for rid in ids:
            await third.send(Resume(id=rid, offset=0))
        accepted, refused = _count(await _answers(third, ids))
        assert accepted == CAP and len(refused) == CAP
        assert all(e.code == ErrorCode.RATE_LIMITED and e.retry_after_ms for e in refused)
        # A new chat on the full connection is refused too; a retry of an attached id replaces its
        # stream (no room needed) and is accepted.
        attached = [rid for rid in ids if rid not in {e.id for e in refused}]
        await third.send(Chat(id="one-more", messages=ASK, params=LONG))
        await third.send(Chat(id=attached[0], messages=ASK, params=LONG))
        answers = await _answers(third, ["one-more", attached[0]])
        assert isinstance(answers["one-more"], Error) and answers["one-more"].code == ErrorCode.RATE_LIMITED
        assert isinstance(answers[attached[0]], Accepted)

        # hello.resume: one hello naming all 2 x CAP attaches only CAP.
        points = tuple(ResumePoint(rid, 0) for rid in ids)
        fourth = await Client.connect(server.url, session_token=token, resume=points)
        accepted, refused = _count(await _answers(fourth, ids))
        assert accepted == CAP and len(refused) == CAP
        assert all(e.code == ErrorCode.RATE_LIMITED for e in refused)
        # ... and then a resume of a further id is refused as well.
        await fourth.send(Resume(id=refused[0].id or "", offset=0))
        [again] = (await _answers(fourth, [refused[0].id or ""])).values()
        assert isinstance(again, Error) and again.code == ErrorCode.RATE_LIMITED
        for c in (first, second, third, fourth):
            await c.close()


async def test_resume_flood_is_rate_limited_per_connection(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, resume_rate_per_connection=5, max_streams_per_connection=4)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        c = await Client.connect(server.url)
        _, _, done, _ = await collect(c.chat("replay me", id="done-1", params=Params(max_tokens=8)))
        assert done is not None
        # 40 full replays of a finished request, back to back: the burst (max(2 x 5, 4) = 10) passes.
        accepted, limited = 0, []
        for _ in range(40):
            await c.send(Resume(id="done-1", offset=0))
        while accepted + len(limited) < 40:
            f = await asyncio.wait_for(c.recv(), 30)
            if isinstance(f, Accepted):
                accepted += 1
            elif isinstance(f, Error):
                assert f.id == "done-1" and f.code == ErrorCode.RATE_LIMITED, f
                limited.append(f)
        assert 10 <= accepted < 40
        assert all(e.retry_after_ms and e.retry_after_ms > 0 for e in limited)
        await c.close()


async def test_resume_flood_is_rate_limited_per_user(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, resume_rate_per_connection=1000, resume_rate_per_user=5)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        c = await Client.connect(server.url)
        _, _, done, _ = await collect(c.chat("replay me", id="done-2", params=Params(max_tokens=4)))
        assert done is not None
        for _ in range(30):
            await c.send(Resume(id="done-2", offset=0))
        accepted, limited = 0, 0
        while accepted + limited < 30:
            f = await asyncio.wait_for(c.recv(), 30)
            if isinstance(f, Accepted):
                accepted += 1
            elif isinstance(f, Error):
                assert f.code == ErrorCode.RATE_LIMITED and "user" in f.message, f
                limited += 1
        # 5 per one-second window: 30 resumes sent back to back cannot all pass.
        assert limited > 0 and accepted >= 5
        await c.close()


async def test_clients_dropped_right_after_a_chat_or_a_waiting_turn_hold_nothing(server: Running) -> None:
    """A client gone in the same pass of the loop that made its stream or waiting-turn task (a phone losing
    signal just after sending) used to keep that task's grant: the connection cancelled the task before it
    ran, so its releasing finally never did, and each drop kept a stream slot of the owner (a waiting turn
    also its session's waiting slot and its bytes)."""
    server.engine.reply_len = 40
    server.engine.step_s = 0.01
    hello = json.dumps({"type": "hello", "v": 1})
    for i in range(20):
        ws = await websockets.connect(server.url, subprotocols=[Subprotocol(JSON_SUBPROTOCOL)])
        await ws.send(hello)
        json.loads(await asyncio.wait_for(ws.recv(), 10))  # welcome
        # Two content-mode turns of one session: the second waits for the first (SPEC §4.2).
        for n in range(1 + i % 2):
            await ws.send(json.dumps({"type": "chat", "id": f"d{i}-{n}", "content": "bye"}))
        ws.transport.abort()
        await ws.wait_closed()
    admission = server.gateway.core.admission
    deadline = time.monotonic() + 10
    while admission.streams_by_owner and time.monotonic() < deadline:  # noqa: ASYNC110 (a count)
        await asyncio.sleep(0.02)
    assert admission.streams_by_owner == {}
    assert admission.waiting_by_session == {} and admission.waiting_bytes == 0
