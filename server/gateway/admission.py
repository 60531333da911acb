"""The one admission step every door takes when a frame or request arrives, before it holds anything.

A door (the WebSocket protocol, HTTP chat completions, the Responses API over HTTP or WebSocket) asks
:meth:`Admission.admit` once per ``chat``, resume (a retrieve over HTTP is one) or cancel, before it
creates a task, keeps a buffer beyond the frame it read, subscribes to a log, reads one or writes to the
store. The answer is a :class:`Grant` or a
``ProtocolError`` (``rate_limited`` / ``overloaded`` with ``retry_after_ms``), which the door sends at
once: nothing waits to be refused.

A grant is what the rest of the core insists on: :meth:`server.gateway.submit.Submitter.submit` and
:meth:`server.gateway.streams.Streams.follow` take one and refuse to run without it, so a door cannot
skip this step. A grant holds the stream slot (of its connection and of its owner) and, for a
content-mode turn that waits for the previous turn, a waiting slot of its session and the bytes of its
content, until the door releases it; releasing is idempotent. A door that gives its grant to a task makes
that task with :func:`task_holding`, which releases the grant if the task is cancelled before it ran.

What is checked, cheapest first (SPEC.md §6):

1. the connection's token bucket for chats, resumes or cancels (WebSocket doors; for HTTP, resumes and
   cancels per owner on this gateway), and for the bytes of chat text (per connection; per owner on this
   gateway for HTTP);
2. streams attached or reserved on the connection (``max_streams``) and for the owner on this gateway;
3. for a waiting turn: turns waiting in its session, waiting bytes on this gateway, and the queue depth
   (a turn that would be refused ``overloaded`` once its wait ends is refused now);
4. the owner's rate of chats or resumes across all gateways (a counter in the store: the one write
   admission makes; a cancel is rated locally only, as it costs the store no more than that counter).

Frame and body sizes are checked where the bytes are read (websockets' ``max_size``, the HTTP door's
``max_body``), from the same settings (:attr:`Admission.max_frame_bytes`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from protocol import ErrorCode, ProtocolError
from server import metrics
from server.gateway.ingress import Ingress, Pace
from server.gateway.settings import GatewaySettings
from server.store.requests import RequestStore

Kind = Literal["chat", "resume", "cancel"]
T = TypeVar("T")


@dataclass(slots=True)
class TokenBucket:
    """``rate`` per second with bursts of ``burst``; local to one connection (or gateway)."""

    rate: float
    burst: float
    tokens: float = field(default=float("nan"))  # starts full
    at: float = field(default_factory=time.monotonic)

    def take(self, cost: float = 1.0) -> int:
        """0 if allowed (``cost`` taken), else how many ms until it would be. A cost above the burst is
        allowed once the bucket is full, leaving it in debt, so no single action is refused for ever."""
        now = time.monotonic()
        if self.tokens != self.tokens:  # NaN: first use
            self.tokens = self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        need = min(cost, self.burst)
        if self.tokens >= need:
            self.tokens -= cost
            return 0
        return max(1, int((need - self.tokens) / self.rate * 1000))


def limited(id: str | None, what: str, retry_after_ms: int) -> ProtocolError:
    return ProtocolError(
        ErrorCode.RATE_LIMITED, f"{what}; retry in {retry_after_ms} ms", id=id, retry_after_ms=retry_after_ms
    )


Rated = Literal["chat", "resume", "cancel", "bytes"]  # what a token bucket limits ("bytes": chat text)


def rate_bucket(st: GatewaySettings, what: Rated) -> TokenBucket:
    """A full bucket for ``what`` at one connection's rate: WebSocket connections have one of each, HTTP
    callers one per owner on the gateway. Bursts are twice the rate; resumes and cancels may burst to
    ``max_streams`` (one reconnect resumes every stream it may hold, a hello.resume of that many points)."""
    if what == "bytes":
        # The text a connection's chats carry, per second: a 1 MiB chat costs as much as 1,000 small ones
        # to store, prepare and template, so the chat rate alone would let one socket push 10 MiB/s.
        rate = float(st.chat_bytes_per_connection)
        return TokenBucket(rate=rate, burst=2 * rate)
    if what == "chat":
        return TokenBucket(rate=st.chat_rate_per_connection, burst=2 * st.chat_rate_per_connection)
    rate = st.resume_rate_per_connection if what == "resume" else st.cancel_rate_per_connection
    return TokenBucket(rate=rate, burst=max(2 * rate, float(st.max_streams_per_connection)))


_PLURAL = {"chat": "chats", "resume": "resumes", "cancel": "cancels"}


class _Buckets:
    """Owner -> bucket of ``what``, made on first use; bounded: past 10,000 owners the oldest is
    forgotten (and starts full again)."""

    def __init__(self, st: GatewaySettings, what: Rated) -> None:
        self.st, self.what = st, what
        self.buckets: dict[str, TokenBucket] = {}

    def of(self, owner: str) -> TokenBucket:
        bucket = self.buckets.get(owner)
        if bucket is None:
            bucket = self.buckets[owner] = rate_bucket(self.st, self.what)
            if len(self.buckets) > 10_000:
                self.buckets.pop(next(iter(self.buckets)))
        return bucket


class ConnectionLimits:
    """One WebSocket connection's share of the limits: its buckets and the ids of its streams (attached,
    or reserved by a grant not yet attached)."""

    def __init__(self, st: GatewaySettings, ingress: Pace) -> None:
        self.buckets = {what: rate_bucket(st, what) for what in ("chat", "resume", "cancel", "bytes")}
        # Every byte read, frames of any kind: paced rather than refused (ingress.py).
        self.ingress = ingress
        self.streams: dict[str, int] = {}  # id -> grants holding a stream of it on this connection

    def count(self) -> int:
        return len(self.streams)

    def close(self) -> None:
        """The connection ended: its share of its peer's pace goes (idempotent)."""
        self.ingress.close()


