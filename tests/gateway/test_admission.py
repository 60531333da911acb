"""One admission step for every door (issue 24): a content-mode turn that waits for the previous turn is
answered at once (``waiting``) and counts against every limit; a refusal comes at once; and no door can
create, attach or follow anything without going through admission."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
import websockets

from protocol import (
    Accepted,
    Cancel,
    Chat,
    Done,
    Error,
    ErrorCode,
    Hello,
    Message,
    Params,
    ProtocolError,
    Resume,
    ResumePoint,
    ServerFrame,
    Waiting,
)
from server.client import Client
from server.gateway.admission import Admission, Ask, Grant, task_holding
from server.gateway.server import GatewaySettings
from server.gateway.streams import Streams
from server.gateway.submit import ChatRequest, Submitter
from server.store.keys import Keys
from server.store.requests import Settings
from tests.gateway.conftest import Running, running_server
from tests.gateway.test_http_surface import _http

LONG = Params(max_tokens=300)  # the fake engine's turn that keeps the session busy


async def _answers(c: Client, ids: list[str], within_s: float = 5.0) -> dict[str, list[ServerFrame]]:
    """Every frame about ``ids`` that arrives within ``within_s``, per id (first the one that answered)."""
    got: dict[str, list[ServerFrame]] = {i: [] for i in ids}
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not all(got.values()):
        try:
            f = await asyncio.wait_for(c.recv(), max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            break
        fid = getattr(f, "id", None)
        if fid in got:
            got[fid].append(f)
    return got


async def _busy_session(server: Running) -> Client:
    """A connection whose session has a long content-mode turn running."""
    server.engine.step_s = 0.05
    server.engine.reply_len = 400  # no natural stop before max_tokens
    c = await Client.connect(server.url)
    await c.send(Chat(id="long", content="a long answer", params=LONG))
    async for f in c.frames_for("long"):
        if isinstance(f, Accepted):
            break
    return c


async def test_a_waiting_turn_is_acknowledged_at_once_and_then_accepted(server: Running) -> None:
    c = await _busy_session(server)
    await c.send(Chat(id="next", content="and then?", params=Params(max_tokens=3)))
    first = (await _answers(c, ["next"], within_s=2.0))["next"]
    assert first and isinstance(first[0], Waiting) and first[0].after == "long"
    await c.send(Chat(id="stop-it", content="x"))  # waits too (cap 2), and is answered at once as well
    assert isinstance((await _answers(c, ["stop-it"], within_s=2.0))["stop-it"][0], Waiting)
    await c.send(Cancel(id="long"))  # the wait ends: the next turn is accepted and runs
    frames = [f async for f in c.frames_for("next")]
    assert isinstance(frames[0], Accepted) and isinstance(frames[-1], Done)
    await c.close()


async def test_waiting_turns_past_the_cap_are_refused_at_once(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    # The attack, scaled down: one long turn, then a burst of big content-mode chats. Before,
    # none was answered within seconds and every one held its content in a task.
    gw = GatewaySettings(port=0, chat_rate_per_connection=1000, chat_rate_per_user=1000)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        c = await _busy_session(server)
        # 40 x 40 KB: within the chat-text burst (2 MiB), and read within a second of the pace (§2.2):
        # more, back to back, is a flood that closes the connection (test_ingress.py).
        big = "x" * 40_000
        ids = [f"w{i}" for i in range(40)]
        sent = time.monotonic()
        for i in ids:
            await c.send(Chat(id=i, content=big, params=Params(max_tokens=2)))
        answers = await _answers(c, ids, within_s=3.0)
        took = time.monotonic() - sent
        assert all(answers.values()), (
            f"unanswered after {took:.1f}s: {[i for i, a in answers.items() if not a]}"
        )
        firsts = [a[0] for a in answers.values()]
        waiting = [f for f in firsts if isinstance(f, Waiting)]
        refused = [f for f in firsts if isinstance(f, Error)]
        assert len(waiting) == gw.max_waiting_turns_per_session
        assert len(refused) == len(ids) - len(waiting)
        assert all(e.code == "rate_limited" and (e.retry_after_ms or 0) > 0 for e in refused)
        assert server.gateway.core.admission.waiting_bytes == len(waiting) * len(big)
        await c.close()
        await asyncio.sleep(0.1)
        # The connection's end frees what its waiting turns held.
        assert server.gateway.core.admission.waiting_bytes == 0
        assert server.gateway.core.admission.waiting_by_session == {}


async def test_a_content_burst_on_one_connection_is_answered_frame_by_frame(server: Running) -> None:
    # SPEC: 10 chats/s with bursts of 20 per connection. 30 content-mode chats: every one gets an answer
    # (waiting, accepted or rate_limited) promptly, none is left for the client to time out on.
    c = await _busy_session(server)
    ids = [f"b{i}" for i in range(30)]
    for i in ids:
        await c.send(Chat(id=i, content="burst", params=Params(max_tokens=2)))
    answers = await _answers(c, ids, within_s=3.0)
    assert all(answers.values())
    codes = {f.code for a in answers.values() for f in a[:1] if isinstance(f, Error)}
    assert codes == {"rate_limited"}
    await c.close()


async def test_max_streams_counts_waiting_turns(redis: aioredis.Redis, redis_url: str, keys: Keys) -> None:
    gw = GatewaySettings(port=0, max_streams_per_connection=2, max_waiting_turns_per_session=5)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        c = await _busy_session(server)  # one stream
        await c.send(Chat(id="w1", content="one"))  # waits: the second stream
        await c.send(Chat(id="w2", content="two"))  # no room: refused at once
        answers = await _answers(c, ["w1", "w2"], within_s=2.0)
        assert isinstance(answers["w1"][0], Waiting)
        refused = answers["w2"][0]
        assert isinstance(refused, Error) and refused.code == "rate_limited" and "streams" in refused.message
        await c.close()


async def test_a_waiting_turn_is_refused_overloaded_at_once_when_the_queue_is_full(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    async with running_server(redis, redis_url, keys, store=Settings(max_queued=1)) as server:
        c = await _busy_session(server)
        for w in server.workers:
            w.pause()  # nothing more is taken: the queue fills
        await asyncio.sleep(1.2)  # a take already blocked in the store returns within its 1 s block
        other = await Client.connect(server.url)
        await other.send(Chat(id="filler", content="fill the queue"))
        assert isinstance((await _answers(other, ["filler"], 2.0))["filler"][0], Accepted)
        await asyncio.sleep(1.1)  # the queue depth admission reads is at most a second old
        await c.send(Chat(id="late", content="waits behind a full queue"))
        answer = (await _answers(c, ["late"], 2.0))["late"]
        assert isinstance(answer[0], Error) and answer[0].code == "overloaded"
        assert (answer[0].retry_after_ms or 0) > 0
        for w in server.workers:
            w.resume()
        await c.close()
        await other.close()


async def test_the_owner_rate_covers_content_turns_over_several_connections(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    # 64 chats from one owner over 4 connections of one session: every one is answered, and the owner's
    # cross-gateway rate (here 20/s) refuses the rest with retry_after_ms.
    gw = GatewaySettings(
        port=0, chat_rate_per_connection=1000, chat_rate_per_user=20, max_waiting_turns_per_session=64
    )
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        first = await _busy_session(server)
        assert first.welcome is not None
        conns = [first] + [
            await Client.connect(server.url, session_token=first.welcome.session_token) for _ in range(3)
        ]
        ids: dict[int, list[str]] = {k: [f"c{k}-{i}" for i in range(16)] for k in range(4)}
        for k, c in enumerate(conns):
            for i in ids[k]:
                await c.send(Chat(id=i, content="hi", params=Params(max_tokens=2)))
        results = await asyncio.gather(*(_answers(c, ids[k], 3.0) for k, c in enumerate(conns)))
        firsts = [a[0] for r in results for a in r.values() if a]
        assert len(firsts) == 64
        refused = [f for f in firsts if isinstance(f, Error)]
        assert refused and all(f.code == "rate_limited" and "user" in f.message for f in refused)
        for c in conns:
            await c.close()


# ---- no door can skip admission -------------------------------------------------------------------


class _RefuseAll(Admission):
    """An admission that says no to everything, counting what it was asked."""

    asked: list[Ask]

    async def admit(self, ask: Ask, **kw: Any) -> Grant:
        self.asked = [*getattr(self, "asked", []), ask]
        raise ProtocolError(ErrorCode.RATE_LIMITED, "refused by the test", id=ask.id, retry_after_ms=5)


async def test_every_door_is_refused_when_admission_refuses(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    async with running_server(redis, redis_url, keys) as server:
        # A request to resume, created while admission still says yes.
        c = await Client.connect(server.url)
        assert c.welcome is not None
        token = c.welcome.session_token
        async for _ in c.chat("made before", id="old", params=Params(max_tokens=2)):
            pass
        await c.close()
        core = server.gateway.core
        refuse = _RefuseAll(core.settings, core.store)
        core.admission = refuse
        before = set(await redis.keys(f"{keys.prefix}*"))

        c = await Client.connect(server.url, session_token=token)
        await c.send(Chat(id="ws-chat", content="hi"))
        await c.send(Chat(id="ws-m", messages=(Message("user", "x"),)))
        await c.send(Resume(id="old", offset=0))
        answers = await _answers(c, ["ws-chat", "ws-m", "old"], 3.0)
        await c.send(Cancel(id="old"))
        cancelled = await _answers(c, ["old"], 3.0)
        await c.close()
        hello_resume = await Client.connect(server.url, hello=False)
        await hello_resume.send(Hello(session_token=token, resume=(ResumePoint(id="old", offset=0),)))
        hr = await _answers(hello_resume, ["old"], 3.0)
        await hello_resume.close()

        async def post(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            status, _, raw = await _http(server.port, "POST", path, json.dumps(body).encode())
            return status, json.loads(raw)

        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
        results = [
            await post("/v1/chat/completions", body),
            await post("/v1/chat/completions", {**body, "stream": True}),
            await post("/v1/responses", {"model": "default", "input": "hi"}),
            await post("/v1/responses", {"model": "default", "input": "hi", "background": True}),
            await post("/v1/responses", {"model": "default", "input": "hi", "stream": True}),
        ]
        # The Responses WebSocket's handshake resume point (tw_resume) is refused as it is admitted.
        host = f"ws://127.0.0.1:{server.port}"
        async with websockets.connect(f"{host}/v1/responses?tw_resume=resp_none:3") as rws:
            tw_resume = json.loads(await asyncio.wait_for(rws.recv(), 5.0))
        assert tw_resume["type"] == "error" and tw_resume["error"]["code"] == "rate_limited", tw_resume
        reads = [
            await _http(server.port, "GET", "/v1/responses/resp_none?stream=true"),
            await _http(server.port, "GET", "/v1/responses/resp_none"),
            await _http(server.port, "POST", "/v1/responses/resp_none/cancel"),
        ]
        for frames in (answers["ws-chat"], answers["ws-m"], answers["old"], hr["old"], cancelled["old"]):
            assert frames and isinstance(frames[0], Error) and frames[0].code == "rate_limited"
        assert [status for status, _ in results] == [429] * 5
        assert all(body["error"]["code"] == "rate_limited" for _, body in results)
        # Retrieves and cancels are admitted before the response is looked up (so unknown ids too).
        assert [status for status, _, _ in reads] == [429] * 3
        kinds = sorted(a.kind for a in refuse.asked)
        assert kinds == ["cancel"] * 2 + ["chat"] * 7 + ["resume"] * 5
        # Nothing was created: no new request, log or session history in the store.
        after = set(await redis.keys(f"{keys.prefix}*"))
        new = {k.decode() for k in after - before}
        assert not [k for k in new if ":req:" in k or ":log:" in k], new


async def test_the_core_refuses_to_run_without_a_grant(server: Running) -> None:
    core = server.gateway.core
    chat = Chat(id="sneaky", content="hi")
    req = ChatRequest(owner="o", chat=chat, messages=[{"role": "user", "content": "hi"}], fingerprint="f")
    with pytest.raises(TypeError, match="Grant"):
        await core.submitter.submit(req, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Grant"):
        async with core.streams.follow(object(), "o", "sneaky", 0):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError):
        Grant(core.admission, Ask("chat", "o", "x"), object())  # only Admission mints grants
    grant = await core.admission.admit(Ask("chat", "o", "once", stream=False))
    await core.submitter.submit(
        ChatRequest(
            owner="o",
            chat=Chat(id="once", content="hi"),
            messages=[{"role": "user", "content": "hi"}],
            fingerprint="f",
        ),
        grant,
    )
    with pytest.raises(RuntimeError, match="one submit"):
        await core.submitter.submit(req, grant)
    assert isinstance(core.submitter, Submitter) and isinstance(core.streams, Streams)


async def test_chat_text_is_rated_in_bytes_per_connection_and_per_http_owner(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    # Ten 900 KB chats a second fit the chat rate, but they cost the store, the worker and the template
    # a thousand small ones each: the byte rate lets a big chat through about once a second.
    # (The read pace is twice the byte rate, so two such chats back to back would be a flood that
    # closes the connection, §2.2: that is test_ingress.py's, not this test's.)
    gw = GatewaySettings(port=0, chat_bytes_per_connection=100_000, flood_close_s=0)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        c = await Client.connect(server.url)
        big = (Message("user", "x" * 150_000),)
        await c.send(Chat(id="b1", messages=big, params=Params(max_tokens=2)))
        await c.send(Chat(id="b2", messages=big, params=Params(max_tokens=2)))
        await c.send(Chat(id="small", messages=(Message("user", "hi"),), params=Params(max_tokens=2)))
        answers = await _answers(c, ["b1", "b2", "small"], 3.0)
        assert isinstance(answers["b1"][0], Accepted)
        refused = answers["b2"][0]
        assert isinstance(refused, Error) and refused.code == "rate_limited" and "text" in refused.message
        assert 0 < (refused.retry_after_ms or 0) <= 2000
        await c.close()
        body = {"model": "default", "messages": [{"role": "user", "content": "y" * 150_000}], "max_tokens": 2}
        raw = json.dumps(body).encode()
        first = await _http(server.port, "POST", "/v1/chat/completions", raw)
        second = await _http(server.port, "POST", "/v1/chat/completions", raw)
        assert first[0] == 200 and second[0] == 429
        assert "text" in json.loads(second[2])["error"]["message"]


class _NoRates:
    """The store as admission sees it, with every owner under their rate."""

    async def rate(self, owner: str, kind: str, limit: float) -> int:
        return 0


async def test_a_grant_that_must_wait_after_all_takes_a_waiting_slot_within_the_cap() -> None:
    """start_wait: a turn admitted as not waiting that finds, at submit time, another turn ahead of it
    counts as waiting from then on, and is refused once its session has the most turns waiting."""
    adm = Admission(GatewaySettings(max_waiting_turns_per_session=1), _NoRates())  # type: ignore[arg-type]
    conn = adm.connection("10.0.0.1")
    ask = Ask("chat", "o", "t1", conn=conn, session="s", held_bytes=10)
    first, second = await adm.admit(ask), await adm.admit(Ask("chat", "o", "t2", conn=conn, session="s"))
    adm.start_wait(first)
    assert first.waiting and adm.waiting_by_session == {"s": 1} and adm.waiting_bytes == 10
    adm.start_wait(first)  # already waiting: nothing more is taken
    assert adm.waiting_by_session == {"s": 1}
    with pytest.raises(ProtocolError) as refused:
        adm.start_wait(second)
    assert refused.value.code is ErrorCode.RATE_LIMITED and refused.value.retry_after_ms
    assert not second.waiting
    first.release()
    second.release()
    assert adm.waiting_by_session == {} and adm.waiting_bytes == 0 and conn.count() == 0


async def test_a_task_cancelled_before_its_first_step_still_releases_its_grant() -> None:
    """A connection whose client is gone cancels the stream (or waiting turn) task it just made before that
    task ever runs: the coroutine's body, and the finally that releases the grant in it, never run. Before
    task_holding, each such drop kept a stream slot of the owner (and a waiting turn's slot and bytes), so
    enough of them refused the owner every stream until a restart."""
    adm = Admission(GatewaySettings(), _NoRates())  # type: ignore[arg-type]
    conn = adm.connection("10.0.0.1")
    ran: list[str] = []

    async def body(grant: Grant) -> None:
        try:
            ran.append("body")
            await asyncio.sleep(3600)
        finally:
            grant.release()

    stream = await adm.admit(Ask("chat", "o", "s1", conn=conn))
    turn = await adm.admit(Ask("chat", "o", "t1", conn=conn, session="s", waits=True, held_bytes=10))
    assert adm.streams_by_owner == {"o": 2} and adm.waiting_bytes == 10
    coros = [body(stream), body(turn)]
    tasks = [
        task_holding(g, c, name=f"t{i}") for i, (g, c) in enumerate(zip((stream, turn), coros, strict=True))
    ]
    for task in tasks:
        task.cancel()  # in the same pass of the loop that made it: it never starts
    await asyncio.gather(*tasks, return_exceptions=True)
    assert ran == [] and all(c.cr_frame is None for c in coros)  # never ran, and closed (no warning)
    assert adm.streams_by_owner == {} and conn.count() == 0
    assert adm.waiting_by_session == {} and adm.waiting_bytes == 0

    # A task that started is its body's business: the grant may have been handed on (a waiting turn's
    # to the stream it attached), so task_holding leaves it alone.
    handed = await adm.admit(Ask("chat", "o", "s2", conn=conn))

    async def hands_on(grant: Grant) -> None:
        ran.append("hands_on")

    await task_holding(handed, hands_on(handed), name="h")
    assert ran == ["hands_on"] and adm.streams_by_owner == {"o": 1}
    handed.release()
    assert adm.streams_by_owner == {} and conn.count() == 0


async def test_http_retrieves_and_cancels_are_rated_per_user_before_the_store_is_read(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    """A retrieve (or a create's previous_response_id) reads a whole log and a cancel runs a store
    script: over HTTP each is admitted like a WebSocket resume or cancel, per user on this server (bursts
    of 2 here), and refused 429 with Retry-After once over. Before, each went to the store unrated."""
    st = GatewaySettings(
        port=0, resume_rate_per_connection=0.2, cancel_rate_per_connection=0.2, max_streams_per_connection=2
    )

    def call(method: str, path: str, body: bytes | None, key: str) -> tuple[int, str, dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:  # with auth off, each API key is an owner of its own
            conn.request(method, path, body=body, headers={"Authorization": f"Bearer {key}"})
            r = conn.getresponse()
            return r.status, r.getheader("Retry-After") or "", json.loads(r.read())
        finally:
            conn.close()

    async with running_server(redis, redis_url, keys, gateway=st) as server:
        follow_up = json.dumps({"model": "default", "input": "hi", "previous_response_id": "resp_nope"})
        for method, path, sent in (
            ("GET", "/v1/responses/resp_nope", None),
            ("POST", "/v1/responses/resp_nope/cancel", None),
            ("POST", "/v1/responses", follow_up.encode()),  # reads the previous response's whole log
        ):
            answers = [
                await asyncio.to_thread(call, method, path, sent, f"key-{method}-{path}") for _ in range(3)
            ]
            assert [status for status, _, _ in answers] == [404, 404, 429], (method, path, answers)
            _, retry_after, body = answers[-1]
            assert int(retry_after) >= 1 and body["error"]["code"] == "rate_limited"
