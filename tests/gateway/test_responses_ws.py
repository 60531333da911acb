"""OpenAI's Responses WebSocket mode (``GET /v1/responses`` upgraded), driven by the official ``openai``
SDK's ``client.responses.connect()`` against a real gateway, store and worker with the fake engine."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import jwt
import pytest
import redis.asyncio as aioredis
import websockets
from openai import AsyncOpenAI

from server.examples.openai_ws_resume import ResumeTracker
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import Running, running_server

SECRET = "jwt-test-secret-of-at-least-32-bytes!"
END = ("response.completed", "response.incomplete", "response.failed")
_CLIENTS: list[AsyncOpenAI] = []


def sdk(server: Running, key: str = "k-test") -> AsyncOpenAI:
    c = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0)
    _CLIENTS.append(c)
    return c


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _CLIENTS:
        await _CLIENTS.pop().close()


async def until_end(conn: Any, lanes: int = 1, on_event: Any = None) -> list[Any]:
    """Events until ``lanes`` responses ended (errors included in the list)."""
    events: list[Any] = []

    async def read() -> None:
        ended = 0
        async for ev in conn:
            events.append(ev)
            if on_event is not None:
                await on_event(ev)
            if ev.type in END:
                ended += 1
                if ended == lanes:
                    return

    await asyncio.wait_for(read(), 30)
    return events


def text_of(events: list[Any], lane: str | None = None) -> str:
    return "".join(
        e.delta
        for e in events
        if e.type == "response.output_text.delta" and getattr(e, "stream_id", None) == lane
    )


async def test_connect_streams_a_reply_with_openai_events(server: Running) -> None:
    client = sdk(server)
    async with client.responses.connect() as conn:
        await conn.response.create(model="default", input="hello there", max_output_tokens=5)
        events = await until_end(conn)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    seqs = [e.sequence_number for e in events]
    assert seqs[0] == 0 and all(a < b for a, b in itertools.pairwise(seqs))
    final = events[-1].response
    assert text_of(events) == final.output_text and final.output_text.startswith("re[1] hello there")
    # The same response through the HTTP door: one request in the store.
    assert (await client.responses.retrieve(final.id)).output_text == final.output_text


async def test_a_second_turn_with_previous_response_id_sees_the_first(server: Running) -> None:
    async with sdk(server).responses.connect() as conn:
        await conn.response.create(model="default", input="one", max_output_tokens=3)
        first = (await until_end(conn))[-1].response
        await conn.response.create(
            model="default", input="two", previous_response_id=first.id, max_output_tokens=3
        )
        second = (await until_end(conn))[-1].response
    assert second.previous_response_id == first.id
    assert second.output_text.startswith("re[3] two")  # the fake engine counts user, assistant, user


async def test_generate_false_warms_up_a_response_to_continue_from(server: Running) -> None:
    async with sdk(server).responses.connect() as conn:
        await conn.response.create(model="default", input="context first", instructions="sys", generate=False)
        warm = await until_end(conn)
        assert [e.type for e in warm] == ["response.created", "response.completed"]
        rid = warm[-1].response.id
        assert warm[-1].response.output == [] and warm[-1].response.usage.output_tokens == 0
        await conn.response.create(
            model="default", input="now go", previous_response_id=rid, max_output_tokens=4
        )
        reply = (await until_end(conn))[-1].response
    # user "context first" + user "now go": the warm-up's input came before this turn's.
    assert reply.output_text.startswith("re[2] now go")
    assert server.engine.requests_started == 1  # the warm-up generated nothing


async def test_a_second_create_while_one_streams_is_refused_and_lanes_multiplex(server: Running) -> None:
    server.engine.reply_len = 30
    server.engine.step_s = 0.02
    async with sdk(server).responses.connect() as conn:
        await conn.response.create(model="default", input="first", max_output_tokens=30)
        await conn.response.create(model="default", input="second", max_output_tokens=30)
        events = await until_end(conn)
        errors = [e for e in events if e.type == "error"]
        assert [e.error.code for e in errors] == ["response_already_in_flight"]
        assert events[-1].type == "response.incomplete" and events[-1].response.output_text.startswith(
            "re[1] first"
        )
        # OpenAI's stream_id names lanes: two responses at once on one socket, each event tagged.
        await conn.response.create(model="default", input="left", stream_id="a", max_output_tokens=6)
        await conn.response.create(model="default", input="right", stream_id="b", max_output_tokens=6)
        both = await until_end(conn, lanes=2)
        # Ended lanes leave the socket's table (client-chosen stream_ids must not pile up).
        [sock] = server.gateway.response_sockets
        deadline = time.monotonic() + 10
        while sock.lanes:
            assert time.monotonic() < deadline, f"lanes never freed: {list(sock.lanes)}"
            await asyncio.sleep(0.02)
    finals = {e.stream_id: e.response for e in both if e.type in END}
    assert set(finals) == {"a", "b"}
    for lane, final in finals.items():
        assert text_of(both, lane) == final.output_text
        seqs = [e.sequence_number for e in both if e.stream_id == lane]
        assert all(a < b for a, b in itertools.pairwise(seqs))
    assert finals["a"].output_text.startswith("re[1] left") and finals["b"].output_text.startswith(
        "re[1] right"
    )


async def test_refusals_name_the_field_and_the_socket_stays_usable(server: Running) -> None:
    async with sdk(server).responses.connect() as conn:
        sends: list[dict[str, Any]] = [
            {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
                ]
            },
            {"previous_response_id": "resp_nope"},
            {"temperature": 9},
            {"background": True},
            {"reasoning": {"effort": "high"}},
            {"prompt_cache_key": "k\ud800"},  # a lone surrogate: not text (a 500 before)
            {"stream": 5},  # typed as over HTTP (created a response before)
            {"background": 0},
            {"input": [{"role": ["user"], "content": "x"}]},  # an unhashable role (a 500 before)
        ]
        for extra in sends:
            await conn.send({"type": "response.create", "model": "default", "input": "x", **extra})  # type: ignore[arg-type,typeddict-item]
        await conn.send({"type": "response.cancel"})  # type: ignore[arg-type,typeddict-item]
        errors = [await asyncio.wait_for(conn.recv(), 10) for _ in range(len(sends) + 1)]
        # background false and a null generate are what their absence is
        still = {"input": "still fine", "max_output_tokens": 2, "background": False, "generate": None}
        await conn.send({"type": "response.create", "model": "default", **still})  # type: ignore[arg-type,typeddict-item]
        ok = await until_end(conn)
    got = [(e.type, e.error.code, e.error.param) for e in errors]
    assert got == [
        ("error", "unsupported_parameter", "tools"),
        ("error", "unsupported_parameter", "input[0].content[0]"),
        ("error", "previous_response_not_found", "previous_response_id"),
        ("error", "invalid_request_error", "temperature"),
        ("error", "invalid_request_error", "background"),
        ("error", "unsupported_parameter", "reasoning"),
        ("error", "invalid_request_error", None),
        ("error", "invalid_request_error", "stream"),
        ("error", "invalid_request_error", "background"),
        ("error", "invalid_request_error", "input[0].role"),
        ("error", "invalid_request_error", "type"),
    ]
    assert "images" in errors[1].error.message and "tools" in errors[0].error.message
    assert ok[-1].type == "response.incomplete"


async def test_a_binary_frame_or_a_repeated_key_gets_an_error_event(server: Running) -> None:
    # SPEC §15.7: events are JSON text. Before, a binary frame was read as JSON all the same, and a
    # repeated key let the last one win ("input": 5, "input": "x" created a response).
    url = f"ws://127.0.0.1:{server.port}/v1/responses"
    async with websockets.connect(url) as ws:
        await ws.send(b'{"type":"response.create","model":"default","input":"x"}')
        await ws.send('{"type":"response.create","model":"default","input":5,"input":"x"}')
        errors = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(2)]
        await ws.send('{"type":"response.create","model":"default","input":"ok","max_output_tokens":2}')
        while (event := json.loads(await asyncio.wait_for(ws.recv(), 10)))["type"] not in END:
            pass
    assert [(e["type"], e["status"], e["error"]["code"]) for e in errors] == [
        ("error", 400, "invalid_request_error")
    ] * 2
    assert "binary" in errors[0]["error"]["message"] and "repeats a key" in errors[1]["error"]["message"]
    assert event["type"] == "response.incomplete"  # the socket serves on


async def test_a_resume_point_with_a_non_ascii_digit_is_refused_and_holds_no_stream(server: Running) -> None:
    # "\u00b2" (superscript two) passes str.isdigit() but not int(): the handshake's resume point was
    # admitted, then the handler died with a ValueError, closing the socket and keeping the stream, so
    # 256 such handshakes locked the owner out of every stream (429) until a restart.
    done = await sdk(server).responses.create(model="default", input="x", max_output_tokens=2)
    url = f"ws://127.0.0.1:{server.port}/v1/responses"
    headers = {"Authorization": "Bearer k-test"}
    for point in (f"{done.id}:%C2%B2", f"{done.id}:%D9%A1"):  # U+00B2, and U+0661 (an Arabic-Indic 1)
        async with websockets.connect(f"{url}?tw_resume={point}", additional_headers=headers) as ws:
            err = json.loads(await asyncio.wait_for(ws.recv(), 10))
            await ws.send('{"type":"response.create","model":"default","input":"ok","max_output_tokens":2}')
            while (event := json.loads(await asyncio.wait_for(ws.recv(), 10)))["type"] not in END:
                pass
        assert (err["type"], err["status"], err["error"]["param"]) == ("error", 400, "tw_resume"), err
        assert event["type"] == "response.incomplete"  # the socket served on
    admission = server.gateway.core.admission
    deadline = time.monotonic() + 5
    while any(admission.streams_by_owner.values()) and time.monotonic() < deadline:  # noqa: ASYNC110 (a count)
        await asyncio.sleep(0.02)
    assert not any(admission.streams_by_owner.values()), admission.streams_by_owner


async def test_sockets_dropped_right_after_a_resume_or_a_create_hold_no_stream(server: Running) -> None:
    # A client gone in the same pass of the loop that made its stream task (a phone losing signal) used to
    # keep a stream slot for each drop: the task was cancelled before it ran its releasing finally.
    server.engine.reply_len = 40
    server.engine.step_s = 0.01
    done = await sdk(server).responses.create(model="default", input="x", max_output_tokens=2)
    url = f"ws://127.0.0.1:{server.port}/v1/responses"
    headers = {"Authorization": "Bearer k-test"}
    create = '{"type":"response.create","model":"default","input":"bye","max_output_tokens":40}'
    for i in range(20):
        query = f"?tw_resume={done.id}:0" if i % 2 else ""
        ws = await websockets.connect(f"{url}{query}", additional_headers=headers)
        if not query:
            await ws.send(create)
        ws.transport.abort()
        await ws.wait_closed()
    admission = server.gateway.core.admission
    deadline = time.monotonic() + 10
    while any(admission.streams_by_owner.values()) and time.monotonic() < deadline:  # noqa: ASYNC110 (a count)
        await asyncio.sleep(0.02)
    assert not any(admission.streams_by_owner.values()), admission.streams_by_owner


async def test_the_handshake_needs_a_jwt_when_auth_is_on(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    settings = GatewaySettings(port=0, auth_secret=SECRET)
    async with running_server(redis, redis_url, keys, gateway=settings) as server:
        with pytest.raises(websockets.exceptions.InvalidStatus) as err:
            async with sdk(server, "not-a-jwt").responses.connect():
                pass
        assert err.value.response.status_code == 401
        token = jwt.encode({"sub": "alice", "exp": int(time.time() + 60)}, SECRET, algorithm="HS256")
        async with sdk(server, token).responses.connect() as conn:
            await conn.response.create(model="default", input="mine", max_output_tokens=2)
            rid = (await until_end(conn))[-1].response.id
        assert (
            await server.store.get("alice", rid.removeprefix("resp_")) is not None
        )  # owned by the JWT's sub


async def test_the_protocol_endpoint_still_requires_its_subprotocol(server: Running) -> None:
    with pytest.raises(websockets.exceptions.InvalidStatus) as err:
        async with websockets.connect(server.url):
            pass
    assert err.value.response.status_code == 400


async def test_a_drop_mid_reply_is_resumed_by_the_sdks_own_reconnect(server: Running) -> None:
    server.engine.reply_len = 60
    server.engine.step_s = 0.02
    tracker = ResumeTracker()
    dropped = asyncio.Event()

    async def on_event(ev: Any) -> None:
        tracker.see(ev)
        if ev.type == "response.output_text.delta" and ev.sequence_number >= 10 and not dropped.is_set():
            dropped.set()
            # The server side goes away mid-reply, as a gateway restarting does (1012).
            for sock in list(server.gateway.response_sockets):
                await sock.ws.close(1012, "restart")

    queries: list[Any] = []

    def on_reconnecting(event: Any) -> Any:
        overrides = tracker.on_reconnecting(event)
        queries.append(overrides["extra_query"])
        return overrides

    client = sdk(server)
    async with client.responses.connect(on_reconnecting=on_reconnecting, initial_delay=0.01) as conn:
        await conn.response.create(model="default", input="long story", max_output_tokens=60)
        events = await until_end(conn, on_event=on_event)
    assert dropped.is_set() and len(queries) == 1  # one reconnect, naming the response and where it was
    assert queries[0]["tw_resume"].startswith(events[0].response.id + ":")
    seqs = [e.sequence_number for e in events]
    assert all(a < b for a, b in itertools.pairwise(seqs))  # nothing repeated
    final = events[-1].response
    stored = await client.responses.retrieve(final.id)
    assert text_of(events) == final.output_text == stored.output_text  # nothing missing
    assert stored.usage is not None and stored.usage.output_tokens == 60
    assert [e.type for e in events].count("response.created") == 1
    assert server.engine.requests_started == 1


async def test_the_example_streams_a_reply(server: Running, capsys: pytest.CaptureFixture[str]) -> None:
    from server.examples.openai_ws_resume import main

    text = await main(f"http://127.0.0.1:{server.port}/v1", "hello")
    assert text.startswith("re[1] hello") and "re[1] hello" in capsys.readouterr().out


async def test_get_without_an_upgrade_is_the_http_api(server: Running) -> None:
    from tests.gateway.test_http_api import raw

    status, headers, body = await raw(server.port, "GET", "/v1/responses")
    assert status == 405 and headers["allow"] == "POST" and b'"code":"method"' in body
