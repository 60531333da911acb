"""Chat over a real socket: streaming, subprotocols, sessions, cancel, idempotent retries, resume."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from protocol import JSON_SUBPROTOCOL, Accepted, Cancel, Delta, Done, Error, Params, Ping, Pong, Resume
from server.client import Client, collect
from tests.gateway.conftest import ON_BOTH, Running


def _contiguous(deltas: list[Delta], start: int = 0) -> bool:
    pos = start
    for d in deltas:
        if d.offset != pos:
            return False
        pos += d.n
    return True


@pytest.mark.parametrize("subprotocol", ["tokenwire.v1.msgpack", JSON_SUBPROTOCOL])
async def test_chat_streams_contiguous_deltas_then_done(server: Running, subprotocol: str) -> None:
    c = await Client.connect(server.url, subprotocol=subprotocol)
    text, deltas, done, errors = await collect(c.chat("hello there", id="r1"))
    assert errors == []
    assert done is not None and done.finish_reason == "stop"
    assert len(deltas) >= 2 and _contiguous(deltas)
    assert done.offset == sum(d.n for d in deltas) == 12
    assert text.startswith("re[1] hello there")
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == 1
    assert done.usage.cached_tokens == 0
    # With an earlier message, the fake engine counts it as reused: done.usage.cached_tokens says so.
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    _, _, done, errors = await collect(c.chat(messages=messages, id="r2"))
    assert errors == [] and done is not None
    assert (done.usage.prompt_tokens, done.usage.cached_tokens) == (2, 1)
    await c.close()


async def test_handshake_without_our_subprotocol_is_refused(server: Running) -> None:
    with pytest.raises(InvalidStatus) as exc:
        await connect(server.url, subprotocols=["chat"])  # type: ignore[list-item]
    assert exc.value.response.status_code == 400
    with pytest.raises(InvalidStatus):
        await connect(server.url)


async def test_http_endpoints(server: Running) -> None:
    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""

    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, get, "/healthz") == (200, "ok\n")
    assert (await loop.run_in_executor(None, get, "/readyz"))[0] == 200
    assert (await loop.run_in_executor(None, get, "/nope"))[0] == 404


async def test_ping_pong_echoes_ts(server: Running) -> None:
    c = await Client.connect(server.url)
    await c.send(Ping(ts=123.5))
    assert await c.recv() == Pong(ts=123.5)
    await c.close()


async def test_session_history_feeds_the_next_turn(server: Running) -> None:
    c = await Client.connect(server.url)
    first, *_ = await collect(c.chat("one", id="t1"))
    second, *_ = await collect(c.chat("two", id="t2"))
    assert first.startswith("re[1] one")
    assert second.startswith("re[3] two")  # history: user one, assistant reply, user two
    # messages mode does not use or change the history
    third, *_ = await collect(c.chat(messages=[{"role": "user", "content": "solo"}], id="t3"))
    assert third.startswith("re[1] solo")
    await c.close()


async def test_same_id_retry_attaches_and_never_generates_twice(server: Running) -> None:
    c1 = await Client.connect(server.url)
    assert c1.welcome is not None
    token = c1.welcome.session_token
    c2 = await Client.connect(server.url, session_token=token)
    params = Params(max_tokens=8)
    a, b = await asyncio.gather(
        collect(c1.chat("same", id="dup", params=params)), collect(c2.chat("same", id="dup", params=params))
    )
    assert a[0] == b[0] and a[2] is not None and a[2].offset == 8
    assert server.engine.requests_started == 1
    # The same id with another payload is a conflict, not a silent second request.
    _, _, done, errors = await collect(c1.chat("different", id="dup"))
    assert done is None and [e.code for e in errors] == ["idempotency_conflict"]
    await c1.close()
    await c2.close()


@ON_BOTH
async def test_other_session_cannot_see_requests(server: Running) -> None:
    owner = await Client.connect(server.url)
    await collect(owner.chat("mine", id="secret"))
    stranger = await Client.connect(server.url)
    await stranger.send(Resume(id="secret", offset=0))
    e1 = await stranger.recv()
    await stranger.send(Cancel(id="secret"))
    e2 = await stranger.recv()
    await stranger.send(Resume(id="never-existed", offset=0))
    e3 = await stranger.recv()
    assert isinstance(e1, Error) and isinstance(e2, Error) and isinstance(e3, Error)
    assert (e1.code, e2.code, e3.code) == ("not_found", "not_found", "not_found")
    assert e1.message == e3.message  # the same answer: existence does not leak
    await owner.close()
    await stranger.close()


@ON_BOTH
async def test_disconnect_does_not_cancel_and_resume_continues(server: Running) -> None:
    server.engine.step_s = 0.02
    c = await Client.connect(server.url)
    assert c.welcome is not None
    token = c.welcome.session_token
    seen: list[Delta] = []
    async for f in c.chat("resume me please", id="long", params=Params(max_tokens=12)):
        if isinstance(f, Delta):
            seen.append(f)
            if sum(d.n for d in seen) >= 3:
                break
    c.ws.transport.abort()  # drop mid-stream, no closing handshake
    offset = sum(d.n for d in seen)
    c2 = await Client.connect(server.url, session_token=token)
    await c2.send(Resume(id="long", offset=offset))
    frames = [f async for f in c2.frames_for("long")]
    assert isinstance(frames[0], Accepted)
    rest = [f for f in frames if isinstance(f, Delta)]
    done = frames[-1]
    assert isinstance(done, Done) and done.offset == 12 and done.finish_reason == "length"
    assert _contiguous(rest, offset)
    full = "".join(d.text for d in seen + rest)
    assert full.startswith("re[1] resume me please")
    assert server.engine.requests_started == 1
    await c2.close()


@pytest.mark.parametrize("subprotocol", ["tokenwire.v1.msgpack", JSON_SUBPROTOCOL])
async def test_a_length_done_says_which_limit_ended_it_also_on_resume(
    server: Running, subprotocol: str
) -> None:
    """done.length_reason (SPEC 12): "max_tokens" when the asked max_tokens ended the reply, "context"
    when the model's context window did (the client starts a new conversation rather than asking for
    more tokens); a resume replays the same done; a stop has none."""
    c = await Client.connect(server.url, subprotocol=subprotocol)
    _, _, done, _ = await collect(c.chat("short", id="asked", params=Params(max_tokens=4)))
    assert done is not None and (done.finish_reason, done.length_reason, done.offset) == (
        "length",
        "max_tokens",
        4,
    )
    _, _, done, _ = await collect(c.chat("natural", id="stopped"))
    assert done is not None and (done.finish_reason, done.length_reason) == ("stop", None)
    server.engine.context = 6  # one prompt token (one message) and five of completion fill the window
    one = [{"role": "user", "content": "too long"}]  # messages mode: no session history in the prompt
    _, _, done, _ = await collect(c.chat(messages=one, id="window", params=Params(max_tokens=12)))
    assert done is not None and (done.finish_reason, done.length_reason, done.offset) == (
        "length",
        "context",
        5,
    )
    await c.send(Resume(id="window", offset=5))
    frames = [f async for f in c.frames_for("window")]
    assert isinstance(frames[-1], Done) and frames[-1].length_reason == "context"
    await c.close()


async def test_cancel_ends_stream_with_cancelled(server: Running) -> None:
    server.engine.step_s = 0.05
    server.engine.reply_len = 400
    c = await Client.connect(server.url)
    got_delta = False
    done = None
    async for f in c.chat("stop me", id="c1", params=Params(max_tokens=300)):
        if isinstance(f, Delta) and not got_delta:
            got_delta = True
            await c.send(Cancel(id="c1"))
        if isinstance(f, Done):
            done = f
    assert done is not None and done.finish_reason == "cancelled" and done.offset < 300
    # Its usage counts the prompt its tokens came from (SPEC §5): 0 is only for one never started.
    assert done.usage is not None and done.usage.prompt_tokens > 0
    assert done.usage.completion_tokens == done.offset
    assert c.welcome is not None
    info = await server.store.get(f"anon:{c.welcome.session}", "c1")
    assert info is not None and info.state == "cancelled"
    await c.close()
