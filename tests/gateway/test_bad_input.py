"""Every invalid golden vector, sent over a real socket, gets its documented error; the connection stays
usable and then completes a normal chat. Abuse closes the connection with the right code."""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from protocol import Error, Hello, Params, Ping, Pong
from server.client import Client, collect
from tests.gateway.conftest import Running

VECTORS = json.loads(resources.files("protocol").joinpath("vectors", "frames.json").read_text())["invalid"]


def _payload(v: dict[str, str]) -> bytes | str:
    return bytes.fromhex(v["data_hex"]) if "data_hex" in v else v["data_text"]


@pytest.mark.parametrize("subprotocol", ["tokenwire.v1.msgpack", "tokenwire.v1.json"])
async def test_invalid_vectors_get_their_error_and_the_connection_still_chats(
    server: Running, subprotocol: str
) -> None:
    c = await Client.connect(server.url, subprotocol=subprotocol)
    cases = [v for v in VECTORS if v["subprotocol"] == subprotocol and v["expected_code"] == "bad_frame"]
    assert len(cases) >= 20
    for v in cases:
        await c.send_raw(_payload(v), encode=False)
        err = await c.recv()
        assert isinstance(err, Error), v["name"]
        assert err.code == v["expected_code"], (v["name"], err)
        if v["expect_id"] is not None:
            assert err.id == v["expect_id"], v["name"]
        # A valid frame in between keeps the consecutive-bad-frame counter from closing the connection.
        await c.send(Ping(ts=1))
        assert await c.recv() == Pong(ts=1)
    text, _, done, errors = await collect(c.chat("still here?"))
    assert errors == [] and done is not None and text.startswith("re[1] still here?")
    await c.close()


@pytest.mark.parametrize("v", VECTORS, ids=[f"{v['subprotocol'][13:]}-{v['name']}" for v in VECTORS])
async def test_each_bad_input_leaves_the_server_serving(server: Running, v: dict[str, str]) -> None:
    """The named table: each bad input gets its documented error (or close code), and afterwards a
    normal chat on a fresh connection works."""
    c = await Client.connect(server.url, subprotocol=v["subprotocol"])
    await c.send_raw(_payload(v), encode=False)
    err = await c.recv()
    assert isinstance(err, Error) and err.code == v["expected_code"], (v["name"], err)
    if v["expected_code"] == "unsupported_version":
        with pytest.raises(ConnectionClosed) as exc:
            await c.recv()
        assert exc.value.rcvd is not None and exc.value.rcvd.code == 1002
    await c.ws.close()
    fresh = await Client.connect(server.url, subprotocol=v["subprotocol"])
    _, _, done, errors = await collect(fresh.chat("fine?", params=Params(max_tokens=2)))
    assert errors == [] and done is not None and done.offset == 2
    await fresh.close()


async def test_unsupported_version_closes_1002(server: Running) -> None:
    c = await Client.connect(server.url, hello=False)
    await c.send(Hello(v=2))
    err = await c.recv()
    assert isinstance(err, Error) and err.code == "unsupported_version"
    with pytest.raises(ConnectionClosed) as exc:
        await c.recv()
    assert exc.value.rcvd is not None and exc.value.rcvd.code == 1002


async def test_sixteen_bad_frames_in_a_row_close_1008(server: Running) -> None:
    c = await Client.connect(server.url)
    for _ in range(16):
        await c.send_raw(b"\xc1", encode=False)
    codes = []
    with pytest.raises(ConnectionClosed) as exc:
        while True:
            f = await c.recv()
            assert isinstance(f, Error)
            codes.append(f.code)
    assert codes == ["bad_frame"] * 16
    assert exc.value.rcvd is not None and exc.value.rcvd.code == 1008


async def test_frames_sent_past_the_closing_one_do_not_hold_up_the_close(server: Running) -> None:
    # 40 bad frames at once: the server closes after the 16th, and the rest sit ahead of the client's
    # close reply. They are dropped unread (SPEC §7) while the close goes on; before, the server stopped
    # reading and waited its whole close timeout (10 s) for a reply it could not reach.
    c = await Client.connect(server.url)
    for _ in range(40):
        await c.send_raw(b"\xc1", encode=False)

    async def until_closed() -> None:
        while True:
            await c.recv()

    with pytest.raises(ConnectionClosed) as exc:
        await asyncio.wait_for(until_closed(), 5)  # closed at once, not by a 10 s timeout's abort
    assert exc.value.rcvd is not None and exc.value.rcvd.code == 1008


async def test_oversize_message_closes_1009(server: Running) -> None:
    limit = server.gateway.settings.max_frame_bytes
    async with connect(server.url, subprotocols=["tokenwire.v1.msgpack"]) as ws:  # type: ignore[list-item]
        await ws.send(b"\x00" * (limit + 1))
        with pytest.raises(ConnectionClosed) as exc:
            await ws.recv()
        assert exc.value.rcvd is not None and exc.value.rcvd.code == 1009


async def test_chat_before_hello_is_refused_then_hello_works(server: Running) -> None:
    c = await Client.connect(server.url, hello=False)
    await c.send_raw({"type": "chat", "id": "early", "content": "hi"})
    err = await c.recv()
    assert isinstance(err, Error) and (err.code, err.id) == ("bad_frame", "early")
    await c.send(Hello())
    welcome = await c.recv()
    assert welcome.type == "welcome"
    _, _, done, _ = await collect(c.chat("now", id="late"))
    assert done is not None
    await c.close()


async def test_a_socket_that_never_says_hello_is_closed_1008(redis: Any, redis_url: str, keys: Any) -> None:
    """A socket that sends nothing (or anything but hello) for hello_timeout_s is closed with 1008: it
    would otherwise hold a connection and its read-ahead for ever."""
    from server.gateway.server import GatewaySettings
    from tests.gateway.conftest import running_server

    async with running_server(
        redis, redis_url, keys, gateway=GatewaySettings(port=0, hello_timeout_s=0.5)
    ) as s:
        c = await Client.connect(s.url, hello=False)
        await c.send_raw({"type": "ping"})
        with pytest.raises(ConnectionClosed) as closed:
            for _ in range(10):
                await asyncio.wait_for(c.recv(), 5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        ok = await Client.connect(s.url)  # one that says hello in time is kept past the deadline
        await asyncio.sleep(0.8)
        await ok.send(Ping(ts=7))
        pong = await asyncio.wait_for(ok.recv(), 5)
        assert isinstance(pong, Pong) and pong.ts == 7
        await ok.close()


async def test_cancels_past_the_connection_rate_are_refused_before_the_store(server: Running) -> None:
    c = await Client.connect(server.url)
    codes = []
    for i in range(600):
        await c.send_raw({"type": "cancel", "id": f"nope-{i}"})
    for _ in range(600):
        f = await asyncio.wait_for(c.recv(), 10)
        codes.append(getattr(f, "code", None))
    assert codes.count("rate_limited") > 0 and codes.count("not_found") > 0  # SPEC §6
    assert set(codes) == {"rate_limited", "not_found"}
    await c.close()
