"""The OpenAI-compatible HTTP API on the gateway's port, driven by the official ``openai`` SDK, over a real
gateway, store and worker with the fake engine (its ``requests_started`` counts generations)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import re
import time
from collections.abc import AsyncIterator

import jwt
import openai
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from protocol import Chat, Message, Params
from server.client import Client, collect
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import ON_BOTH, Running, running_server

SECRET = "jwt-test-secret-of-at-least-32-bytes!"


def token(sub: str) -> str:
    return jwt.encode({"sub": sub, "exp": int(time.time() + 60)}, SECRET, algorithm="HS256")


_CLIENTS: list[AsyncOpenAI] = []


def sdk(server: Running, key: str = "k-test") -> AsyncOpenAI:
    """An SDK client pointed at the gateway (closed after the test)."""
    c = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0)
    _CLIENTS.append(c)
    return c


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _CLIENTS:
        await _CLIENTS.pop().close()


async def raw(
    port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a fresh socket; the whole response (the server closes or says its length)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    h = {"Host": "x", "Content-Length": str(len(body)), "Connection": "close", **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    writer.write(head.encode() + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head_b, _, rest = data.partition(b"\r\n\r\n")
    lines = head_b.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    hdrs = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, hdrs, rest


@pytest.fixture
async def server(redis: aioredis.Redis, redis_url: str, keys: Keys) -> AsyncIterator[Running]:
    async with running_server(redis, redis_url, keys) as s:
        yield s


async def test_models_lists_the_default_alias(server: Running) -> None:
    models = await sdk(server).models.list()
    assert [m.id for m in models.data] == ["default"]


async def test_chat_completion_non_streaming(server: Running) -> None:
    r = await sdk(server).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hello there"}], max_tokens=5, seed=3
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.content == "re[1] hello there s3 w0"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 1
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == 0


async def test_chat_completion_streaming_with_usage(server: Running) -> None:
    stream = await sdk(server).chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"}],
        stream=True,
        stream_options={"include_usage": True},
        seed=4,
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == "re[2] a b s4" + "".join(f" w{k}" for k in range(8))
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == 12
    # The fake engine counts the system message as reused: the SDK reads it where OpenAI puts it.
    assert usage.prompt_tokens == 2 and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 1


async def test_same_idempotency_key_attaches_to_one_generation(server: Running) -> None:
    client = sdk(server)
    body = {"model": "default", "messages": [{"role": "user", "content": "retry me"}], "max_tokens": 10}
    headers = {"Idempotency-Key": "key-1"}

    async def streamed() -> str:
        s = await client.chat.completions.create(**body, stream=True, extra_headers=headers)  # type: ignore[call-overload]
        return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

    texts = await asyncio.gather(streamed(), streamed(), streamed())
    plain = await client.chat.completions.create(**body, extra_headers=headers)  # type: ignore[call-overload]
    assert len(set(texts)) == 1 and texts[0].startswith("re[1] retry me")
    assert plain.choices[0].message.content == texts[0]
    assert server.engine.requests_started == 1
    with pytest.raises(openai.ConflictError) as ei:
        await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "another"}], extra_headers=headers
        )
    assert ei.value.code == "idempotency_conflict"
    assert server.engine.requests_started == 1


async def test_a_retry_cannot_make_a_response_background_or_cross_apis(server: Running) -> None:
    # SPEC §15.2: background is part of the fingerprint (a retry with it used to attach silently to the
    # foreground response, which a client then believed exempt from the detach timeout), and so is the
    # API that made the request.
    client = sdk(server)
    headers = {"Idempotency-Key": "bg-1"}
    first = await client.responses.create(
        model="default", input="hi", max_output_tokens=3, extra_headers=headers
    )
    again = await client.responses.create(
        model="default", input="hi", max_output_tokens=3, extra_headers=headers
    )
    assert again.id == first.id and again.background is False
    with pytest.raises(openai.ConflictError) as ei:
        await client.responses.create(
            model="default", input="hi", max_output_tokens=3, background=True, extra_headers=headers
        )
    assert ei.value.code == "idempotency_conflict"
    with pytest.raises(openai.ConflictError):
        await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_headers=headers
        )
    assert server.engine.requests_started == 1


async def test_unsupported_fields_are_refused_by_name(server: Running) -> None:
    client = sdk(server)
    msgs = [{"role": "user", "content": "x"}]
    cases = [
        ({"n": 2}, "n"),
        ({"n": True}, "n"),  # SPEC §3: a boolean is not an integer, and 1.0 is not one either
        ({"n": 1.0}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"temperature": 3}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 9000}, "max_completion_tokens"),  # named as sent, not max_tokens
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            await client.chat.completions.create(model="default", messages=msgs, extra_body=extra)  # type: ignore[arg-type]
        assert ei.value.param == param, (extra, ei.value.body)
        if param.startswith("max_"):
            assert ei.value.body["message"].startswith(f"{param}:"), ei.value.body  # type: ignore[index]
    for value in (0, 8193):
        with pytest.raises(openai.BadRequestError) as ei:
            await client.responses.create(model="default", input="x", max_output_tokens=value)
        assert ei.value.param == "max_output_tokens"
        assert ei.value.body["message"].startswith("max_output_tokens:"), ei.value.body  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4o", messages=msgs)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as ei:
        await client.chat.completions.create(model="default", messages=[{"role": "tool", "content": "x"}])  # type: ignore[list-item]
    assert ei.value.param == "messages[0].role"
    # n=1 and zero penalties are what many clients send by default: accepted.
    r = await client.chat.completions.create(
        model="default",
        messages=msgs,
        n=1,
        presence_penalty=0,
        max_tokens=2,  # type: ignore[arg-type]
    )
    assert r.choices[0].finish_reason == "length"
    assert server.engine.requests_started == 1


async def test_bad_bodies_get_documented_4xx_and_nothing_breaks(server: Running) -> None:
    port = server.port
    json_h = {"Content-Type": "application/json"}
    status, _, body = await raw(port, "POST", "/v1/chat/completions", b"{not json", json_h)
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, body = await raw(port, "POST", "/v1/chat/completions", b"[1, 2]", json_h)
    assert status == 400
    status, _, body = await raw(port, "POST", "/v1/chat/completions", b'{"model": NaN}', json_h)
    assert status == 400
    # A repeated key: the last one used to win, so {"model": "nope", "model": "default"} was a 200.
    for twice in (b'"model":"nope","model":"default"', b'"model":"default","model":"nope"'):
        status, _, body = await raw(
            port, "POST", "/v1/chat/completions", b"{" + twice + b',"messages":[]}', json_h
        )
        assert status == 400 and "repeats a key" in json.loads(body)["error"]["message"], body
    status, _, body = await raw(port, "POST", "/v1/chat/completions", b"x" * (2 << 20), json_h)
    assert status == 413 and json.loads(body)["error"]["message"].startswith("request body larger")
    status, hdrs, _ = await raw(port, "GET", "/v1/chat/completions")
    assert status == 405 and hdrs["allow"] == "POST"
    status, _, body = await raw(port, "GET", "/v1/nothing-here")
    assert status == 404 and json.loads(body)["error"]["code"] == "unknown_url"
    deep = b'{"model": "default", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, _, _ = await raw(port, "POST", "/v1/chat/completions", deep, json_h)
    assert status == 400
    status, _, body = await raw(
        port,
        "POST",
        "/v1/chat/completions",
        b'{"model":"default","messages":[]}',
        {**json_h, "Idempotency-Key": "a b"},
    )
    assert status == 400
    status, _, body = await raw(port, "POST", "/v1/chat/completions", b"{}", {"Content-Type": "text/plain"})
    assert status == 400
    # Lone surrogates, escaped or as CESU-8 bytes, are not text: 400, before anything hashes or stores them.
    for text in (b'"\\ud800"', b'"\xed\xa0\x80"'):
        for where in (
            b'"messages":[{"role":"user","content":' + text + b"}]",
            b'"messages":[], "user":' + text,
        ):
            chat = b'{"model":"default",' + where + b"}"
            status, _, body = await raw(port, "POST", "/v1/chat/completions", chat, json_h)
            assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"], (chat, body)
        status, _, body = await raw(
            port, "POST", "/v1/responses", b'{"model":"default","input":' + text + b"}", json_h
        )
        assert status == 400, body
    # A role that is an array or an object (unhashable): 400 naming it, where it was a 500.
    for role in (b'["user"]', b'{"a":1}'):
        msg = b'[{"role":' + role + b',"content":"x"}]'
        for path, field, where in (
            ("/v1/chat/completions", b"messages", "messages[0].role"),
            ("/v1/responses", b"input", "input[0].role"),
        ):
            bad_role = b'{"model":"default","max_tokens":1,"' + field + b'":' + msg + b"}"
            if field == b"input":
                bad_role = bad_role.replace(b'"max_tokens"', b'"max_output_tokens"')
            status, _, body = await raw(port, "POST", path, bad_role, json_h)
            assert status == 400 and json.loads(body)["error"]["param"] == where, (path, body)
    # Too many input messages: the refusal names the Responses body's field, not the chat's "messages".
    many = json.dumps({"model": "default", "input": [{"role": "user", "content": "x"}] * 257}).encode()
    status, _, body = await raw(port, "POST", "/v1/responses", many, json_h)
    assert status == 400 and json.loads(body)["error"]["param"] == "input", body
    # The WebSocket door and the plain GETs still answer as before, on the same port.
    status, _, body = await raw(port, "GET", "/healthz")
    assert status == 200 and body == b"ok\n"
    c = await Client.connect(server.url)
    text, _, done, errors = await collect(c.chat("still fine", params=Params(max_tokens=3)))
    assert errors == [] and done is not None and text.startswith("re[1] still fine")
    await c.close()


@ON_BOTH
async def test_owners_are_isolated_by_jwt(redis: aioredis.Redis, redis_url: str, keys: Keys) -> None:
    async with running_server(
        redis, redis_url, keys, gateway=GatewaySettings(port=0, auth_secret=SECRET)
    ) as s:
        alice, bob = sdk(s, token("alice")), sdk(s, token("bob"))
        with pytest.raises(openai.AuthenticationError):
            await sdk(s, "not-a-jwt").models.list()
        r = await alice.responses.create(model="default", input="mine", background=True)
        assert (await alice.responses.retrieve(r.id)).id == r.id
        with pytest.raises(openai.NotFoundError):
            await bob.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            await bob.responses.retrieve("resp_doesnotexist")
        with pytest.raises(openai.NotFoundError):
            await bob.responses.cancel(r.id)
        # The same Idempotency-Key is per owner: bob's request is his own generation.
        h = {"Idempotency-Key": "shared-key"}
        a = await alice.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "q"}], max_tokens=3, extra_headers=h
        )
        b = await bob.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "other"}], max_tokens=3, extra_headers=h
        )
        assert a.choices[0].message.content != b.choices[0].message.content
        # A WebSocket chat of alice with that id is the same request (one namespace per owner).
        c = await Client.connect(s.url.replace("/v1/ws", "/v1/ws"), token=token("alice"))
        _, _, _, errors = await collect(
            c.chat(messages=[{"role": "user", "content": "different"}], id="shared-key")
        )
        assert [e.code for e in errors] == ["idempotency_conflict"]
        await c.close()


@ON_BOTH
async def test_background_response_cut_mid_stream_resumes_exactly(server: Running) -> None:
    server.engine.reply_len = 40
    server.engine.step_s = 0.01
    client = sdk(server)
    r = await client.responses.create(
        model="default", instructions="be brief", input="tell me", background=True, max_output_tokens=30
    )
    assert r.status in ("queued", "in_progress") and r.background
    events = await client.responses.retrieve(r.id, stream=True)
    seen, last_seq = "", 0
    async for ev in events:
        if ev.type == "response.output_text.delta":
            seen += ev.delta
            last_seq = ev.sequence_number
            if last_seq >= 5:
                break  # the client drops mid-stream
    await events.close()
    rest, final = "", None
    async for ev in await client.responses.retrieve(r.id, stream=True, starting_after=last_seq):
        if ev.type == "response.output_text.delta":
            assert ev.sequence_number > last_seq
            rest += ev.delta
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert final is not None and final.status == "incomplete"
    assert seen + rest == final.output_text
    # The fake engine counts the instructions' message as reused: in the event and in the stored object.
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == 1
    done = await client.responses.retrieve(r.id)
    assert done.output_text == seen + rest and done.usage is not None and done.usage.output_tokens == 30
    assert (done.usage.input_tokens, done.usage.input_tokens_details.cached_tokens) == (2, 1)
    assert server.engine.requests_started == 1


async def test_cancel_works_and_works_twice(server: Running) -> None:
    server.engine.reply_len = 300
    server.engine.step_s = 0.02
    client = sdk(server)
    r = await client.responses.create(model="default", input="long", background=True, max_output_tokens=300)
    c1 = await client.responses.cancel(r.id)
    c2 = await client.responses.cancel(r.id)
    assert c1.status == c2.status == "cancelled"
    assert (await client.responses.retrieve(r.id)).status == "cancelled"
    finals = [
        ev async for ev in await client.responses.retrieve(r.id, stream=True) if ev.type == "response.failed"
    ]
    assert finals and finals[0].response.status == "cancelled"
    # A cancelled response has no conversation to continue: 404, as for an unknown id (SPEC §15.4).
    with pytest.raises(openai.NotFoundError) as ei:
        await client.responses.create(model="default", input="more", previous_response_id=r.id)
    assert ei.value.param == "previous_response_id"


async def test_previous_response_id_continues_the_conversation(server: Running) -> None:
    client = sdk(server)
    first = await client.responses.create(model="default", input="one", max_output_tokens=3)
    assert (
        first.status == "incomplete" and first.output_text == "re[1] one s" + first.output_text.split(" s")[1]
    )
    second = await client.responses.create(
        model="default", input="two", previous_response_id=first.id, instructions="sys", max_output_tokens=3
    )
    # The fake engine's first word counts the messages it saw: system + user + assistant + user.
    assert second.output_text.startswith("re[4] two")
    # "" continues nothing, as null does (SPEC §15.4; some SDKs send it for "none").
    alone = await client.responses.create(
        model="default", input="two", previous_response_id="", max_output_tokens=3
    )
    assert alone.output_text.startswith("re[1] two") and alone.previous_response_id is None


async def test_stream_without_key_is_cancelled_when_the_client_drops(server: Running) -> None:
    server.engine.reply_len = 300
    server.engine.step_s = 0.02
    client = sdk(server)
    stream = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "drop me"}], stream=True, max_tokens=300
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    await stream.close()
    owner = "http:" + hashlib.sha256(b"k-test").hexdigest()[:32]

    async def cancelled() -> None:
        while await _only_request_state(server, owner) != "cancelled":  # noqa: ASYNC110 (state in Redis)
            await asyncio.sleep(0.02)

    await asyncio.wait_for(cancelled(), 10)


async def _only_request_state(server: Running, owner: str) -> str | None:
    keys = [k async for k in server.store.r.scan_iter(match=server.store.keys.request(owner, "*"))]
    assert len(keys) == 1
    state = await server.store.r.hget(keys[0], "state")
    return state.decode() if state else None


def test_chat_frame_validation_is_shared() -> None:
    # The HTTP body becomes this very frame type: one set of rules for both doors.
    assert Chat(id="x", messages=(Message("user", "y"),), params=Params()).canonical()


async def test_a_kept_alive_api_connection_still_gets_health_answers(server: Running) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    assert head.startswith(b"HTTP/1.1 200")
    assert json.loads(await reader.readexactly(length))["object"] == "list"
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # same connection
    rest = await asyncio.wait_for(reader.read(), 10)  # answered, then closed
    writer.close()
    assert rest.startswith(b"HTTP/1.1 200") and rest.endswith(b"ok\n")


async def test_response_events_have_unique_increasing_sequence_numbers_and_resume_after_any(
    server: Running,
) -> None:
    server.engine.reply_len = 9
    client = sdk(server)
    r = await client.responses.create(model="default", input="count", background=True)
    while (await client.responses.retrieve(r.id)).status in ("queued", "in_progress"):  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    full = [ev async for ev in await client.responses.retrieve(r.id, stream=True)]
    seqs = [ev.sequence_number for ev in full]
    assert seqs[0] == 0 and all(a < b for a, b in itertools.pairwise(seqs))  # the replay from 0
    assert [ev.type for ev in full][-2:] == ["response.output_item.done", "response.completed"]
    whole = "".join(ev.delta for ev in full if ev.type == "response.output_text.delta")
    assert whole == (await client.responses.retrieve(r.id)).output_text
    for cut, ev in enumerate(full):
        before = "".join(e.delta for e in full[: cut + 1] if e.type == "response.output_text.delta")
        # The server resumes after N ...
        rest = [
            e
            async for e in await client.responses.retrieve(
                r.id, stream=True, starting_after=ev.sequence_number
            )
        ]
        assert [e.sequence_number for e in rest] == seqs[cut + 1 :]
        assert before + "".join(e.delta for e in rest if e.type == "response.output_text.delta") == whole
        # ... and the SDK's own resume (it reads from 0 and drops what is not after N) gets the rest too.
        async with client.responses.stream(response_id=r.id, starting_after=ev.sequence_number) as stream:
            got = [e async for e in stream]
            final = await stream.get_final_response()
        assert [e.sequence_number for e in got] == seqs[cut + 1 :]
        assert final.output_text == whole


async def test_starting_after_past_the_last_event_is_refused(server: Running) -> None:
    client = sdk(server)
    r = await client.responses.create(model="default", input="short", max_output_tokens=3)
    last = [ev async for ev in await client.responses.retrieve(r.id, stream=True)][-1].sequence_number
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.retrieve(r.id, stream=True, starting_after=last + 1)
    assert err.value.body["param"] == "starting_after"  # type: ignore[index]
    # Digits that are not ASCII: "\u00b2" passes str.isdigit() but not int() (a 500 before), "\u0661" was
    # read as 1.
    for digit in ("%C2%B2", "%D9%A1"):
        for stream in ("stream=true&", ""):
            status, _, body = await raw(
                server.port, "GET", f"/v1/responses/{r.id}?{stream}starting_after={digit}"
            )
            assert status == 400 and json.loads(body)["error"]["param"] == "starting_after", body


async def _params(server: Running, owner_key: str, id: str) -> dict[str, object]:
    owner = "http:" + hashlib.sha256(owner_key.encode()).hexdigest()[:32]
    view = await server.store.view(owner, id)
    assert view is not None
    return dict(view.payload["params"])


async def test_what_an_openai_client_sends_is_how_it_samples(server: Running) -> None:
    client = sdk(server)
    msgs = [{"role": "user", "content": "capital of France?"}]

    async def chat(key: str, **kw: object) -> dict[str, object]:
        await client.chat.completions.create(
            model="default",
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=2,
            extra_headers={"Idempotency-Key": key},
            **kw,  # type: ignore[arg-type]
        )
        return await _params(server, "k-test", key)

    # temperature 0 is plain greedy: the server's default penalties do not apply.
    greedy = await chat("t0", temperature=0)
    assert greedy["temperature"] == 0 and greedy["repetition_penalty"] == 1.0
    assert (greedy["frequency_penalty"], greedy["presence_penalty"]) == (0.0, 0.0)
    # One penalty sent: that one, the others off.
    assert (await chat("f", frequency_penalty=0.2))["repetition_penalty"] == 1.0
    # The penalties it sends are the ones it gets; metadata is accepted.
    sent = await chat(
        "pen",
        frequency_penalty=0.5,
        presence_penalty=0.25,
        metadata={"who": "me"},
        extra_body={"repetition_penalty": 1.3},
    )
    assert (sent["frequency_penalty"], sent["presence_penalty"], sent["repetition_penalty"]) == (
        0.5,
        0.25,
        1.3,
    )
    # A client that chooses nothing gets the server's defaults as a whole (the worker fills them in).
    none = await chat("none")
    assert not {"repetition_penalty", "frequency_penalty", "presence_penalty"} & set(none)
    # The same rule on the Responses API, over HTTP and over its WebSocket mode.
    r = await client.responses.create(model="default", input="x", temperature=0, max_output_tokens=2)
    assert (await _params(server, "k-test", r.id.removeprefix("resp_")))["repetition_penalty"] == 1.0
    async with client.responses.connect() as conn:
        await conn.response.create(model="default", input="x", temperature=0, max_output_tokens=2)
        async for ev in conn:
            if ev.type in ("response.completed", "response.incomplete"):
                rid = ev.response.id
                break
    assert (await _params(server, "k-test", rid.removeprefix("resp_")))["repetition_penalty"] == 1.0
    with pytest.raises(openai.BadRequestError) as ei:
        await chat("bad", frequency_penalty=3)
    assert ei.value.param == "frequency_penalty"


async def test_prompt_cache_key_is_checked_carried_and_routes(
    server: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenAI's ``prompt_cache_key`` (else its ``user``) reaches the worker with the request, on chat
    completions and on both Responses doors, and names the conversation for worker affinity (one owner's
    key, never another owner's); ``safety_identifier`` is accepted. A key that is not a short string is
    a 400 naming it, on every door, and nothing is generated."""
    routed: list[str] = []
    router = server.gateway.core.submitter.router
    prefer = router.prefer

    async def spy(place: str) -> str:
        routed.append(place)
        return await prefer(place)

    monkeypatch.setattr(router, "prefer", spy)
    client = sdk(server)
    owner = "http:" + hashlib.sha256(b"k-test").hexdigest()[:32]
    msgs = [{"role": "user", "content": "x"}]

    async def chat(key: str, **kw: object) -> object:
        await client.chat.completions.create(
            model="default",
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=2,
            extra_headers={"Idempotency-Key": key},
            **kw,  # type: ignore[arg-type]
        )
        view = await server.store.view(owner, key)
        assert view is not None
        return view.payload.get("reuse_key")

    assert await chat("c1", prompt_cache_key="conv-1") == "conv-1"
    assert routed[-1] == f"\0key\0{owner}\0conv-1"
    assert await chat("c2", user="end-user-7", safety_identifier="h-7") == "end-user-7"
    assert await chat("c3", user="end-user-7", prompt_cache_key="conv-2") == "conv-2"
    n = len(routed)
    assert await chat("c4") is None
    assert routed[n:] == []  # nothing to route by: the shared queue
    r = await client.responses.create(model="default", input="x", max_output_tokens=2, prompt_cache_key="r-1")
    view = await server.store.view(owner, r.id.removeprefix("resp_"))
    assert view is not None and view.payload["reuse_key"] == "r-1"
    assert (r.prompt_cache_key, r.user, r.safety_identifier) == ("r-1", None, None)  # echoed as sent
    r = await client.responses.create(model="default", input="x", max_output_tokens=2, user="u-2")
    assert (r.prompt_cache_key, r.user) == (None, "u-2")
    assert (await client.responses.retrieve(r.id)).user == "u-2"
    async with client.responses.connect() as conn:
        await conn.response.create(model="default", input="x", max_output_tokens=2, prompt_cache_key="w-1")
        async for ev in conn:
            if ev.type in ("response.completed", "response.incomplete"):
                rid = ev.response.id
                break
    view = await server.store.view(owner, rid.removeprefix("resp_"))
    assert view is not None and view.payload["reuse_key"] == "w-1"
    started = server.engine.requests_started
    for field, value in (("prompt_cache_key", 5), ("prompt_cache_key", "k" * 257), ("safety_identifier", [])):
        with pytest.raises(openai.BadRequestError) as ei:
            await chat(f"bad-{field}", extra_body={field: value})
        assert ei.value.param == field
    for field, value in (("prompt_cache_key", {}), ("user", 7)):
        with pytest.raises(openai.BadRequestError) as ei:
            await client.responses.create(model="default", input="x", extra_body={field: value})
        assert ei.value.param == field
    assert server.engine.requests_started == started
