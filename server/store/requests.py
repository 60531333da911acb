"""Request state machine and token logs in Redis (DESIGN.md §4).

States: ``queued → running → done | failed | cancelled``. Each transition is one Lua script (``lua/``),
so a crash between two commands can never leave a request half-moved. The token log of a request is a
Redis Stream whose entry ids encode token offsets: a delta starting at offset ``o`` has id ``o-1`` and the
end entry at total ``t`` has id ``t-2``; reading from ``o-0`` therefore starts exactly at offset ``o``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from server.store.keys import Keys

FINAL_STATES = frozenset({"done", "failed", "cancelled"})


def now_ms() -> int:
    return int(time.time() * 1000)


def _load_script(r: aioredis.Redis, name: str) -> AsyncScript:
    source = resources.files("server.store").joinpath("lua", f"{name}.lua").read_text()
    return r.register_script(source)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True, slots=True)
class SubmitResult:
    outcome: str  # "new" | "attach" | "conflict" | "overloaded"
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


@dataclass(frozen=True, slots=True)
class WorkItem:
    """What a worker needs to run a request it has just started."""

    req_key: str
    log_key: str
    history_key: str
    payload: dict[str, Any]
    completion_tokens: int
    epoch: int


@dataclass(slots=True)
class Settings:
    retention_ms: int = 24 * 3600 * 1000
    unfinished_ttl_ms: int = 7 * 24 * 3600 * 1000
    max_queued: int = 0  # 0: unbounded here; the engine bounds its own waiting queue
    history_max_messages: int = 64
    session_ttl_ms: int = 24 * 3600 * 1000


class RequestStore:
    """Requests, their token logs and the work queue. Every method is one round trip unless noted."""

    GROUP = "workers"

    def __init__(self, r: aioredis.Redis, keys: Keys | None = None, settings: Settings | None = None) -> None:
        self.r = r
        self.keys = keys or Keys()
        self.settings = settings or Settings()
        self._submit = _load_script(r, "submit")
        self._start = _load_script(r, "start")
        self._append = _load_script(r, "append")
        self._finish = _load_script(r, "finish")
        self._cancel = _load_script(r, "cancel")

    async def submit(
        self,
        owner: str,
        id: str,
        fingerprint: str,
        payload: dict[str, Any],
        *,
        session: str = "",
        user_message: dict[str, str] | None = None,
    ) -> SubmitResult:
        """Create request ``(owner, id)`` and queue it, or report what exists under that id. Atomic.

        Same id and same fingerprint → ``attach`` (nothing is queued again: one generation per id).
        Same id, other fingerprint → ``conflict``. Queue full → ``overloaded`` and nothing is written.
        ``user_message`` is appended to the session history when the request ends normally.
        """
        k = self.keys
        res = await self._submit(
            keys=[k.request(owner, id), k.queue, k.queued_count],
            args=[
                owner,
                id,
                fingerprint,
                json.dumps(payload, separators=(",", ":")),
                now_ms(),
                session,
                json.dumps(user_message) if user_message else "",
                self.settings.unfinished_ttl_ms,
                self.settings.max_queued,
            ],
        )
        outcome, epoch, state = _s(res[0]), int(res[1]), _s(res[2])
        if outcome == "overloaded":
            return SubmitResult(outcome, 0, "", queued=epoch)
        return SubmitResult(outcome, epoch, state)

    async def get(self, owner: str, id: str) -> RequestInfo | None:
        """The request's current record, or None if unknown (never created, other owner, or expired)."""
        f = await self.r.hmget(
            self.keys.request(owner, id),
            ["state", "epoch", "completion_tokens", "prompt_tokens", "finish_reason", "session"],
        )
        if f[0] is None:
            return None
        return RequestInfo(
            owner=owner,
            id=id,
            state=_s(f[0]),
            epoch=int(f[1] or 1),
            completion_tokens=int(f[2] or 0),
            prompt_tokens=int(f[3] or 0),
            finish_reason=_s(f[4]) if f[4] is not None else None,
            session=_s(f[5] or b""),
        )

    async def cancel(self, owner: str, id: str) -> str | None:
        """Cancel if queued or running and end its log; returns the state before, None if unknown."""
        k = self.keys
        res = await self._cancel(
            keys=[k.request(owner, id), k.log(owner, id), k.queued_count],
            args=[now_ms(), self.settings.retention_ms],
        )
        return None if res is None else _s(res)

    # ---- worker side ---------------------------------------------------------------------------

    async def ensure_group(self) -> None:
        """Create the workers' consumer group on the queue (idempotent)."""
        try:
            await self.r.xgroup_create(self.keys.queue, self.GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def take(self, worker: str, count: int, block_ms: int) -> list[tuple[str, str]]:
        """Next queue entries for this worker: [(entry id, request key)]. Blocks up to ``block_ms``."""
        res: Any = await self.r.xreadgroup(
            self.GROUP, worker, {self.keys.queue: ">"}, count=count, block=block_ms
        )
        out: list[tuple[str, str]] = []
        for _stream, entries in res or []:
            for entry_id, fields in entries:
                out.append((_s(entry_id), _s(fields[b"req"])))
        return out

    async def start(self, worker: str, entry_id: str, req_key: str) -> WorkItem | None:
        """queued → running for ``worker`` and acknowledge the queue entry, in one round trip.

        None if the request is no longer queued (cancelled while waiting, or expired).
        """
        pipe = self.r.pipeline(transaction=False)
        await self._start(keys=[req_key, self.keys.queued_count], args=[worker, now_ms()], client=pipe)
        pipe.xack(self.keys.queue, self.GROUP, entry_id)
        res, _ = await pipe.execute()
        if not res:
            return None
        payload = json.loads(_s(res[0]))
        owner, id = payload["owner"], payload["id"]
        return WorkItem(
            req_key=req_key,
            log_key=self.keys.log(owner, id),
            history_key=self.keys.history(payload.get("session") or "-"),
            payload=payload,
            completion_tokens=int(res[1]),
            epoch=int(res[2]),
        )

    async def write_step(self, ops: list[StepOp], worker: str) -> list[bool]:
        """Apply one engine step for all its sequences in one pipelined round trip.

        Each op appends a delta (when it has tokens) and, when it is final, ends the request. Returns, per
        op, whether the worker still holds the request; False means stop generating it (cancelled).
        """
        if not ops:
            return []
        pipe = self.r.pipeline(transaction=False)
        calls: list[int] = []
        for op in ops:
            n = 0
            if op.n > 0:
                await self._append(
                    keys=[op.item.req_key, op.item.log_key],
                    args=[worker, op.offset, op.n, op.text, op.prompt_tokens],
                    client=pipe,
                )
                n += 1
            if op.finish is not None:
                await self._finish(
                    keys=[op.item.req_key, op.item.log_key, op.item.history_key],
                    args=[
                        worker,
                        op.finish,
                        op.prompt_tokens,
                        op.reply_text,
                        now_ms(),
                        self.settings.retention_ms,
                        op.error_code,
                        op.error_message,
                        self.settings.history_max_messages,
                        self.settings.session_ttl_ms,
                    ],
                    client=pipe,
                )
                n += 1
            calls.append(n)
        results = await pipe.execute()
        out: list[bool] = []
        i = 0
        for n in calls:
            ok = all(int(results[j]) == 1 for j in range(i, i + n))
            out.append(ok)
            i += n
        return out


@dataclass(slots=True)
class StepOp:
    item: WorkItem
    offset: int
    n: int
    text: str
    prompt_tokens: int
    finish: str | None = None
    reply_text: str = ""
    error_code: str = ""
    error_message: str = ""
