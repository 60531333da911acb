"""WebSockets per gateway and per peer address are capped (SPEC §2.1): past a cap the handshake is
refused 429 (this address) or 503 (the gateway), with Retry-After; both doors count together, and a
closed WebSocket gives its place back."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from server import metrics
from server.gateway.settings import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import running_server

SUB = ["tokenwire.v1.msgpack"]


async def _open(url: str) -> ClientConnection:
    return await connect(url, subprotocols=SUB)  # type: ignore[arg-type]


async def _refused(url: str) -> tuple[int, str | None, str]:
    with pytest.raises(InvalidStatus) as exc:
        await _open(url)
    r = exc.value.response
    return r.status_code, r.headers.get("Retry-After"), r.body.decode() if r.body else ""


async def _gave_back(server_caps: object, total: int) -> None:
    for _ in range(100):  # the handler's end (which gives the place back) follows the close shortly
        if server_caps.total == total:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"caps hold {server_caps.total}, expected {total}")


async def test_one_address_gets_429_past_its_cap_and_its_place_back_on_close(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, max_ws_connections_per_peer=2)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        a, b = await _open(server.url), await _open(server.url)
        before = metrics.WS_REFUSED.labels("peer")._value.get()
        status, retry, text = await _refused(server.url)
        assert (status, retry) == (429, "1") and "too many WebSockets from this address" in text
        assert metrics.WS_REFUSED.labels("peer")._value.get() == before + 1
        await a.close()
        await _gave_back(server.gateway.ws_caps, 1)
        c = await _open(server.url)  # the place came back
        await b.close()
        await c.close()
        await _gave_back(server.gateway.ws_caps, 0)


async def test_a_full_gateway_answers_503_for_both_doors_together(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, max_ws_connections=2, max_ws_connections_per_peer=0)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        responses = server.url.replace("/v1/ws", "/v1/responses")
        a = await _open(server.url)
        b = await connect(responses)  # the Responses WebSocket door counts against the same cap
        for url in (server.url, responses):
            with pytest.raises(InvalidStatus) as exc:
                await connect(url, subprotocols=SUB if url == server.url else None)  # type: ignore[arg-type]
            assert exc.value.response.status_code == 503
            assert exc.value.response.headers.get("Retry-After") == "1"
        await b.close()
        await _gave_back(server.gateway.ws_caps, 1)
        c = await connect(responses)
        await asyncio.gather(a.close(), c.close())
        await _gave_back(server.gateway.ws_caps, 0)


async def test_a_refused_handshake_holds_no_place(redis: aioredis.Redis, redis_url: str, keys: Keys) -> None:
    gw = GatewaySettings(port=0, max_ws_connections_per_peer=1)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        with pytest.raises(InvalidStatus):
            await connect(server.url, subprotocols=["chat"])  # type: ignore[list-item]  # 400: not counted
        assert server.gateway.ws_caps.total == 0
        a = await _open(server.url)
        assert (await _refused(server.url))[0] == 429  # refused past the cap: not counted either
        assert server.gateway.ws_caps.total == 1
        await a.close()
        await _gave_back(server.gateway.ws_caps, 0)
