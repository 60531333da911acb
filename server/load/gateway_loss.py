"""``tokenwire load URL --scenario gateway-loss``: kill -9 one gateway of a cluster under load, and measure
how the others take its clients back (issue 28).

**Target.** A local ``tokenwire cluster --gateways 4 --workers 1`` (gateways on consecutive ports). The
load tool takes the first gateway's URL and ``--gateways N`` (the others on the next ports, as the cluster
command puts them), or every URL with ``--gateway-url`` (repeat; the positional URL, if any, first). It
needs each gateway's pid, to kill one and to read its CPU and memory from /proc: ``--gateway-pid`` (repeat,
in URL order), or else it finds the process that listens on each URL's port, from /proc/net/tcp{,6} and
/proc/*/fd (Linux; the gateways must run as the same user as the load tool, which must be able to signal
them anyway). A port that no single process holds is an error that asks for ``--gateway-pid``.

**Load.** ``--idle C`` idle connections (default 16,000) in child processes of this one, at most
``--idle-per-process`` each (default 4,000; every process raises its soft RLIMIT_NOFILE to the hard limit,
so with 20,000 a process holds its share and the herd's new sockets with room to spare, and the herd is
handled on every core), connection *i* on gateway *i mod N*; and ``--streams S`` streaming conversations
(default 64) in this process, stream *j* on gateway *j mod N*, each chatting continuously: one messages-mode
chat after another, a seeded prompt, greedy (temperature 0), ``--stream-max-tokens`` tokens, never from
the response cache.

**The kill.** After ``--baseline`` seconds with everything connected, and once every stream on the gateway
to be killed has a reply in flight (``--kill-share`` of them, default half — on CPU an engine runs 32 at
once and the others wait — with ``--kill-after-tokens`` tokens or more; after ``--kill-wait`` seconds it
kills anyway and says how many were mid-reply), it SIGKILLs the gateway holding the most connections (the
load tool's own count; ties: the first). Every client of that gateway then does
what SPEC §7/§10 asks of a client: it reconnects with exponential backoff and full jitter (as the JS
client: a delay uniform in [0, min(10 s, 0.3 s * 2^attempt)], the first attempt included), to one of the
other gateways at random (a gateway that refuses the TCP connection is not tried again), sends ``hello``
with its ``session_token`` — a stream with ``hello.resume`` of its reply at the last offset it holds —
and honours ``retry_after_ms`` on ``rate_limited`` / ``overloaded``, the only refusals the protocol
documents.

**Report** (table, and ``--json F``): the time from the kill until every stream of that gateway is
attached again (``accepted`` for its resume) and until every idle connection is back (``welcome``, with its
own session); the Redis operations per second (``INFO stats`` total_commands_processed, sampled every 100
ms; ``--redis-url``: give the cluster a Redis of its own, INFO is server-wide) before, at the peak of the
herd and after; each surviving gateway's CPU (utime + stime from /proc/PID/stat) and RSS before, at the
peak and ``--settle`` seconds after the last reconnect; lost and duplicated tokens (each delta's offset
against the offset held; every interrupted reply, once done, replayed from offset 0 and compared with the
text assembled live: the store's log); errors by code. Targets — exit status 1 when one is missed: every
stream and every idle connection back within ``--recover-timeout``, each with its own session; no token
lost or repeated and every replay equal; every reply ends ``stop`` or ``length``; no ``internal`` error,
and no error but ``rate_limited`` / ``overloaded`` with ``retry_after_ms``. Exit 2: the run could not
start (no pids, nothing connected).

**Admission.** No flag of the cluster needs changing for a load test from one address: the WebSocket
door's limits are per connection and per owner (every connection here is a session of its own, so an
owner), and the per-peer read pace (``--ingress-bytes-per-peer``, 16 MiB/s by default) is far above
what 16,000 ``hello`` frames need. Each gateway must be allowed its share of the connections after the
loss (``ulimit -n``; the load tool warns when a gateway's limit is lower).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.exceptions import InvalidStatus, WebSocketException

from protocol import (
    MSGPACK_SUBPROTOCOL,
    Accepted,
    Chat,
    Delta,
    Done,
    Error,
    Message,
    Params,
    ProtocolError,
    Resume,
    ResumePoint,
)
from server.load.connection import LoadClient, ServerError
from server.load.conversation import prompt_text
from server.load.idle import cpu_s, rss_kib
from server.load.integrity import StreamCheck, replay_and_compare
from server.load.options import GATEWAY_LOSS_IDLE as DEFAULT_IDLE
from server.load.report import percentile
from server.load.runner import raise_open_file_limit

# The refusals SPEC §6 documents, each sent with retry_after_ms; any other error in this run is a fault.
REFUSALS = ("rate_limited", "overloaded")
SAMPLE_S = 0.1  # Redis and /proc sampling period
RAMP_ATTEMPTS = 8
OPEN_TIMEOUT_S = 30.0
REPLAY_TIMEOUT_S = 60.0


# --- configuration ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class GatewayLossConfig:
    urls: list[str]
    pids: list[int] | None = None  # --gateway-pid, in URL order; None: found from the listening ports
    idle: int = DEFAULT_IDLE
    streams: int = 64
    idle_per_process: int = 4000
    stream_max_tokens: int = 128
    seed: int = 0
    redis_url: str | None = None
    connect_concurrency: int = 64
    kill_after_tokens: int = 4
    kill_share: float = 0.5  # of the victim's streams that must hold kill_after_tokens tokens
    kill_wait_s: float = 60.0
    baseline_s: float = 3.0
    settle_s: float = 5.0
    recover_timeout_s: float = 120.0
    drain_timeout_s: float = 300.0  # after the run, the streams' last replies must end within this
    reconnect_initial_s: float = 0.3
    reconnect_max_s: float = 10.0
    json_path: Path | None = None

    def __post_init__(self) -> None:
        if len(self.urls) < 2:
            raise ValueError("--scenario gateway-loss needs at least 2 gateways (one to kill, one to go to)")
        if self.pids is not None and len(self.pids) != len(self.urls):
            raise ValueError(f"--gateway-pid: {len(self.pids)} pids for {len(self.urls)} gateways")
        if self.idle < 0 or self.streams < 0 or self.idle + self.streams < 1:
            raise ValueError("--idle and --streams: at least one connection in all")
        if self.idle_per_process < 1:
            raise ValueError("--idle-per-process must be at least 1")
        if not 0.0 <= self.kill_share <= 1.0:
            raise ValueError("--kill-share must be in [0, 1]")

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["json_path"] = None if self.json_path is None else str(self.json_path)
        d.pop("redis_url")  # it may hold a password
        d["redis"] = self.redis_url is not None
        return d


def gateway_urls(url: str | None, count: int, explicit: list[str] | None) -> list[str]:
    """The gateways' URLs: ``url`` then each ``--gateway-url``; or, without those, ``count`` gateways on
    consecutive ports from ``url``'s (``tokenwire cluster``'s layout)."""
    if explicit:
        urls = ([url] if url else []) + list(explicit)
        return list(dict.fromkeys(urls))
    if not url:
        raise ValueError("give the first gateway's URL (and --gateways N), or --gateway-url for each")
    parts = urlsplit(url)
    if parts.port is None or parts.hostname is None:
        raise ValueError(f"{url}: the URL needs a host and a port (the next gateways are on the next ports)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return [urlunsplit(parts._replace(netloc=f"{host}:{parts.port + i}")) for i in range(count)]


def listening_pids(port: int) -> set[int]:
    """The pids of local processes holding a TCP socket that listens on ``port`` (any address): the
    socket's inode from /proc/net/tcp and tcp6, then every /proc/PID/fd link to it (Linux; only processes
    this user may inspect)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    links = {f"socket:[{i}]" for i in inodes}
    pids: set[int] = set()
    if not links:
        return pids
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in links:
                        pids.add(int(d.name))
                        break
        except OSError:
            continue
    return pids


