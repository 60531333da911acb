"""Sans-I/O connection state machines for protocol v1 (in the manner of the websockets library).

The I/O layer feeds each WebSocket message to ``receive_data``, takes the frames it should act on from
``events_received`` and writes out whatever ``data_to_send`` returns. When ``close_code`` becomes set it
sends those messages and then closes the WebSocket with that code. Nothing here imports asyncio.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from protocol.codec import Codec, codec_for
from protocol.errors import CloseCode, ErrorCode, ProtocolError
from protocol.frames import (
    ClientFrame,
    Error,
    Hello,
    ServerFrame,
    Welcome,
    parse_client_frame,
    parse_server_frame,
)

# A client that sends this many bad frames in a row is broken or hostile; one bad frame is a bug to report.
MAX_CONSECUTIVE_BAD_FRAMES = 16


class InvalidState(Exception):
    """The caller asked for something the current state forbids (a bug in the caller, not the peer)."""


class ServerState(enum.Enum):
    AWAITING_HELLO = "awaiting_hello"
    OPEN = "open"  # hello received; welcome sent or about to be
    CLOSING = "closing"  # close_code set: flush data_to_send, then close the socket


class ServerConnection:
    """The server's side of one connection."""

    def __init__(
        self,
        subprotocol: str,
        *,
        max_bad_frames: int = MAX_CONSECUTIVE_BAD_FRAMES,
        on_error: Callable[[ErrorCode], None] | None = None,
    ) -> None:
        self.codec: Codec = codec_for(subprotocol)
        self._on_error = on_error  # observability hook (metrics); called for every error frame queued
        self.state = ServerState.AWAITING_HELLO
        self.close_code: CloseCode | None = None
        self.close_reason = ""
        self.welcomed = False
        self._max_bad = max_bad_frames
        self._bad_in_a_row = 0
        self._events: list[ClientFrame] = []
        self._out: list[bytes | str] = []

    # ---- input ---------------------------------------------------------------------------------

    def receive_data(self, data: bytes | str) -> None:
        """Take one WebSocket message. Valid frames become events; invalid ones queue an ``error``."""
        if self.state is ServerState.CLOSING:
            return  # we are closing: late frames are dropped, as RFC 6455 allows
        try:
            frame = parse_client_frame(self.codec.decode(data))
            self._check_order(frame)
        except ProtocolError as exc:
            self._bad_frame(exc)
            return
        self._bad_in_a_row = 0
        if isinstance(frame, Hello):
            self.state = ServerState.OPEN
        self._events.append(frame)

    def _check_order(self, frame: ClientFrame) -> None:
        if self.state is ServerState.AWAITING_HELLO and not isinstance(frame, Hello):
            raise ProtocolError(
                ErrorCode.BAD_FRAME,
                f"{frame.type}: the first frame must be hello",
                id=getattr(frame, "id", None),
            )
        if self.state is ServerState.OPEN and isinstance(frame, Hello):
            raise ProtocolError(ErrorCode.BAD_FRAME, "hello: already received on this connection")

    def _bad_frame(self, exc: ProtocolError) -> None:
        self._bad_in_a_row += 1
        self.send_error(exc)
        if exc.code is ErrorCode.UNSUPPORTED_VERSION:
            self.close(CloseCode.PROTOCOL_ERROR, "unsupported protocol version")
        elif self._bad_in_a_row >= self._max_bad:
            self.close(CloseCode.POLICY_VIOLATION, f"{self._bad_in_a_row} bad frames in a row")

    def events_received(self) -> list[ClientFrame]:
        events, self._events = self._events, []
        return events

    # ---- output --------------------------------------------------------------------------------

    def send(self, frame: ServerFrame) -> None:
        if self.state is ServerState.CLOSING:
            return
        if isinstance(frame, Welcome):
            if self.state is not ServerState.OPEN or self.welcomed:
                raise InvalidState("welcome is sent once, after hello")
            self.welcomed = True
        elif not isinstance(frame, Error) and not self.welcomed:
            raise InvalidState(f"{frame.type} before welcome")
        self._out.append(self.codec.encode(frame.to_wire()))

    def send_error(self, exc: ProtocolError) -> None:
        if self.state is not ServerState.CLOSING:
            self._out.append(self.codec.encode(Error.from_exc(exc).to_wire()))
            if self._on_error is not None:
                self._on_error(exc.code)

    def fail(self, exc: ProtocolError, code: CloseCode) -> None:
        """Send an error and close (used for a refused hello: unauthorized, bad session_token)."""
        self.send_error(exc)
        self.close(code, exc.message)

    def close(self, code: CloseCode, reason: str = "") -> None:
        if self.state is not ServerState.CLOSING:
            self.state = ServerState.CLOSING
            self.close_code = code
            self.close_reason = reason[:120]  # a close reason must fit in 123 bytes

    def data_to_send(self) -> list[bytes | str]:
        out, self._out = self._out, []
        return out


class ClientConnection:
    """The client's side: encodes client frames, validates server frames.

    Server frames that do not validate raise ProtocolError: a client cannot repair a broken server.
    """

    def __init__(self, subprotocol: str) -> None:
        self.codec: Codec = codec_for(subprotocol)
        self._out: list[bytes | str] = []
        self._events: list[ServerFrame] = []

    def send(self, frame: ClientFrame) -> None:
        self._out.append(self.codec.encode(frame.to_wire()))

    def send_raw(self, obj: Any) -> None:
        """Encode an arbitrary object (tests use it to send malformed frames)."""
        self._out.append(self.codec.encode(obj))

    def data_to_send(self) -> list[bytes | str]:
        out, self._out = self._out, []
        return out

    def receive_data(self, data: bytes | str) -> None:
        self._events.append(parse_server_frame(self.codec.decode(data)))

    def events_received(self) -> list[ServerFrame]:
        events, self._events = self._events, []
        return events
