"""Request state machine and token logs in Redis (ARCHITECTURE.md, "Request state machine").

States: ``queued → running → done | failed | cancelled``, and ``running → queued`` when the worker's
lease lapses. Each transition is one Lua script (``lua/``, loaded once and called by SHA), so a crash
between two commands can never leave a request half-moved; scripts read the clock with Redis ``TIME`` so
gateways and workers on different machines agree on it.

The token log of a request is a Redis Stream whose entry ids encode token offsets: a delta starting at
offset ``o`` has id ``o-1`` and the end entry at total ``t`` has id ``t-2``; reading from ``o-0``
therefore starts exactly at offset ``o``, and a second write of an offset is impossible.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from server.store.keys import Keys

log = structlog.get_logger(__name__)

FINAL_STATES = frozenset({"done", "failed", "cancelled"})
# A worker that writes at the wrong offset (a bug) gets its request taken away and re-queued this many
# times; after that the request fails with `internal` rather than loop.
MAX_MISMATCH_REQUEUES = 3


def _lua(name: str) -> str:
    return resources.files("server.store").joinpath("lua", f"{name}.lua").read_text()


def _load_script(r: aioredis.Redis, name: str, *includes: str) -> AsyncScript:
    """A transition's script, after the shared Lua it calls (``includes``: local functions, prepended:
    Redis scripts have no import, and a Redis Function library would outlive a deploy that changed it)."""
    return r.register_script("\n".join([*(_lua(i) for i in includes), _lua(name)]))


async def execute(pipe: Any) -> Any:
    """Run a pipeline and always give its connection back, even when Redis is gone mid-way (redis-py
    keeps it otherwise, and warns about an unclosed client when the pipeline is collected)."""
    try:
        return await pipe.execute()
    finally:
        await pipe.reset()


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# The request hash's fields that make a RequestInfo, in the order _info reads them.
_INFO_FIELDS = (
    "state",
    "epoch",
    "completion_tokens",
    "prompt_tokens",
    "finish_reason",
    "session",
    "model",
    "cached_tokens",
)


def _info(owner: str, id: str, f: list[Any]) -> RequestInfo:
    """A RequestInfo from the HMGET of _INFO_FIELDS (first in ``f``); the record must exist."""
    return RequestInfo(
        owner=owner,
        id=id,
        state=_s(f[0]),
        epoch=int(f[1] or 1),
        completion_tokens=int(f[2] or 0),
        prompt_tokens=int(f[3] or 0),
        finish_reason=_s(f[4]) if f[4] is not None else None,
        session=_s(f[5] or b""),
        model=_s(f[6] or b""),
        cached_tokens=int(f[7] or 0),
    )


# What a tombstone's payload leaves out: the prompt, whose size only the frame or body limit bounds.
_PROMPT_FIELDS = ("messages", "instructions")


def _log_end(entries: list[Any]) -> int:
    """The tokens a log holds, from its last entry (as XREVRANGE/XRANGE return it; 0 for none): a delta
    at offset o of n tokens ends at o + n, an end entry's offset is the total."""
    if not entries:
        return 0
    fields = entries[-1][1]
    return int(fields.get(b"o", 0)) + int(fields.get(b"n", 0))


