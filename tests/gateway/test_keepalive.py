"""The server's WebSocket keepalive (SPEC §13, server/gateway/keepalive.py): a client that talks is never
pinged; one quiet for the ping interval is, and is closed with 1011 when it does not answer.

The client here is a raw socket, so that it answers a Ping control frame only when the test says so
(websockets' client, like a browser, always does)."""

from __future__ import annotations

import asyncio
import struct
import time
from types import SimpleNamespace

import msgpack
import redis.asyncio as aioredis
from prometheus_client import REGISTRY
from pytest import MonkeyPatch
from websockets.protocol import State

from server.gateway import keepalive
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import running_server
from tests.gateway.raw_ws import BINARY, CLOSE, PING, PONG, RawClient

INTERVAL_S = 1.5  # long against any stall of the test's event loop, which also runs the gateway


async def test_a_talking_client_is_not_pinged_a_quiet_one_is_and_is_closed_if_it_does_not_answer(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    before = {o: _pings(o) for o in ("pong", "timeout")}
    gw = GatewaySettings(port=0, ping_interval_s=INTERVAL_S)
    async with running_server(redis, redis_url, keys, gateway=gw) as s:
        c = await RawClient.connect(s.port)
        c.send_frame({"type": "hello", "v": 1})
        opcode, data = await c.recv()
        assert opcode == BINARY and msgpack.unpackb(data)["type"] == "welcome"

        # Talking (an application ping every 0.1 s) for twice the interval: only pongs come back, no Ping
        # control frame, though this client would never answer one (websockets' own keepalive pinged
        # it after one interval and closed it after two).
        talk_until = time.monotonic() + 2 * INTERVAL_S
        n = 0
        while time.monotonic() < talk_until:
            n += 1
            c.send_frame({"type": "ping", "ts": n})
            opcode, data = await asyncio.wait_for(c.recv(), 5)
            assert (opcode, msgpack.unpackb(data)) == (BINARY, {"type": "pong", "ts": n})
            await asyncio.sleep(0.1)
        last_sent = time.monotonic()

        # Quiet: a Ping comes once the interval has passed since it last sent anything; answered, the
        # connection lives on.
        opcode, data = await asyncio.wait_for(c.recv(), 10 * INTERVAL_S)
        assert opcode == PING
        assert time.monotonic() - last_sent >= 0.9 * INTERVAL_S
        c.send(PONG, data)
        answered = time.monotonic()

        # Quiet again and not answering: pinged once more, then closed with 1011 after the timeout.
        opcode, data = await asyncio.wait_for(c.recv(), 10 * INTERVAL_S)
        assert opcode == PING
        assert time.monotonic() - answered >= 0.9 * INTERVAL_S
        opcode, data = await asyncio.wait_for(c.recv(), 10 * INTERVAL_S)
        assert opcode == CLOSE
        assert struct.unpack("!H", data[:2])[0] == 1011 and data[2:] == b"keepalive ping timeout"
        c.writer.close()
    # /metrics counts both: one answered, one not (a peer gone without a close, as far as the server knows).
    assert {o: _pings(o) - before[o] for o in before} == {"pong": 1, "timeout": 1}


def _pings(outcome: str) -> float:
    return REGISTRY.get_sample_value("tokenwire_keepalive_pings_total", {"outcome": outcome}) or 0.0


async def test_the_responses_websocket_is_pinged_when_quiet_too(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, ping_interval_s=INTERVAL_S)
    async with running_server(redis, redis_url, keys, gateway=gw) as s:
        c = await RawClient.connect(s.port, "/v1/responses")
        opened = time.monotonic()
        opcode, data = await asyncio.wait_for(c.recv(), 10 * INTERVAL_S)
        assert opcode == PING and time.monotonic() - opened >= 0.9 * INTERVAL_S
        c.send(PONG, data)
        c.writer.close()


class _Fake:
    """What sweep_once reads of a connection, and the ping it starts."""

    def __init__(
        self,
        heard_ago: float,
        state: State = State.OPEN,
        pinging: bool = False,
        deadline_in: float | None = None,
    ) -> None:
        now = asyncio.get_running_loop().time()
        self.heard_at = now - heard_ago
        self.protocol = SimpleNamespace(state=state)
        self.keepalive_task: object = object() if pinging else None
        self.close_deadline = None if deadline_in is None else now + deadline_in
        self.aborted = 0
        self.transport = SimpleNamespace(abort=self._abort)
        self.pinged = 0

    def _abort(self) -> None:
        self.aborted += 1

    async def ping_once(self, pong_within_s: float) -> None:
        self.pinged += 1


async def test_a_sweep_pings_only_open_quiet_connections_not_already_pinged(monkeypatch: MonkeyPatch) -> None:
    monkeypatch.setattr(keepalive, "SWEEP_CHUNK", 2)  # yields to the loop mid-sweep: every one still seen
    quiet, talking, closing, pinging = _Fake(25), _Fake(3), _Fake(25, State.CLOSING), _Fake(25, pinging=True)
    conns = [quiet, talking, closing, pinging, _Fake(20)]
    assert await keepalive.sweep_once(conns, 20, 20) == 2  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert [c.pinged for c in conns] == [1, 0, 0, 0, 1]
    assert await keepalive.sweep_once(conns, 20, 20) == 0  # type: ignore[arg-type]  # their pings are on


async def test_a_sweep_aborts_a_connection_still_closing_past_its_close_deadline() -> None:
    # websockets checks the deadline only in a send or a close: a peer that sent its close frame and keeps
    # its end of the TCP connection, while the door waits for a frame, was held for ever.
    late = _Fake(1, State.CLOSING, deadline_in=-0.5)
    in_time, no_deadline = _Fake(1, State.CLOSING, deadline_in=5), _Fake(1, State.CLOSING)
    open_late = _Fake(1, deadline_in=-0.5)  # open: a deadline left from nothing it cares about
    conns = [late, in_time, no_deadline, open_late]
    assert await keepalive.sweep_once(conns, 20, 20) == 0  # type: ignore[arg-type]
    assert [c.aborted for c in conns] == [1, 0, 0, 0]


async def test_a_failing_sweep_does_not_end_the_keepalive() -> None:
    calls = []
    quiet = _Fake(25)

    def connections() -> list[_Fake]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return [quiet]

    task = asyncio.create_task(keepalive.sweep(connections, 0.04, 1))  # type: ignore[arg-type]
    for _ in range(100):
        await asyncio.sleep(0.01)
        if quiet.pinged:
            break
    task.cancel()
    assert len(calls) >= 2 and quiet.pinged == 1