def find_gateway_pids(urls: list[str]) -> list[int]:
    out = []
    for url in urls:
        port = urlsplit(url).port
        pids = listening_pids(port) if port is not None else set()
        if len(pids) != 1:
            found = ", ".join(map(str, sorted(pids))) or "none"
            raise ValueError(
                f"{url}: expected one local process listening on port {port}, found {found}; "
                "give the gateways' pids with --gateway-pid (repeat, in URL order)"
            )
        out.append(pids.pop())
    return out


def open_files_limit(pid: int) -> int | None:
    """A local process's soft limit on open files (/proc/PID/limits), or None."""
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return None if soft == "unlimited" else int(soft)
    except (OSError, ValueError, IndexError):
        return None
    return None


# --- what every client does on a failure -----------------------------------------------------------------


def backoff_s(attempt: int, rng: random.Random, initial_s: float, max_s: float) -> float:
    """Full jitter, as the JS client's ``backoffDelay``: uniform in [0, min(max, initial * 2^attempt)]."""
    return rng.uniform(0.0, min(max_s, initial_s * 2 ** min(attempt, 30)))


@dataclass(slots=True)
class Tally:
    """Error frames by code, refusals that came without ``retry_after_ms``, and failed connection attempts
    by cause (a refused TCP connection, a timeout, an HTTP status instead of the upgrade)."""

    errors: Counter[str] = field(default_factory=Counter)
    bare_refusals: Counter[str] = field(default_factory=Counter)
    connect: Counter[str] = field(default_factory=Counter)

    def error(self, frame: Error) -> None:
        self.errors[frame.code] += 1
        if frame.code in REFUSALS and frame.retry_after_ms is None:
            self.bare_refusals[frame.code] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "errors": dict(self.errors),
            "bare_refusals": dict(self.bare_refusals),
            "connect_errors": dict(self.connect),
        }

    def add(self, d: dict[str, dict[str, int]]) -> None:
        self.errors.update(d.get("errors") or {})
        self.bare_refusals.update(d.get("bare_refusals") or {})
        self.connect.update(d.get("connect_errors") or {})


def _cause(exc: BaseException) -> str:
    if isinstance(exc, InvalidStatus):
        return f"http_{exc.response.status_code}"
    return type(exc).__name__


@dataclass(slots=True)
class Backoff:
    initial_s: float
    max_s: float
    open_timeout_s: float = OPEN_TIMEOUT_S


async def connect(
    urls: list[str],
    candidates: list[int],
    rng: random.Random,
    tally: Tally,
    backoff: Backoff,
    *,
    session_token: str | None = None,
    resume: tuple[ResumePoint, ...] = (),
    wait_first: bool = True,
    attempts: int | None = None,
    gate: asyncio.Semaphore | None = None,
) -> tuple[LoadClient, int] | None:
    """Connect and say hello to one of ``candidates`` (indices into ``urls``, tried at random), with
    backoff and full jitter between attempts (before the first too, unless ``wait_first`` is false: a
    client that just lost its connection must not come back at once with all the others). Returns the
    client and its gateway, or None after ``attempts`` failures or an answer that forbids retrying
    (``unauthorized``, ``unsupported_version``: SPEC §7)."""
    candidates = list(candidates)
    attempt = 0
    while attempts is None or attempt < attempts:
        if wait_first or attempt:
            await asyncio.sleep(backoff_s(attempt, rng, backoff.initial_s, backoff.max_s))
        attempt += 1
        g = rng.choice(candidates)
        try:
            async with gate if gate is not None else contextlib.nullcontext():
                # The whole attempt is bounded, the hello's answer included (open_timeout covers only
                # the TCP connection and the WebSocket handshake).
                async with asyncio.timeout(backoff.open_timeout_s):
                    c = await LoadClient.open(
                        urls[g],
                        MSGPACK_SUBPROTOCOL,
                        session_token=session_token,
                        resume=resume,
                        open_timeout=backoff.open_timeout_s,
                    )
            return c, g
        except ServerError as exc:
            tally.error(exc.frame)
            if exc.frame.code in ("unauthorized", "unsupported_version"):
                return None
            if exc.frame.retry_after_ms:
                await asyncio.sleep(exc.frame.retry_after_ms / 1000)
        except ConnectionRefusedError:
            tally.connect["refused"] += 1
            if len(candidates) > 1:
                candidates.remove(g)  # nothing listens there: that is the dead gateway
        except (OSError, WebSocketException, TimeoutError, ProtocolError, RuntimeError) as exc:
            tally.connect[_cause(exc)] += 1
    return None


# --- idle connections (child processes) ------------------------------------------------------------------


@dataclass(slots=True)
class ShardSpec:
    """One child process's share of the idle connections: global indices ``first`` .. ``first + count``."""

    urls: list[str]
    first: int
    count: int
    seed: int
    connect_concurrency: int
    initial_s: float
    max_s: float


