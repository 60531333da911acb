"""Feeds the engine from the store and writes each engine step back to the token logs.

The engine thread hands over all of a step's outputs in one call; this loop turns them into one
pipelined round trip to Redis (one step script per partition for every delta, a finish script per
request that ends), and stops generating any request the store says this worker no longer holds (it was
cancelled, detached or taken over). The other way round, it re-queues any
request the store says it holds and it does not run (``_reconcile``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import structlog

from server import metrics
from server.aio import cancel_and_wait
from server.engine.api import (
    DEFAULT_FREQUENCY_PENALTY,
    DEFAULT_MAX_TOKENS,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    Engine,
    EngineOverloaded,
    GenerationRequest,
    SamplingParams,
    StepOutput,
)
from server.engine.prompt import PromptTooLarge
from server.store.requests import RequestStore, StepOp, WorkItem

log = structlog.get_logger(__name__)


def params_from_payload(p: dict[str, object]) -> SamplingParams:
    def get(key: str, default: object) -> object:
        v = p.get(key)
        return default if v is None else v

    stop = p.get("stop") or ()
    return SamplingParams(
        max_tokens=int(get("max_tokens", DEFAULT_MAX_TOKENS)),  # type: ignore[call-overload]
        temperature=float(get("temperature", DEFAULT_TEMPERATURE)),  # type: ignore[arg-type]
        top_p=float(get("top_p", DEFAULT_TOP_P)),  # type: ignore[arg-type]
        top_k=int(get("top_k", 0)),  # type: ignore[call-overload]
        seed=int(get("seed", 0)),  # type: ignore[call-overload]
        stop=tuple(stop),  # type: ignore[arg-type]
        repetition_penalty=float(get("repetition_penalty", DEFAULT_REPETITION_PENALTY)),  # type: ignore[arg-type]
        frequency_penalty=float(get("frequency_penalty", DEFAULT_FREQUENCY_PENALTY)),  # type: ignore[arg-type]
        presence_penalty=float(get("presence_penalty", 0.0)),  # type: ignore[arg-type]
    )


def _weight(v: object) -> float:
    """The owner's fair-share weight from the payload (the gateway sets it from the JWT tier)."""
    return float(v) if isinstance(v, int | float) and 0 < v <= 1000 else 1.0


@dataclass(slots=True)
class _Timing:
    started: float  # monotonic, when this worker started the request
    log: Any  # a logger bound to the request's id, session, user and this worker
    last: float | None = None  # when its last delta was logged


PROMPT_THREADS = 2


def merge_steps(outs: list[StepOutput]) -> list[StepOutput]:
    """Several engine steps' outputs, one per request: its tokens of those steps as one delta (one log
    entry, one XADD), in the order the requests first appear. Offsets stay exact: a request's outputs
    come in step order and each starts where the previous one ended. Its end, if any, is the last."""
    merged: dict[str, StepOutput] = {}
    for o in outs:
        prev = merged.get(o.key)
        if prev is None or prev.finish is not None or prev.offset + prev.n != o.offset:
            # (an output after an end, or not contiguous, is never produced; kept apart, the store's
            # offset check refuses it as it would unmerged)
            merged[o.key if prev is None else f"{o.key}\0{id(o)}"] = o
            continue
        merged[o.key] = dataclasses.replace(
            o,
            offset=prev.offset,
            n=prev.n + o.n,
            text=prev.text + o.text,
            token_ids=(*prev.token_ids, *o.token_ids),
        )
    return list(merged.values())


