"""A metered protocol client: ``server.client.Client`` plus the payload size of every frame received.

One WebSocket message carries exactly one frame (SPEC §2.1), so the size of each message is the size of
the frame it holds. Keepalive is the application's ``ping``: the load tool's sockets send no WebSocket-level
pings of their own (the server's are still answered by the library).
"""

from __future__ import annotations

from websockets.asyncio.client import connect

from protocol import Error, Hello, ResumePoint, ServerFrame, Welcome
from protocol.connection import ClientConnection
from server.client import Client, ServerError

__all__ = ["LoadClient", "ServerError", "ws_header_bytes"]


def ws_header_bytes(payload: int) -> int:
    """Bytes of an unmasked (server to client) WebSocket frame header for a payload of that size."""
    if payload < 126:
        return 2
    if payload < 1 << 16:
        return 4
    return 10


class LoadClient(Client):
    """One connection of the load tool."""

    subprotocol: str

    @classmethod
    async def open(
        cls,
        url: str,
        subprotocol: str,
        *,
        token: str | None = None,
        session_token: str | None = None,
        resume: tuple[ResumePoint, ...] = (),
        open_timeout: float = 30.0,
        coalesce_ms: int | None = None,
    ) -> LoadClient:
        """Connect and say hello; raises ServerError if the server answers with an error instead of
        welcome, OSError/websockets errors if the connection fails."""
        ws = await connect(
            url,
            subprotocols=[subprotocol],  # type: ignore[list-item]
            max_size=None,
            open_timeout=open_timeout,
            ping_interval=None,
            compression=None,
        )
        c = cls(ws, ClientConnection(subprotocol))
        c.subprotocol = subprotocol
        try:
            await c.send(
                Hello(token=token, session_token=session_token, resume=resume, coalesce_ms=coalesce_ms)
            )
            first, _ = await c.recv_sized()
        except BaseException:
            c.abort()
            raise
        if isinstance(first, Error):
            c.abort()
            raise ServerError(first)
        if not isinstance(first, Welcome):
            c.abort()
            raise RuntimeError(f"expected welcome, got {first.type}")
        c.welcome = first
        return c

    async def recv_sized(self) -> tuple[ServerFrame, int]:
        """The next frame and its payload size in bytes (UTF-8 bytes for the JSON subprotocol)."""
        data = await self.ws.recv()
        size = len(data) if isinstance(data, bytes) else len(data.encode())
        self.proto.receive_data(data)
        (frame,) = self.proto.events_received()
        return frame, size

    def abort(self) -> None:
        """Drop the TCP connection at once, without a closing handshake (what a phone losing signal
        looks like to the server)."""
        self.ws.transport.abort()
