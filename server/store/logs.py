"""Reading token logs: one blocking XREAD per reader process serves every attached stream.

A gateway attaches many (connection, request) pairs to logs. Rather than one polling task per request,
``LogReader`` keeps one task that issues a single ``XREAD BLOCK`` over all attached logs (each from the
lowest position any of its subscribers still needs) and hands entries to subscribers. Attaching a new log
XADDs to this reader's own wake stream, which is part of every XREAD, so the blocking read returns at once
and the next one includes the new log.

A command's keys must share a hash slot on a Redis Cluster, so the reader runs one such read per
partition (keys.py: a log lives in its owner's partition, and so does the wake stream it reads with):
one on a plain Redis, CLUSTER_PARTITIONS (each holding a connection) on a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog

from server.aio import cancel_and_wait
from server.store.keys import Keys
from server.store.requests import execute

log = structlog.get_logger(__name__)

WAKE_TTL_MS = 24 * 3600 * 1000
# How often a reader renews that expiry: far inside it, and rarely, since a wake-up comes with every
# stream a gateway attaches and a PEXPIRE with each one was a command per request for nothing.
WAKE_RENEW_S = 3600.0

# After a read that brought entries, a reader pauses this long per log it follows (at most
# MAX_READ_PAUSE_S) before reading again, so the next read gathers the writes meanwhile. A read names
# every followed log, so it costs in proportion to them, in the gateway's Python and in Redis; without
# the pause a reader reads again after every write of every worker. Following 1,024 logs at 500 writes a
# second (`python -m server.bench.fanin`, 2-core EPYC), it read 298-306 times a second, Redis spent
# 117-130 ms a second on it and the process 930-943 ms (the writer with it could not even keep up);
# with the pause (20.5 ms there), 38-39 reads, 47-48 ms and 237-274 ms. Tokens reach the client up to
# the pause later; under MIN_READ_PAUSE_S (fewer than 50 logs) there is none.
READ_PAUSE_S_PER_LOG = 20e-6
MAX_READ_PAUSE_S = 0.05
MIN_READ_PAUSE_S = 0.001

# The client type a LogReader reads with, for callers outside the store (the gateway never imports redis).
RedisClient = aioredis.Redis


@dataclass(frozen=True, slots=True)
class LogEntry:
    """A delta (``finish`` is None) or the end of the log (``finish`` set, ``n`` = 0, ``offset`` = total)."""

    offset: int
    n: int
    text: str
    finish: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the engine reused (the end entry's "ct")
    error_code: str = ""
    error_message: str = ""
    cancel_reason: str = ""  # the end entry's "c": "detach_timeout" when nobody was attached (detach.lua)
    length_reason: str = ""  # the end entry's "lr": "max_tokens" or "context" with finish "length"

    @staticmethod
    def parse(fields: dict[bytes, bytes]) -> LogEntry:
        d = {k.decode(): v.decode() for k, v in fields.items()}
        if "d" in d:
            return LogEntry(
                offset=int(d["o"]),
                n=0,
                text="",
                finish=d["d"],
                prompt_tokens=int(d.get("pt") or 0),
                cached_tokens=int(d.get("ct") or 0),
                error_code=d.get("e", ""),
                error_message=d.get("m", ""),
                cancel_reason=d.get("c", ""),
                length_reason=d.get("lr", ""),
            )
        return LogEntry(offset=int(d["o"]), n=int(d["n"]), text=d["t"])


def read_pause_s(following: int) -> float:
    """How long a reader following ``following`` logs waits after a read that brought entries (0: none)."""
    pause = min(MAX_READ_PAUSE_S, following * READ_PAUSE_S_PER_LOG)
    return pause if pause >= MIN_READ_PAUSE_S else 0.0


def position(offset: int) -> str:
    """The stream id just before the entry that starts at ``offset``."""
    return f"{offset}-0"


@dataclass(eq=False, slots=True)
class Subscription:
    key: str
    last_id: str
    queue: asyncio.Queue[LogEntry] = field(default_factory=asyncio.Queue)
    closed: bool = False
    # Set once the log's end entry is queued: a reader pacing its deltas (hello.coalesce_ms) stops
    # waiting, so the last delta and done go out when the request ends, not when its window closes.
    ended: asyncio.Event = field(default_factory=asyncio.Event)


def _id_tuple(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


class LogReader:
    """Fans token-log entries out to subscribers with one blocking read per partition (see the module
    docstring)."""

    def __init__(
        self, r: aioredis.Redis, keys: Keys, name: str, *, block_ms: int = 2000, count: int = 256
    ) -> None:
        # ``r`` should be a client of its own: each partition's blocking XREAD holds a connection.
        self.keys = keys
        self._parts = [
            PartitionReader(r, keys.wake(name, p), block_ms=block_ms, count=count)
            for p in range(keys.partitions)
        ]

    def start(self) -> None:
        for part in self._parts:
            part.start()

    async def stop(self) -> None:
        for part in self._parts:
            await part.stop()

    def reader_for(self, key: str) -> PartitionReader:
        """The partition's reader that serves the log at ``key``."""
        return self._parts[self.keys.partition_of(key)]

    def subscribe(self, key: str, offset: int) -> Subscription:
        """Receive the log at ``key`` from token ``offset`` on (replay, then live) until unsubscribed
        (see :meth:`PartitionReader.subscribe`)."""
        return self.reader_for(key).subscribe(key, offset)

    def unsubscribe(self, sub: Subscription) -> None:
        self.reader_for(sub.key).unsubscribe(sub)