class Worker:
    def __init__(
        self,
        store: RequestStore,
        engine: Engine,
        *,
        name: str | None = None,
        max_running: int = 64,
        max_buffered_steps: int = 2048,
        model_name: str | None = None,
        route: str = "",
        log_flush_ms: float = 0.0,
    ) -> None:
        self.store = store
        # Write the token logs at most this often (0: after every engine step). A longer interval puts
        # several steps' tokens of a request in one log entry: fewer Redis commands and bytes per token
        # (the store's cost, issue 28), each token later by up to this long. Worth it where steps are
        # much shorter than the interval (an accelerator); on a CPU a step takes longer than most.
        self.log_flush_s = max(0.0, log_flush_ms) / 1000
        self.engine = engine
        # The one model this worker's engine holds, and its queue (Keys.model_queue: "" for the
        # deployment's default model). A process serving several models runs one Worker per model.
        self.model_name = model_name
        self.route = route
        self._taking = asyncio.Event()  # cleared by pause(): take no new work meanwhile
        self._taking.set()
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.max_running = max_running
        # Engine steps held while Redis is unreachable; past this the worker stops generating and hands
        # its requests back once Redis returns (they continue after their logged tokens).
        self.max_buffered_steps = max_buffered_steps
        self.store_ok = True  # the last store call succeeded (probes: not ready while False)
        self._store_up = asyncio.Event()
        self._store_up.set()
        self._hand_back = False  # requests were shed during an outage: hand them back when Redis returns
        # Partitions with entries read but not started after a failure (read them again, take()).
        self._retake_pending: set[int] = set()
        self._items: dict[str, WorkItem] = {}
        # Requests between the start call and _run (the start may have committed in Redis while its reply
        # is on the way, or a re-queued one's logged tokens are being read): running in the store, not
        # yet in _items, and not orphans (see _reconcile).
        self._starting: set[str] = set()
        # Requests the store said this worker runs and it did not, at the last reconcile: req key ->
        # the started_ms seen then. Seen again under the same start at the next one, they are orphans.
        self._unheld: dict[str, int] = {}
        self._replies: dict[str, list[str]] = {}
        self._timing: dict[str, _Timing] = {}
        self._steps: asyncio.Queue[list[StepOutput]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._take_tasks: list[asyncio.Task[None]] = []
        # Templating, tokenising and fitting a conversation: CPU work that must stall neither the event
        # loop nor the engine thread (the tokenizer releases the GIL), so a pool of its own.
        self._prompt_pool = ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="prompt")
        self._preparing: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._idle = asyncio.Event()  # set while no request is running here
        self._idle.set()
        # What the probes read (probes.py), from another thread: plain attributes, written on the loop.
        self.lease_ttl_s = store.settings.lease_ttl_ms / 1000
        self.lease_period_s = self.lease_ttl_s / 3
        self.last_tick = time.monotonic()  # the lease loop ran (whether or not Redis answered)
        self.last_heartbeat: float | None = None  # a heartbeat reached Redis
        self.draining = False

    def engine_alive(self) -> bool:
        alive = getattr(self.engine, "alive", None)
        return bool(alive()) if callable(alive) else True

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await self.store.ensure_group(self.name, routes=(self.route,))

        def on_step(outs: list[StepOutput]) -> None:  # called on the engine thread, once per step
            loop.call_soon_threadsafe(self._steps.put_nowait, outs)

        self.engine.start(on_step)
        kv_usage = getattr(self.engine, "kv_usage", None)
        if callable(kv_usage):
            metrics.KV_USAGE.set_function(kv_usage)
        reused = getattr(self.engine, "prompt_tokens_reused", None)
        if callable(reused):
            metrics.PROMPT_REUSE.read = reused
        self._room.set()
        await self._heartbeat()  # hold a lease before taking any work
        # One take loop per partition of the work queue (keys.py): a blocking read may not span two hash
        # slots on a Redis Cluster. One loop on a plain Redis.
        self._take_tasks = [
            asyncio.create_task(self._take_loop(p), name=f"worker-take-{p}") for p in self.store.partitions
        ]
        self._tasks = [
            *self._take_tasks,
            asyncio.create_task(self._write_loop(), name="worker-write"),
            asyncio.create_task(self._lease_loop(), name="worker-lease"),
            asyncio.create_task(self._detach_loop(), name="worker-detach"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        Worker._running.pop(self.name, None)
        await cancel_and_wait(list(self._preparing))
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    async def drain(self, deadline_s: float) -> int:
        """Graceful stop: take no new work, let running requests finish for up to ``deadline_s``, then hand
        the rest back to the queue (another worker continues them after their logged tokens) and stop.
        Returns how many requests were handed back."""
        self.draining = True
        await cancel_and_wait(self._take_tasks)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), deadline_s)
        handed = 0
        if self._items:
            handed = max(0, await self.store.reap(self.name, own=True))
            log.warning("worker.handed_back", requests=handed, worker=self.name)
        else:
            await self.store.reap(self.name, own=True)  # give up the lease and the affinity queue now
        await self.stop()
        return handed

    # Requests running per Worker of this process (one per model): the process's gauge is their sum.
    _running: ClassVar[dict[str, int]] = {}

    def _count_running(self) -> None:
        Worker._running[self.name] = len(self._items)
        metrics.RUNNING.set(sum(Worker._running.values()))

    def pause(self) -> None:
        """Take no new work until :meth:`resume` (running requests go on). New chats for this model then
        wait in its queue: an operator's brake, and how tests build a backlog without timing."""
        self._taking.clear()

    def resume(self) -> None:
        self._taking.set()

    def _store_failed(self, exc: Exception) -> None:
        if self.store_ok:
            log.warning("worker.store_unreachable", error=str(exc), worker=self.name)
        self.store_ok = False
        self._store_up.clear()

    def _store_answered(self) -> None:
        if not self.store_ok:
            log.info("worker.store_back", worker=self.name)
        self.store_ok = True
        self._store_up.set()

    async def _take_loop(self, partition: int) -> None:
        parts = len(self.store.partitions)
        while True:
            await self._room.wait()
            await self._taking.wait()
            await self._store_up.wait()  # no new work while Redis is unreachable
            try:
                room = self.max_running - len(self._items)
                # With several partitions each loop asks for its share of the room (at least one), so the
                # loops together take at most max_running + partitions - 1 at once.
                count = max(1, room // parts)
                pending = partition in self._retake_pending
                entries = await self.store.take(
                    self.name,
                    count=count,
                    block_ms=1000,
                    pending=pending,
                    partition=partition,
                    routes=(self.route,),
                )
                if pending and not entries:
                    self._retake_pending.discard(partition)
                own = self.store.keys.worker_queue(self.name, partition)
                for queue, entry_id, req_key in entries:
                    # Its own queue holds only the default model's requests (session affinity).
                    route = "" if queue == own else self.route
                    self._starting.add(req_key)
                    try:
                        item = await self.store.start(self.name, entry_id, req_key, queue, route)
                        if item is not None:
                            resume: tuple[list[int], str] = ([], "")
                            if item.completion_tokens:
                                # Re-queued after its worker died: continue after the tokens already logged.
                                resume = await self.store.logged_tokens(item.log_key)
                            self._run(item, *resume)
                    finally:
                        # Failed here after start committed (its reply lost, or the log read failed):
                        # running in the store and nowhere here; _reconcile re-queues it.
                        self._starting.discard(req_key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("worker.take_failed", error=str(exc))
                self._store_failed(exc)
                self._retake_pending.add(partition)  # entries read but not started are still ours: read again
                await asyncio.sleep(0.5)

    async def _heartbeat(self) -> list[str]:
        dead = await self.store.heartbeat(
            self.name, len(self._items), self.max_running, model=self.model_name or "", route=self.route
        )
        self.last_heartbeat = time.monotonic()
        self._store_answered()
        return dead

    async def _lease_loop(self) -> None:
        """Renew this worker's lease and re-queue the requests of workers whose leases lapsed."""
        while True:
            await asyncio.sleep(self.lease_period_s)
            self.last_tick = time.monotonic()
            try:
                if self._hand_back:
                    # Back after an outage in which this worker shed its requests: re-queue them (they
                    # continue after their logged tokens), then take a lease again.
                    n = await self.store.reap(self.name, own=True)
                    self._hand_back = False
                    log.warning("worker.handed_back_after_outage", requests=n, worker=self.name)
                for dead in await self._heartbeat():
                    n = await self.store.reap(dead)
                    if n >= 0:
                        metrics.REQUEUED.inc(n)
                        log.warning("worker.reaped", dead_worker=dead, requeued=n, worker=self.name)
                await self._reconcile()
                depth = await self.store.queued(self.route)
                metrics.MODEL_QUEUE_DEPTH.labels(self.model_name or "").set(depth)
                if not self.route:
                    metrics.QUEUE_DEPTH.set(depth)  # the default model's queue, as before models had names
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("worker.heartbeat_failed", error=str(exc))
                self._store_failed(exc)

    async def _detach_loop(self) -> None:
        """The detach timeout: about every second (a quarter of the timeout when that is shorter), cancel
        this worker's running requests that nobody has been attached to for the timeout. Its writes
        (step.lua) no longer read every request's record on every step, which is what made a token cost
        five commands; the cancelled ones stop at their next step."""
        period = min(1.0, self.store.settings.detach_timeout_ms / 4000)
        while True:
            await asyncio.sleep(period)
            if not self._items:
                continue
            try:
                n = await self.store.detach_sweep(self.name)
                if n:
                    log.info("worker.detached", cancelled=n, worker=self.name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store is away: the write loop and the lease loop say so
                log.debug("worker.detach_sweep_failed", error=str(exc))

    async def _reconcile(self) -> None:
        """Re-queue the requests the store says this worker runs and it does not: started in Redis, but
        the reply to start was lost (or the worker failed before handing one to its engine), or left by an
        earlier process under this name. Nobody else would ever run them: the lease stays live, so no
        reaper takes them, and attached clients' touches keep them from the detach timeout.

        Runs once per lease period. A request counts as an orphan only when two checks in a row find it
        running here under the same start (started_ms) and in neither ``_items`` (running, or being
        prepared) nor ``_starting`` (between start and _run): one just started is in ``_starting`` from
        before its start call, and the second look spares any snapshot race. So an orphan is re-queued
        (its own model's queue, same epoch: continued after its logged tokens, by this worker or another)
        within two lease periods, well inside the lease TTL. Skipped while shed requests wait to be
        handed back: the hand-back re-queues them all."""
        if self._hand_back:
            self._unheld = {}
            return
        held = set(self._items) | self._starting  # before the read: see RequestStore.unheld
        unheld = await self.store.unheld(self.name, held)
        seen, self._unheld = self._unheld, {}
        for key, (started_ms, route) in unheld.items():
            if key in self._items or key in self._starting:
                continue  # started here while the store was read
            if seen.get(key) != started_ms:
                self._unheld[key] = started_ms  # first sighting: look again next period
                continue
            if await self.store.requeue_orphan(self.name, key, started_ms, route):
                metrics.REQUEUED.inc()
                log.warning("worker.orphan_requeued", key=key, worker=self.name)

    def _run(self, item: WorkItem, resume: list[int], resumed_text: str) -> None:
        p = item.payload
        key = item.req_key
        self._items[key] = item
        rlog = log.bind(request_id=p["id"], session=p.get("session"), user=p.get("owner"), server=self.name)
        self._timing[key] = _Timing(started=time.monotonic(), log=rlog)
        self._idle.clear()
        self._replies[key] = [resumed_text]
        if len(self._items) >= self.max_running:
            self._room.clear()
        self._count_running()
        metrics.QUEUE_WAIT.observe(item.queue_wait_ms / 1000)
        request = GenerationRequest(
            key=key,
            messages=p["messages"],
            params=params_from_payload(p.get("params") or {}),
            resume_ids=resume,
            session=p.get("session") or "",
            user=str(p.get("owner") or ""),
            weight=_weight(p.get("weight")),
            cache_key=str(p.get("reuse_key") or ""),
        )
        task = asyncio.create_task(self._prepare_and_submit(item, request), name=f"prepare-{key}")
        self._preparing.add(task)
        task.add_done_callback(self._preparing.discard)
        rlog.info("request.started", resumed_at=len(resume) or None, queue_wait_ms=item.queue_wait_ms)

    async def _prepare_and_submit(self, item: WorkItem, request: GenerationRequest) -> None:
        """Turn the request's messages into token ids on the prompt pool, then hand it to the engine,
        unless this worker dropped the request meanwhile (shed): then it never reaches the engine."""
        code, message = "", ""
        try:
            prepare = getattr(self.engine, "prepare", None)
            if callable(prepare):
                loop = asyncio.get_running_loop()
                request = await loop.run_in_executor(self._prompt_pool, prepare, request)
            if self._items.get(request.key) is not item:
                return  # dropped while it was prepared: nobody would read its tokens
            self.engine.submit(request)
        except PromptTooLarge as exc:
            code, message = "too_large", str(exc)
        except EngineOverloaded as exc:
            # The engine's own waiting queue is full: end the request with a clear error, never drop it.
            code, message = "overloaded", f"the engine is full; retry after {exc.retry_after_ms} ms"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a request that cannot be prepared fails alone
            log.exception("worker.prepare_failed", key=request.key)
            code, message = "internal", f"bad request: {exc}"
        if code:
            out = StepOutput(
                request.key,
                len(request.resume_ids),
                0,
                "",
                finish="error",
                error_code=code,
                error_message=message[:200],
            )
            self._steps.put_nowait([out])

    async def _write(self, ops: list[StepOp]) -> list[bool]:
        """Write a step, retrying through a store outage: dropping it would leave a gap in the logs.
        The engine keeps running meanwhile; its later steps queue up and go out together. Retries are
        safe (append and finish accept a repeat of what this worker already wrote). If the backlog passes
        ``max_buffered_steps``, the worker sheds its requests instead (see ``_shed``)."""
        if not ops:
            # Only outputs of requests dropped here (after a shed, say): nothing to write, and nothing
            # that says Redis answered (an empty write_step never asks it).
            return []
        delay = 0.05
        while True:
            try:
                held = await self.store.write_step(ops, self.name)
                self._store_answered()
                return held
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._store_failed(exc)
                if self._steps.qsize() >= self.max_buffered_steps:
                    self._shed()
                    return [False] * len(ops)
                log.warning("worker.write_failed", error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _shed(self) -> None:
        """Redis has been away too long for the buffer: stop generating everything and drop what was not
        written. The requests stay running for this worker in the store, with the tokens logged so far;
        when Redis is back the lease loop hands them back (re-queued, continued after those tokens), so
        nothing is lost or repeated, and memory stays bounded however long the outage."""
        log.warning("worker.shed", requests=len(self._items), steps=self._steps.qsize(), worker=self.name)
        for key in list(self._items):
            self.engine.cancel(key)
        # Those still being prepared have not reached the engine, so the cancels above find nothing:
        # stop them before they are submitted (and _prepare_and_submit checks again, for one whose
        # prompt is already done and whose submit is next).
        for task in list(self._preparing):
            task.cancel()
        while not self._steps.empty():
            self._steps.get_nowait()
        self._items.clear()
        self._replies.clear()
        self._timing.clear()
        self._hand_back = True

    async def _write_loop(self) -> None:
        last_write = 0.0
        while True:
            outs = await self._steps.get()
            wait = last_write + self.log_flush_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # --log-flush-ms: gather the steps until the next write
            # If Redis fell behind, several engine steps may be waiting: write them in one round trip.
            while not self._steps.empty():
                outs.extend(self._steps.get_nowait())
            last_write = time.monotonic()
            ops: list[StepOp] = []
            for o in merge_steps(outs):
                item = self._items.get(o.key)
                if item is None:
                    # Dropped here (cancelled, shed): whatever the engine still runs of it runs for
                    # nobody, so stop it (a cancel of a request the engine has finished does nothing).
                    if o.finish is None:
                        self.engine.cancel(o.key)
                    continue
                reply = self._replies[o.key]
                reply.append(o.text)
                ops.append(
                    StepOp(
                        item=item,
                        offset=o.offset,
                        n=o.n,
                        text=o.text,
                        prompt_tokens=o.prompt_tokens,
                        cached_tokens=o.cached_tokens,
                        token_ids=o.token_ids,
                        finish=o.finish,
                        reply_text="".join(reply) if o.finish else "",
                        error_code=o.error_code,
                        error_message=o.error_message,
                        length_reason=o.length_reason,
                    )
                )
            t0 = time.perf_counter()
            held = await self._write(ops)
            now = time.monotonic()
            if ops:  # an empty write never asked Redis: no round trip to report
                metrics.REDIS_RTT.observe(time.perf_counter() - t0)
            for op, ok in zip(ops, held, strict=True):
                key = op.item.req_key
                if ok and op.n:
                    metrics.TOKENS.inc(op.n)
                    timing = self._timing.get(key)
                    if timing is not None:
                        if timing.last is None:
                            metrics.TTFT.observe(now - timing.started)
                        else:
                            metrics.INTER_TOKEN.observe((now - timing.last) / op.n)
                        timing.last = now
                if ok and op.finish is not None:
                    metrics.FINISHED.labels(op.finish).inc()
                    if op.finish == "length" and op.length_reason == "context":
                        metrics.CONTEXT_FULL.inc()
                if not ok and op.finish is None:
                    self.engine.cancel(key)  # cancelled or no longer ours: stop spending compute on it
                if not ok or op.finish is not None:
                    self._items.pop(key, None)
                    self._replies.pop(key, None)
                    t = self._timing.pop(key, None)
                    rlog = t.log if t is not None else log.bind(request_id=op.item.payload["id"])
                    if op.finish is not None:
                        why = {"length_reason": op.length_reason} if op.finish == "length" else {}
                        rlog.info("request.finished", finish=op.finish, tokens=op.offset + op.n, **why)
                    elif not ok:
                        rlog.info("request.stopped", reason="cancelled, detached or taken over")
            self._count_running()
            if len(self._items) < self.max_running:
                self._room.set()
            if not self._items:
                self._idle.set()
