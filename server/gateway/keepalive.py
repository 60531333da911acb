"""The server's WebSocket keepalive: one sweep pings only the connections it has heard nothing from.

websockets' own keepalive runs a task per connection that sends a Ping control frame every
``ping_interval``, whatever the peer sends. Its job is to find a peer that is gone without a close (a
phone that lost its network, a NAT that forgot the mapping): no Pong comes, and the connection is closed
with 1011 (SPEC §13). A client that talks, and our clients ping every 15 s while idle as SPEC §13 asks,
has just shown that it is there, so pinging it too costs the gateway a frame each way, a timer and a
task's wake-up for nothing, and wakes a phone's radio at a second rhythm beside its own pings.

So each :class:`GatewayWebSocket` stamps the time of every byte it receives, websockets' keepalive is
off (``ping_interval=None``), and :func:`sweep` looks at every open connection every ``interval / 4``:
one quiet for ``interval`` gets a Ping, in a task that waits ``pong_within_s`` for the Pong and closes
the connection with 1011 when none comes. A connection that talks holds no task and no timer for this.
A peer that is gone is closed at most ``1.25 * interval + pong_within_s`` after the last thing it sent
(45 s with the defaults, against websockets' 40).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.frames import CloseCode
from websockets.protocol import State

from server import metrics

log = structlog.get_logger(__name__)

# Connections looked at between two yields to the event loop: a sweep of 100,000 must not stall the
# gateway's streams for tens of milliseconds at once.
SWEEP_CHUNK = 2000


class GatewayWebSocket(ServerConnection):
    """websockets' server connection that knows when its peer last sent anything (``heard_at``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.heard_at = self.loop.time()

    def data_received(self, data: bytes) -> None:
        self.heard_at = self.loop.time()
        super().data_received(data)

    async def ping_once(self, pong_within_s: float) -> None:
        """Ping, and close with 1011 if no Pong comes within ``pong_within_s``. Runs as
        ``keepalive_task``, which websockets cancels when the connection is lost."""
        try:
            pong = await self.ping()
            try:
                async with asyncio.timeout(pong_within_s):
                    self.latency = await pong
                metrics.KEEPALIVE.labels("pong").inc()
            except TimeoutError:
                metrics.KEEPALIVE.labels("timeout").inc()  # a peer gone without a close: found
                async with self.send_context():
                    self.protocol.fail(CloseCode.INTERNAL_ERROR, "keepalive ping timeout")
        except Exception:  # the connection closed meanwhile (ConnectionClosed), or a bug: it ends either way
            if self.protocol.state is State.OPEN:
                self.logger.error("keepalive ping failed", exc_info=True)
        finally:
            if self.keepalive_task is asyncio.current_task():
                self.keepalive_task = None


async def sweep(
    connections: Callable[[], Iterable[GatewayWebSocket]], interval: float, pong_within_s: float
) -> None:
    """Ping every open connection quiet for ``interval``, and close one whose Pong does not come within
    ``pong_within_s`` (see the module), for ever."""
    while True:
        await asyncio.sleep(interval / 4)
        try:
            await sweep_once(connections(), interval, pong_within_s)
        except Exception:  # a bug here must not end every connection's keepalive for the process's life
            log.exception("keepalive.sweep_failed")


async def sweep_once(connections: Iterable[GatewayWebSocket], interval: float, pong_within_s: float) -> int:
    """One sweep: a ping task for each open connection quiet for ``interval`` that has none; how many.
    And a connection still closing past its close deadline is aborted: websockets enforces that deadline
    only in a send or a close, so a peer that sent its close frame but never closes its end of the TCP
    connection, while its door waits for a frame, was held for ever."""
    loop = asyncio.get_running_loop()
    started = 0
    quiet_since = loop.time() - interval  # heard from at or before this: quiet for the interval
    for i, ws in enumerate(list(connections)):
        if i and i % SWEEP_CHUNK == 0:
            await asyncio.sleep(0)
            quiet_since = loop.time() - interval
        state = ws.protocol.state
        if state is State.OPEN and ws.heard_at <= quiet_since and ws.keepalive_task is None:
            ws.keepalive_task = loop.create_task(ws.ping_once(pong_within_s))
            started += 1
        elif state is State.CLOSING and ws.close_deadline is not None and loop.time() > ws.close_deadline:
            log.info("keepalive.closing_aborted")
            ws.transport.abort()
    return started
