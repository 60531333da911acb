"""One client connection: protocol state, its session, and the requests it is attached to.

The sans-I/O ``ServerConnection`` decides what frames mean; this class does the asynchronous work each
frame asks for (store calls, log subscriptions) and writes out what the protocol queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from typing import TYPE_CHECKING

import structlog
from websockets.asyncio.server import ServerConnection as WebSocket
from websockets.exceptions import ConnectionClosed

from protocol import (
    Accepted,
    Cancel,
    Chat,
    ClientFrame,
    CloseCode,
    Delta,
    Done,
    Error,
    ErrorCode,
    Hello,
    Ping,
    Pong,
    ProtocolError,
    Resume,
    ServerFrame,
    Usage,
    Welcome,
)
from protocol.connection import ServerConnection
from server import metrics
from server.gateway.auth import authenticate_user
from server.gateway.limits import TokenBucket, limited
from server.gateway.submit import ChatRequest, submit_chat
from server.store.logs import LogEntry
from server.store.requests import FINAL_STATES

if TYPE_CHECKING:
    from server.gateway.server import Gateway

log = structlog.get_logger(__name__)


# Deltas waiting in a subscription are merged into one frame up to this many tokens: a client that fell
# behind catches up in few frames instead of one per token.
MAX_TOKENS_PER_DELTA = 512


class Connection:
    def __init__(self, gw: Gateway, ws: WebSocket) -> None:
        self.gw = gw
        self.ws = ws
        assert ws.subprotocol is not None  # the handshake refuses connections without one
        self.proto = ServerConnection(
            ws.subprotocol, on_error=lambda code: metrics.ERRORS.labels(code.value).inc()
        )
        self.user: str | None = None
        self.session = ""
        self.owner = ""
        self.weight = 1.0  # fair-share weight from the JWT tier claim
        self._attached: dict[str, asyncio.Task[None]] = {}
        self._waiting: set[asyncio.Task[None]] = set()  # content turns waiting for the previous turn
        self._turn_chain: asyncio.Task[None] | None = None  # the last of them
        self._send_lock = asyncio.Lock()
        rate = gw.settings.chat_rate_per_connection
        self._bucket = TokenBucket(rate=rate, burst=2 * rate)
        # Resumes replay whole logs: limited like chats, with a burst that lets one reconnect resume
        # every stream it may hold (a hello.resume of max_streams points).
        rrate = gw.settings.resume_rate_per_connection
        self._resume_bucket = TokenBucket(
            rate=rrate, burst=max(2 * rrate, float(gw.settings.max_streams_per_connection))
        )
        self.log = log.bind(server=gw.name)

    async def run(self) -> None:
        try:
            async for message in self.ws:
                self.proto.receive_data(message)
                for frame in self.proto.events_received():
                    await self._handle(frame)
                await self._flush()
                if self.proto.close_code is not None:
                    await self.ws.close(self.proto.close_code, self.proto.close_reason)
                    break
        except ConnectionClosed:
            pass
        finally:
            for task in [*self._attached.values(), *self._waiting]:
                task.cancel()
            # A disconnect never cancels a request: it runs on and its log fills for a later resume.
            self._attached.clear()

    async def _flush(self) -> None:
        async with self._send_lock:
            for data in self.proto.data_to_send():
                try:
                    # A client that stops reading fills the socket buffers and blocks this send; waiting
                    # forever would pile its deltas up in memory. Close it instead: its requests run on
                    # and it can resume them after reconnecting.
                    await asyncio.wait_for(self.ws.send(data), self.gw.settings.slow_reader_timeout_s)
                except TimeoutError:
                    self.log.warning("connection.slow_reader_closed")
                    self.ws.transport.abort()
                    raise ConnectionClosed(None, None) from None

    async def _send(self, frame: ServerFrame) -> None:
        self.proto.send(frame)
        await self._flush()

    async def _handle(self, frame: ClientFrame, *, waited: bool = False) -> None:
        try:
            if isinstance(frame, Hello):
                await self._hello(frame)
            elif isinstance(frame, Chat):
                before = self._turn_chain
                if (
                    not waited
                    and frame.content is not None
                    and (
                        (before is not None and not before.done()) or (await self._previous_turn(frame.id))[1]
                    )
                ):
                    # Its session's previous turn is still running: this one waits for it (content mode,
                    # SPEC.md) without holding up this connection's other frames; turns sent on this
                    # connection are accepted in the order they were sent.
                    task = asyncio.create_task(
                        self._handle_after_wait(frame, before), name=f"turn-{frame.id}"
                    )
                    self._waiting.add(task)
                    task.add_done_callback(self._waiting.discard)
                    self._turn_chain = task
                    return
                await self._chat(frame)
            elif isinstance(frame, Resume):
                await self._resume(frame.id, frame.offset, frame.epoch)
            elif isinstance(frame, Cancel):
                await self._cancel(frame)
            elif isinstance(frame, Ping):
                self.proto.send(Pong(ts=frame.ts))
        except ProtocolError as exc:
            self.proto.send_error(exc)
        except Exception as exc:  # a bug or a store outage must not take the server down
            self.log.exception("connection.frame_failed", frame=frame.type)
            err = ProtocolError(
                ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}", id=getattr(frame, "id", None)
            )
            if isinstance(frame, Hello) and not self.proto.welcomed:
                # Without a welcome the connection is of no use: say so and let the client reconnect.
                self.proto.fail(err, CloseCode.INTERNAL_ERROR)
            else:
                self.proto.send_error(err)

    async def _handle_after_wait(self, chat: Chat, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            await asyncio.wait({before})  # the turn sent before this one on this connection goes first
        await self._handle(chat, waited=True)
        await self._flush()

    async def _previous_turn(self, id: str) -> tuple[str, bool]:
        """The session's latest content-mode turn ("" if none) and whether it is still unfinished."""
        prev = await self.gw.sessions.last_turn(self.session, self.owner)
        if not prev or prev == id:
            return prev, False
        info = await self.gw.store.get(self.owner, prev)
        return prev, info is not None and info.state not in FINAL_STATES

    async def _wait_previous_turn(self, id: str) -> str:
        """Wait until the session's latest content turn has ended; its id ("" for none). A turn then
        sees the reply of the one before it, whichever connection or gateway sent either."""
        delay = 0.02
        while True:
            prev, pending = await self._previous_turn(id)
            if not pending:
                return prev
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def _hello(self, hello: Hello) -> None:
        try:
            self.user, self.weight = authenticate_user(hello.token, self.gw.settings.auth_secret)
        except ProtocolError as exc:
            self.proto.fail(exc, CloseCode.POLICY_VIOLATION)
            return
        sessions = self.gw.sessions
        if hello.session_token:
            session = sessions.verify(hello.session_token, self.user)
            if session is None:
                self.proto.fail(
                    ProtocolError(ErrorCode.UNAUTHORIZED, "session_token: not valid for this user or server"),
                    CloseCode.POLICY_VIOLATION,
                )
                return
        else:
            session = sessions.new_id()
        self.session = session
        self.owner = sessions.owner_for(session, self.user)
        self.log = self.log.bind(session=session, user=self.user)
        await sessions.touch(session, self.owner)
        self.proto.send(
            Welcome(
                session=session,
                session_token=sessions.token(session, self.owner),
                server=self.gw.name,
                limits=self.gw.limits(),
                models=(await self.gw.models.served()).names,
            )
        )
        for point in hello.resume:
            try:
                await self._resume(point.id, point.offset, point.epoch)
            except ProtocolError as exc:
                self.proto.send_error(exc)

    async def _check_limits(self, chat: Chat) -> None:
        st = self.gw.settings
        wait = self._bucket.take()
        if wait:
            raise limited(chat.id, "too many chats on this connection", wait)
        self._check_room(chat.id)
        wait = await self.gw.store.rate(self.owner, "chat", st.chat_rate_per_user)
        if wait:
            raise limited(chat.id, "too many chats for this user", wait)

    def _check_room(self, id: str) -> None:
        """Refuse a new stream past max_streams, however it would attach (chat, resume, hello.resume, a
        retry); a new chat/resume of an id already attached here replaces that stream (§8.9): no room
        needed."""
        cap = self.gw.settings.max_streams_per_connection
        if len(self._attached) >= cap and id not in self._attached:
            raise limited(id, f"at most {cap} streams per connection", 1000)

    async def _check_resume_limits(self, id: str) -> None:
        wait = self._resume_bucket.take()
        if wait:
            raise limited(id, "too many resumes on this connection", wait)
        self._check_room(id)
        wait = await self.gw.store.rate(self.owner, "resume", self.gw.settings.resume_rate_per_user)
        if wait:
            raise limited(id, "too many resumes for this user", wait)

    async def _chat(self, chat: Chat, *, limits_checked: bool = False) -> None:
        if not limits_checked:
            await self._check_limits(chat)
        user_message = None
        turn_after: str | None = None
        if chat.content is not None:
            turn_after = await self._wait_previous_turn(chat.id)
            user_message = {"role": "user", "content": chat.content}
            messages = [*await self.gw.sessions.history(self.session, self.owner), user_message]
        else:
            messages = [m.to_wire() for m in chat.messages or ()]
        sub = await submit_chat(
            self.gw,
            ChatRequest(
                owner=self.owner,
                chat=chat,
                messages=messages,
                fingerprint=hashlib.sha256(chat.canonical().encode()).hexdigest(),
                weight=self.weight,
                session=self.session,
                user_message=user_message,
                turn_after=turn_after,
            ),
        )
        res = sub.result
        if res.outcome == "turn_moved":
            # Another turn of this session was accepted meanwhile (another connection): wait for it too.
            return await self._chat(chat, limits_checked=True)
        self.log.info(
            "request.accepted", request_id=chat.id, outcome=res.outcome, state=res.state, model=sub.model
        )
        self.proto.send(Accepted(id=chat.id, epoch=res.epoch, state=res.state, model=sub.model))
        self._attach(chat.id, 0, model=sub.model if res.outcome == "new" else None)

    async def _resume(self, id: str, offset: int, epoch: int | None) -> None:
        metrics.RESUMES.inc()
        await self._check_resume_limits(id)
        info = await self.gw.store.get(self.owner, id)
        if info is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "no such request", id=id)
        if epoch is not None and epoch != info.epoch and offset > 0:
            # The log the client's text came from is gone; a stream from this offset would splice two
            # different generations. The client must start over (from offset 0 of the new epoch).
            raise ProtocolError(
                ErrorCode.RESUME_FAILED,
                f"epoch: the request restarted (epoch {info.epoch}, yours {epoch}); resume from offset 0",
                id=id,
            )
        if offset > info.completion_tokens:
            raise ProtocolError(
                ErrorCode.BAD_FRAME,
                f"offset: {offset} is past the {info.completion_tokens} tokens generated so far",
                id=id,
            )
        # Back within the detach timeout: postpone it now, not at the next periodic touch.
        await self.gw.store.touch([self.gw.store.keys.request(self.owner, id)])
        self.proto.send(Accepted(id=id, epoch=info.epoch, state=info.state, model=info.model or None))
        self._attach(id, offset)

    async def _cancel(self, frame: Cancel) -> None:
        before = await self.gw.store.cancel(self.owner, frame.id)
        if before is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "no such request", id=frame.id)
        self.log.info("request.cancel", request_id=frame.id, state_before=before)

    def _attach(self, id: str, offset: int, *, model: str | None = None) -> None:
        """Stream request ``id`` from ``offset``; ``model``: a new request of that model, whose time to
        first token feeds the model's degradation signal."""
        old = self._attached.pop(id, None)
        if old is not None:
            old.cancel()
        started = (time.monotonic(), model) if model is not None else None
        self._attached[id] = asyncio.create_task(self._stream(id, offset, started), name=f"stream-{id}")

    async def _stream(self, id: str, offset: int, started: tuple[float, str] | None = None) -> None:
        """Forward the log of request ``id`` from ``offset``: deltas, then done (or an error)."""
        key = self.gw.store.keys.log(self.owner, id)
        req_key = self.gw.store.keys.request(self.owner, id)
        me = asyncio.current_task()
        sub = self.gw.reader.subscribe(key, offset)
        self.gw.attach(req_key)
        expected = offset
        try:
            while True:
                entry = await sub.queue.get()
                if self._attached.get(id) is not me:
                    return  # superseded by a newer chat/resume of this id on this connection
                batch = [entry]
                while (
                    entry.finish is None
                    and not sub.queue.empty()
                    and expected + sum(e.n for e in batch) < (expected + MAX_TOKENS_PER_DELTA)
                ):
                    entry = sub.queue.get_nowait()
                    batch.append(entry)
                if batch[0].offset != expected:
                    raise ProtocolError(
                        ErrorCode.RESUME_FAILED,
                        f"offset {expected} is not at a delta boundary of this request's log",
                        id=id,
                    )
                deltas = [e for e in batch if e.finish is None]
                if deltas:
                    if started is not None:
                        self.gw.observe_ttft(time.monotonic() - started[0], started[1])  # degradation
                        started = None
                    n = sum(e.n for e in deltas)
                    await self._send(Delta(id=id, offset=expected, n=n, text="".join(e.text for e in deltas)))
                    expected += n
                end = batch[-1]
                if end.finish is not None:
                    if self._attached.get(id) is not me:
                        # Replaced while the delta went out (a cancel that arrived as the send completed
                        # is not seen there): the old stream must end without a done (SPEC §8.9).
                        return
                    await self._finish(id, end)
                    return
        except ProtocolError as exc:
            self.proto.send_error(exc)
            await self._flush()
        except ConnectionClosed:
            pass
        finally:
            self.gw.detach(req_key)
            self.gw.reader.unsubscribe(sub)
            if self._attached.get(id) is asyncio.current_task():
                del self._attached[id]

    async def _finish(self, id: str, end: LogEntry) -> None:
        if end.error_code:
            self.proto.send(Error(code=end.error_code, message=end.error_message, id=id))
        await self._send(
            Done(
                id=id,
                finish_reason=end.finish or "error",
                offset=end.offset,
                usage=Usage(prompt_tokens=end.prompt_tokens, completion_tokens=end.offset),
            )
        )


async def handle(gw: Gateway, ws: WebSocket) -> None:
    conn = Connection(gw, ws)
    gw.connections.add(conn)
    metrics.CONNECTIONS.inc()
    try:
        await conn.run()
    finally:
        metrics.CONNECTIONS.dec()
        gw.connections.discard(conn)
        with contextlib.suppress(Exception):
            await ws.close()