def tombstone_payload(payload: dict[str, Any]) -> str:
    """The payload a refused request keeps (JSON): every field but the prompt. What is left is small and
    bounded (ids, params, the door's own fields), and still says which door made it (the Responses door
    finds its responses by ``api``)."""
    return json.dumps({k: v for k, v in payload.items() if k not in _PROMPT_FIELDS}, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class SubmitResult:
    outcome: str  # "new" | "attach" | "conflict" | "overloaded" | "user_limit" | "cached" | "turn_moved"
    epoch: int
    state: str
    queued: int = 0


@dataclass(frozen=True, slots=True)
class RequestInfo:
    owner: str
    id: str
    state: str
    epoch: int
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str | None
    session: str
    model: str = ""  # the model that serves it ("" for requests made before models had names)
    cached_tokens: int = 0  # of prompt_tokens, those whose KV the engine reused (set when it finished)


@dataclass(frozen=True, slots=True)
class RequestView:
    """A request as an HTTP client sees it (``RequestStore.view``)."""

    info: RequestInfo
    payload: dict[str, Any]
    created_ms: int
    text: str  # the completion text logged so far
    error_code: str = ""  # when it failed: the code and message its log ends with
    error_message: str = ""


@dataclass(frozen=True, slots=True)
class WorkItem:
    """What a worker needs to run a request it has just started."""

    req_key: str
    log_key: str
    history_key: str
    session_key: str
    payload: dict[str, Any]
    completion_tokens: int  # > 0: a re-queued request to continue after these logged tokens
    epoch: int
    queue_wait_ms: int = 0  # from creation (or re-queue) to this start, on the Redis clock
    cache_key: str = ""  # the response-cache entry its log is copied to when it ends normally ("" for none)
    route: str = ""  # its model's queue (Keys.model_queue): where it goes back to if re-queued


@dataclass(slots=True)
class Settings:
    retention_ms: int = 24 * 3600 * 1000
    unfinished_ttl_ms: int = 7 * 24 * 3600 * 1000
    detach_timeout_ms: int = 30_000
    lease_ttl_ms: int = 10_000
    max_queued: int = 0  # 0: unbounded
    max_inflight_per_user: int = 0  # requests one owner may have queued or running at once; 0: unbounded
    history_max_messages: int = 64
    # A session's history is also bounded in bytes: the oldest turns go first (history.lua), so one
    # session costs Redis at most this plus its newest turn, whatever its messages weigh.
    history_max_bytes: int = 1 << 20
    session_ttl_ms: int = 24 * 3600 * 1000
    cache_ttl_ms: int = 10 * 60 * 1000  # response cache for deterministic requests
    # A request refused before it generated anything (too_large, overloaded, a prompt that cannot be
    # prepared) is kept only as a tombstone this long, without its prompt: long enough for a client's
    # retries to get the same answer, short enough that refused megabyte chats cannot fill a Redis
    # that never evicts (finish.lua). At most the retention.
    refused_ttl_ms: int = 10 * 60 * 1000


@dataclass(slots=True)
class StepOp:
    """One request's share of an engine step: a delta (``n`` > 0) and/or its end (``finish``)."""

    item: WorkItem
    offset: int
    n: int
    text: str
    prompt_tokens: int
    token_ids: tuple[int, ...] = ()
    finish: str | None = None
    cached_tokens: int = 0  # of prompt_tokens, those not computed (written with the end)
    reply_text: str = ""
    error_code: str = ""
    error_message: str = ""
    length_reason: str = ""  # with finish "length": "max_tokens" or "context" (the end entry's "lr")


class RequestStore:
    """Requests, their token logs, the work queue and worker leases."""

    GROUP = "workers"

    def __init__(self, r: aioredis.Redis, keys: Keys | None = None, settings: Settings | None = None) -> None:
        self.r = r
        self.keys = keys or Keys()
        self.settings = settings or Settings()
        self._submit = _load_script(r, "submit", "history")
        self._start = _load_script(r, "start", "prompt_len")
        self._step = _load_script(r, "step")
        self._mismatch = _load_script(r, "mismatch")
        self._detach = _load_script(r, "detach", "prompt_len")
        # worker -> its held requests' token logs -> when (time.monotonic) their detach deadline can next
        # have passed (detach_sweep)
        self._detach_due: dict[str, dict[str, float]] = {}
        self._finish = _load_script(r, "finish", "history")
        self._cancel = _load_script(r, "cancel", "prompt_len")
        self._touch = _load_script(r, "touch")
        self._heartbeat = _load_script(r, "heartbeat")
        self._reap = _load_script(r, "reap")
        self._lease = _load_script(r, "lease")
        self._live = _load_script(r, "live")
        self._rate = _load_script(r, "rate")
        self._orphan = _load_script(r, "orphan")

    @property
    def partitions(self) -> range:
        """The work queue's partitions (keys.py): one on a plain Redis, CLUSTER_PARTITIONS on a cluster."""
        return range(self.keys.partitions)

    def partition_of(self, req_key: str) -> int:
        return self.keys.partition_of(req_key)

    async def load_scripts(self) -> None:
        """Load every script on every primary (a cluster's SCRIPT LOAD goes to all of them). Scripts called
        directly are loaded on demand anyway (NOSCRIPT → load → retry); this is for those queued in a
        cluster pipeline, which redis-py does not load first."""
        for script in (
            self._submit,
            self._start,
            self._step,
            self._mismatch,
            self._detach,
            self._finish,
            self._cancel,
            self._touch,
            self._heartbeat,
            self._reap,
            self._lease,
            self._live,
            self._orphan,
        ):
            await self.r.script_load(script.script)

    # ---- client side (gateway) ---------------------------------------------------------------

    async def submit(
        self,
        owner: str,
        id: str,
        fingerprint: str,
        payload: dict[str, Any],
        *,
        session: str = "",
        user_message: dict[str, str] | None = None,
        prefer: str = "",
        cache_key: str = "",
        shared_cache: bool = False,
        turn_after: str | None = None,
        detach_timeout_ms: int | None = None,
        keep_detach_timeout: bool = False,
        model: str = "",
        route: str = "",
    ) -> SubmitResult:
        """Create request ``(owner, id)`` and queue it, or report what exists under that id. Atomic.

        Same id and same fingerprint → ``attach`` (nothing is queued again: one generation per id).
        Same id, other fingerprint → ``conflict``. Queue full → ``overloaded`` and nothing is written.
        The owner already has ``max_inflight_per_user`` requests queued or running → ``user_limit`` (their
        count in ``queued``), nothing written.
        ``user_message`` is appended to the session history when the request ends normally. ``prefer``
        names the worker to queue it for (session affinity), used only while that worker's lease is live.
        ``cache_key`` (deterministic requests): a recent identical request's log answers it at once
        (``cached``, state done, no worker runs); otherwise its log is cached when it ends normally.
        The cache is the owner's own unless ``shared_cache``: then any owner's identical request answers
        it, which tells the asker that someone asked the same recently (a side channel, SPEC.md).
        ``turn_after`` (content-mode turns of ``session``): the id of the session's latest turn, as
        ``SessionStore.last_turn`` gave it, which the caller waited for and whose reply its history holds
        ("" for the first turn). If another turn was accepted since → ``turn_moved``, nothing written;
        otherwise this request becomes the session's latest turn. None: not a content-mode turn.
        ``detach_timeout_ms`` overrides the detach timeout of this request (a background HTTP response
        passes its unfinished TTL: nobody needs to stay attached to it). ``keep_detach_timeout``: it is
        the request's own for good (a chat's ``params.detach_timeout_ms``), and every touch extends the
        request's deadline by it, not by the default.
        ``model`` names the model that serves it (recorded for ``accepted.model``); ``route`` picks that
        model's queue and counter (``Keys.model_queue``: "" for the default model). Session affinity
        (``prefer``) applies to the default model's queue only: a reaped worker's affinity queue drains
        into the default queue.
        """
        k = self.keys
        st = self.settings
        p = k.partition(owner)
        req = k.request(owner, id)
        # Every key is in the owner's partition (one slot); one not needed is passed as the request's own.
        inflight = k.inflight(owner) if st.max_inflight_per_user else ""
        members = sorted(_s(m) for m in await self.r.smembers(inflight)) if inflight else []
        if len(members) >= st.max_inflight_per_user > 0:
            # Not this id's own: a chat sent again is a sign of life, which submit.lua answers by
            # attaching and extending its deadline.
            await self._expire_detached(owner, [m for m in members if m != req])
        if route:
            prefer = ""  # affinity queues hold the default model's requests only
        # Read outside the transition, since they may live in other slots: the other partitions' queued
        # counts of this model (the queue limit is global; a race between gateways may let a few more
        # in) and the response-cache entry (a shared one is in no owner's partition; an entry that
        # expires meanwhile is still a valid answer).
        elsewhere = await self._queued([q for q in self.partitions if q != p], route) if st.max_queued else 0
        cache = k.cache(cache_key, None if shared_cache else owner) if cache_key else ""
        cached = _s(await self.r.get(cache) or b"") if cache else ""
        res = await self._submit(
            keys=[
                req,
                k.queue(p, route),
                k.queued_count(p, route),
                k.worker_queue(prefer, p) if prefer else req,
                req,
                k.log(owner, id),
                req,
                k.history(session or "-", owner),
                inflight or req,
                k.session(session or "-", owner),
                *members,
            ],
            args=[
                owner,
                id,
                fingerprint,
                json.dumps(payload, separators=(",", ":")),
                session,
                json.dumps(user_message) if user_message else "",
                st.unfinished_ttl_ms,
                st.max_queued,
                st.detach_timeout_ms if detach_timeout_ms is None else detach_timeout_ms,
                prefer,
                st.retention_ms,
                st.history_max_messages,
                st.session_ttl_ms,
                st.max_inflight_per_user,
                "" if turn_after is None else "1",
                turn_after or "",
                elsewhere,
                cached,
                cache,
                model,
                route,
                st.history_max_bytes,
                "1" if keep_detach_timeout and detach_timeout_ms is not None else "",
            ],
        )
        outcome, epoch, state = _s(res[0]), int(res[1]), _s(res[2])
        if outcome in ("overloaded", "user_limit"):
            return SubmitResult(outcome, 0, "", queued=epoch)
        return SubmitResult(outcome, epoch, state)

    async def _expire_detached(self, owner: str, req_keys: list[str]) -> None:
        """Cancel those of ``owner``'s queued requests that no client has been attached to for their detach
        timeout (cancel.lua's "detach": the end start.lua would give them when a worker reached them).
        submit calls it when the owner's in-flight set holds the limit's count, before submit.lua counts
        them: while no worker takes work (all of them restarting or loading, or the queue long), a user
        who dropped off would otherwise be refused every new request until a worker reached its abandoned
        ones."""
        k = self.keys
        p = k.partition(owner)
        pipe = self.r.pipeline(transaction=False)
        for req in req_keys:
            pipe.hmget(req, ["state", "id", "route"])
        calls: list[tuple[AsyncScript, list[str], list[Any]]] = []
        for req, (state, id_b, route_b) in zip(req_keys, await execute(pipe), strict=True):
            if state != b"queued" or not id_b:
                continue  # running: the worker's own sweep (detach.lua) ends it
            id, route = _s(id_b), _s(route_b or b"")
            calls.append(
                (
                    self._cancel,
                    [req, k.log(owner, id), k.queued_count(p, route), req],
                    [self.settings.retention_ms, "", "detach"],
                )
            )
        if calls:
            await self._run_scripts(calls)

    async def get(self, owner: str, id: str) -> RequestInfo | None:
        """The request's current record, or None if unknown (never created, other owner, or expired).

        While it runs, the tokens logged so far are its worker's to count (the held hash, step.lua) and
        the record's ``completion_tokens`` lags: they are read from the log's last entry, in the same
        transaction."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hmget(self.keys.request(owner, id), list(_INFO_FIELDS))
        pipe.xrevrange(self.keys.log(owner, id), count=1)
        f, last = await execute(pipe)
        if f[0] is None:
            return None
        info = _info(owner, id, f)
        logged = _log_end(last)
        return replace(info, completion_tokens=logged) if logged > info.completion_tokens else info

    async def view(self, owner: str, id: str) -> RequestView | None:
        """The request's record, its payload and the text logged so far, read in one transaction (the
        text is exactly what the record says has been logged). None if unknown (as :meth:`get`)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hmget(self.keys.request(owner, id), [*_INFO_FIELDS, "payload", "created_ms"])
        pipe.xrange(self.keys.log(owner, id))
        f, entries = await execute(pipe)
        if f[0] is None:
            return None
        info = _info(owner, id, f)
        n = len(_INFO_FIELDS)
        text: list[str] = []
        error_code = error_message = ""
        for _id, fields in entries:
            if b"d" in fields:
                error_code = _s(fields.get(b"e", b""))
                error_message = _s(fields.get(b"m", b""))
            elif b"t" in fields:
                text.append(_s(fields[b"t"]))
        logged = _log_end(entries[-1:])
        if logged > info.completion_tokens:  # running: see get()
            info = replace(info, completion_tokens=logged)
        return RequestView(
            info=info,
            payload=json.loads(_s(f[n])) if f[n] else {},
            created_ms=int(f[n + 1] or 0),
            text="".join(text),
            error_code=error_code,
            error_message=error_message,
        )

    async def cancel(self, owner: str, id: str) -> str | None:
        """Cancel if queued or running and end its log; returns the state before, None if unknown.
        Atomic (one Lua transition; the holder is read first so the script declares its running set)."""
        k = self.keys
        req = k.request(owner, id)
        p = k.partition(owner)
        while True:
            worker_b, route_b = await self.r.hmget(req, ["worker", "route"])
            worker, route = _s(worker_b or b""), _s(route_b or b"")
            res = await self._cancel(
                keys=[req, k.log(owner, id), k.queued_count(p, route), k.worker_requests(worker, p)],
                args=[self.settings.retention_ms, worker],
            )
            if res is None:
                return None
            if _s(res) != "moved":
                return _s(res)

    async def rate(self, owner: str, kind: str, limit: int, window_ms: int = 1000) -> int:
        """Count one action of ``kind`` (e.g. "chat", "resume") by ``owner`` in a fixed window shared by
        every gateway: 0 if within ``limit`` per window, else the ms until the window ends. Atomic (one
        script, rate.lua: the counter and its expiry are set together, so a counter never outlives its
        window)."""
        return int(await self._rate(keys=[self.keys.rate(kind, owner)], args=[limit, window_ms]))

    async def touch(self, req_keys: list[str]) -> int:
        """Record that clients are attached to these requests now (postpones the detach timeout)."""
        if not req_keys:
            return 0
        # One call per partition: a script's keys must share a slot.
        by_partition: dict[int, list[str]] = {}
        for key in req_keys:
            by_partition.setdefault(self.partition_of(key), []).append(key)
        n = 0
        for keys in by_partition.values():
            n += int(await self._touch(keys=keys, args=[self.settings.detach_timeout_ms]))
        return n

    # ---- worker side ---------------------------------------------------------------------------

    async def ensure_group(
        self, worker: str | None = None, partition: int | None = None, routes: tuple[str, ...] = ("",)
    ) -> None:
        """Create the consumer group on the queues of ``routes`` (models, Keys.queue) and on ``worker``'s
        own queue, in every partition (or in ``partition``) (idempotent). A worker's own queue existing is
        what lets submit.lua route work to it (reap.lua deletes it)."""
        parts = self.partitions if partition is None else [partition]
        queues = [self.keys.queue(p, r) for p in parts for r in routes]
        if worker:
            queues += [self.keys.worker_queue(worker, p) for p in parts]
        for q in queues:
            try:
                await self.r.xgroup_create(q, self.GROUP, id="0", mkstream=True)
            except aioredis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def take(
        self,
        worker: str,
        count: int,
        block_ms: int,
        *,
        pending: bool = False,
        partition: int = 0,
        routes: tuple[str, ...] = ("",),
    ) -> list[tuple[str, str, str]]:
        """Next entries for this worker from its own queue and the queues of the models it holds
        (``routes``, Keys.queue) in one partition, in one blocking read (all are in the partition's slot; a
        worker reads each partition in a loop of its own): [(queue, entry id, request key)]. Blocks up to
        ``block_ms``. ``pending=True``: instead, the entries already delivered to this worker and not yet
        started (after a failure between reading and starting them; without this they would wait for
        this worker's death to be re-queued)."""
        own = self.keys.worker_queue(worker, partition)
        start = "0" if pending else ">"
        streams: Any = {own: start, **{self.keys.queue(partition, r): start for r in routes}}
        try:
            res: Any = await self.r.xreadgroup(self.GROUP, worker, streams, count=count, block=block_ms)
        except aioredis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Our own queue does not exist (yet, or any more: a reaper drained and deleted it after our
            # lease lapsed). Recreate it and read again.
            await self.ensure_group(worker, partition, routes)
            res = await self.r.xreadgroup(self.GROUP, worker, streams, count=count, block=block_ms)
        out: list[tuple[str, str, str]] = []
        for stream, entries in res or []:
            for entry_id, fields in entries:
                if fields:  # a pending entry deleted meanwhile comes back without fields
                    out.append((_s(stream), _s(entry_id), _s(fields[b"req"])))
        return out

    async def start(
        self, worker: str, entry_id: str, req_key: str, queue: str | None = None, route: str = ""
    ) -> WorkItem | None:
        """queued → running for ``worker`` and consume the queue entry (acknowledged and deleted), in one
        Lua transition: never one without the other.

        None if the request is no longer queued (cancelled while waiting, detached too long, expired); the
        entry is consumed either way. ``route``: the model whose queued counter counts it (the entry's
        queue is that model's queue, or this worker's own, which holds only the default model's).
        """
        p = self.partition_of(req_key)
        queue = queue or self.keys.queue(p, route)
        log_key = self.keys.log_of(req_key)
        res = await self._start(
            keys=[
                req_key,
                self.keys.queued_count(p, route),
                log_key,
                self.keys.worker_requests(worker, p),
                queue,
            ],
            args=[worker, self.settings.retention_ms, self.GROUP, entry_id],
        )
        if not res:
            return None
        payload = json.loads(_s(res[0]))
        return WorkItem(
            req_key=req_key,
            log_key=log_key,
            history_key=self.keys.history_in(p, payload.get("session") or "-"),
            session_key=self.keys.session_in(p, payload.get("session") or "-"),
            payload=payload,
            completion_tokens=int(res[1]),
            epoch=int(res[2]),
            queue_wait_ms=int(res[3]),
            cache_key=_s(res[4]) if len(res) > 4 else "",
            route=route,
        )

    async def logged_tokens(self, log_key: str) -> tuple[list[int], str]:
        """The token ids and the text of a log's deltas, in order (to continue a re-queued request)."""
        ids: list[int] = []
        text: list[str] = []
        entries: Any = await self.r.xrange(log_key)
        for _id, fields in entries:
            raw = fields.get(b"k")
            if raw:
                ids.extend(int(x) for x in raw.split(b","))
            if b"t" in fields:
                text.append(fields[b"t"].decode())
        return ids, "".join(text)

    async def write_step(self, ops: list[StepOp], worker: str) -> list[bool]:
        """Apply one engine step for all its sequences in one pipelined round trip.

        Each op appends a delta (when it has tokens) and, when it is final, ends the request. Returns, per
        op, whether the worker still holds the request; False means stop generating it (cancelled,
        detached too long, taken over by another worker after this one's lease lapsed, or re-queued or
        failed because the op's offset was not the log's end).

        A request that fails before any token is logged (refused: too_large, overloaded, a prompt that
        cannot be prepared) ends as a tombstone: its state, error, fingerprint, owner and a payload
        without the prompt (``tombstone_payload``), with its log's end entry, both expiring after
        ``refused_ttl_ms`` instead of the retention; the user message it would have added to its session
        is dropped. A retry with the same id and payload within that time attaches to it and gets the
        same error (never a generation); a later one is a new request.
        """
        if not ops:
            return []
        st = self.settings
        k = self.keys
        scripted: list[tuple[AsyncScript, list[str], list[Any]]] = []
        # The deltas: one step.lua call per partition for all of them (one slot per call on a cluster).
        by_partition: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            if op.n > 0:
                by_partition.setdefault(self.partition_of(op.item.req_key), []).append(i)
        step_calls: list[list[int]] = []
        for p, idx in by_partition.items():
            args: list[Any] = [worker]
            for i in idx:
                op = ops[i]
                ids = ",".join(map(str, op.token_ids))
                args += [op.offset, op.n, op.text, ids, op.prompt_tokens if op.offset == 0 else ""]
            scripted.append(
                (self._step, [k.worker_requests(worker, p), *(ops[i].item.log_key for i in idx)], args)
            )
            step_calls.append(idx)
        # The ends, after the deltas in the same pipeline (one Redis runs them in order).
        finishing: list[int] = []
        for i, op in enumerate(ops):
            if op.finish is None:
                continue
            # Refused before its first token: finish.lua keeps only a tombstone (it checks the log is
            # empty itself; this only spares normal ends the bytes of the slim payload).
            refused = op.finish == "error" and op.offset == 0 and op.n == 0
            scripted.append(
                (
                    self._finish,
                    [
                        op.item.req_key,
                        op.item.log_key,
                        op.item.history_key,
                        k.worker_requests(worker, self.partition_of(op.item.req_key)),
                        op.item.session_key,
                    ],
                    [
                        worker,
                        op.finish,
                        op.prompt_tokens,
                        op.reply_text,
                        st.retention_ms,
                        op.error_code,
                        op.error_message,
                        st.history_max_messages,
                        st.session_ttl_ms,
                        min(st.refused_ttl_ms, st.retention_ms),
                        tombstone_payload(op.item.payload) if refused else "",
                        st.history_max_bytes,
                        op.cached_tokens,
                        op.length_reason if op.finish == "length" else "",
                    ],
                )
            )
            finishing.append(i)
        results = await self._run_scripts(scripted)
        held = [True] * len(ops)
        mismatched: list[int] = []
        for idx, res in zip(step_calls, results, strict=False):
            for i, r in zip(idx, res, strict=True):
                if int(r) != 1:
                    held[i] = False
                    if int(r) == -1:
                        mismatched.append(i)
        caches: list[tuple[str, Any]] = []
        for i, res in zip(finishing, results[len(step_calls) :], strict=True):
            op = ops[i]
            if isinstance(res, bytes | str):  # finish.lua: ended normally, here is its cache entry
                if op.item.cache_key:
                    caches.append((op.item.cache_key, res))
            elif int(res) != 1:
                held[i] = False
        if mismatched:
            await self._mismatches([ops[i] for i in mismatched], worker)
        if caches:
            # After the transitions, in commands of their own: a shared cache entry is in another slot.
            # Losing one (a crash here) only costs a later identical chat its cache hit.
            cpipe = self.r.pipeline(transaction=False)
            for key, value in caches:
                cpipe.set(key, value, px=st.cache_ttl_ms)
            await execute(cpipe)
        return held

    async def _mismatches(self, ops: list[StepOp], worker: str) -> None:
        """Ops whose offset was not their log's end (a bug in the caller): re-queue each request (it is
        continued after its logged tokens) or, past MAX_MISMATCH_REQUEUES, fail it (mismatch.lua)."""
        k = self.keys
        calls: list[tuple[AsyncScript, list[str], list[Any]]] = []
        for op in {op.item.req_key: op for op in ops}.values():
            p = self.partition_of(op.item.req_key)
            calls.append(
                (
                    self._mismatch,
                    [
                        op.item.req_key,
                        op.item.log_key,
                        k.worker_requests(worker, p),
                        k.queue(p, op.item.route),
                        k.queued_count(p, op.item.route),
                    ],
                    [worker, self.settings.retention_ms, op.prompt_tokens, MAX_MISMATCH_REQUEUES],
                )
            )
            log.warning("store.offset_mismatch", request=op.item.req_key, offset=op.offset, worker=worker)
        await self._run_scripts(calls)

    async def detach_sweep(self, worker: str) -> int:
        """Cancel the running requests of ``worker`` that no client has been attached to for the detach
        timeout (detach.lua, one call per partition it holds requests in); how many. The worker calls it
        about every second: a request cancelled here stops at its next step (step.lua answers 0).

        A request is only read again once its ``attached_until`` has passed: that deadline only ever
        moves later, so until then it cannot be due, and a client that stays attached costs one read per
        detach timeout instead of one per second."""
        pipe = self.r.pipeline(transaction=False)
        for p in self.partitions:
            pipe.hkeys(self.keys.worker_requests(worker, p))
        calls: list[tuple[AsyncScript, list[str], list[Any]]] = []
        now = time.monotonic()
        old_due = self._detach_due.get(worker, {})
        due: dict[str, float] = {}  # only the requests still held: the rest are forgotten
        for p, logs in zip(self.partitions, await execute(pipe), strict=True):
            keys = [self.keys.worker_requests(worker, p)]
            for raw in logs:
                log_key = _s(raw)
                if log_key in old_due and old_due[log_key] > now:
                    due[log_key] = old_due[log_key]
                else:
                    keys += [self.keys.req_of(log_key), log_key]
            if len(keys) > 1:
                calls.append((self._detach, keys, [worker, self.settings.retention_ms]))
        self._detach_due[worker] = due
        if not calls:
            return 0
        cancelled = 0
        for reply in await self._run_scripts(calls):
            redis_now = int(reply[0])
            for i in range(1, len(reply) - 1, 2):
                log_key, until = _s(reply[i]), int(reply[i + 1])
                if until < 0:
                    cancelled += 1
                else:
                    # Redis's clock for the deadline, ours for the wait: only the difference crosses.
                    due[log_key] = now + max(0, until - redis_now) / 1000
        return cancelled

    async def _run_scripts(self, calls: list[tuple[AsyncScript, list[str], list[Any]]]) -> list[Any]:
        """Run script calls in one non-transactional pipeline (on a cluster: one per node, sent at once)
        by EVALSHA: a cluster pipeline refuses redis-py's script objects, which would load them first. On
        NOSCRIPT (a fresh server, or a node restarted or failed over) load them everywhere and run the
        calls again: every script run here is safe to repeat (append and finish recognise a repeat of
        their own writes)."""
        for attempt in (1, 2):
            pipe = self.r.pipeline(transaction=False)
            for script, keys, args in calls:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            try:
                return list(await execute(pipe))
            except NoScriptError:
                if attempt == 2:
                    raise
                await self.load_scripts()
        raise AssertionError("unreachable")

    async def heartbeat(
        self, worker: str, running: int = 0, capacity: int = 0, *, model: str = "", route: str = ""
    ) -> list[str]:
        """Renew this worker's lease and publish its load and the model it holds (``model``, whose queue
        is ``route``; gateways list the models of live workers); returns workers whose leases have lapsed.
        (Two calls: a cluster pipeline refuses script objects.)"""
        dead = await self._heartbeat(
            keys=[self.keys.workers, self.keys.workers_load],
            args=[worker, self.settings.lease_ttl_ms, running, capacity],
        )
        if model:
            await self.r.hset(self.keys.worker_models, worker, json.dumps({"model": model, "route": route}))
        return [_s(d) for d in dead or []]

    async def served_models(self) -> dict[str, tuple[str, str]]:
        """The models live workers hold: worker id -> (model, route). A worker's entry goes with its
        lease (reaped: removed; lapsed: not listed)."""
        live = await self.live_workers()
        models = await self.r.hgetall(self.keys.worker_models)
        out: dict[str, tuple[str, str]] = {}
        for member, raw in models.items():
            if _s(member) in live and raw:
                try:
                    m = json.loads(raw)
                    out[_s(member)] = (str(m["model"]), str(m.get("route") or ""))
                except (ValueError, KeyError, TypeError):
                    continue  # not ours to interpret (a newer version's entry): skip it
        return out

    async def reap(self, dead_worker: str, *, own: bool = False) -> int:
        """Re-queue a lapsed worker's running requests (each to its own model's queue), and move its
        affinity queue and the entries it read from its model's queue but never started back to that
        queue, partition by partition (each one atomic: reap.lua), then forget its lease and the model it
        advertised; the number of running requests re-queued, or -1 if its lease turned out live.
        ``own=True``: a draining worker hands back its own. Moves only work not yet acknowledged (queues
        hold nothing else), so its cost is bounded by that.

        The lease is checked first and dropped last (lease.lua: it lives in another slot than the
        partitions). Two reapers racing re-queue each request once (reap.lua checks each request's holder);
        a reaper that dies half-way leaves the lease lapsed, so the next heartbeat's reaper finishes the
        job; a worker that renews its lease in between keeps it and finds its requests taken away (fenced,
        continued elsewhere after their logged tokens)."""
        k = self.keys
        lease_keys = [k.workers, k.workers_load]
        me = "self" if own else ""
        if int(await self._lease(keys=lease_keys, args=[dead_worker, me, "check"])) == -1:
            return -1
        advertised = await self.r.hget(k.worker_models, dead_worker)
        route = ""
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            route = str(json.loads(advertised or b"{}").get("route") or "")
        total = 0
        for p in self.partitions:
            wreqs = k.worker_requests(dead_worker, p)
            while True:
                logs = sorted(_s(m) for m in await self.r.hkeys(wreqs))
                running = [k.req_of(log_key) for log_key in logs]
                routes: list[str] = []
                if running:
                    pipe = self.r.pipeline(transaction=False)
                    for req in running:
                        pipe.hget(req, "route")
                    routes = [_s(r or b"") for r in await execute(pipe)]
                n = int(
                    await self._reap(
                        keys=[
                            wreqs,
                            k.queue(p, route),
                            k.queued_count(p, route),
                            k.worker_queue(dead_worker, p),
                            *running,
                            *(key for r in routes for key in (k.queue(p, r), k.queued_count(p, r))),
                        ],
                        args=[dead_worker, self.GROUP, len(running), *logs],
                    )
                )
                if n != -2:  # -2: it started another request since we read its hash
                    total += n
                    break
        await self._lease(keys=lease_keys, args=[dead_worker, me, "drop"])
        await self.r.hdel(k.worker_models, dead_worker)
        return total

    async def unheld(self, worker: str, held: Collection[str]) -> dict[str, tuple[int, str]]:
        """The requests the store says ``worker`` runs (its running sets, every partition) that are not in
        ``held``, the ones the worker knows it runs: req key -> (started_ms, route) as read now. Reads
        only (one pipelined HKEYS per partition, then one HMGET per request not held): a snapshot that
        may already be stale, which :meth:`requeue_orphan` fences. Take ``held`` before calling, so that
        a request started after the snapshot shows up only if it was started after the read too."""
        pipe = self.r.pipeline(transaction=False)
        for p in self.partitions:
            pipe.hkeys(self.keys.worker_requests(worker, p))
        logs = {_s(m) for ms in await execute(pipe) for m in ms}
        members = sorted({self.keys.req_of(log_key) for log_key in logs} - set(held))
        if not members:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for req in members:
            pipe.hmget(req, ["state", "worker", "started_ms", "route"])
        out: dict[str, tuple[int, str]] = {}
        for req, (state, holder, started, route) in zip(members, await execute(pipe), strict=True):
            if state is not None and _s(state) == "running" and _s(holder or b"") == worker:
                out[req] = (int(started or 0), _s(route or b""))
        return out

    async def requeue_orphan(self, worker: str, req_key: str, started_ms: int, route: str) -> bool:
        """Put back on its own model's queue (same epoch: continued after its logged tokens) a request
        that ``worker`` holds as running but does not run, if it is still running for ``worker`` under
        the start that :meth:`unheld` saw (``started_ms``). Atomic (orphan.lua) and idempotent: a second
        call, or one after the request ended, moved or was started again, changes nothing. True when it
        was re-queued."""
        k = self.keys
        p = self.partition_of(req_key)
        while True:
            res = int(
                await self._orphan(
                    keys=[
                        k.worker_requests(worker, p),
                        req_key,
                        k.queue(p, route),
                        k.queued_count(p, route),
                        k.log_of(req_key),
                    ],
                    args=[worker, started_ms, route],
                )
            )
            if res != -2:
                return res == 1
            route = _s(await self.r.hget(req_key, "route") or b"")  # declared the wrong queue: read again

    async def ping(self) -> None:
        """Raise unless the store answers (a round trip; readiness probes call it)."""
        await self.r.ping()

    async def queued(self, route: str = "") -> int:
        """Requests waiting in one model's queue (``route`` as in Keys.queue; all partitions, all
        workers)."""
        return await self._queued(self.partitions, route)

    async def _queued(self, partitions: Any, route: str = "") -> int:
        keys = [self.keys.queued_count(p, route) for p in partitions]
        if not keys:
            return 0
        # One GET per partition (an MGET may not span slots), pipelined: one round trip per node.
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return sum(int(v or 0) for v in await execute(pipe))

    async def live_workers(self) -> dict[str, tuple[int, int]]:
        """Workers with a live lease: id -> (running, capacity)."""
        flat = await self._live(keys=[self.keys.workers, self.keys.workers_load])
        out: dict[str, tuple[int, int]] = {}
        for i in range(0, len(flat), 2):
            running, _, capacity = _s(flat[i + 1]).partition("/")
            out[_s(flat[i])] = (int(running or 0), int(capacity or 0))
        return out
