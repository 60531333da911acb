"""`ping.ts` is any finite number (SPEC §4.5) a frame can carry, echoed unchanged in `pong` over the real
gateway: every msgpack integer (int64 and uint64, so 2^64-1 too) and every finite float."""

from __future__ import annotations

import pytest

from protocol import Error, ErrorCode, Pong
from protocol.codec import JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL
from server.client import Client
from tests.gateway.conftest import Running

FINITE = [2**64 - 1, 2**63, 2**63 - 1, -(2**63), 0, -1, 1.5, -1.7976931348623157e308, 5e-324, 1e308]


@pytest.mark.parametrize("subprotocol", [MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL])
async def test_ping_ts_of_any_finite_number_is_echoed(server: Running, subprotocol: str) -> None:
    c = await Client.connect(server.url, subprotocol=subprotocol)
    for ts in FINITE:
        await c.send_raw({"type": "ping", "ts": ts})
        pong = await c.recv()
        assert isinstance(pong, Pong) and pong.ts == ts and type(pong.ts) is type(ts), (ts, pong)
    await c.close()


async def test_ping_ts_beyond_what_msgpack_carries_is_a_bad_frame(server: Running) -> None:
    # JSON can spell integers msgpack cannot hold (and so no pong could carry): refused, connection open.
    c = await Client.connect(server.url, subprotocol=JSON_SUBPROTOCOL)
    for text in ('{"type":"ping","ts":18446744073709551616}', '{"type":"ping","ts":-9223372036854775809}'):
        await c.send_raw(text, encode=False)
        err = await c.recv()
        assert isinstance(err, Error) and err.code == ErrorCode.BAD_FRAME, (text, err)
    await c.send_raw({"type": "ping", "ts": 1})
    assert await c.recv() == Pong(ts=1)
    await c.close()