@dataclass(frozen=True, slots=True)
class Ask:
    """What a door asks to do. ``conn`` is None for doors without a connection of their own (HTTP: one
    request at a time per connection). ``stream``: the request will follow a log (an HTTP background
    create does not). ``waits``: a content-mode turn that will wait for its session's previous turn,
    holding ``held_bytes`` meanwhile."""

    kind: Kind
    owner: str
    id: str
    conn: ConnectionLimits | None = None
    session: str = ""
    weight: float = 1.0
    stream: bool = True
    waits: bool = False
    held_bytes: int = 0
    text_bytes: int = 0  # the chat's text (content or messages): charged to the byte rate


class Grant:
    """Admission's yes. Only :class:`Admission` makes them; the submit path and the log follower check
    ``isinstance`` and refuse anything else. Holds its slots until :meth:`release`."""

    __slots__ = ("_admission", "_streams", "_waiting", "ask", "submitted", "weight")

    def __init__(self, admission: Admission, ask: Ask, key: object) -> None:
        if key is not _MINT:
            raise TypeError("grants come from Admission.admit")
        self._admission = admission
        self.ask = ask
        self.weight = ask.weight  # the owner's fair-share weight, as admission saw it
        self._streams = ask.stream
        self._waiting = ask.waits
        self.submitted = False  # the submit path takes a grant once

    @property
    def waiting(self) -> bool:
        return self._waiting

    def _begin_wait(self, ask: Ask) -> None:
        self.ask = ask
        self._waiting = True

    def end_wait(self) -> None:
        """The turn's wait is over (it is about to be submitted, or dropped): free its waiting slot."""
        if self._waiting:
            self._waiting = False
            self._admission._end_wait(self.ask)

    def release(self) -> None:
        """Free everything this grant holds (idempotent): the door's stream ended or was refused."""
        self.end_wait()
        if self._streams:
            self._streams = False
            self._admission._end_stream(self.ask)


_MINT = object()


