"""Attached streams: following a request's token log, and telling the store which requests have a client.

Every door reads logs through :meth:`Streams.follow`, which takes the admission grant of the stream and
gives it back when the stream ends, so the stream slots admission counts are exactly the streams open.
The subscription, the attach count and the grant are all taken inside one ``try``: whatever fails (a
``touch`` during a store outage, a cancelled task), none of them leaks, and a request never counts as
attached after its last stream ended (its detach timeout must be able to run).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog

from protocol import ErrorCode, ProtocolError
from server import metrics
from server.aio import cancel_and_wait
from server.gateway.admission import Grant, require
from server.store.logs import LogEntry, LogReader, Subscription
from server.store.requests import RequestStore

log = structlog.get_logger(__name__)

# Log entries waiting in a subscription are merged into one batch up to this many tokens: a client that
# fell behind catches up in few frames or chunks instead of one per token.
MAX_TOKENS_PER_BATCH = 512


class Streams:
    def __init__(self, store: RequestStore, reader: LogReader) -> None:
        self.store = store
        self.reader = reader
        self.attached: dict[str, int] = {}  # request key -> streams of this process attached to it
        self._touch_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.reader.start()
        self._touch_task = asyncio.create_task(self._touch_loop(), name="gateway-touch")

    async def stop(self) -> None:
        await cancel_and_wait([self._touch_task])
        await self.reader.stop()

    @contextlib.asynccontextmanager
    async def follow(
        self, grant: Grant, owner: str, id: str, offset: int, *, attached: bool = True, touch: bool = True
    ) -> AsyncIterator[Subscription]:
        """Subscribe to request ``id``'s log from token ``offset`` for as long as the block runs.
        ``attached``: the request counts as having a client meanwhile (its detach timeout does not run;
        a background response is followed without). ``touch`` False: the request was created just now,
        and its submit set the deadline a touch would (a store call per request saved). Releases
        ``grant`` at the end."""
        require(grant)
        req_key = self.store.keys.request(owner, id)
        sub: Subscription | None = None
        counted = False
        try:
            sub = self.reader.subscribe(self.store.keys.log(owner, id), offset)
            if attached:
                self._attach(req_key)
                counted = True
                if touch:
                    # Back within the detach timeout: postpone it now, not at the next periodic touch.
                    await self.store.touch([req_key])
            yield sub
        finally:
            if counted:
                self._detach(req_key)
            if sub is not None:
                self.reader.unsubscribe(sub)
            grant.release()

    def _attach(self, req_key: str) -> None:
        self.attached[req_key] = self.attached.get(req_key, 0) + 1
        metrics.STREAMS.inc()

    def _detach(self, req_key: str) -> None:
        metrics.STREAMS.dec()
        n = self.attached.get(req_key, 0) - 1
        if n > 0:
            self.attached[req_key] = n
        else:
            self.attached.pop(req_key, None)

    async def _touch_loop(self) -> None:
        """Tell the store, a few times per detach timeout, which requests have a client attached here;
        a request nobody touches for the detach timeout is cancelled by the worker at its next step."""
        period = self.store.settings.detach_timeout_ms / 3000
        while True:
            await asyncio.sleep(period)
            try:
                await self.store.touch(list(self.attached))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("gateway.touch_failed", error=str(exc))


async def batches(sub: Subscription, id: str, offset: int) -> AsyncIterator[list[LogEntry]]:
    """The log's entries from token ``offset``, in batches of what has arrived (at most
    MAX_TOKENS_PER_BATCH tokens), the last batch ending with the end entry. Raises ProtocolError
    ``resume_failed`` when ``offset`` is not an entry boundary of the log."""
    expected = offset
    while True:
        batch = [await sub.queue.get()]
        tokens = batch[0].n
        while batch[-1].finish is None and not sub.queue.empty() and tokens < MAX_TOKENS_PER_BATCH:
            entry = sub.queue.get_nowait()
            batch.append(entry)
            tokens += entry.n
        if batch[0].offset != expected:
            raise ProtocolError(
                ErrorCode.RESUME_FAILED,
                f"offset {offset} is not at a delta boundary of this request's log",
                id=id,
            )
        expected = batch[-1].offset + batch[-1].n
        yield batch
        if batch[-1].finish is not None:
            return
