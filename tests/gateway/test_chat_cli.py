"""``tokenwire chat`` rides out dropped connections: it reconnects with its session token, resumes the
reply at the offset it has printed, and the printed text equals an undisturbed reply."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from protocol import Params
from server.chat_cli import (
    ChatSession,
    _apply_set,
    _settings_text,
    config_url,
    fetch_server_defaults,
    run_chat,
)
from server.defaults import sampling_defaults
from server.store.keys import Keys
from tests.gateway.conftest import running_server
from tests.gateway.proxy import DropProxy


async def test_chat_resumes_the_reply_after_drops(redis: aioredis.Redis, redis_url: str, keys: Keys) -> None:
    async with running_server(redis, redis_url, keys) as server:
        server.engine.step_s = 0.01
        server.engine.reply_len = 120
        params = Params(max_tokens=100, seed=7, cache=False)

        calm: list[str] = []
        quiet = ChatSession(server.url, write=calm.append, notice=lambda _: None)
        assert await quiet.ask("tell me a long story", params)
        await quiet.close()

        proxy = DropProxy(server.port)
        port = await proxy.start()
        rough: list[str] = []
        reached = {10: asyncio.Event(), 50: asyncio.Event()}

        def write(text: str) -> None:
            rough.append(text)
            for n, ev in reached.items():
                if len(rough) >= n:
                    ev.set()

        notices: list[str] = []
        session = ChatSession(f"ws://127.0.0.1:{port}/v1/ws", write=write, notice=notices.append)

        async def drop_when(chunks: int) -> None:
            await reached[chunks].wait()
            assert session.client is not None
            assert proxy.drop(session.client.ws.transport.get_extra_info("sockname")[1])

        try:
            dropper = asyncio.gather(drop_when(10), drop_when(50))  # the second after the reconnect
            assert await asyncio.wait_for(session.ask("tell me a long story", params), 60)
            await asyncio.wait_for(dropper, 10)
        finally:
            await session.close()
            await proxy.stop()
        assert session.reconnects == 2 and any("connection lost" in n for n in notices)
        assert "".join(rough) == "".join(calm) and len(calm) > 60


async def test_chat_reports_a_server_error_and_goes_on(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    async with running_server(redis, redis_url, keys) as server:
        out: list[str] = []
        notices: list[str] = []
        session = ChatSession(server.url, write=out.append, notice=notices.append)
        try:
            assert not await session.ask("", Params(max_tokens=0))  # invalid: bad_frame, no reply
            assert notices and "[error" in notices[-1]
            assert await session.ask("hello", Params(max_tokens=5))  # the same connection still chats
        finally:
            await session.close()
        assert "".join(out).strip()


async def test_chat_settings_show_the_server_defaults_and_set_checks_ranges_at_once(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    """/settings shows the values the server applies (its /config.json), not "server default"; /set
    refuses a value out of SPEC's range when it is typed, not with the next send (issue 29)."""
    async with running_server(redis, redis_url, keys) as server:
        session = ChatSession(server.url, write=lambda _: None, notice=lambda _: None)
        try:
            await session.connect()
            session.server_defaults = await fetch_server_defaults(server.url)
            defaults = sampling_defaults()
            assert {k: session.server_defaults[k] for k in defaults} == defaults
            text = _settings_text(session, Params(max_tokens=7))
            assert "max_tokens         7\n" in text
            assert f"temperature        {defaults['temperature']} (server default)" in text
        finally:
            await session.close()
    params = Params()
    params, said = _apply_set(params, ["temperature", "9"])
    assert params.temperature is None and "temperature" in said and "(unchanged)" in said
    params, said = _apply_set(params, ["top_p", "0"])
    assert params.top_p is None and "(unchanged)" in said
    params, said = _apply_set(params, ["temperature", "0.7"])
    assert params.temperature == 0.7 and said == "temperature = 0.7"
    # A server that does not answer /config.json: the settings say "server default" as before.
    assert await fetch_server_defaults("ws://127.0.0.1:9/v1/ws") == {}
    assert config_url("wss://chat.example.com/v1/ws") == "https://chat.example.com/config.json"


async def test_chat_once_says_the_flag_for_more_tokens(
    redis: aioredis.Redis, redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """In -m mode there is no /set: the max-tokens notice names the flag."""
    async with running_server(redis, redis_url, keys) as server:
        assert await run_chat(server.url, once="hello", max_tokens=2) == 0
    err = capsys.readouterr().err
    assert "max tokens reached (2); --max-tokens N for more" in err and "/set" not in err


async def test_chat_says_when_the_context_window_ended_a_reply(
    redis: aioredis.Redis, redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """A length ended by the context window (done.length_reason "context") does not advise more tokens,
    which would give none: it says the window is full and what to do instead."""
    async with running_server(redis, redis_url, keys) as server:
        server.engine.context = 4  # one prompt token, three of completion
        assert await run_chat(server.url, once="hello", max_tokens=50) == 0
    err = capsys.readouterr().err
    assert "[the model's context window is full after 3 tokens; send a shorter message]" in err
    assert "max tokens reached" not in err
