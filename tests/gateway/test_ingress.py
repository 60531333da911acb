"""Reading is paced per connection and per peer address, and a WebSocket that floods is closed (issue 24):
SPEC §2.2. The pace itself runs on a fake clock; the close runs against a real gateway."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from protocol import MSGPACK_SUBPROTOCOL, Chat, Hello, Params, codec_for
from server.gateway.ingress import START_CREDIT, Ingress
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import running_server

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_connection_reads_its_start_credit_then_at_its_rate() -> None:
    clock = Clock()
    ingress = Ingress(per_connection=2 * MiB, per_peer=0, flood_close_s=0, clock=clock)
    p = ingress.open("10.0.0.1")
    assert p.take(START_CREDIT) == 0.0
    # 1 MiB more at 2 MiB/s: half a second of debt to wait out.
    assert p.take(MiB) == pytest.approx(0.5)
    clock.t += 0.5
    assert p.take(MiB) == pytest.approx(0.5)  # still in step with the pace: it waited exactly that
    clock.t += 10  # quiet for a while: the budget refills up to its burst (twice the rate), no further
    assert p.take(4 * MiB) == 0.0
    assert p.take(MiB) == pytest.approx(0.5)


def test_a_connection_held_back_too_long_in_a_row_is_told_to_close() -> None:
    clock = Clock()
    ingress = Ingress(per_connection=2 * MiB, per_peer=0, flood_close_s=1.0, clock=clock)
    p = ingress.open("10.0.0.1")
    waits = []
    for _ in range(4):  # 1 MiB frames back to back, each read once the last one's wait is over
        w = p.take(MiB)
        waits.append(w)
        if w is None:
            break
        clock.t += w + 0.2  # its wait, then handling it takes a while: the next one was waiting anyway
        p.done()
    # Held back from the first frame on (its handling refills 0.4 MiB of the second's debt): the third
    # would be read more than a second after that.
    assert waits[:2] == [pytest.approx(0.5 - START_CREDIT / (2 * MiB)), pytest.approx(0.3)]
    assert waits[2] is None


def test_a_connection_that_keeps_under_its_pace_is_never_closed() -> None:
    clock = Clock()
    ingress = Ingress(per_connection=2 * MiB, per_peer=0, flood_close_s=1.0, clock=clock)
    p = ingress.open("10.0.0.1")
    for _ in range(50):  # 1 MiB every 0.67 s (1.5 MiB/s), under 2 MiB/s: a gap after each wait
        w = p.take(MiB)
        assert w is not None and w < 0.5
        clock.t += w
        p.done()
        clock.t += 0.67 - w


def test_connections_of_one_peer_share_its_pace_and_only_their_own_closes_them() -> None:
    clock = Clock()
    ingress = Ingress(per_connection=2 * MiB, per_peer=4 * MiB, flood_close_s=1.0, clock=clock)
    many = [ingress.open("10.0.0.1") for _ in range(8)]
    other = ingress.open("10.0.0.2")
    # Eight connections each within their own start credit, 8 x 64 KiB, then 4 MiB more between them:
    # the peer's budget (4 MiB, twice its rate, at first) is spent, whatever each connection's own.
    for p in many:
        assert p.take(START_CREDIT) == 0.0
    assert max(p.take(MiB // 2) or 0 for p in many) > 0
    quiet = ingress.open("10.0.0.1")
    wait = quiet.take(100)
    assert wait is not None and wait > 0  # a new connection of that peer waits for the peer's debt...
    for _ in range(20):
        clock.t += 0.2
        assert quiet.take(100) is not None  # ...but is never closed for it: its own pace is untouched
    assert other.take(START_CREDIT) == 0.0  # another address is not affected
    assert ingress.peers == 2
    for p in [*many, quiet, quiet]:  # closing twice is harmless
        p.close()
    assert ingress.peers == 1
    other.close()
    assert ingress.peers == 0


async def test_a_websocket_sending_max_size_frames_back_to_back_is_closed_1008(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    async with running_server(redis, redis_url, keys, gateway=GatewaySettings(port=0)) as srv:
        codec = codec_for(MSGPACK_SUBPROTOCOL)
        big = codec.encode(Chat(id="big", content="x" * 900_000, params=Params(max_tokens=4)).to_wire())
        async with connect(srv.url, subprotocols=[MSGPACK_SUBPROTOCOL], max_size=None) as ws:  # type: ignore[list-item]
            await ws.send(codec.encode(Hello().to_wire()))
            started = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                async with asyncio.timeout(20):
                    while True:  # as fast as the socket takes them (the answers are not read)
                        await ws.send(big)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 1008
            assert "faster than the server reads" in closed.value.rcvd.reason
            # Held back from its first frame past the start credit on, one second of that closes it,
            # and the client hears of it at once: not after websockets' 10 s closing handshake timeout.
            assert time.monotonic() - started < 9
        # The gateway is fine, and the next connection (the same address) is served at once.
        async with connect(srv.url, subprotocols=[MSGPACK_SUBPROTOCOL]) as ws:  # type: ignore[list-item]
            await ws.send(codec.encode(Hello().to_wire()))
            assert codec.decode(await asyncio.wait_for(ws.recv(), 5))["type"] == "welcome"
            assert srv.gateway.core.admission.ingress.peers == 1
        for _ in range(100):  # the address's shared pace goes with its last connection (within 5 s)
            if not srv.gateway.core.admission.ingress.peers:
                break
            await asyncio.sleep(0.05)
        assert srv.gateway.core.admission.ingress.peers == 0


def test_small_frames_between_big_ones_do_not_hide_a_flood_nor_close_a_chatty_client() -> None:
    clock = Clock()
    ingress = Ingress(per_connection=2 * MiB, per_peer=0, flood_close_s=1.0, clock=clock)
    flood = ingress.open("10.0.0.1")
    # The flood's pattern: two big frames and a resume, back to back. Each big frame's wait repays the
    # debt exactly, so the small one after it finds the budget at zero: still the same run.
    verdicts = []
    for i in range(12):
        w = flood.take(MiB if i % 3 else 40)
        verdicts.append(w)
        if w is None:
            break
        clock.t += w + 0.001
        flood.done()
    assert verdicts[-1] is None and len(verdicts) <= 6
    chatty = ingress.open("10.0.0.2")
    for _ in range(2000):  # 200 small frames a second, back to back, for 10 s: never held back
        w = chatty.take(200)
        assert w == 0.0
        clock.t += 0.005
        chatty.done()
