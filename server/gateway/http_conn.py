"""An HTTP/1.1 connection for the OpenAI-compatible API: h11 parses and frames, this moves the bytes.

One request at a time per connection (keep-alive, no pipelining in parallel). A handler returns an
:class:`HttpResponse` whose body is either bytes or an async iterator of chunks (SSE), written with
chunked transfer coding and flow control. When the client goes away the handler's task is cancelled,
so a handler learns about a dropped connection as a ``CancelledError`` at its current ``await`` (and
decides there whether the generation goes on). Bodies past ``max_body`` get 413 and the connection closes.
What a client sends while its response is written (a pipelined next request) is read up to one
request's worth (``max_body`` and headers); past that reading pauses until the response is done, and TCP
pushes back, so a streamed response cannot be used to pile a client's bytes up in h11's buffer.

Time limits: a kept-alive connection with no request for ``idle_timeout_s`` is closed; a request's
headers and body must all arrive within ``request_timeout_s`` of its first byte (a body trickled a byte
at a time gets 408, whatever the pace). Connections are counted by :class:`ConnectionCaps`: past its cap
for the gateway (503) or for one peer address (429), a new connection is answered at once and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

import h11
import structlog

from server import metrics
from server.gateway.ingress import Ingress, Pace

log = structlog.get_logger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # a request's line and headers (SPEC §15.1: past it, 431)


@dataclass(slots=True)
class HttpRequest:
    method: str
    target: str  # path and query, as sent
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes = b""

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.target.partition("?")[2]


@dataclass(slots=True)
class HttpResponse:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None  # SSE: chunks written as they come
    # Called once the response is written or abandoned (however the connection ends): what the handler
    # still holds for the stream (an admission grant) is given back there, even if the stream never ran.
    on_close: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        callbacks, self.on_close = self.on_close, []
        for cb in callbacks:
            cb()


class ConnectionCaps:
    """Connections open on this gateway, in all and per peer address (``max_per_peer`` 0: no per-peer
    cap). The HTTP door holds one, the WebSocket doors another."""

    def __init__(self, max_total: int, max_per_peer: int) -> None:
        self.max_total = max_total
        self.max_per_peer = max_per_peer
        self.total = 0
        self.by_peer: dict[str, int] = {}

    def take(self, peer: str) -> int:
        """200 when a connection from ``peer`` may open (and is counted), else the status to refuse it
        with: 503 (the gateway is full), 429 (this peer holds too many)."""
        if self.total >= self.max_total:
            return 503
        if self.max_per_peer and self.by_peer.get(peer, 0) >= self.max_per_peer:
            return 429
        self.total += 1
        self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
        return 200

    def give_back(self, peer: str) -> None:
        self.total -= 1
        n = self.by_peer.get(peer, 0) - 1
        if n > 0:
            self.by_peer[peer] = n
        else:
            self.by_peer.pop(peer, None)


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]
ErrorBody = Callable[[int, str], HttpResponse]  # a framing error's response (status, message)


class HttpConnection(asyncio.Protocol):
    """asyncio protocol: feeds h11, runs one handler task per request, writes its response."""

    def __init__(
        self,
        handler: Handler,
        error: ErrorBody,
        *,
        max_body: int,
        idle_timeout_s: float,
        write_timeout_s: float,
        request_timeout_s: float = 30.0,
        ingress: Ingress | None = None,
        registry: set[HttpConnection] | None = None,
        caps: ConnectionCaps | None = None,
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        self.handler = handler
        self.on_closed = on_closed  # told when the connection closes (the gateway's churn collector)
        self.error = error
        self.max_body = max_body
        self.idle_timeout_s = idle_timeout_s
        self.request_timeout_s = request_timeout_s
        self.write_timeout_s = write_timeout_s
        self.registry = registry
        self.caps = caps
        self._peer: str | None = None  # counted in caps while set
        self._refuse = 0  # the status this connection is refused with (caps), 0 if it is not
        # Bytes read are paced per connection and per peer (ingress.py): past either, reading pauses and
        # TCP pushes back, so a client sending bodies back to back, or on many connections at once,
        # cannot keep the gateway parsing them for everyone.
        self._ingress = ingress
        self._pace_of: Pace | None = None
        self._paused = False
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.transport: asyncio.Transport | None = None
        self._data = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._discard = False  # after refusing a body: read and drop the rest (see _linger)
        self._reading = True  # a request is being read; False while its response is written
        self._ahead = 0  # bytes received (pipelined) since the request being answered was read
        self._held = False  # reading paused until the next request is read: _ahead passed its cap

    # ---- asyncio protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self._ingress is not None:
            self._pace_of = self._ingress.open(host, closes=False)
        if self.caps is not None:
            status = self.caps.take(host)
            if status == 200:
                self._peer = host
            else:
                self._refuse = status
                metrics.HTTP_REFUSED.labels("gateway" if status == 503 else "peer").inc()
        if self.registry is not None:
            self.registry.add(self)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="http-connection")
        self._task.add_done_callback(self._ran)

    def _ran(self, task: asyncio.Task[None]) -> None:
        # A finished task that ended in an exception holds its traceback, whose frames hold this
        # connection (and its buffers, up to a 1 MiB body): a reference cycle a full collection would be
        # needed to free. Forget the task once it is done, so a closed connection is freed at once.
        if self._task is task:
            self._task = None

    def data_received(self, data: bytes) -> None:
        if self._discard:
            return
        self._pace(len(data))
        with contextlib.suppress(h11.RemoteProtocolError):  # surfaces from next_event() in _run
            self.h11.receive_data(data)
        self._data.set()
        if not self._reading:
            self._ahead += len(data)
            if self._ahead > self.max_body + 64 * 1024 and not self._held and self.transport is not None:
                self._held = True
                self.transport.pause_reading()

    def _pace(self, n: int) -> None:
        if self._pace_of is None:
            return
        wait = self._pace_of.take(n) or 0.0  # opened with closes=False: never None
        if wait > 0 and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
            asyncio.get_running_loop().call_later(wait, self._unpause)

    def _unpause(self) -> None:
        self._paused = False
        if self.transport is not None and not self._closed and not self._held:
            self.transport.resume_reading()

    def eof_received(self) -> bool | None:
        # A client that half-closes is gone as far as streaming goes: treat EOF as a disconnect.
        with contextlib.suppress(h11.RemoteProtocolError):
            self.h11.receive_data(b"")
        self._data.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._pace_of is not None:
            self._pace_of.close()
        self._writable.set()
        self._data.set()
        if self._peer is not None and self.caps is not None:
            self.caps.give_back(self._peer)
            self._peer = None
        if self.registry is not None:
            self.registry.discard(self)
        if self.on_closed is not None:
            self.on_closed()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the handler sees CancelledError: the client is gone

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def close(self) -> None:
        """Close now (the server is stopping); a handler in progress is cancelled."""
        if self.transport is not None and not self._closed:
            self.transport.close()

    # ---- the request loop ------------------------------------------------------------------------

    async def _next_event(self, timeout_s: float) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
        async with asyncio.timeout(timeout_s):
            while True:
                event = self.h11.next_event()
                if event is not h11.NEED_DATA:
                    return event
                if self._closed:
                    return h11.ConnectionClosed()
                self._data.clear()
                await self._data.wait()

    async def _run(self) -> None:
        try:
            if self._refuse:
                await self._refuse_connection()
                return
            while not self._closed:
                try:
                    request = await self._read_request()
                except (TimeoutError, h11.RemoteProtocolError, _TooLarge) as exc:
                    await self._fail(exc)
                    return
                if request is None:
                    return
                try:
                    response = await self.handler(request)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("http.handler_failed", path=request.path)
                    response = self.error(500, "internal server error")
                try:
                    await self._respond(response, head=request.method == "HEAD")
                finally:
                    response.close()
                if self.h11.our_state is h11.MUST_CLOSE or self._closed:
                    return
                self.h11.start_next_cycle()
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("http.connection_failed")
        finally:
            if self.transport is not None:
                self.transport.close()

    async def _refuse_connection(self) -> None:
        """Answer a connection past the caps without reading its request, then close it."""
        if self._refuse == 503:
            resp = self.error(503, "this server holds too many HTTP connections; retry later")
        else:
            resp = self.error(429, "too many HTTP connections from your address; close some and retry")
        resp.headers += [("Retry-After", "1"), ("Retry-After-Ms", "1000")]
        await self._raw_response(resp)

    async def _raw_response(self, resp: HttpResponse) -> None:
        """Write a complete response and close, outside h11's state machine (which refuses a response
        before a whole request has arrived), then linger so that the client reads it."""
        if self.transport is None or self._closed:
            return
        head = [f"HTTP/1.1 {resp.status} {_reason(resp.status)}", *(f"{k}: {v}" for k, v in resp.headers)]
        head += [f"Date: {email.utils.formatdate(usegmt=True)}", f"Content-Length: {len(resp.body)}"]
        head.append("Connection: close")
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + resp.body)
        await self._linger()

    async def _read_request(self) -> HttpRequest | None:
        """The next request, or None when the connection closed or stayed idle for ``idle_timeout_s``.
        Raises TimeoutError past ``request_timeout_s`` from the request's first byte."""
        self._reading, self._ahead = True, 0
        if self._held:
            self._held = False
            if self.transport is not None and not self._closed and not self._paused:
                self.transport.resume_reading()
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                # h11 holds what arrived but was not parsed yet: nothing there means idle.
                while not self._closed and self.h11.trailing_data == (b"", False):
                    self._data.clear()
                    await self._data.wait()
        except TimeoutError:
            return None  # an idle keep-alive connection: just close it
        # The whole request, headers and body, within one deadline however slowly it trickles.
        async with asyncio.timeout(self.request_timeout_s):
            return await self._read_whole_request()

    async def _read_whole_request(self) -> HttpRequest | None:
        event = await self._next_event(self.request_timeout_s)
        if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None
        if not isinstance(event, h11.Request):
            raise h11.RemoteProtocolError("expected a request")
        if event.http_version not in (b"1.0", b"1.1"):  # h11 takes any digit.digit
            raise h11.RemoteProtocolError(
                f"HTTP/{event.http_version.decode()} is not supported; send HTTP/1.1",
                error_status_hint=505,
            )
        # h11's bound covers only a head still arriving: one that came whole in a single read is parsed
        # at any size, so the 16 KiB of SPEC §15.1 are counted here too (the request line and each
        # header's "name: value\r\n").
        head = len(event.method) + len(event.target) + 12 + sum(len(k) + len(v) + 4 for k, v in event.headers)
        if head > MAX_HEAD_BYTES:
            raise h11.RemoteProtocolError(
                f"request head larger than {MAX_HEAD_BYTES} bytes", error_status_hint=431
            )
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        if len(headers) < len(event.headers):
            names = [k.lower() for k, _ in event.headers]
            for once in (b"authorization", b"idempotency-key"):
                if names.count(once) > 1:  # which one counts would depend on who reads them
                    raise h11.RemoteProtocolError(f"more than one {once.decode().title()} header")
        if "transfer-encoding" in headers and "content-length" in headers:
            # A proxy in front that frames by Content-Length would read another request's bytes into this
            # one's body than h11 (which frames by Transfer-Encoding) does: request smuggling. RFC 9112
            # §6.1 lets a server refuse it, and it must close the connection either way: 400, closed.
            raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding")
        length = headers.get("content-length")
        if length is not None and length.isascii() and length.isdigit() and int(length) > self.max_body:
            raise _TooLarge()
        if self.h11.they_are_waiting_for_100_continue:
            await self._write(h11.InformationalResponse(status_code=100, headers=[]))
        chunks: list[bytes] = []
        size = 0
        while True:
            ev = await self._next_event(self.request_timeout_s)
            if isinstance(ev, h11.Data):
                size += len(ev.data)
                if size > self.max_body:
                    raise _TooLarge()
                chunks.append(bytes(ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                self._reading = False  # what arrives from now on is the next request's
                break
            else:
                return None  # closed mid-body
        return HttpRequest(
            method=event.method.decode("ascii", "replace"),
            target=event.target.decode("ascii", "replace"),
            headers=headers,
            body=b"".join(chunks),
        )

    async def _fail(self, exc: Exception) -> None:
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE) or self._closed:
            return
        if isinstance(exc, _TooLarge):
            resp = self.error(413, f"request body larger than {self.max_body} bytes")
        elif isinstance(exc, TimeoutError):
            resp = self.error(408, f"request not received within {self.request_timeout_s:g} s")
            if self.h11.their_state is h11.IDLE:  # headers incomplete: h11 cannot answer yet
                with contextlib.suppress(Exception):
                    await self._raw_response(resp)
                return
        else:
            # h11's hint: 400, or 431 (headers too large), 501 (a transfer coding it does not know), 505.
            status = getattr(exc, "error_status_hint", 400)
            resp = self.error(status, f"malformed HTTP request: {_plain_words(exc)}"[:200])
        resp.headers.append(("Connection", "close"))
        with contextlib.suppress(Exception):
            await self._respond(resp)
            if isinstance(exc, _TooLarge):
                await self._linger()

    async def _linger(self) -> None:
        """Closing with unread request bytes makes the kernel send RST, which can destroy the response
        before the client reads it. Half-close, then drop what still arrives for a moment."""
        self._discard = True
        if self.transport is not None and self.transport.can_write_eof():
            self.transport.write_eof()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                while not self._closed:
                    self._data.clear()
                    await self._data.wait()

    async def _write(self, event: h11.Event) -> None:
        data = self.h11.send(event)
        if data is None or self.transport is None or self._closed:
            if self._closed:
                raise asyncio.CancelledError
            return
        self.transport.write(data)
        if not self._writable.is_set():
            try:
                # A client that stops reading must not pile chunks up in memory: close it instead.
                # (asyncio.timeout, not wait_for: see connection.py's send.)
                async with asyncio.timeout(self.write_timeout_s):
                    await self._writable.wait()
            except TimeoutError:
                self.transport.abort()
                raise asyncio.CancelledError from None
        if self._closed:
            raise asyncio.CancelledError

    async def _respond(self, response: HttpResponse, *, head: bool = False) -> None:
        """Write ``response``; ``head``: the request was HEAD, so its headers go out without the body
        (RFC 9110 §9.3.2; h11 refuses body bytes after a HEAD)."""
        headers = [(k, v) for k, v in response.headers]
        if not any(k.lower() == "date" for k, _ in headers):
            headers.append(("Date", email.utils.formatdate(usegmt=True)))  # RFC 9110 §6.6.1
        if response.stream is None:
            headers.append(("Content-Length", str(len(response.body))))
        reason = _reason(response.status).encode()
        await self._write(h11.Response(status_code=response.status, headers=headers, reason=reason))
        if head:
            if response.stream is not None:
                aclose = getattr(response.stream, "aclose", None)
                if aclose is not None:
                    await aclose()
        elif response.stream is None:
            if response.body:
                await self._write(h11.Data(data=response.body))
        else:
            stream = response.stream
            try:
                async for chunk in stream:
                    if chunk:
                        await self._write(h11.Data(data=chunk))
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
        await self._write(h11.EndOfMessage())


_KNOWN = frozenset(s.value for s in HTTPStatus)


def _reason(status: int) -> str:
    """The status line's reason phrase ("" for a code HTTPStatus does not know)."""
    return HTTPStatus(status).phrase if status in _KNOWN else ""


def _plain_words(exc: Exception) -> str:
    """An HTTP parser error in words a client can use: h11 quotes the offending bytes as Python reprs
    ("illegal chunk header: bytearray(b'-5\\r\\n')"), so a message that does keeps its words only."""
    text = str(exc)
    if "b'" in text or 'b"' in text:
        text = text.split(":", 1)[0]
    return text


class _TooLarge(Exception):
    pass