class IdleShard:
    """Holds idle connections; each one that closes reconnects (to another gateway) with its session token.

    ``emit`` gets the events the parent follows: ``ramped`` once every connection was opened or given up,
    ``progress`` (at most every 100 ms while something changes) and ``report`` at the end."""

    def __init__(self, spec: ShardSpec, emit: Callable[[dict[str, Any]], None]) -> None:
        self.spec = spec
        self.emit = emit
        n = len(spec.urls)
        self.rng = random.Random(f"{spec.seed}:gateway-loss:idle:{spec.first}")
        self.backoff = Backoff(spec.initial_s, spec.max_s)
        self.tally = Tally()
        self.by_gateway = [0] * n  # connections held now, by gateway
        self.lost_by_gateway = [0] * n  # connections that closed under us, by the gateway they were on
        self.connected = 0
        self.ramp_failed = 0
        self.lost = 0
        self.back = 0
        self.gave_up = 0
        self.session_mismatch = 0
        self.back_times: list[tuple[float, float]] = []  # (lost at, back at), time.monotonic()
        self.clients: dict[int, LoadClient] = {}
        self._settled = 0
        self._dirty = False
        self._stopping = False
        self._stop = asyncio.Event()
        self._gate = asyncio.Semaphore(max(1, spec.connect_concurrency))

    async def run(self) -> None:
        """Open the connections and hold them until :meth:`stop`; then close them and emit the report."""
        s = self.spec
        if not s.count:
            self._ramped()
        tasks = [asyncio.create_task(self._hold(i)) for i in range(s.first, s.first + s.count)]
        ticker = asyncio.create_task(self._progress())
        await self._stop.wait()
        self._stopping = True
        await asyncio.gather(*(self._close(c) for c in list(self.clients.values())))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        self.emit({"ev": "report", **self.summary()})

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> dict[str, Any]:
        return {
            "connected": self.connected,
            "ramp_failed": self.ramp_failed,
            "by_gateway": list(self.by_gateway),
            "lost": self.lost,
            "lost_by_gateway": list(self.lost_by_gateway),
            "back": self.back,
            "gave_up": self.gave_up,
            "session_mismatch": self.session_mismatch,
            "back_times": [[round(a, 4), round(b, 4)] for a, b in self.back_times],
            **self.tally.as_dict(),
        }

    def _ramped(self) -> None:
        self.emit(
            {
                "ev": "ramped",
                "connected": self.connected,
                "ramp_failed": self.ramp_failed,
                "by_gateway": list(self.by_gateway),
                "connect_errors": dict(self.tally.connect),
            }
        )

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_S)
            if self._dirty:
                self._dirty = False
                self.emit(
                    {
                        "ev": "progress",
                        "lost": self.lost,
                        "back": self.back,
                        "gave_up": self.gave_up,
                        "last_back": max((b for _, b in self.back_times), default=None),
                    }
                )

    @staticmethod
    async def _close(c: LoadClient) -> None:
        try:
            async with asyncio.timeout(5):
                await c.close()
        except (TimeoutError, OSError, WebSocketException):
            c.abort()

    async def _hold(self, i: int) -> None:
        s = self.spec
        home = i % len(s.urls)
        opened = await connect(
            s.urls, [home], self.rng, self.tally, self.backoff, wait_first=False, attempts=RAMP_ATTEMPTS,
            gate=self._gate,
        )  # fmt: skip
        if opened is None:
            self.ramp_failed += 1
        else:
            self.connected += 1
            self.clients[i] = opened[0]
            self.by_gateway[opened[1]] += 1
        self._settled += 1
        if self._settled == s.count:
            self._ramped()
        if opened is None:
            return
        c, g = opened
        assert c.welcome is not None
        token, session = c.welcome.session_token, c.welcome.session
        while True:
            try:
                while True:
                    await c.recv_sized()  # nothing comes but what ends it: we wait for the close
            except (OSError, WebSocketException, ProtocolError):
                pass
            self.by_gateway[g] -= 1
            c.abort()
            if self._stopping:
                return
            lost_at = time.monotonic()
            self.lost += 1
            self.lost_by_gateway[g] += 1
            self._dirty = True
            others = [k for k in range(len(s.urls)) if k != g]
            again = await connect(s.urls, others, self.rng, self.tally, self.backoff, session_token=token)
            if again is None:
                self.gave_up += 1
                self._dirty = True
                self.clients.pop(i, None)
                return
            c, g = again
            assert c.welcome is not None
            if c.welcome.session != session:
                self.session_mismatch += 1
            self.clients[i] = c
            self.by_gateway[g] += 1
            self.back += 1
            self.back_times.append((lost_at, time.monotonic()))
            self._dirty = True


def shard_main(spec_json: str) -> int:
    """A child process: run one :class:`IdleShard`, events as JSON lines on stdout, until a line on stdin
    (or its end: the parent is gone)."""
    from server.gctune import tune_for_long_lived_objects

    raise_open_file_limit(1 << 30)
    spec = ShardSpec(**json.loads(spec_json))

    def emit(ev: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(ev) + "\n")
        sys.stdout.flush()

    async def main() -> None:
        tune_for_long_lived_objects()
        shard = IdleShard(spec, emit)
        runner = asyncio.create_task(shard.run())
        told = asyncio.create_task(asyncio.to_thread(sys.stdin.readline))
        await asyncio.wait({runner, told}, return_when=asyncio.FIRST_COMPLETED)
        shard.stop()
        await runner

    asyncio.run(main())
    return 0


class ShardProcess:
    """The parent's handle on one child process of idle connections."""

    def __init__(self, spec: ShardSpec) -> None:
        self.spec = spec
        self.proc: asyncio.subprocess.Process | None = None
        self.ramped: dict[str, Any] | None = None
        self.progress: dict[str, Any] = {"lost": 0, "back": 0, "gave_up": 0, "last_back": None}
        self.report: dict[str, Any] | None = None
        self.ramp_event = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.load.gateway_loss", "--shard", json.dumps(asdict(self.spec)),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=64 << 20,
        )  # fmt: skip
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            ev = json.loads(line)
            kind = ev.pop("ev")
            if kind == "ramped":
                self.ramped = ev
                self.ramp_event.set()
            elif kind == "progress":
                self.progress = ev
            elif kind == "report":
                self.report = ev
        self.ramp_event.set()  # the child ended (a crash before its ramp): nobody waits for ever

    async def stop(self, timeout_s: float = 60.0) -> dict[str, Any] | None:
        if self.proc is None:
            return None
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            with contextlib.suppress(OSError):
                self.proc.stdin.write(b"stop\n")
                await self.proc.stdin.drain()
            self.proc.stdin.close()
        try:
            async with asyncio.timeout(timeout_s):
                if self._reader is not None:
                    await self._reader
                await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        return self.report


# --- streams (this process) ------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    """One request of a stream, as its client saw it."""

    id: str
    chat: Chat
    check: StreamCheck
    epoch: int | None = None
    sent: bool = False
    accepted: bool = False
    done: Done | None = None
    error: str | None = None
    lost_tokens: int = 0
    dup_tokens: int = 0
    interruptions: int = 0  # connections lost while it was in flight
    offset_at_loss: list[int] = field(default_factory=list)
    verified: bool = False


