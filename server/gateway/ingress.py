"""How fast the gateway reads what clients send: a pace per connection and per peer address (SPEC §2.2).

Every door reads through a :class:`Pace`. Each chunk or frame read is charged to the connection's own
budget and to its peer address's; when either is in debt, the door waits before it reads on (the
WebSocket doors sleep before handling the next message, the HTTP door pauses its transport), so TCP
pushes back on the sender instead of one socket keeping the gateway busy parsing for everyone.

Pacing alone leaves a flooding client's frames in socket buffers, each answered seconds after it was
sent. So a connection that its own budget has held back for ``flood_close_s`` without a break is sending
faster than it may, by more than any burst explains: the door closes it (WebSocket 1008), which answers
everything it still had in flight at once. The per-peer budget only paces, never closes: a well-behaved
connection from an address that others flood must not be taken for one of them.

Why per peer as well: a new connection starts with little credit, so a client gains nothing by opening
connection after connection, but it could read at N paces by holding N connections open at once.
Behind a reverse proxy every client shares the proxy's address: set the per-peer rate to 0 (off) there,
or raise it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.frames import CloseCode

START_CREDIT = 64 * 1024  # bytes a new connection may send before its pace applies
# A message read this soon after the door went back to reading was already waiting: the sender is ahead
# of the pace (a read from a socket that has the bytes takes microseconds; the margin covers a busy loop).
BACKLOG_GAP_S = 0.05


@dataclass(slots=True)
class Budget:
    """Bytes a second with bursts of ``burst``; a charge may leave it in debt, which ``debt_s`` says
    how long takes to repay."""

    rate: float
    burst: float
    tokens: float
    at: float

    def charge(self, n: int, now: float) -> float:
        """Take ``n`` bytes; the seconds until the budget is out of debt again (0 if it is not in debt)."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate) - n
        self.at = now
        return -self.tokens / self.rate if self.tokens < 0 else 0.0


class Ingress:
    """The gateway's paces: one budget per connection, one shared by the connections of each peer."""

    def __init__(
        self,
        per_connection: float,
        per_peer: float,
        flood_close_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.per_connection = per_connection  # bytes/s; 0: no pace
        self.per_peer = per_peer  # bytes/s for all of one address's connections; 0: no per-peer pace
        self.flood_close_s = flood_close_s  # 0: never close a flooding connection, only pace it
        self._peers: dict[str, tuple[Budget, int]] = {}  # address -> its budget, connections using it

    def open(self, peer: str, *, closes: bool = True) -> Pace:
        """The pace of a new connection from ``peer`` (its address); call :meth:`Pace.close` when it ends.
        ``closes``: whether flooding closes it (the WebSocket doors), or only paces it (the HTTP door,
        where one request at a time with a bounded body cannot be held back for long)."""
        own = None
        if self.per_connection > 0:
            credit = min(START_CREDIT, self.per_connection)
            own = Budget(self.per_connection, 2 * self.per_connection, credit, self.clock())
        shared = None
        if self.per_peer > 0:
            fresh = (Budget(self.per_peer, 2 * self.per_peer, self.per_peer, self.clock()), 0)
            budget, users = self._peers.get(peer) or fresh
            self._peers[peer] = (budget, users + 1)
            shared = budget
        return Pace(self, peer, own, shared, self.flood_close_s if closes else 0.0)

    def _close(self, peer: str) -> None:
        entry = self._peers.get(peer)
        if entry is None:
            return
        budget, users = entry
        if users <= 1:
            del self._peers[peer]  # bounded by the connections open: nothing kept for a peer gone
        else:
            self._peers[peer] = (budget, users - 1)

    @property
    def peers(self) -> int:
        return len(self._peers)


class Pace:
    """One connection's pace (see the module docstring)."""

    __slots__ = (
        "_close_after",
        "_closed",
        "_held",
        "_ingress",
        "_own",
        "_peer",
        "_ready_at",
        "_shared",
    )

    def __init__(
        self, ingress: Ingress, peer: str, own: Budget | None, shared: Budget | None, close_after: float
    ) -> None:
        self._ingress = ingress
        self._close_after = close_after
        self._peer = peer
        self._own = own
        self._shared = shared
        self._held = 0.0  # seconds its own budget held it back in this run of back-to-back messages
        self._ready_at = 0.0  # when the door went back to reading after the last message
        self._closed = False

    def take(self, n: int) -> float | None:
        """Charge ``n`` bytes read. Returns the seconds to wait before reading on (0.0: none), or None
        when its own budget has held the connection back for ``flood_close_s`` in all over one run of
        messages read back to back: close it.

        "Back to back": each message was already there when the door went back to reading after the one
        before it (its wait and its handling over, :meth:`done`), read within ``BACKLOG_GAP_S`` of that,
        so the sender is ahead of the pace and its backlog, sitting in socket buffers, only grows. A
        sender slower than the pace leaves gaps, and a gap starts a new run. Only the waits count, so a
        client sending many small frames quickly is never closed for it."""
        now = self._ingress.clock()
        own = self._own.charge(n, now) if self._own is not None else 0.0
        shared = self._shared.charge(n, now) if self._shared is not None else 0.0
        if now > self._ready_at + BACKLOG_GAP_S:
            self._held = 0.0  # a gap: the sender had caught up with the pace
        self._held += own
        self._ready_at = now + own  # at least; done() moves it past the handling
        if self._close_after > 0 and self._held > self._close_after:
            return None
        return max(own, shared)

    def done(self) -> None:
        """The door handled the message it was charged for and reads on: a message that is read at once
        from here was already waiting."""
        self._ready_at = max(self._ready_at, self._ingress.clock())

    def close(self) -> None:
        """The connection ended (idempotent)."""
        if not self._closed:
            self._closed = True
            if self._shared is not None:
                self._ingress._close(self._peer)


FLOOD_REASON = "sending faster than the server reads; slow down"
# A flooding client's close reply is stuck behind the bytes it is still sending: the handshake is not
# waited for long, so the client learns of the close within a moment, not the close timeout (2 s).
FLOOD_CLOSE_TIMEOUT_S = 0.25


def peer_address(ws: ServerConnection) -> str:
    """A WebSocket's peer address (host only), the key of its per-peer pace."""
    addr: Any = ws.remote_address
    return str(addr[0]) if isinstance(addr, tuple) and addr else "?"


async def pace(ws: ServerConnection, p: Pace, n: int) -> bool:
    """Charge a message of ``n`` bytes read from a WebSocket and wait out its pace. False when the
    connection floods: then it is being closed with 1008 and the caller stops reading. The caller
    calls ``p.done()`` once it has handled the message."""
    wait = p.take(n)
    if wait is None:
        ws.close_timeout = FLOOD_CLOSE_TIMEOUT_S
        await ws.close(CloseCode.POLICY_VIOLATION, FLOOD_REASON)
        return False
    if wait:
        await asyncio.sleep(wait)
    return True