class PartitionReader:
    """The logs of one partition, read with one blocking XREAD (with the partition's wake stream)."""

    def __init__(self, r: aioredis.Redis, wake_key: str, *, block_ms: int = 2000, count: int = 256) -> None:
        # ``r`` should be a client of its own: a blocking XREAD holds its connection. ``block_ms`` stays
        # under redis-py's default 5 s socket timeout.
        self.r = r
        self.wake_key = wake_key
        self.block_ms = block_ms
        self.count = count
        self._subs: dict[str, set[Subscription]] = {}
        self._task: asyncio.Task[None] | None = None
        self._waker: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._wake_id = "$"
        self._renew_at = 0.0  # when the wake stream's expiry is next renewed (monotonic)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="log-reader")
        self._waker = asyncio.create_task(self._wake_loop(), name="log-reader-wake")

    async def stop(self) -> None:
        await cancel_and_wait([self._task, self._waker])
        with contextlib.suppress(Exception):
            await self.r.delete(self.wake_key)

    def subscribe(self, key: str, offset: int) -> Subscription:
        """Receive the log at ``key`` from token ``offset`` on (replay, then live) until unsubscribed.

        Synchronous on purpose: the subscription exists when this returns, whatever happens to the
        caller; the blocking read is woken by a separate task.
        """
        sub = Subscription(key, position(offset))
        self._subs.setdefault(key, set()).add(sub)
        self._wake.set()
        return sub

    async def _wake_loop(self) -> None:
        # One XADD wakes the blocking read for any number of subscriptions made since the last one.
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                pipe = self.r.pipeline(transaction=False)
                pipe.xadd(self.wake_key, {"w": 1}, maxlen=16, approximate=False)  # exact: it stays tiny
                renew = time.monotonic() >= self._renew_at
                if renew:
                    # A gateway killed without stop() would leave its wake stream behind for good. (A
                    # Redis that lost it meanwhile gets it back from the XADD without an expiry for at
                    # most WAKE_RENEW_S: 16 entries.)
                    pipe.pexpire(self.wake_key, WAKE_TTL_MS)
                await execute(pipe)
                if renew:
                    self._renew_at = time.monotonic() + WAKE_RENEW_S
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("log_reader.wake_failed", error=str(exc))
                await asyncio.sleep(0.2)
                self._wake.set()

    def unsubscribe(self, sub: Subscription) -> None:
        sub.closed = True
        subs = self._subs.get(sub.key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.key]

    async def _run(self) -> None:
        if self._wake_id == "$":
            # Resolve "$" once, so a wake-up XADDed between two reads is never missed.
            info = await self.r.xinfo_stream(self.wake_key) if await self.r.exists(self.wake_key) else None
            self._wake_id = info["last-generated-id"].decode() if info else "0-0"
        while True:
            streams: dict[str, str] = {self.wake_key: self._wake_id}
            for key, subs in self._subs.items():
                streams[key] = min((s.last_id for s in subs), key=_id_tuple)
            try:
                res: Any = await self.r.xread(streams, count=self.count, block=self.block_ms)  # type: ignore[arg-type]
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarting, connection dropped: retry, never die silently
                log.warning("log_reader.read_failed", error=str(exc))
                await asyncio.sleep(0.2)
                continue
            logged = False
            for stream, entries in res or []:
                key = stream.decode()
                if key == self.wake_key:
                    self._wake_id = entries[-1][0].decode()
                    continue
                logged = True
                self._dispatch(key, entries, _id_tuple(streams[key]))
            pause = read_pause_s(len(self._subs))
            if logged and pause:
                # Let the writes gather (READ_PAUSE_S_PER_LOG). A new subscription's wake-up alone does
                # not pause: its first read, a replay perhaps, goes at once.
                await asyncio.sleep(pause)

    def _dispatch(
        self, key: str, entries: list[tuple[bytes, dict[bytes, bytes]]], read_from: tuple[int, int]
    ) -> None:
        for sub in list(self._subs.get(key, ())):
            last = _id_tuple(sub.last_id)
            if read_from > last:
                # This read began past this subscription's position (it joined while the read was in
                # flight): entries it needs may be missing from the batch. The next read starts at the
                # lowest position of all subscribers, so it gets them then, in order.
                continue
            for raw_id, fields in entries:
                entry_id = raw_id.decode()
                if _id_tuple(entry_id) <= last:
                    continue
                sub.last_id = entry_id
                entry = LogEntry.parse(fields)
                sub.queue.put_nowait(entry)
                if entry.finish is not None:
                    sub.ended.set()