class Stream:
    """One conversation that chats continuously; on a lost connection it reconnects elsewhere and resumes."""

    def __init__(self, run: GatewayLoss, j: int) -> None:
        self.run_ = run
        self.j = j
        self.home = j % len(run.cfg.urls)
        self.gateway = self.home
        self.rng = random.Random(f"{run.cfg.seed}:gateway-loss:stream:{j}")
        self.client: LoadClient | None = None
        self.session_token: str | None = None
        self.session: str | None = None
        self.replies: list[Reply] = []
        self.current: Reply | None = None
        self.lost_at: float | None = None  # since its last loss, until attached again
        self.losses: list[tuple[int, float]] = []  # (gateway, lost at)
        self.attaches: list[tuple[float, float, int]] = []  # (lost at, attached at, gateway)
        self.session_mismatch = 0
        self.failed: str | None = None
        self.connected = asyncio.Event()

    @property
    def in_flight(self) -> bool:
        r = self.current
        return r is not None and r.accepted and r.done is None and self.client is not None

    @property
    def offset(self) -> int:
        return self.current.check.offset if self.current is not None else 0

    async def run(self) -> None:
        cfg = self.run_.cfg
        try:
            opened = await connect(
                cfg.urls, [self.home], self.rng, self.run_.tally, self.run_.backoff, wait_first=False,
                attempts=RAMP_ATTEMPTS,
            )  # fmt: skip
            if opened is None:
                self.failed = "connect_failed"
                return
            self._use(*opened)
            self.connected.set()
            k = 0
            while not self.run_.stopping.is_set():
                reply = self._new_reply(k)
                k += 1
                self.current = reply
                self.replies.append(reply)
                await self._until_done(reply)
                if reply.error is not None and reply.error in ("gave_up", "bad_server_frame"):
                    self.failed = reply.error
                    return
                if reply.interruptions and reply.done is not None:
                    await self._verify(reply)
                self.current = None
        finally:
            self.connected.set()
            if self.client is not None:
                with contextlib.suppress(TimeoutError, OSError, WebSocketException):
                    async with asyncio.timeout(2):
                        await self.client.close()
                self.client.abort()

    def _new_reply(self, k: int) -> Reply:
        cfg = self.run_.cfg
        rng = random.Random(f"{cfg.seed}:gateway-loss:prompt:{self.j}:{k}")
        rid = f"gl-{self.run_.tag}-{self.j}-{k}"
        chat = Chat(
            id=rid,
            messages=(Message("user", prompt_text(rng, rng.randint(12, 24), 0)),),
            params=Params(max_tokens=cfg.stream_max_tokens, temperature=0, cache=False),
        )
        return Reply(id=rid, chat=chat, check=StreamCheck(rid))

    def _use(self, client: LoadClient, gateway: int) -> None:
        assert client.welcome is not None
        if self.session is not None and client.welcome.session != self.session:
            self.session_mismatch += 1
        self.client, self.gateway = client, gateway
        self.session_token, self.session = client.welcome.session_token, client.welcome.session

    def _attached(self) -> None:
        if self.lost_at is not None:
            self.attaches.append((self.lost_at, time.monotonic(), self.gateway))
            self.lost_at = None

    def _lose(self) -> None:
        """The connection died under us: drop it; the next step reconnects."""
        c, self.client = self.client, None
        if c is not None:
            c.abort()
        now = time.monotonic()
        self.losses.append((self.gateway, now))
        if self.lost_at is None:
            self.lost_at = now
        r = self.current
        if r is not None and (r.sent or r.accepted) and r.done is None:
            r.interruptions += 1
            r.offset_at_loss.append(r.check.offset)

    async def _reconnect(self, resume: tuple[ResumePoint, ...], *, attach: bool = False) -> bool:
        """Reconnect to another gateway with the session token (and ``resume``); ``attach``: the stream
        has nothing to resume, so it is attached again at ``welcome`` (otherwise at ``accepted``)."""
        cfg = self.run_.cfg
        others = [k for k in range(len(cfg.urls)) if k != self.gateway]
        opened = await connect(
            cfg.urls, others, self.rng, self.run_.tally, self.run_.backoff,
            session_token=self.session_token, resume=resume,
        )  # fmt: skip
        if opened is None:
            return False
        self._use(*opened)
        if attach:
            self._attached()
        return True

    async def _until_done(self, r: Reply) -> None:
        while r.done is None and r.error is None:
            if self.client is None:
                point = (ResumePoint(r.id, r.check.offset, r.epoch),) if r.accepted else ()
                if not await self._reconnect(point):
                    r.error = "gave_up"
                    return
                if not r.accepted:
                    r.sent = False  # never accepted: send the same chat again (idempotent by id)
            client = self.client
            assert client is not None
            try:
                await self._pump(client, r)
            except (OSError, WebSocketException):
                self._lose()
            except ProtocolError:
                r.error = "bad_server_frame"  # a server frame that does not validate
                self._lose()

    async def _pump(self, client: LoadClient, r: Reply) -> None:
        if not r.sent:
            await client.send(r.chat)
            r.sent = True
        while True:
            frame, _ = await client.recv_sized()
            if getattr(frame, "id", None) != r.id:
                if isinstance(frame, Error):
                    self.run_.tally.error(frame)  # about no request of ours: still an error to count
                continue
            if isinstance(frame, Delta):
                held = r.check.offset
                if frame.offset > held:
                    r.lost_tokens += frame.offset - held
                elif frame.offset < held:
                    r.dup_tokens += min(held, frame.offset + frame.n) - frame.offset
                r.check.delta(frame)
                self.run_.tokens += frame.n
            elif isinstance(frame, Accepted):
                r.check.epoch(r.epoch, frame.epoch)
                r.epoch, r.accepted = frame.epoch, True
                self._attached()
            elif isinstance(frame, Done):
                r.check.done(frame)
                r.done = frame
                if frame.finish_reason not in ("stop", "length"):
                    r.error = r.error or f"finish_{frame.finish_reason}"
                return
            elif isinstance(frame, Error):
                self.run_.tally.error(frame)
                if frame.code in REFUSALS:
                    wait_ms = frame.retry_after_ms if frame.retry_after_ms is not None else 1000
                    await asyncio.sleep(wait_ms / 1000 * (1 + 0.1 * self.rng.random()))
                    if r.accepted:  # a refused resume (hello.resume point): ask again
                        await client.send(Resume(id=r.id, offset=r.check.offset, epoch=r.epoch))
                    else:
                        await client.send(r.chat)
                elif frame.code == "resume_failed":
                    # The log we held is gone (SPEC §10.4): a fault in this run; start over from 0.
                    r.error = r.error or "resume_failed"
                    r.check.restart()
                    r.epoch = None
                    await client.send(Resume(id=r.id, offset=0))
                elif frame.code in ("too_large", "internal") and r.accepted:
                    r.error = r.error or frame.code  # a done with finish_reason error follows
                else:
                    r.error = frame.code
                    return

    async def _verify(self, r: Reply) -> None:
        """Replay an interrupted reply from offset 0 (the store's log) and compare it with the live text."""
        for _ in range(3):
            if self.client is None and not await self._reconnect((), attach=True):
                break
            client = self.client
            assert client is not None
            try:
                async with asyncio.timeout(REPLAY_TIMEOUT_S):
                    await replay_and_compare(client, r.check)
                r.verified = True
                return
            except (OSError, WebSocketException, TimeoutError, ProtocolError):
                self._lose()


# --- sampling --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    at: float
    cpu: list[float | None]
    rss: list[int | None]
    machine: tuple[int, int] | None = None  # (busy, total) jiffies of all cores, /proc/stat
    tool_cpu: float = 0.0  # CPU seconds of the load tool: this process and its children


