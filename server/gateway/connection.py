"""The WebSocket protocol door (``/v1/ws``): one client connection, its session and its streams.

The sans-I/O ``ServerConnection`` decides what frames mean; this class does the asynchronous work each
frame asks for and writes out what the protocol queued. Every ``chat``, ``resume``, ``hello.resume``
point and ``cancel`` goes through the core's admission step first (admission.py), before a task, a
subscription or a store call exists for it; a refusal is answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace

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
    Waiting,
    Welcome,
)
from protocol.connection import ServerConnection
from server import metrics
from server.gateway import egress
from server.gateway.admission import Ask, Grant, Kind, task_holding
from server.gateway.auth import authenticate_user
from server.gateway.core import GatewayCore
from server.gateway.ingress import pace, peer_address
from server.gateway.streams import batches
from server.gateway.submit import ChatRequest
from server.store.logs import LogEntry
from server.store.requests import FINAL_STATES

log = structlog.get_logger(__name__)


class TurnDropped(Exception):
    """A waiting content-mode turn was cancelled before it was submitted (Connection._cancel)."""


@dataclass(eq=False)
class WaitingTurn:
    """A content-mode turn this connection holds (SPEC §4.2): ``dropped`` is set by a cancel of it, and
    ``settled`` is done once it has been dropped, submitted or refused (what that cancel waits for).
    ``canonical`` and ``after``: its payload and the turn it waits for, for a resend of it."""

    dropped: asyncio.Event
    settled: asyncio.Future[None]
    canonical: str
    after: str | None

    @property
    def held(self) -> bool:
        """Still waiting (or being submitted): neither dropped nor settled."""
        return not self.dropped.is_set() and not self.settled.done()

    def settle(self) -> None:
        if not self.settled.done():
            self.settled.set_result(None)


async def _quietly(wait: Awaitable[object]) -> None:
    # A cancel here (the connection closed) needs no traceback: see _chat_after_wait.
    try:
        await wait
    except asyncio.CancelledError as exc:
        exc.__traceback__ = None
        raise


class Connection:
    def __init__(self, core: GatewayCore, ws: WebSocket) -> None:
        self.core = core
        self.ws = ws
        assert ws.subprotocol is not None  # the handshake refuses connections without one
        self.proto = ServerConnection(
            ws.subprotocol, on_error=lambda code: metrics.ERRORS.labels(code.value).inc()
        )
        self.user: str | None = None
        self.session = ""
        self.owner = ""
        self.weight = 1.0  # fair-share weight from the JWT tier claim
        self.coalesce_s = 0.0  # hello.coalesce_ms: at most one delta per stream this often
        self.limits = core.admission.connection(peer_address(ws))
        self._attached: dict[str, asyncio.Task[None]] = {}
        self._waiting: set[asyncio.Task[None]] = set()  # content turns waiting for the previous turn
        # The same turns by chat id (a client may send one id twice), for a cancel of them (_cancel).
        self._turns: dict[str, list[WaitingTurn]] = {}
        self._turn_chain: asyncio.Task[None] | None = None  # the last of them
        self._send_lock = asyncio.Lock()
        self._closing: asyncio.Future[None] | None = None  # the close of a socket that sent no hello
        self._gone = False  # the socket is closed: a waiting turn ends with it (_wait_previous_turn)
        self.log = log.bind(server=core.name)

    async def run(self) -> None:
        # A socket that never says hello would hold its read-ahead and a connection slot for ever.
        no_hello = asyncio.get_running_loop().call_later(self.core.settings.hello_timeout_s, self._no_hello)
        try:
            async for message in self.ws:
                # Reading is paced (ingress.py): a connection that sends more bytes a second than its
                # budget waits here, websockets stops reading once a few frames are queued, and TCP
                # pushes back on the sender; one held back for too long in a row is closed.
                if not await pace(self.ws, self.limits.ingress, len(message)):
                    break
                self.proto.receive_data(message)
                for frame in self.proto.events_received():
                    await self._handle(frame)
                await self._flush()
                self.limits.ingress.done()
                if self.proto.close_code is not None:
                    await self._close(self.proto.close_code, self.proto.close_reason)
                    break
                if egress.closing(self.ws):
                    break  # the client closed: what it sent before is not served (egress.py)
        except ConnectionClosed:
            pass
        finally:
            no_hello.cancel()
            self._gone = True
            # A waiting turn's task releases its grant as it is cancelled (task_holding: even one that never
            # started); a client that reconnects sends that chat again (it was never accepted).
            for task in [*self._attached.values(), *self._waiting]:
                task.cancel()
            # A disconnect never cancels a request: it runs on and its log fills for a later resume.
            self._attached.clear()
            # A cancelled task keeps its CancelledError, whose traceback holds the task's frames, which
            # hold this connection: holding the last waiting turn here would make that a cycle, keeping
            # the connection (and the turns' content) until a full collection.
            self._turn_chain = None
            self.limits.close()
            await egress.drain(self.ws)  # what the client sent before it closed, left unread

    async def _close(self, code: int, reason: str) -> None:
        """Close with ``code``, dropping unread whatever the client sent after the frame that closed it
        (SPEC §7). Its close reply queues behind those frames, and websockets stops reading while a
        couple wait (max_queue): a plain close() waited its whole close timeout (10 s) for a reply it
        could not reach, holding the socket and telling the client late."""
        # What is drained is read unpaced: a client that keeps sending instead of replying is cut off
        # after the close timeout (egress.CLOSE_TIMEOUT_S, server.py's serve()).
        closing = asyncio.ensure_future(self.ws.close(code, reason))
        with contextlib.suppress(ConnectionClosed):
            async for _ in self.ws:
                pass  # ends when the close handshake does (or close() gives up and aborts)
        await closing

    def _no_hello(self) -> None:
        if not self.session:
            self.log.info("connection.no_hello")
            reason = f"no hello within {self.core.settings.hello_timeout_s:g} s"
            self._closing = asyncio.ensure_future(self.ws.close(CloseCode.POLICY_VIOLATION, reason))

    async def _flush(self) -> None:
        async with self._send_lock:
            for data in self.proto.data_to_send():
                # A client that stops reading is closed after slow_reader_timeout_s (its requests run on
                # and it can resume them); a socket already closing fails at once (egress.py).
                await egress.send(
                    self.ws, data, self.core.settings.slow_reader_timeout_s, self.log, "connection"
                )

    async def _send(self, frame: ServerFrame) -> None:
        self.proto.send(frame)
        await self._flush()

    async def _handle(self, frame: ClientFrame) -> None:
        try:
            if isinstance(frame, Hello):
                await self._hello(frame)
            elif isinstance(frame, Chat):
                await self._chat_frame(frame)
            elif isinstance(frame, Resume):
                await self._resume(frame.id, frame.offset, frame.epoch)
            elif isinstance(frame, Cancel):
                await self._cancel(frame)
            elif isinstance(frame, Ping):
                self.proto.send(Pong(ts=frame.ts))
        except ProtocolError as exc:
            self.proto.send_error(exc)
        except ConnectionClosed:
            return  # the client went away (or was closed as a slow reader) mid-answer: not a failure
        except Exception as exc:  # a bug or a store outage must not take the server down
            self._internal(frame, exc)

    def _internal(self, frame: ClientFrame, exc: Exception) -> None:
        self.log.error("connection.frame_failed", frame=frame.type, exc_info=exc)
        err = ProtocolError(
            ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}", id=getattr(frame, "id", None)
        )
        if isinstance(frame, Hello) and not self.proto.welcomed:
            # Without a welcome the connection is of no use: say so and let the client reconnect.
            self.proto.fail(err, CloseCode.INTERNAL_ERROR)
        else:
            self.proto.send_error(err)

    def _ask(self, kind: Kind, id: str, held_bytes: int = 0, text_bytes: int = 0) -> Ask:
        return Ask(
            kind,
            self.owner,
            id,
            conn=self.limits,
            session=self.session,
            weight=self.weight,
            held_bytes=held_bytes,
            text_bytes=text_bytes,
        )

    async def _chat_frame(self, chat: Chat) -> None:
        """Admit a chat, then submit it now, or (a content-mode turn whose previous turn is unfinished)
        answer ``waiting`` now and submit it once that turn ends (SPEC §4.2)."""
        same = next((t for t in self._turns.get(chat.id, ()) if t.held), None)
        if same is not None:
            await self._resent_turn(chat, same)
            return
        before = self._turn_chain
        after: list[str] = []
        checked: list[tuple[str, bool]] = []  # what waits() read, so that _chat need not read it again

        async def waits() -> bool:
            if chat.content is None:
                return False
            if before is not None and not before.done():
                return True  # a turn sent earlier on this connection is still waiting: this one queues
            prev, pending = await self._previous_turn(chat.id)
            checked.append((prev, pending))
            if pending:
                after.append(prev)
            return pending

        held = len(chat.content) if chat.content is not None else 0  # characters: near enough
        text = held or sum(len(m.content) for m in chat.messages or ())
        ask = self._ask("chat", chat.id, held_bytes=held, text_bytes=text)
        grant = await self.core.admission.admit(ask, waits=waits)
        if not grant.waiting:
            if await self._chat(chat, grant, turn=checked[-1] if checked else None):
                return
            # Another turn of the session came first after all (sent meanwhile on another connection or
            # gateway): this one waits too, off the read loop, holding a waiting slot like any other.
            try:
                self.core.admission.start_wait(grant)
            except BaseException:
                grant.release()
                raise
            after.clear()
        # Its session's previous turn is still running: this one waits for it without holding up this
        # connection's other frames; turns sent on this connection are accepted in the order sent.
        waits_for = after[0] if after else None
        self.proto.send(Waiting(id=chat.id, after=waits_for))
        turn = WaitingTurn(
            asyncio.Event(), asyncio.get_running_loop().create_future(), chat.canonical(), waits_for
        )
        task = task_holding(grant, self._chat_after_wait(chat, grant, before, turn), name=f"turn-{chat.id}")
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)
        self._turns.setdefault(chat.id, []).append(turn)
        task.add_done_callback(functools.partial(self._turn_ended, chat.id, turn))
        self._turn_chain = task

    async def _resent_turn(self, chat: Chat, turn: WaitingTurn) -> None:
        """A ``chat`` for the id of a turn this connection holds waiting (a client unsure its first one
        arrived): the same payload is answered ``waiting`` again and changes nothing, a waiting slot
        included; another payload is ``idempotency_conflict``, as it would be once the turn exists
        (SPEC §4.2, §10.2). Rated as a chat all the same; it needs no room, like any chat of an id the
        connection already holds (§6)."""
        ask = replace(self._ask("chat", chat.id, text_bytes=len(chat.content or "")), stream=False)
        (await self.core.admission.admit(ask)).release()
        if chat.canonical() != turn.canonical:
            raise ProtocolError(
                ErrorCode.IDEMPOTENCY_CONFLICT,
                "id: a turn with another payload is waiting under this id; use a new id for a new request",
                id=chat.id,
            )
        if turn.held:
            self.proto.send(Waiting(id=chat.id, after=turn.after))
        elif chat.id in self._attached:
            # Its wait ended during the admission's store call, and it was accepted: a waiting now would
            # follow its accepted. The same chat of an attached id re-attaches from 0 (SPEC §8.9).
            await self._resume(chat.id, 0, None)
        else:
            await self._chat_frame(chat)  # refused or dropped meanwhile: nothing holds it now

    def _turn_ended(self, id: str, turn: WaitingTurn, _task: asyncio.Task[None]) -> None:
        turn.settle()  # a task cancelled with its connection: a cancel waiting on it must not hang
        turns = self._turns.get(id, [])
        if turn in turns:
            turns.remove(turn)
        if not turns:
            self._turns.pop(id, None)

    async def _chat_after_wait(
        self, chat: Chat, grant: Grant, before: asyncio.Task[None] | None, turn: WaitingTurn
    ) -> None:
        try:
            try:
                if before is not None:
                    # The turn sent before this one on this connection goes first (or a cancel of this one).
                    waker = asyncio.ensure_future(turn.dropped.wait())
                    try:
                        await asyncio.wait({before, waker}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waker.cancel()
                await self._chat(chat, grant, dropped=turn.dropped)
            finally:
                turn.settle()  # dropped, submitted or refused: what a cancel of it waits for
        except TurnDropped:
            # Cancelled while it waited: never submitted, so nothing exists in the store (SPEC §4.2).
            self.log.info("request.cancel", request_id=chat.id, state_before="waiting")
            self.proto.send(Done(id=chat.id, finish_reason="cancelled", offset=0, usage=Usage(0, 0)))
            with contextlib.suppress(ConnectionClosed):
                await self._flush()
            if before is not None:
                # Turns sent after this one on this connection wait for this task: it ends when the turn
                # ahead of it does, so they are still accepted in the order they were sent.
                await _quietly(asyncio.wait({before}))
        except ProtocolError as exc:
            self.proto.send_error(exc)
        except Exception as exc:
            self._internal(chat, exc)
        except asyncio.CancelledError as exc:
            # The connection closed. A cancel that landed before _chat (waiting for the turn ahead)
            # leaves the grant to release here; release is idempotent.
            grant.release()
            # The task keeps its CancelledError, and a cancel that landed inside a store call carries
            # that library's frames in its traceback, one of which holds the task (its timeout context):
            # a cycle holding this connection until a full collection. The inner frames say nothing a
            # closed connection needs; drop them.
            exc.__traceback__ = None
            raise
        finally:
            grant.end_wait()
        with contextlib.suppress(ConnectionClosed):
            await self._flush()

    async def _previous_turn(self, id: str) -> tuple[str, bool]:
        """The session's latest content-mode turn ("" if none) and whether it is still unfinished."""
        prev = await self.core.sessions.last_turn(self.session, self.owner)
        if not prev or prev == id:
            return prev, False
        info = await self.core.store.get(self.owner, prev)
        return prev, info is not None and info.state not in FINAL_STATES

    async def _wait_previous_turn(self, id: str, dropped: asyncio.Event) -> str:
        """Wait until the session's latest content turn has ended; its id ("" for none). A turn then
        sees the reply of the one before it, whichever connection or gateway sent either. Raises
        TurnDropped once ``dropped`` is set (a cancel of this turn)."""
        delay = 0.02
        while True:
            if dropped.is_set():
                raise TurnDropped
            prev, pending = await self._previous_turn(id)
            if self._gone:
                # The close cancelled this turn, but a store call interrupted mid-command can swallow that
                # one cancel (seen with redis-py: the loop then polled on until the previous turn ended,
                # holding the closed connection). The turn ends with its connection, never submitted.
                raise asyncio.CancelledError
            if dropped.is_set():
                raise TurnDropped
            if not pending:
                return prev
            with contextlib.suppress(TimeoutError):  # woken at once by a cancel of this turn
                async with asyncio.timeout(delay):
                    await dropped.wait()
            delay = min(delay * 2, 0.25)

    async def _hello(self, hello: Hello) -> None:
        try:
            self.user, self.weight = authenticate_user(hello.token, self.core.settings.auth_secret)
        except ProtocolError as exc:
            self.proto.fail(exc, CloseCode.POLICY_VIOLATION)
            return
        sessions = self.core.sessions
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
        self.coalesce_s = (hello.coalesce_ms or 0) / 1000
        self.log = self.log.bind(session=session, user=self.user)
        await sessions.touch(session, self.owner, new=not hello.session_token)
        self.proto.send(
            Welcome(
                session=session,
                session_token=sessions.token(session, self.owner),
                server=self.core.name,
                limits=self.core.limits(),
                models=(await self.core.models.served()).names,
                loading=await self.core.models.loading(),
            )
        )
        for i, point in enumerate(hello.resume, 1):
            try:
                await self._resume(point.id, point.offset, point.epoch)
            except ProtocolError as exc:
                self.proto.send_error(exc)
            if i % 16 == 0:
                # Up to 256 points, each a store lookup or two: answer as they come, not all at the end.
                await self._flush()

    async def _chat(
        self,
        chat: Chat,
        grant: Grant,
        *,
        turn: tuple[str, bool] | None = None,
        dropped: asyncio.Event | None = None,
    ) -> bool:
        """Submit an admitted chat and attach its stream; the grant goes to the stream, or is released.
        ``dropped`` given (a waiting turn, off the read loop): a content turn waits here for its session's
        previous turn, until a cancel sets ``dropped`` (TurnDropped). None (called from the read loop): a
        content turn whose session's previous turn is unfinished is not waited for here; False is
        returned and the grant stays the caller's. ``turn``:
        the session's previous turn as admission just read it (``_previous_turn``), used once instead of
        a second read; a turn that moved since is caught by the submit all the same (``turn_moved``)."""
        try:
            while True:
                user_message = None
                turn_after: str | None = None
                if chat.content is not None:
                    if dropped is not None:
                        turn_after = await self._wait_previous_turn(chat.id, dropped)
                    else:
                        turn_after, pending = turn if turn is not None else await self._previous_turn(chat.id)
                        turn = None  # after a turn_moved, read it again
                        if pending:
                            return False
                    grant.end_wait()  # its content now goes to the store
                    user_message = {"role": "user", "content": chat.content}
                    messages = [*await self.core.sessions.history(self.session, self.owner), user_message]
                else:
                    messages = [m.to_wire() for m in chat.messages or ()]
                sub = await self.core.submitter.submit(
                    ChatRequest(
                        owner=self.owner,
                        chat=chat,
                        messages=messages,
                        fingerprint=hashlib.sha256(chat.canonical().encode()).hexdigest(),
                        session=self.session,
                        user_message=user_message,
                        turn_after=turn_after,
                    ),
                    grant,
                )
                # turn_moved: another turn of this session was accepted meanwhile (another connection):
                # wait for that one too.
                if sub.result.outcome != "turn_moved":
                    break
                if dropped is None:
                    return False
        except BaseException:
            grant.release()
            raise
        res = sub.result
        self.log.info(
            "request.accepted", request_id=chat.id, outcome=res.outcome, state=res.state, model=sub.model
        )
        self.proto.send(Accepted(id=chat.id, epoch=res.epoch, state=res.state, model=sub.model))
        self._attach(chat.id, 0, grant, model=sub.model if res.outcome == "new" else None)
        return True

    async def _resume(self, id: str, offset: int, epoch: int | None) -> None:
        metrics.RESUMES.inc()
        grant = await self.core.admission.admit(self._ask("resume", id))
        try:
            info = await self.core.store.get(self.owner, id)
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
        except BaseException:
            grant.release()
            raise
        self.proto.send(Accepted(id=id, epoch=info.epoch, state=info.state, model=info.model or None))
        self._attach(id, offset, grant)

    async def _cancel(self, frame: Cancel) -> None:
        # Admitted before the store is asked anything (SPEC §6); a cancel holds nothing afterwards.
        ask = Ask("cancel", self.owner, frame.id, conn=self.limits, session=self.session, stream=False)
        (await self.core.admission.admit(ask)).release()
        turns = self._turns.get(frame.id)
        if turns:
            # A content turn this connection holds waiting: it is dropped, and answers done (cancelled)
            # itself, unless it was already being submitted; then it is cancelled in the store below,
            # once its submit is through (a short wait: it no longer waits for the previous turn).
            for turn in turns:
                turn.dropped.set()
            await asyncio.wait([turn.settled for turn in turns])
            if frame.id not in self._attached:
                return
        before = await self.core.store.cancel(self.owner, frame.id)
        if before is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "no such request", id=frame.id)
        self.log.info("request.cancel", request_id=frame.id, state_before=before)

    def _attach(self, id: str, offset: int, grant: Grant, *, model: str | None = None) -> None:
        """Stream request ``id`` from ``offset`` under ``grant``; ``model``: a new request of that model,
        whose time to first token feeds the model's degradation signal."""
        old = self._attached.pop(id, None)
        if old is not None:
            old.cancel()
        started = (time.monotonic(), model) if model is not None else None
        self._attached[id] = task_holding(
            grant, self._stream(id, offset, grant, started), name=f"stream-{id}"
        )

    async def _stream(
        self, id: str, offset: int, grant: Grant, started: tuple[float, str] | None = None
    ) -> None:
        """Forward the log of request ``id`` from ``offset``: deltas, then done (or an error)."""
        me = asyncio.current_task()
        expected = offset
        try:
            # A request submitted just now (``started``) has the deadline a touch would give it.
            async with self.core.streams.follow(grant, self.owner, id, offset, touch=started is None) as sub:
                async for batch in batches(sub, id, offset):
                    if self._attached.get(id) is not me:
                        return  # superseded by a newer chat/resume of this id on this connection
                    deltas = [e for e in batch if e.finish is None]
                    if deltas:
                        if started is not None:
                            self.core.degradation.observe_ttft(time.monotonic() - started[0], started[1])
                            started = None
                        n = sum(e.n for e in deltas)
                        text = "".join(e.text for e in deltas)
                        await self._send(Delta(id=id, offset=expected, n=n, text=text))
                        expected += n
                    end = batch[-1]
                    if self.coalesce_s and end.finish is None and sub.queue.empty():
                        # What arrives meanwhile goes out as one delta (whole log entries: offsets and
                        # resume points are unchanged). A replay that is behind does not wait, and
                        # neither does the end (a finish or a cancel): the rest and done go at once.
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(sub.ended.wait(), self.coalesce_s)
                    if end.finish is not None:
                        if self._attached.get(id) is not me:
                            # Replaced while the delta went out (a cancel that arrived as the send
                            # completed is not seen there): the old stream ends without a done (§8.9).
                            return
                        await self._finish(id, end)
                        return
        except ProtocolError as exc:
            self.proto.send_error(exc)
            await self._flush()
        except ConnectionClosed:
            pass
        finally:
            grant.release()  # follow() released it too, unless the subscription never started
            if self._attached.get(id) is asyncio.current_task():
                del self._attached[id]
            # This frame outlives the task inside a cancelled task's traceback; holding the task there
            # would make a cycle (task, its CancelledError, this frame) that keeps the connection.
            del me

    async def _finish(self, id: str, end: LogEntry) -> None:
        if end.error_code:
            self.proto.send(Error(code=end.error_code, message=end.error_message, id=id))
        await self._send(
            Done(
                id=id,
                finish_reason=end.finish or "error",
                offset=end.offset,
                usage=Usage(
                    prompt_tokens=end.prompt_tokens,
                    completion_tokens=end.offset,
                    cached_tokens=end.cached_tokens,
                ),
                cancel_reason=end.cancel_reason or None,
                # Only a length has one (SPEC 5): a receiver takes it on another end for a bad frame.
                length_reason=(end.length_reason or None) if end.finish == "length" else None,
            )
        )