class Admission:
    """Per-gateway counters and the store's per-owner rates; see the module docstring."""

    def __init__(
        self,
        settings: GatewaySettings,
        store: RequestStore,
        queued: Callable[[str], Awaitable[int]] | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self._queued = queued  # route -> queue depth, cached (degradation.py); None: never consulted
        self.streams_by_owner: dict[str, int] = {}
        self.waiting_by_session: dict[str, int] = {}
        self.waiting_bytes = 0
        # HTTP callers' rates on this gateway, per owner, at a connection's rates (chats are rated
        # across gateways instead, in _check_shared).
        self.by_owner = {what: _Buckets(settings, what) for what in ("resume", "cancel", "bytes")}
        self.ingress = Ingress(
            per_connection=2.0 * settings.chat_bytes_per_connection,
            per_peer=float(settings.ingress_bytes_per_peer),
            flood_close_s=settings.flood_close_s,
        )

    @property
    def max_frame_bytes(self) -> int:
        return self.settings.max_frame_bytes

    def connection(self, peer: str) -> ConnectionLimits:
        """The limits of a new WebSocket connection from address ``peer``; ``close()`` them when it ends."""
        return ConnectionLimits(self.settings, self.ingress.open(peer))

    async def admit(self, ask: Ask, *, waits: Callable[[], Awaitable[bool]] | None = None) -> Grant:
        """Admit ``ask`` or raise ProtocolError (rate_limited / overloaded, with retry_after_ms). Nothing
        is held when it raises; the grant holds its slots when it returns. ``waits``, asked only once the
        connection's own limits passed: whether this content-mode turn will wait for the previous one
        (``grant.waiting`` then says so)."""
        try:
            self._check_local(ask)
            if waits is not None and not ask.waits and await waits():
                ask = replace(ask, waits=True)
                self._check_waiting(ask)
            grant = self._take(ask)
        except ProtocolError as exc:
            metrics.ADMISSION.labels(ask.kind, exc.code.value).inc()
            raise
        try:
            await self._check_shared(ask)
        except BaseException as exc:
            grant.release()
            if isinstance(exc, ProtocolError):
                metrics.ADMISSION.labels(ask.kind, exc.code.value).inc()
            raise
        metrics.ADMISSION.labels(ask.kind, "admitted").inc()
        return grant

    def _check_local(self, ask: Ask) -> None:
        st = self.settings
        conn = ask.conn
        if conn is not None:
            wait = conn.buckets[ask.kind].take()
            if wait:
                raise limited(ask.id, f"too many {_PLURAL[ask.kind]} on this connection", wait)
            if ask.text_bytes:
                wait = conn.buckets["bytes"].take(ask.text_bytes)
                if wait:
                    raise limited(ask.id, "too much chat text on this connection", wait)
            cap = st.max_streams_per_connection
            # A new chat/resume of an id already streaming here replaces that stream (SPEC §8.9).
            if ask.stream and conn.count() >= cap and ask.id not in conn.streams:
                raise limited(ask.id, f"at most {cap} streams per connection", 1000)
        else:
            # Doors without a connection of their own (HTTP): the owner's share of this gateway. A
            # retrieve reads a whole log and a cancel runs a store script: each is rated like a
            # connection's (chats are rated across gateways, in _check_shared).
            if ask.kind != "chat":
                wait = self.by_owner[ask.kind].of(ask.owner).take()
                if wait:
                    raise limited(ask.id, f"too many {_PLURAL[ask.kind]} for this user", wait)
            if ask.text_bytes:
                wait = self.by_owner["bytes"].of(ask.owner).take(ask.text_bytes)
                if wait:
                    raise limited(ask.id, "too much chat text for this user", wait)
        if ask.stream and self.streams_by_owner.get(ask.owner, 0) >= st.max_streams_per_user:
            raise limited(ask.id, f"at most {st.max_streams_per_user} streams per user on this server", 1000)
        self._check_waiting(ask)

    def _check_waiting(self, ask: Ask) -> None:
        st = self.settings
        if ask.waits:
            cap = st.max_waiting_turns_per_session
            if self.waiting_by_session.get(ask.session, 0) >= cap:
                raise limited(ask.id, f"at most {cap} turns of a session may wait for the previous one", 1000)
            if self.waiting_bytes + ask.held_bytes > st.max_waiting_bytes:
                raise ProtocolError(
                    ErrorCode.OVERLOADED,
                    "too many turns waiting on this server; retry later",
                    id=ask.id,
                    retry_after_ms=1000,
                )

    async def _check_shared(self, ask: Ask) -> None:
        if ask.kind == "cancel":
            return
        st = self.settings
        if ask.waits and self._queued is not None and self.store.settings.max_queued:
            # A waiting turn is held until its wait ends; one the queue would refuse is refused now.
            queued = await self._queued("")
            if queued >= self.store.settings.max_queued:
                raise ProtocolError(
                    ErrorCode.OVERLOADED,
                    "the server's queue is full; retry later",
                    id=ask.id,
                    retry_after_ms=1000,
                )
        limit = st.chat_rate_per_user if ask.kind == "chat" else st.resume_rate_per_user
        wait = await self.store.rate(ask.owner, ask.kind, limit)
        if wait:
            raise limited(ask.id, f"too many {_PLURAL[ask.kind]} for this user", wait)

    def start_wait(self, grant: Grant) -> None:
        """A granted turn that must wait after all: its session's previous turn was found unfinished, or
        another turn was accepted, between admission and submit. It takes a waiting slot as if it had
        waited from the start, or raises as :meth:`admit` would (the grant is still the caller's)."""
        if grant.waiting:
            return
        ask = replace(grant.ask, waits=True)
        try:
            self._check_waiting(ask)
        except ProtocolError as exc:
            metrics.ADMISSION.labels(ask.kind, exc.code.value).inc()
            raise
        self._take_wait(ask)
        grant._begin_wait(ask)

    def _take(self, ask: Ask) -> Grant:
        if ask.stream:
            if ask.conn is not None:
                ask.conn.streams[ask.id] = ask.conn.streams.get(ask.id, 0) + 1
            self.streams_by_owner[ask.owner] = self.streams_by_owner.get(ask.owner, 0) + 1
        if ask.waits:
            self._take_wait(ask)
        return Grant(self, ask, _MINT)

    def _take_wait(self, ask: Ask) -> None:
        self.waiting_by_session[ask.session] = self.waiting_by_session.get(ask.session, 0) + 1
        self.waiting_bytes += ask.held_bytes
        metrics.WAITING_TURNS.inc()

    def _end_wait(self, ask: Ask) -> None:
        _decrement(self.waiting_by_session, ask.session)
        self.waiting_bytes -= ask.held_bytes
        metrics.WAITING_TURNS.dec()

    def _end_stream(self, ask: Ask) -> None:
        if ask.conn is not None:
            _decrement(ask.conn.streams, ask.id)
        _decrement(self.streams_by_owner, ask.owner)


def _decrement(counts: dict[str, int], key: str) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


def require(grant: object) -> Grant:
    """The grant a core entry point was given, checked: a door that skipped admission fails here."""
    if not isinstance(grant, Grant):
        raise TypeError("this needs a Grant from Admission.admit: every door is admitted first")
    return grant


def task_holding(grant: Grant, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
    """A task that runs ``coro``, which holds ``grant`` and releases it (or hands it on) as it ends.

    A task cancelled before its first step never runs its coroutine's body, its ``finally`` included, so
    it would keep the grant's slots for good. A connection whose client is gone cancels its tasks in the
    same pass of the event loop that made them (websockets raises ``ConnectionClosed`` without suspending
    once the socket is lost), and a client that sends a chat and drops at once did that: each time, one
    stream slot of its owner was kept, and after ``max_streams_per_user`` of them the owner was refused
    every stream until a restart. Here a task that never started releases the grant as it ends. One that
    started is its body's business: it may have handed the grant to another task (a waiting turn to the
    stream it attached)."""
    started = False

    async def run() -> T:
        nonlocal started
        started = True
        return await coro

    def unstarted(_task: asyncio.Task[T]) -> None:
        if not started:
            coro.close()  # never awaited: closed, without a "never awaited" warning
            grant.release()

    task = asyncio.create_task(run(), name=name)
    task.add_done_callback(unstarted)
    return task