def machine_jiffies() -> tuple[int, int] | None:
    """(busy, total) clock ticks of every core since boot (/proc/stat; idle and iowait are not busy)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(f[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - f[3] - f[4], total


class ProcSampler:
    """Every gateway's CPU seconds and RSS every 100 ms (a dead one reads None)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.tool_pids: list[int] = [os.getpid()]  # and the idle connections' processes, once started
        self.samples: list[Sample] = []

    def take(self) -> None:
        self.samples.append(
            Sample(
                time.monotonic(),
                [cpu_s(p) for p in self.pids],
                [rss_kib(p) for p in self.pids],
                machine_jiffies(),
                sum(c for p in self.tool_pids if (c := cpu_s(p)) is not None),
            )
        )

    def machine_busy_pct(self, t0: float, t1: float) -> float | None:
        """How busy the machine's cores were between two times, percent of all of them."""
        a, b = self.at(t0), self.at(t1)
        if a is None or b is None or a.machine is None or b.machine is None or b.machine[1] <= a.machine[1]:
            return None
        return round(100 * (b.machine[0] - a.machine[0]) / (b.machine[1] - a.machine[1]), 1)

    def tool_cpu_s(self, t0: float, t1: float) -> float | None:
        a, b = self.at(t0), self.at(t1)
        return None if a is None or b is None else round(b.tool_cpu - a.tool_cpu, 2)

    async def run(self) -> None:
        while True:
            self.take()
            await asyncio.sleep(SAMPLE_S)

    def at(self, t: float) -> Sample | None:
        """The last sample taken at or before ``t`` (the first one if none)."""
        best = None
        for s in self.samples:
            if s.at <= t or best is None:
                best = s
            if s.at > t:
                break
        return best

    def cpu_pct(self, g: int, t0: float, t1: float) -> float | None:
        a, b = self.at(t0), self.at(t1)
        if a is None or b is None or b.at <= a.at:
            return None
        x, y = a.cpu[g], b.cpu[g]
        return None if x is None or y is None else round(100 * (y - x) / (b.at - a.at), 1)

    def peak_cpu_pct(self, g: int, t0: float, t1: float, window_s: float = 1.0) -> float | None:
        """The most CPU over any ``window_s`` window in [t0, t1], percent of one core."""
        xs = [(s.at, c) for s in self.samples if t0 <= s.at <= t1 and (c := s.cpu[g]) is not None]
        best: float | None = None
        k = 0
        for i, (at, cpu) in enumerate(xs):
            k = max(k, i + 1)
            while k < len(xs) and xs[k][0] - at < window_s:
                k += 1
            if k >= len(xs):
                break
            pct = 100 * (xs[k][1] - cpu) / (xs[k][0] - at)
            best = pct if best is None else max(best, pct)
        if best is None and len(xs) > 1 and xs[-1][0] > xs[0][0]:  # shorter than one window: all of it
            best = 100 * (xs[-1][1] - xs[0][1]) / (xs[-1][0] - xs[0][0])
        return None if best is None else round(best, 1)

    def rss_mib(self, g: int, t: float) -> float | None:
        s = self.at(t)
        v = None if s is None else s.rss[g]
        return None if v is None else round(v / 1024, 1)

    def peak_rss_mib(self, g: int, t0: float, t1: float) -> float | None:
        vs = [v for s in self.samples if t0 <= s.at <= t1 and (v := s.rss[g]) is not None]
        return round(max(vs) / 1024, 1) if vs else None


class RedisSampler:
    """``INFO stats`` every 100 ms: the commands processed so far (and Redis's own instantaneous rate)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[tuple[float, int, int]] = []  # (at, total_commands_processed, instantaneous)
        self.error: str | None = None

    async def run(self) -> None:
        import redis.asyncio as aioredis

        r = aioredis.from_url(self.url)
        try:
            while True:
                try:
                    info = await r.info("stats")
                except Exception as exc:  # a sampler must not end the run; it says why it stopped
                    self.error = f"{type(exc).__name__}: {exc}"[:200]
                    return
                self.samples.append(
                    (
                        time.monotonic(),
                        int(info["total_commands_processed"]),
                        int(info.get("instantaneous_ops_per_sec", 0)),
                    )
                )
                await asyncio.sleep(SAMPLE_S)
        finally:
            await r.aclose()

    def _at(self, t: float) -> tuple[float, int, int] | None:
        best = None
        for s in self.samples:
            if s[0] <= t or best is None:
                best = s
            if s[0] > t:
                break
        return best

    def rate(self, t0: float, t1: float) -> float | None:
        a, b = self._at(t0), self._at(t1)
        if a is None or b is None or b[0] <= a[0]:
            return None
        return round((b[1] - a[1]) / (b[0] - a[0]), 1)

    def peak(self, t0: float, t1: float) -> tuple[float | None, int | None]:
        """The highest rate between two consecutive samples in [t0, t1], and Redis's own peak."""
        xs = [s for s in self.samples if t0 <= s[0] <= t1]
        rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(xs) if b[0] > a[0]]
        return (round(max(rates), 1) if rates else None, max((s[2] for s in xs), default=None))

    def commands(self, t0: float, t1: float) -> int | None:
        a, b = self._at(t0), self._at(t1)
        return None if a is None or b is None else b[1] - a[1]


# --- the run ---------------------------------------------------------------------------------------------


def _say(text: str) -> None:
    print(f"gateway-loss: {text}", flush=True)


def _ms(seconds: list[float]) -> dict[str, float | int | None]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(1000 * v, 1)

    return {
        "n": len(seconds),
        "p50": r(percentile(seconds, 50)),
        "p99": r(percentile(seconds, 99)),
        "max": r(max(seconds, default=None)),
    }


