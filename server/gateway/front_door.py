"""One port, two doors: every TCP connection's first request line decides who serves it.

The gateway keeps ``websockets`` for WebSocket handshakes (``/v1/ws``, whose per-connection memory and
throughput ``make bench`` measures, and the Responses WebSocket mode). Every other request, the
OpenAI-compatible HTTP API (``POST`` bodies, streamed SSE responses) and the plain GETs (``/healthz``,
``/readyz``, ``/metrics``, the UI) alike, needs an HTTP/1.1 server that websockets is not: it answers
only GET and closes without a word on a request line it cannot parse, a ``HEAD`` or a pipelined
request. Those connections are handed to :class:`server.gateway.http_conn.HttpConnection` (h11)
instead, which answers every request (400 for what is not HTTP/1.1, 405 with ``Allow``, a ``HEAD``
without its body).

The hand-off uses websockets' documented ``create_connection`` hook: websockets calls it for each new
TCP connection with its sans-I/O protocol and server, and the returned :class:`FrontDoor` is the asyncio
protocol until the request line has arrived. Then it builds the real websockets ``ServerConnection``
(a :class:`~server.gateway.keepalive.GatewayWebSocket`, whose keepalive pings only a quiet peer, or the
HTTP connection), gives it the transport and the bytes read so far, and is dropped: an idle
WebSocket holds exactly what it held before this layer existed.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from websockets.asyncio.server import Server, ServerConnection
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from server.gateway.keepalive import GatewayWebSocket

# A request line longer than this is not HTTP we answer: h11 refuses it (its own limit is 16 KiB).
MAX_REQUEST_LINE = 8192

WS_PATH = "/v1/ws"
API_PREFIX = "/v1/"
# OpenAI's Responses WebSocket mode: this path is the HTTP API's (POST) unless its GET asks for an upgrade.
RESPONSES_PATH = "/v1/responses"
# Whether a GET asks for an upgrade only its headers tell; they are read (at most this much) before the
# hand-off. A longer head goes to websockets, whose handshake has limits of its own.
MAX_HEAD = 16384


def is_http_api(path: str) -> bool:
    """Whether a request path belongs to the OpenAI-compatible HTTP API (everything under ``/v1/`` but
    the WebSocket endpoint)."""
    path = path.split("?", 1)[0]
    return path.startswith(API_PREFIX) and path != WS_PATH


def request_line(line: bytes) -> tuple[str, str, str]:
    """Method, target and version of an HTTP request line (``GET /x HTTP/1.1``), or three empty
    strings when it is not one (h11 then says what is wrong with it)."""
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[1] or not parts[2].startswith(b"HTTP/"):
        return "", "", ""
    try:
        method, target, version = (p.decode("ascii") for p in parts)
    except UnicodeDecodeError:
        return "", "", ""
    return method, target, version


def _head_end(buf: bytes) -> int:
    """Where a request head ends (its blank line), -1 if it has not yet: CRLF lines, or bare LF ones
    (which h11 takes too), else such a head would wait here for the open timeout."""
    crlf, lf = buf.find(b"\r\n\r\n"), buf.find(b"\n\n")
    return min(x for x in (crlf, lf) if x >= 0) if crlf >= 0 or lf >= 0 else -1


def is_upgrade(head: bytes) -> bool:
    """Whether a request head (request line and headers) asks for a WebSocket upgrade."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"upgrade" and b"websocket" in value.lower():
            return True
    return False


class FrontDoor(asyncio.Protocol):
    """Reads up to the end of the first request line, then hands the connection over (see module)."""

    __slots__ = ("_buf", "_make_http", "_make_ws", "_on_closed", "_timeout_s", "_timer", "_transport")

    def __init__(
        self,
        make_ws: Callable[[], asyncio.Protocol],
        make_http: Callable[[bool], asyncio.Protocol],
        timeout_s: float,
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        self._make_ws = make_ws
        self._on_closed = on_closed
        self._make_http = make_http
        self._buf = b""
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timeout_s = timeout_s

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        # websockets' own opening timeout starts only once it has the connection: a client that sends
        # nothing (or half a line) is closed here instead.
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, transport.abort)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._buf.startswith(b"\r\n"):
            # RFC 9112 §2.2: empty lines before a request line are ignored (h11 would refuse them).
            self._buf = self._buf.lstrip(b"\r\n")
        end = self._buf.find(b"\r\n")
        if end < 0 and len(self._buf) <= MAX_REQUEST_LINE:
            return
        method, path, version = request_line(self._buf[:end]) if end >= 0 else ("", "", "")
        api = is_http_api(path)
        if method == "GET" and version == "HTTP/1.1" and (not api or path.split("?", 1)[0] == RESPONSES_PATH):
            # A GET outside the API (or of the Responses WebSocket): websockets' if it is a handshake.
            head_end = _head_end(self._buf)
            if head_end < 0 and len(self._buf) <= MAX_HEAD:
                return  # the rest of the headers
            if head_end < 0 or is_upgrade(self._buf[:head_end]):
                self._hand_to(self._make_ws())
                return
        # Everything else is plain HTTP, a request line that is not one included (h11 answers it, where
        # websockets would close without a word). ``api``: the first request is the HTTP API's, and
        # only such a connection counts against the HTTP connection caps; any other ends after its one
        # response, as it did in websockets (a health probe must be answered however full the caps).
        self._hand_to(self._make_http(api))

    def _hand_to(self, protocol: asyncio.Protocol) -> None:
        transport = self._transport
        assert transport is not None
        if self._timer is not None:
            self._timer.cancel()
        data, self._buf = self._buf, b""
        self._transport = None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(data)

    def eof_received(self) -> bool | None:
        return False  # closed before a request line: nothing to answer

    def connection_lost(self, exc: Exception | None) -> None:
        # Closed before a request line (after the hand-over, the new protocol hears of the close).
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None
        if self._on_closed is not None:
            self._on_closed()


SelectSubprotocol = Callable[[ServerConnection, Sequence[Subprotocol]], Subprotocol | None]


def front_door_factory(
    make_http: Callable[[bool], asyncio.Protocol],
    timeout_s: float,
    select_subprotocol: SelectSubprotocol | None = None,
    on_closed: Callable[[], None] | None = None,
) -> Callable[..., Any]:
    """A ``create_connection`` for :func:`websockets.asyncio.server.serve` that puts a
    :class:`FrontDoor` before websockets' own connection. ``select_subprotocol``: websockets' hook of
    that name, given the connection (websockets' own closure expects its connection to be the protocol
    it created, which the front door is not, so the hook is installed here instead). ``on_closed`` is
    told of a connection closed before its first request line (the gateway's churn collector counts
    closes; the protocols it is handed to tell it of theirs)."""

    def create_connection(protocol: ServerProtocol, server: Server, **kwargs: Any) -> FrontDoor:
        def make_ws() -> asyncio.Protocol:
            conn = GatewayWebSocket(protocol, server, **kwargs)
            if select_subprotocol is not None:
                # A weak reference: the connection holds the protocol, and a hook holding the connection
                # would make every closed connection a reference cycle, freed only by a full collection.
                ref = weakref.ref(conn)

                def select(offered: Sequence[Subprotocol]) -> Subprotocol | None:
                    c = ref()
                    return None if c is None else select_subprotocol(c, offered)

                protocol.select_subprotocol = select  # type: ignore[method-assign,assignment]
            return conn

        return FrontDoor(make_ws, make_http, timeout_s, on_closed)

    return create_connection
