"""Idle connections: many sockets that only say ``hello`` and then ``ping`` every few seconds.

One task per connection, no other state: thousands fit in one process. The round trip of each ``ping`` to
its ``pong`` is what a mostly idle chat client sees of the server's responsiveness; handshakes are limited
to ``connect_concurrency`` at a time so the ramp does not overflow the server's listen backlog.
Optionally (``--server-pid``, local servers only) the server's resident memory is read before the ramp and
after it, for the memory each held connection costs the gateway.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from websockets.exceptions import WebSocketException

from protocol import JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL, Ping, Pong, ProtocolError
from server.load.connection import LoadClient, ServerError
from server.load.options import LoadConfig

PONG_TIMEOUT_S = 20.0  # SPEC §13: reconnect if no pong within 20 s
CONNECT_ATTEMPTS = 5


def rss_kib(pid: int) -> int | None:
    """Resident set size of a local process in KiB (Linux /proc), or None if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a local process has used so far (Linux /proc), or None."""
    try:
        # The command name (field 2) may hold spaces: count the fields after its closing parenthesis.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@dataclass(slots=True)
class IdleStats:
    target: int = 0
    connected: int = 0
    connect_failed: Counter[str] = field(default_factory=Counter)  # gave up, by the last cause
    connect_errors: Counter[str] = field(default_factory=Counter)  # every failed attempt, by cause
    closed_by_server: int = 0
    pings: int = 0
    pongs: int = 0
    lost: int = 0  # pings without a pong in PONG_TIMEOUT_S
    ramp_s: float | None = None
    rtt_ramp: list[float] = field(default_factory=list)  # seconds, pings sent while still connecting
    rtt: list[float] = field(default_factory=list)  # seconds, pings sent with every connection held
    rss_before_kib: int | None = None
    rss_after_kib: int | None = None
    # The server's CPU while it only held the connections (from the memory reading to the stop).
    hold_cpu_s: float | None = None
    hold_s: float | None = None

    @property
    def kib_per_connection(self) -> float | None:
        if self.rss_before_kib is None or self.rss_after_kib is None or not self.connected:
            return None
        return (self.rss_after_kib - self.rss_before_kib) / self.connected

    @property
    def us_per_connection_s(self) -> float | None:
        """Server CPU per held connection per second of holding (its pings and timers), microseconds."""
        if self.hold_cpu_s is None or not self.hold_s or not self.connected:
            return None
        return self.hold_cpu_s * 1e6 / self.hold_s / self.connected


class IdlePool:
    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.stats = IdleStats(target=cfg.idle)
        self.ramped = asyncio.Event()
        self._stop = asyncio.Event()
        self._sem = asyncio.Semaphore(max(1, cfg.connect_concurrency))
        self._settled = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._rng = random.Random(f"{cfg.seed}:idle")
        self._t0 = 0.0
        self._hold_from: tuple[float | None, float] | None = None

    def start(self) -> None:
        if self.cfg.server_pid is not None:
            self.stats.rss_before_kib = rss_kib(self.cfg.server_pid)
        self._t0 = time.perf_counter()
        self._tasks = [asyncio.create_task(self._hold(i), name=f"idle-{i}") for i in range(self.cfg.idle)]
        if not self._tasks:
            self.ramped.set()

    def _settle(self) -> None:
        self._settled += 1
        if self._settled == self.cfg.idle:
            self.stats.ramp_s = time.perf_counter() - self._t0
            self.ramped.set()

    async def measure_memory(self, settle_s: float = 1.0) -> None:
        """After the ramp: let the server settle, then read its memory."""
        await self.ramped.wait()
        if self.cfg.server_pid is not None:
            await asyncio.sleep(settle_s)
            self.stats.rss_after_kib = rss_kib(self.cfg.server_pid)
            self._hold_from = (cpu_s(self.cfg.server_pid), time.perf_counter())

    async def _hold(self, i: int) -> None:
        st, cfg = self.stats, self.cfg
        both = cfg.subprotocol == "both"
        sub = JSON_SUBPROTOCOL if cfg.subprotocol == "json" or (both and i % 2) else MSGPACK_SUBPROTOCOL
        phase = self._rng.uniform(0, cfg.ping_interval)
        client = await self._open(sub)
        if client is None:
            self._settle()
            return
        st.connected += 1
        self._settle()
        try:
            if await self._wait_stop(phase):
                return
            while True:
                ts = time.perf_counter()
                steady = self.ramped.is_set()
                await client.send(Ping(ts=ts))
                st.pings += 1
                try:
                    async with asyncio.timeout(PONG_TIMEOUT_S):
                        while True:
                            frame, _ = await client.recv_sized()
                            if isinstance(frame, Pong) and frame.ts == ts:
                                break
                    (st.rtt if steady else st.rtt_ramp).append(time.perf_counter() - ts)
                    st.pongs += 1
                except TimeoutError:
                    st.lost += 1
                if await self._wait_stop(cfg.ping_interval):
                    return
        except (OSError, WebSocketException, ProtocolError):
            st.closed_by_server += 1
        finally:
            try:
                async with asyncio.timeout(2):
                    await client.close()
            except (TimeoutError, OSError, WebSocketException):
                client.abort()

    async def _open(self, sub: str) -> LoadClient | None:
        """Connect and hello, retrying with backoff as SPEC §7 asks of clients; None if it never worked.
        Every failed attempt is counted by its cause (``connect_errors``), final failures apart."""
        st, cfg = self.stats, self.cfg
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                async with self._sem:
                    return await LoadClient.open(cfg.url, sub, token=cfg.token, open_timeout=60)
            except (
                OSError,
                WebSocketException,
                TimeoutError,
                ServerError,
                ProtocolError,
                RuntimeError,
            ) as exc:
                code = exc.frame.code if isinstance(exc, ServerError) else type(exc).__name__
                st.connect_errors[code] += 1
                if attempt == CONNECT_ATTEMPTS - 1 or code in ("unauthorized", "unsupported_version"):
                    st.connect_failed[code] += 1
                    return None
                await asyncio.sleep(0.2 * 2**attempt * (0.5 + self._rng.random()))
        return None

    async def _wait_stop(self, seconds: float) -> bool:
        """Sleep for ``seconds`` or until stopped; True if stopped."""
        try:
            async with asyncio.timeout(seconds):
                await self._stop.wait()
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Close every idle connection (a pending ping still gets its pong or its timeout)."""
        if self._hold_from is not None and self._hold_from[0] is not None and self.cfg.server_pid is not None:
            now = cpu_s(self.cfg.server_pid)
            if now is not None:
                self.stats.hold_cpu_s = now - self._hold_from[0]
                self.stats.hold_s = time.perf_counter() - self._hold_from[1]
        self._stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
