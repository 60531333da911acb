"""The official ``openai`` SDK against a real ``tokenwire serve`` (tiny Llama, real engine), on the same
port as the WebSocket. The response cache is off, so every equal text here was generated, not replayed."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import jwt
import openai
import pytest
from openai import AsyncOpenAI

from protocol import Params
from server.client import Client, collect
from tests.conftest import delete_prefix
from tests.e2e.serve_process import ServeProcess


@pytest.fixture(scope="module")
def served(peaky_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    # One server for the module's tests (a start is about 3 s); each test's requests are its own.
    tmp_path = tmp_path_factory.mktemp("e2e-http")
    prefix = f"twtest:e2e-http:{tmp_path.name}:"
    p = ServeProcess(
        [
            "--model",
            str(peaky_model_dir),
            "--redis-url",
            redis_url,
            "--key-prefix",
            prefix,
            "--no-response-cache",
        ],
        tmp_path,
    )
    try:
        yield p.start()
    finally:
        assert p.stop() == 0, p.stderr_path.read_text()[-2000:]
        delete_prefix(redis_url, prefix)


@pytest.fixture
async def client(served: str) -> AsyncIterator[AsyncOpenAI]:
    base = served.replace("ws://", "http://").removesuffix("/ws")
    c = AsyncOpenAI(base_url=base, api_key="e2e", max_retries=0)
    yield c
    await c.close()


def generations_started(ws_url: str) -> int:
    """The worker's count of requests it started (each a generation): queue-wait observations."""
    url = ws_url.replace("ws://", "http://").replace("/v1/ws", "/metrics")
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^tokenwire_queue_wait_seconds_count (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


async def test_models_lists_the_served_model(client: AsyncOpenAI, peaky_model_dir: Path) -> None:
    ids = [m.id for m in (await client.models.list()).data]
    assert ids == [peaky_model_dir.name, "default"]


async def test_chat_stream_and_plain_agree_and_the_seed_decides(client: AsyncOpenAI, served: str) -> None:
    msgs = [{"role": "user", "content": "The capital of France"}]
    plain = await client.chat.completions.create(
        model="default",
        messages=msgs,
        max_tokens=24,
        temperature=0.9,
        seed=7,  # type: ignore[arg-type]
    )
    stream = await client.chat.completions.create(
        model="default",
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0.9,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        elif chunk.usage is not None:
            usage = chunk.usage
    assert plain.choices[0].message.content == text and text
    assert finish == plain.choices[0].finish_reason
    assert usage is not None and plain.usage is not None
    assert usage.completion_tokens == plain.usage.completion_tokens > 0
    assert usage.prompt_tokens == plain.usage.prompt_tokens > 0
    other = await client.chat.completions.create(
        model="default",
        messages=msgs,
        max_tokens=24,
        temperature=0.9,
        seed=8,  # type: ignore[arg-type]
    )
    assert other.choices[0].message.content != text
    # The WebSocket on the same port gives the same text for the same request (an OpenAI call that sets
    # temperature samples without the server's default penalties, SPEC §15.2).
    c = await Client.connect(served)
    params = Params(max_tokens=24, temperature=0.9, seed=7, repetition_penalty=1.0, frequency_penalty=0.0)
    ws_text, _, done, errors = await collect(c.chat(messages=msgs, params=params))
    await c.close()
    assert errors == [] and done is not None and ws_text == text


async def test_stop_strings_cut_the_text(client: AsyncOpenAI) -> None:
    msgs = [{"role": "user", "content": "Hello, how are you today?"}]
    full = await client.chat.completions.create(model="default", messages=msgs, max_tokens=40, temperature=0)  # type: ignore[arg-type]
    text = full.choices[0].message.content or ""
    assert len(text) > 8
    stop = text[4:7]
    cut = await client.chat.completions.create(
        model="default",
        messages=msgs,
        max_tokens=40,
        temperature=0,
        stop=[stop, "zzzzzz"],  # type: ignore[arg-type]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


async def test_idempotent_retry_while_streaming_is_one_generation(client: AsyncOpenAI, served: str) -> None:
    before = generations_started(served)
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 64,
    }
    key = {"Idempotency-Key": "story-1"}
    first = await client.chat.completions.create(**body, stream=True, extra_headers=key)  # type: ignore[call-overload]
    head = ""
    async for chunk in first:
        head += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if len(head) >= 3:
            break
    await first.close()  # dropped mid-stream: with a key, the generation goes on
    retry = await client.chat.completions.create(**body, stream=True, extra_headers=key)  # type: ignore[call-overload]
    text = "".join([c.choices[0].delta.content or "" async for c in retry if c.choices])
    assert text.startswith(head)
    plain = await client.chat.completions.create(**body, extra_headers=key)  # type: ignore[call-overload]
    assert plain.choices[0].message.content == text
    assert generations_started(served) == before + 1
    with pytest.raises(openai.ConflictError):
        await client.chat.completions.create(**{**body, "max_tokens": 65}, extra_headers=key)  # type: ignore[call-overload]


async def test_background_response_resumes_after_a_cut(client: AsyncOpenAI) -> None:
    r = await client.responses.create(
        model="default", input="Say something long", background=True, max_output_tokens=60, temperature=0
    )
    seen, seq = "", 0
    events = await client.responses.retrieve(r.id, stream=True)
    async for ev in events:
        if ev.type == "response.output_text.delta":
            seen += ev.delta
            seq = ev.sequence_number
            if seq >= 10:
                break
    await events.close()
    rest, final = "", None
    async for ev in await client.responses.retrieve(r.id, stream=True, starting_after=seq):
        if ev.type == "response.output_text.delta":
            rest += ev.delta
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert final is not None and final.output_text == seen + rest
    again = await client.responses.retrieve(r.id)
    assert again.output_text == seen + rest and again.status in ("completed", "incomplete")
    ref = await client.responses.create(
        model="default", input="Say something long", max_output_tokens=60, temperature=0
    )
    assert ref.output_text == seen + rest


async def test_bad_auth_and_bodies_do_not_hurt_the_server(
    peaky_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    prefix = f"twtest:e2e-http-auth:{tmp_path.name}:"
    p = ServeProcess(
        [
            "--model",
            str(peaky_model_dir),
            "--redis-url",
            redis_url,
            "--key-prefix",
            prefix,
            "--auth-secret",
            "s" * 32,
        ],
        tmp_path,
    )
    url = p.start()
    base = url.replace("ws://", "http://").removesuffix("/ws")
    try:
        for key in ("", "nope", "a.b.c"):
            c = AsyncOpenAI(base_url=base, api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}])
            await c.close()
        # A bad JSON body with a good token: 400, and the server goes on serving both doors.
        tok = jwt.encode({"sub": "u", "exp": int(time.time()) + 60}, "s" * 32, algorithm="HS256")
        good = AsyncOpenAI(base_url=base, api_key=tok, max_retries=0)
        with pytest.raises(openai.BadRequestError):
            await good.chat.completions.create(model="default", messages="not a list")  # type: ignore[arg-type]
        r = await good.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], max_tokens=3
        )
        await good.close()
        assert r.usage is not None and r.usage.completion_tokens > 0
        ws = await Client.connect(url, token=tok)
        _, _, done, errors = await collect(ws.chat("hi", params=Params(max_tokens=3)))
        await ws.close()
        assert errors == [] and done is not None
    finally:
        assert p.stop() == 0, p.stderr_path.read_text()[-2000:]
        delete_prefix(redis_url, prefix)
