"""A load run: who sends what when, the bounds, and the tallies every user writes into.

* **Closed loop** (default): ``--users`` users, each running conversations back to back.
* **Open loop** (``--rate R``): conversations arrive as a Poisson process at R per second, each on a new
  connection and session; ``--users`` caps how many run at once (an arrival that finds the cap full waits,
  and its lag is reported, so a saturated server is visible rather than hidden).
* Bounds: ``--requests N`` hands out N request tickets in all; ``--duration S`` hands out none after S
  seconds. Requests in flight always finish (or time out), so every issued request is accounted for.
* ``--idle N`` connections are opened first and held (pinging) while the traffic runs; ``--idle-only``
  just holds them for the duration.

The measured window starts when the traffic starts (after the idle ramp) and ends at the last ``done``.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from protocol import JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL
from server.load.conversation import Conversation, RequestRecord
from server.load.idle import IdlePool, IdleStats
from server.load.options import LoadConfig
from server.load.wire import WireStats

BUCKET_S = 1.0  # tokens/s time series resolution


def raise_open_file_limit(want: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``want`` (at most the hard limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < cap:
        resource.setrlimit(resource.RLIMIT_NOFILE, (cap, hard))
        return cap
    return soft


class RunState:
    """Shared by every user of one run (one event loop: no locks needed)."""

    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.tag = os.urandom(3).hex()  # request ids are unique per run, whatever the seed
        self.t0 = time.perf_counter()
        self.wire = WireStats(cfg.sse_model)
        self.records: list[RequestRecord] = []
        self.issued = 0
        self.tokens = 0
        self.kills = 0
        self.resumes = 0
        self.buckets: list[int] = []
        self.servers: set[str] = set()
        self.connect_error = ""  # the last reason a connection could not be made (the report says it)
        self.arrival_lags: list[float] = []
        self.on_finish: Callable[[RequestRecord], None] | None = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def restart_clock(self) -> None:
        self.t0 = time.perf_counter()

    def exhausted(self) -> bool:
        cfg = self.cfg
        if cfg.requests is not None and self.issued >= cfg.requests:
            return True
        return cfg.duration is not None and self.now() >= cfg.duration

    def take_ticket(self) -> bool:
        """May one more request be issued? Counts it if so."""
        if self.exhausted():
            return False
        self.issued += 1
        return True

    def add_tokens(self, n: int, t: float) -> None:
        self.tokens += n
        i = int(t / BUCKET_S)
        if i >= len(self.buckets):
            self.buckets.extend([0] * (i + 1 - len(self.buckets)))
        self.buckets[i] += n

    def finish(self, rec: RequestRecord) -> None:
        self.records.append(rec)
        if self.on_finish is not None:
            self.on_finish(rec)

    def saw_server(self, name: str) -> None:
        self.servers.add(name)

    def subprotocol(self, i: int) -> str:
        mode = self.cfg.subprotocol
        if mode == "json" or (mode == "both" and i % 2):
            return JSON_SUBPROTOCOL
        return MSGPACK_SUBPROTOCOL


@dataclass(slots=True)
class LoadResult:
    cfg: LoadConfig
    started: float  # wall clock, seconds since the epoch
    window_s: float  # traffic start to the last done (or the hold time in idle-only mode)
    issued: int
    records: list[RequestRecord]
    wire: WireStats
    buckets: list[int]
    idle: IdleStats | None
    servers: list[str]
    arrival_lags: list[float] = field(default_factory=list)
    open_files_limit: int = 0
    connect_error: str = ""


ConversationRunner = Callable[[int, int], Awaitable[None]]  # (user or arrival index, conversation no.)


def websocket_conversation(state: RunState) -> ConversationRunner:
    """Conversations over WebSocket against ``state.cfg.url``."""

    async def run(user: int, conversation: int) -> None:
        await Conversation(state, user, conversation, state.subprotocol(user)).run()

    return run


async def drive(state: RunState, conversation: ConversationRunner) -> None:
    """Run conversations in the configured loop (closed, or open with ``--rate``) until the bounds."""
    await (_open_loop(state, conversation) if state.cfg.rate else _closed_loop(state, conversation))


async def _closed_loop(state: RunState, conversation: ConversationRunner) -> None:
    async def user(u: int) -> None:
        conv = 0
        while not state.exhausted():
            await conversation(u, conv)
            conv += 1

    await asyncio.gather(*(user(u) for u in range(state.cfg.users)))


async def _open_loop(state: RunState, conversation: ConversationRunner) -> None:
    cfg = state.cfg
    assert cfg.rate is not None
    rng = random.Random(f"{cfg.seed}:arrivals")
    cap = asyncio.Semaphore(cfg.users)
    tasks: set[asyncio.Task[None]] = set()

    async def arrival(i: int) -> None:
        try:
            await conversation(i, 0)
        finally:
            cap.release()

    due, i = 0.0, 0
    while True:
        due += rng.expovariate(cfg.rate)
        delay = due - state.now()
        if delay > 0:
            await asyncio.sleep(delay)
        if state.exhausted():
            break
        await cap.acquire()
        state.arrival_lags.append(max(0.0, state.now() - due))
        t = asyncio.create_task(arrival(i), name=f"conversation-{i}")
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        i += 1
    if tasks:
        await asyncio.gather(*tasks)


async def run_load(
    cfg: LoadConfig, *, on_state: Callable[[RunState, IdlePool | None], None] | None = None
) -> LoadResult:
    """Run the configured load against ``cfg.url`` and return what was measured.

    ``on_state`` is called once the shared state exists (the live progress view hooks in there).
    """
    limit = raise_open_file_limit(cfg.users * 2 + cfg.idle + 256)
    started = time.time()
    state = RunState(cfg)
    pool = IdlePool(cfg) if cfg.idle else None
    if on_state is not None:
        on_state(state, pool)
    try:
        if pool is not None:
            pool.start()
            await pool.measure_memory()
        state.restart_clock()
        if cfg.idle_only:
            await asyncio.sleep(cfg.duration or 0.0)
            window = state.now()
        else:
            if cfg.api == "openai":
                from server.load.openai_api import openai_conversation

                await drive(state, openai_conversation(state))
            elif cfg.api == "openai-ws":
                from server.load.openai_ws import openai_ws_conversation

                await drive(state, openai_ws_conversation(state))
            else:
                await drive(state, websocket_conversation(state))
            ends = [r.done_at for r in state.records if r.done_at is not None]
            window = max(ends) if ends else state.now()
    finally:
        if pool is not None:
            await pool.stop()
    return LoadResult(
        cfg=cfg,
        started=started,
        window_s=window,
        issued=state.issued,
        records=state.records,
        wire=state.wire,
        buckets=state.buckets,
        idle=pool.stats if pool is not None else None,
        servers=sorted(state.servers),
        arrival_lags=state.arrival_lags,
        open_files_limit=limit,
        connect_error=state.connect_error,
    )