class GatewayLoss:
    def __init__(self, cfg: GatewayLossConfig) -> None:
        self.cfg = cfg
        self.tag = os.urandom(3).hex()
        self.tally = Tally()
        self.backoff = Backoff(cfg.reconnect_initial_s, cfg.reconnect_max_s)
        self.stopping = asyncio.Event()
        self.tokens = 0
        self.streams: list[Stream] = []
        self.shards: list[ShardProcess] = []

    def _shard_specs(self) -> list[ShardSpec]:
        cfg = self.cfg
        n = math.ceil(cfg.idle / cfg.idle_per_process) if cfg.idle else 0
        specs, first = [], 0
        for k in range(n):
            count = cfg.idle // n + (1 if k < cfg.idle % n else 0)
            specs.append(
                ShardSpec(
                    urls=cfg.urls, first=first, count=count, seed=cfg.seed,
                    connect_concurrency=max(8, cfg.connect_concurrency // n),
                    initial_s=cfg.reconnect_initial_s, max_s=cfg.reconnect_max_s,
                )
            )  # fmt: skip
            first += count
        return specs

    def _idle_by_gateway(self) -> list[int]:
        out = [0] * len(self.cfg.urls)
        for sh in self.shards:
            for g, v in enumerate((sh.ramped or {}).get("by_gateway") or []):
                out[g] += v
        return out

    def _streams_by_gateway(self) -> list[int]:
        out = [0] * len(self.cfg.urls)
        for s in self.streams:
            if s.client is not None:
                out[s.gateway] += 1
        return out

    def _idle_progress(self) -> tuple[int, int, int, float | None]:
        lost = sum(sh.progress.get("lost", 0) for sh in self.shards)
        back = sum(sh.progress.get("back", 0) for sh in self.shards)
        gave_up = sum(sh.progress.get("gave_up", 0) for sh in self.shards)
        lasts = [x for sh in self.shards if (x := sh.progress.get("last_back")) is not None]
        return lost, back, gave_up, max(lasts, default=None)

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        pids = cfg.pids or find_gateway_pids(cfg.urls)
        n = len(cfg.urls)
        per_survivor = math.ceil((cfg.idle + cfg.streams) / (n - 1)) + 64
        for url, pid in zip(cfg.urls, pids, strict=True):
            limit = open_files_limit(pid)
            if limit is not None and limit < per_survivor:
                _say(
                    f"warning: {url} (pid {pid}) may open {limit} files; after the loss it holds about "
                    f"{per_survivor} connections (raise its ulimit -n)"
                )
        limit = raise_open_file_limit(1 << 30)
        procs = ProcSampler(pids)
        redis = RedisSampler(cfg.redis_url) if cfg.redis_url else None
        samplers = [asyncio.create_task(procs.run())]
        if redis is not None:
            samplers.append(asyncio.create_task(redis.run()))
        t_start = time.monotonic()
        stream_tasks: list[asyncio.Task[None]] = []
        try:
            _say(f"{n} gateways {', '.join(cfg.urls)} (pids {', '.join(map(str, pids))})")
            self.shards = [ShardProcess(s) for s in self._shard_specs()]
            await asyncio.gather(*(sh.start() for sh in self.shards))
            procs.tool_pids += [sh.proc.pid for sh in self.shards if sh.proc is not None]
            await asyncio.gather(*(sh.ramp_event.wait() for sh in self.shards))
            ramp_s = time.monotonic() - t_start
            # Then the streams, so that the ramp's time is the idle connections' alone.
            self.streams = [Stream(self, j) for j in range(cfg.streams)]
            stream_tasks = [asyncio.create_task(s.run(), name=f"stream-{s.j}") for s in self.streams]
            await asyncio.gather(*(s.connected.wait() for s in self.streams))
            idle_by_gw = self._idle_by_gateway()
            connected = sum(idle_by_gw)
            _say(
                f"ramp {ramp_s:.1f} s: {connected}/{cfg.idle} idle connections, "
                f"{sum(s.client is not None for s in self.streams)}/{cfg.streams} streams"
            )
            if connected + sum(s.client is not None for s in self.streams) == 0:
                raise RuntimeError("no connection could be opened")
            await asyncio.sleep(cfg.baseline_s)
            # The victim: the gateway holding the most of our connections (ties: the first).
            streams_by_gw = self._streams_by_gateway()
            held = [a + b for a, b in zip(idle_by_gw, streams_by_gw, strict=True)]
            victim = max(range(n), key=lambda g: (held[g], -g))
            mine = [s for s in self.streams if s.gateway == victim and s.client is not None]
            deadline = time.monotonic() + cfg.kill_wait_s
            need = math.ceil(len(mine) * cfg.kill_share)
            while time.monotonic() < deadline:
                flying = [s for s in mine if s.in_flight]
                deep = [s for s in flying if s.offset >= cfg.kill_after_tokens]
                if len(flying) == len(mine) and len(deep) >= need:
                    break
                await asyncio.sleep(0.005)
            in_flight_at_kill = sum(s.in_flight for s in mine)
            mid_reply_at_kill = sum(s.in_flight and s.offset > 0 for s in mine)
            t_kill = time.monotonic()
            os.kill(pids[victim], signal.SIGKILL)
            _say(
                f"killed {cfg.urls[victim]} (pid {pids[victim]}): {held[victim]} connections, "
                f"{len(mine)} streams ({mid_reply_at_kill} mid-reply, {in_flight_at_kill} in flight)"
            )
            # Recovery: every stream attached again, every idle connection back.
            recovered_at: float | None = None
            while time.monotonic() - t_kill < cfg.recover_timeout_s:
                await asyncio.sleep(0.02)
                streams_lost = [s for s in self.streams if s.lost_at is not None and s.failed is None]
                moved = sum(1 for s in mine if any(g == victim and at >= t_kill for g, at in s.losses))
                lost, back, gave_up, _last = self._idle_progress()
                if (
                    not streams_lost
                    and moved >= len(mine)
                    and back + gave_up >= lost
                    and back + gave_up >= idle_by_gw[victim]
                ):
                    recovered_at = time.monotonic()
                    break
            t_rec = recovered_at if recovered_at is not None else time.monotonic()
            _say(
                "recovered in "
                + (
                    f"{t_rec - t_kill:.2f} s"
                    if recovered_at is not None
                    else f"NOT within {cfg.recover_timeout_s:g} s"
                )
            )
            await asyncio.sleep(cfg.settle_s)
            t_after = time.monotonic()
            procs.take()
            self.stopping.set()
            if stream_tasks:
                _, pending = await asyncio.wait(stream_tasks, timeout=cfg.drain_timeout_s)
                for t in pending:
                    t.cancel()
            await asyncio.gather(*stream_tasks, return_exceptions=True)
            reports = await asyncio.gather(*(sh.stop() for sh in self.shards))
            t_end = time.monotonic()
        finally:
            self.stopping.set()
            for t in stream_tasks:
                t.cancel()
            await asyncio.gather(*stream_tasks, return_exceptions=True)
            for sh in self.shards:
                if sh.proc is not None and sh.proc.returncode is None:
                    sh.proc.kill()
                    await sh.proc.wait()
            for t in samplers:
                t.cancel()
            await asyncio.gather(*samplers, return_exceptions=True)
        return self._report(
            pids=pids, victim=victim, held=held, idle_by_gw=idle_by_gw, streams_by_gw=streams_by_gw,
            t_start=t_start, ramp_s=ramp_s, t_kill=t_kill, recovered_at=recovered_at, t_after=t_after,
            t_end=t_end, procs=procs, redis=redis, reports=[r for r in reports if r is not None],
            shards_lost=sum(r is None for r in reports), mine=len(mine), in_flight=in_flight_at_kill,
            mid_reply=mid_reply_at_kill, open_files=limit,
        )  # fmt: skip

    def _report(
        self,
        *,
        pids: list[int],
        victim: int,
        held: list[int],
        idle_by_gw: list[int],
        streams_by_gw: list[int],
        t_start: float,
        ramp_s: float,
        t_kill: float,
        recovered_at: float | None,
        t_after: float,
        t_end: float,
        procs: ProcSampler,
        redis: RedisSampler | None,
        reports: list[dict[str, Any]],
        shards_lost: int,
        mine: int,
        in_flight: int,
        mid_reply: int,
        open_files: int,
    ) -> dict[str, Any]:
        cfg = self.cfg
        n = len(cfg.urls)
        t_rec = recovered_at if recovered_at is not None else t_after - cfg.settle_s
        tally = Tally(
            Counter(self.tally.errors), Counter(self.tally.bare_refusals), Counter(self.tally.connect)
        )
        for r in reports:
            tally.add(r)
        # Streams.
        moved = [s for s in self.streams if any(at >= t_kill for _, at in s.losses)]
        unexpected = [s for s in moved if any(g != victim for g, at in s.losses if at >= t_kill)]
        attach_s = [b - t_kill for s in moved for a, b, _ in s.attaches if a >= t_kill]
        streams_back = [s for s in moved if s.lost_at is None and s.failed is None]
        replies = [r for s in self.streams for r in s.replies]
        ended = [r for r in replies if r.done is not None or r.error is not None]
        interrupted = [r for r in replies if r.interruptions]
        violations = [v for r in replies for v in r.check.violations]
        mismatches = [v for v in violations if v.kind.startswith("replay")]
        lost_tokens = sum(r.lost_tokens for r in replies)
        dup_tokens = sum(r.dup_tokens for r in replies)
        failed = [r for r in ended if r.error is not None]
        # Idle connections.
        pairs = [(a, b) for r in reports for a, b in r["back_times"] if a >= t_kill]
        back_s = [b - t_kill for _, b in pairs]
        noticed_s = [a - t_kill for a, _ in pairs]  # the kill until the client saw its socket close
        reconnect_s = [b - a for a, b in pairs]  # from then to welcome: backoff, connect, hello
        idle_lost = sum(r["lost"] for r in reports)
        idle_back = sum(r["back"] for r in reports)
        idle_gave_up = sum(r["gave_up"] for r in reports)
        lost_by_gw = [sum(r["lost_by_gateway"][g] for r in reports) for g in range(n)]
        session_mismatch = sum(r["session_mismatch"] for r in reports) + sum(
            s.session_mismatch for s in self.streams
        )
        streams_attached_s = round(max(attach_s), 3) if attach_s and len(streams_back) == len(moved) else None
        idle_back_all = idle_back >= idle_lost and idle_back >= idle_by_gw[victim] and not idle_gave_up
        idle_back_last_s = round(max(back_s), 3) if back_s and idle_back_all else None
        # Survivors' CPU and memory.
        before0 = t_kill - min(cfg.baseline_s, t_kill - t_start)
        after0 = t_after - min(2.0, cfg.settle_s) if cfg.settle_s > 0 else t_rec
        survivors = []
        for g in range(n):
            if g == victim:
                continue
            a, b = procs.at(t_kill), procs.at(t_rec)
            c0, c1 = (None if x is None else x.cpu[g] for x in (a, b))
            herd_cpu = None if c0 is None or c1 is None else round(c1 - c0, 3)
            survivors.append(
                {
                    "gateway": g,
                    "url": cfg.urls[g],
                    "pid": pids[g],
                    "cpu_before_pct": procs.cpu_pct(g, before0, t_kill),
                    "cpu_peak_pct": procs.peak_cpu_pct(g, t_kill, t_after),
                    "cpu_after_pct": procs.cpu_pct(g, after0, t_after),
                    "herd_cpu_s": herd_cpu,
                    "rss_before_mib": procs.rss_mib(g, t_kill),
                    "rss_peak_mib": procs.peak_rss_mib(g, t_kill, t_after),
                    "rss_after_mib": procs.rss_mib(g, t_after),
                    "connections_lost": lost_by_gw[g],
                }
            )
        redis_report: dict[str, Any] | None = None
        if redis is not None:
            peak, peak_inst = redis.peak(t_kill, t_rec + 1.0)
            redis_report = {
                "before_ops_per_s": redis.rate(before0, t_kill),
                "peak_ops_per_s": peak,
                "peak_instantaneous_ops_per_s": peak_inst,
                "after_ops_per_s": redis.rate(after0, t_after),
                "herd_commands": redis.commands(t_kill, t_rec),
                "samples": len(redis.samples),
                "error": redis.error,
            }
        allowed = {c: v for c, v in tally.errors.items() if c in REFUSALS}
        others = {c: v for c, v in tally.errors.items() if c not in REFUSALS}
        met = {
            "streams_reattached": recovered_at is not None and len(streams_back) == len(moved),
            "idle_back": recovered_at is not None and idle_back_all,
            "sessions_kept": session_mismatch == 0,
            "no_lost_tokens": lost_tokens == 0,
            "no_duplicated_tokens": dup_tokens == 0,
            "replays_equal": not violations and all(r.verified for r in interrupted if r.done is not None),
            "replies_ok": not failed
            and len(ended) == len(replies)
            and not [s for s in self.streams if s.failed],
            # A surviving gateway dropped none of its connections (nor those that moved to it).
            "survivors_held_on": not unexpected and not any(lost_by_gw[g] for g in range(n) if g != victim),
            "no_internal_errors": tally.errors.get("internal", 0) == 0,
            "only_documented_refusals": not others and not tally.bare_refusals,
            "idle_processes_reported": shards_lost == 0,
        }
        herd_s = (
            round(max(streams_attached_s or 0.0, idle_back_last_s or 0.0), 3)
            if recovered_at is not None
            else None
        )
        return {
            "scenario": "gateway-loss",
            "config": cfg.describe(),
            "open_files_limit": open_files,
            "gateways": [
                {"url": u, "pid": p, "idle": i, "streams": s, "killed": g == victim}
                for g, (u, p, i, s) in enumerate(zip(cfg.urls, pids, idle_by_gw, streams_by_gw, strict=True))
            ],
            "victim": {
                "gateway": victim,
                "url": cfg.urls[victim],
                "pid": pids[victim],
                "connections": held[victim],
            },
            "ramp_s": round(ramp_s, 2),
            "run_s": round(t_end - t_start, 1),
            # The headline figures (capacity.py reads these).
            "connections_moved": idle_by_gw[victim] + len(moved),
            "streams_reattach_s": streams_attached_s,
            "idle_reattach_s": idle_back_last_s,
            "herd_s": herd_s,
            "peak_redis_ops_per_s": None if redis_report is None else redis_report["peak_ops_per_s"],
            "streams": {
                "total": cfg.streams,
                "on_victim": mine,
                "in_flight_at_kill": in_flight,
                "mid_reply_at_kill": mid_reply,
                "moved": len(moved),
                "reattached": len(streams_back),
                "unexpected_losses": len(unexpected),
                "attach_ms": _ms(attach_s),
                "replies": len(replies),
                "replies_ended": len(ended),
                "replies_failed": len(failed),
                "failed_by_code": dict(Counter(r.error for r in failed if r.error is not None)),
                "interrupted": len(interrupted),
                "interrupted_mid_reply": sum(1 for r in interrupted if any(o > 0 for o in r.offset_at_loss)),
                "verified": sum(r.verified for r in replies),
                "tokens": self.tokens,
            },
            "idle": {
                "target": cfg.idle,
                "connected": sum(idle_by_gw),
                "processes": len(self.shards),
                "on_victim": idle_by_gw[victim],
                "lost": idle_lost,
                "lost_by_gateway": lost_by_gw,
                "back": idle_back,
                "gave_up": idle_gave_up,
                "back_ms": _ms(back_s),
                "noticed_ms": _ms(noticed_s),
                "reconnect_ms": _ms(reconnect_s),
            },
            "tokens": {
                "lost": lost_tokens,
                "duplicated": dup_tokens,
                "replay_mismatches": len(mismatches),
                "violations": [v.as_dict() for v in violations[:10]],
            },
            "errors": {
                "by_code": dict(tally.errors),
                "internal": tally.errors.get("internal", 0),
                "refusals": allowed,
                "refusals_without_retry_after": dict(tally.bare_refusals),
                "other": others,
                "connect_errors": dict(tally.connect),
            },
            "redis": redis_report,
            # What bounded the herd: on a small machine the survivors, the load tool's own clients, the
            # worker and Redis share the cores, and recovery is as fast as the CPU left allows.
            "machine": {
                "cores": os.cpu_count(),
                "busy_pct_before": procs.machine_busy_pct(before0, t_kill),
                "busy_pct_herd": procs.machine_busy_pct(t_kill, t_rec),
                "load_tool_herd_cpu_s": procs.tool_cpu_s(t_kill, t_rec),
                "survivors_herd_cpu_s": round(sum(x["herd_cpu_s"] or 0.0 for x in survivors), 2),
                "herd_s": round(t_rec - t_kill, 2),
            },
            "survivors": survivors,
            "met": met,
        }


async def run_gateway_loss(cfg: GatewayLossConfig) -> dict[str, Any]:
    return await GatewayLoss(cfg).run()


# --- output and the command line -------------------------------------------------------------------------


def _v(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.2f}{unit}"
    if isinstance(x, int):
        return f"{x:,}{unit}"
    return f"{x}{unit}"


def print_gateway_loss(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    v, st, idle, tk, er = (
        report["victim"],
        report["streams"],
        report["idle"],
        report["tokens"],
        report["errors"],
    )
    t = Table(title=f"tokenwire load --scenario gateway-loss: killed {v['url']}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row(
        "gateways",
        ", ".join(
            f"{g['url'].split('//')[-1].split('/')[0]} {g['idle']}+{g['streams']}"
            + (" (killed)" if g["killed"] else "")
            for g in report["gateways"]
        ),
    )
    t.add_row("ramp", f"{_v(idle['connected'])}/{_v(idle['target'])} idle in {idle['processes']} processes, "
              f"{st['total']} streams, {_v(report['ramp_s'], ' s')}")  # fmt: skip
    t.add_row(
        "at the kill",
        f"{_v(v['connections'])} connections on the victim; {st['on_victim']} streams, "
        f"{st['mid_reply_at_kill']} mid-reply",
    )
    a = st["attach_ms"]
    t.add_row(
        "streams attached again",
        f"{st['reattached']}/{st['moved']} in {_v(report['streams_reattach_s'], ' s')} "
        f"(p50 {_v(a['p50'], ' ms')}, max {_v(a['max'], ' ms')})",
    )
    b, nb, rb = idle["back_ms"], idle["noticed_ms"], idle["reconnect_ms"]
    t.add_row(
        "idle connections back",
        f"{_v(idle['back'])}/{_v(idle['on_victim'])} in {_v(report['idle_reattach_s'], ' s')} "
        f"(p50 {_v(b['p50'], ' ms')}, p99 {_v(b['p99'], ' ms')}); lost by gateway {idle['lost_by_gateway']}",
    )
    t.add_row(
        "  of which",
        f"noticing the close p50 {_v(nb['p50'], ' ms')} (max {_v(nb['max'], ' ms')}), then backoff, "
        f"connect and hello p50 {_v(rb['p50'], ' ms')} (max {_v(rb['max'], ' ms')})",
    )
    rd = report["redis"]
    if rd is not None:
        t.add_row(
            "Redis ops/s",
            f"before {_v(rd['before_ops_per_s'])}, peak {_v(rd['peak_ops_per_s'])} (100 ms; INFO's own "
            f"{_v(rd['peak_instantaneous_ops_per_s'])}), after {_v(rd['after_ops_per_s'])}; "
            f"{_v(rd['herd_commands'])} commands in the herd"
            + (f" [red]{rd['error']}[/red]" if rd["error"] else ""),
        )
    m = report["machine"]
    t.add_row(
        "machine in the herd",
        f"{_v(m['busy_pct_herd'], '%')} of {m['cores']} cores busy "
        f"(before: {_v(m['busy_pct_before'], '%')}); "
        f"CPU s: survivors {_v(m['survivors_herd_cpu_s'])}, load tool {_v(m['load_tool_herd_cpu_s'])} "
        f"in {_v(m['herd_s'], ' s')}",
    )
    for s in report["survivors"]:
        t.add_row(
            f"gateway {s['gateway']} (pid {s['pid']})",
            f"CPU {_v(s['cpu_before_pct'], '%')} / peak {_v(s['cpu_peak_pct'], '%')} / after "
            f"{_v(s['cpu_after_pct'], '%')} ({_v(s['herd_cpu_s'], ' s')} in the herd); RSS "
            f"{_v(s['rss_before_mib'], ' MiB')} / {_v(s['rss_peak_mib'], ' MiB')} / "
            f"{_v(s['rss_after_mib'], ' MiB')}",
        )
    t.add_row(
        "replies",
        f"{st['replies_ended']} ended, {st['replies_failed']} failed {st['failed_by_code'] or ''}; "
        f"{st['interrupted']} interrupted ({st['interrupted_mid_reply']} mid-reply), "
        f"{st['verified']} replayed and compared; {_v(st['tokens'])} tokens",
    )
    bad = tk["lost"] or tk["duplicated"] or tk["replay_mismatches"]
    style = "bold red" if bad else "green"
    t.add_row(
        "tokens lost / duplicated",
        f"[{style}]{tk['lost']} / {tk['duplicated']} ({tk['replay_mismatches']} replay mismatches)[/{style}]",
    )
    t.add_row(
        "errors",
        (", ".join(f"{k} {n}" for k, n in er["by_code"].items()) or "none")
        + (f"; connect attempts failed: {er['connect_errors']}" if er["connect_errors"] else ""),
    )
    t.add_row(
        "targets",
        ", ".join(f"{k} {'met' if ok else '[bold red]MISSED[/bold red]'}" for k, ok in report["met"].items()),
    )
    Console().print(t)


def config_from_args(args: argparse.Namespace) -> GatewayLossConfig:
    urls = gateway_urls(args.url, args.gateways, args.gateway_url)
    return GatewayLossConfig(
        urls=urls,
        pids=args.gateway_pid or None,
        idle=DEFAULT_IDLE if args.idle is None else args.idle,
        streams=args.streams,
        idle_per_process=args.idle_per_process,
        stream_max_tokens=args.stream_max_tokens,
        seed=args.seed,
        redis_url=args.redis_url,
        connect_concurrency=args.connect_concurrency,
        kill_after_tokens=args.kill_after_tokens,
        kill_share=args.kill_share,
        kill_wait_s=args.kill_wait,
        baseline_s=args.baseline,
        settle_s=args.settle,
        recover_timeout_s=args.recover_timeout,
        drain_timeout_s=args.request_timeout,
        reconnect_initial_s=args.reconnect_initial_ms / 1000,
        reconnect_max_s=args.reconnect_max_ms / 1000,
        json_path=args.json_path,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """``tokenwire load --scenario gateway-loss``: 0 when every target is met, 1 when one is missed, 2
    when the run could not start."""
    from server.gctune import tune_for_long_lived_objects

    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"tokenwire load: {exc}", file=sys.stderr)
        return 2
    tune_for_long_lived_objects()
    try:
        report = asyncio.run(run_gateway_loss(cfg))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"tokenwire load: --scenario gateway-loss: {exc}", file=sys.stderr)
        return 2
    print_gateway_loss(report)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(report["met"].values()) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--shard":
        sys.exit(shard_main(sys.argv[2]))
    print("usage: tokenwire load URL --scenario gateway-loss (this module's own entry is for its children)")
    sys.exit(2)
