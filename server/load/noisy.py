"""``tokenwire load --scenario noisy-neighbour``: light users' latency next to one heavy user, under FIFO
and under fair share.

Three phases, each against its own ``tokenwire serve`` started here (auth on, so that a user is a JWT
subject however many connections it opens):

* ``alone``: 4 light users, each sending one short chat at a time (the next one when the last is done);
* ``fifo``: the same light users while one heavy user keeps ``--heavy-streams`` long streams in flight
  (more than the engine runs at once), the server started with ``--scheduling fifo``;
* ``fair``: the same with ``--scheduling fair``.

With ``--rounds N`` the FIFO and fair phases run N times each in ABBA order (fifo, fair, fair, fifo, ...)
and their samples are pooled: on a shared machine whose speed drifts, both see the same drift.

After a warm-up (the heavy streams accepted and running), the light users chat for ``--duration``
seconds. The report has, per phase, the light users' TTFT p50/p99 (a chat sent in the window that has no
first token ``--grace`` seconds after the window counts with the time it waited so far), their tokens/s,
and the total tokens/s of every stream received in the window. Bounded: three phases of warm-up +
duration + grace, every request capped by max_tokens, loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt

from protocol import Accepted, Chat, Delta, Done, Error, Message, Params, ServerFrame
from server.client import Client
from server.load.report import percentile

LIGHT_USERS = 4
HEAVY_CONNECTIONS = 4
SCHEDULING = {"alone": "fair", "fifo": "fifo", "fair": "fair"}


def phase_order(rounds: int) -> list[str]:
    """``alone``, then FIFO and fair share in ABBA order (fifo, fair, fair, fifo, ...), so that a drift in
    the machine's speed over the run weighs on both alike."""
    order = ["alone"]
    for i in range(rounds):
        order += ["fifo", "fair"] if i % 2 == 0 else ["fair", "fifo"]
    return order


TOPICS = ["the sea", "a lighthouse keeper", "trains", "a city at night", "bees", "the moon", "a library"]
QUESTIONS = ["What is 2+2?", "Say hello.", "Name a colour.", "What day follows Monday?", "Capital of France?"]


@dataclass(slots=True)
class Tally:
    """What one phase saw: first-token waits of light chats, and every token received, with its time."""

    light_ttft: list[float] = field(default_factory=list)
    light_waiting: dict[str, float] = field(default_factory=dict)  # sent in the window, no token yet
    tokens: list[tuple[float, int, bool]] = field(default_factory=list)  # (time, n, light?)
    light_streams: list[float] = field(default_factory=list)  # tokens/s of each finished light stream
    requests: dict[str, int] = field(default_factory=lambda: {"light": 0, "heavy": 0})
    errors: list[str] = field(default_factory=list)
    heavy_live: int = 0  # heavy streams that have a first token and no end yet
    heavy_live_max: int = 0  # the most of them at once: did the heavy user really hold many streams?


class Conn:
    """One WebSocket with several requests in flight: a reader hands each frame to its request's queue."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.queues: dict[str, asyncio.Queue[ServerFrame]] = {}
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str, token: str) -> Conn:
        return cls(await Client.connect(url, token=token))

    async def _read(self) -> None:
        with contextlib.suppress(Exception):
            while True:
                frame = await self.client.recv()
                q = self.queues.get(getattr(frame, "id", None) or "")
                if q is not None:
                    q.put_nowait(frame)

    async def chat(self, content: str, params: Params) -> tuple[str, asyncio.Queue[ServerFrame]]:
        rid = uuid.uuid4().hex
        q: asyncio.Queue[ServerFrame] = asyncio.Queue()
        self.queues[rid] = q
        # Messages mode: each chat stands alone. Content-mode turns of one session run one after
        # another (SPEC 4.2), which would hold the heavy user to one stream per connection.
        await self.client.send(Chat(id=rid, messages=(Message("user", content),), params=params))
        return rid, q

    async def close(self) -> None:
        self.reader.cancel()
        with contextlib.suppress(Exception):
            await self.client.close()


def token_for(secret: str, user: str) -> str:
    return jwt.encode({"sub": user, "exp": int(time.time()) + 3600}, secret, algorithm="HS256")


async def one_chat(
    conn: Conn, content: str, params: Params, tally: Tally, *, light: bool, window: tuple[float, float]
) -> None:
    """Send one chat and follow it to ``done``; retry after ``rate_limited``/``overloaded``."""
    while True:
        rid, q = await conn.chat(content, params)
        sent = time.monotonic()
        in_window = light and window[0] <= sent < window[1]
        if in_window:
            tally.light_waiting[rid] = sent
        first: float | None = None
        n = 0
        try:
            while True:
                frame = await q.get()
                now = time.monotonic()
                if isinstance(frame, Accepted):
                    continue
                if isinstance(frame, Delta):
                    if first is None:
                        first = now
                        if not light:
                            tally.heavy_live += 1
                            tally.heavy_live_max = max(tally.heavy_live_max, tally.heavy_live)
                        if in_window:
                            tally.light_ttft.append(now - sent)
                            tally.light_waiting.pop(rid, None)
                    n += frame.n
                    tally.tokens.append((now, frame.n, light))
                elif isinstance(frame, Done):
                    tally.requests["light" if light else "heavy"] += 1
                    if light and first is not None and now > first and n > 1:
                        tally.light_streams.append((n - 1) / (now - first))
                    return
                elif isinstance(frame, Error):
                    if frame.code in ("rate_limited", "overloaded"):
                        tally.light_waiting.pop(rid, None)
                        await asyncio.sleep((frame.retry_after_ms or 500) / 1000)
                        break  # a new id: the refused one was never queued
                    tally.errors.append(f"{frame.code}: {frame.message}")
                    return
        finally:
            conn.queues.pop(rid, None)
            if not light and first is not None:
                tally.heavy_live -= 1


@dataclass(slots=True)
class PhaseRun:
    """One phase's raw samples (pooled over rounds by ``summary``)."""

    ttft: list[float]  # light chats of the window; those still without a token count their wait so far
    censored: int
    light_streams: list[float]
    light_tokens: int
    heavy_tokens: int
    span: float
    requests: dict[str, int]
    errors: list[str]
    heavy_live_max: int


async def run_phase(url: str, secret: str, args: argparse.Namespace, heavy: bool) -> PhaseRun:
    rng = random.Random(args.seed)
    tally = Tally()
    stop = asyncio.Event()
    window = [float("inf"), float("inf")]
    heavy_conns = [await Conn.open(url, token_for(secret, "heavy")) for _ in range(HEAVY_CONNECTIONS)]
    light_conns = [await Conn.open(url, token_for(secret, f"light-{i}")) for i in range(LIGHT_USERS)]
    tasks: list[asyncio.Task[None]] = []

    async def heavy_stream(conn: Conn, i: int) -> None:
        while not stop.is_set():
            params = Params(
                max_tokens=args.heavy_max_tokens, temperature=0.8, seed=rng.randrange(2**31), cache=False
            )
            topic = TOPICS[i % len(TOPICS)]
            await one_chat(
                conn,
                f"Write a long, detailed story about {topic}, with many chapters.",
                params,
                tally,
                light=False,
                window=(window[0], window[1]),
            )

    async def light_user(conn: Conn, i: int) -> None:
        k = 0
        while time.monotonic() < window[1] and k < args.light_requests:
            params = Params(
                max_tokens=args.light_max_tokens, temperature=0.8, seed=rng.randrange(2**31), cache=False
            )
            await one_chat(
                conn,
                QUESTIONS[(i + k) % len(QUESTIONS)],
                params,
                tally,
                light=True,
                window=(window[0], window[1]),
            )
            k += 1

    try:
        if heavy:
            for s in range(args.heavy_streams):
                tasks.append(asyncio.create_task(heavy_stream(heavy_conns[s % HEAVY_CONNECTIONS], s)))
            # Warm-up: every heavy stream accepted and the engine busy with them before measuring.
            await asyncio.sleep(args.warmup)
        window[0] = time.monotonic()
        window[1] = window[0] + args.duration
        lights = [asyncio.create_task(light_user(c, i)) for i, c in enumerate(light_conns)]
        await asyncio.sleep(args.duration)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*lights), args.grace)
        for t in lights:
            t.cancel()
        end = time.monotonic()
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in [*heavy_conns, *light_conns]:
            await c.close()
    # A light chat of the window still without a token: it waited at least this long.
    censored = [end - sent for sent in tally.light_waiting.values()]
    w0, w1 = window
    in_win = [(n, light) for t, n, light in tally.tokens if w0 <= t < w1]
    return PhaseRun(
        ttft=tally.light_ttft + censored,
        censored=len(censored),
        light_streams=tally.light_streams,
        light_tokens=sum(n for n, light in in_win if light),
        heavy_tokens=sum(n for n, light in in_win if not light),
        span=w1 - w0,
        requests=dict(tally.requests),
        errors=tally.errors,
        heavy_live_max=tally.heavy_live_max,
    )


def summary(runs: list[PhaseRun], scheduling: str) -> dict[str, Any]:
    """A phase's figures over its rounds: TTFT percentiles of every light chat pooled, tokens/s over the
    rounds' windows together."""

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    ttft = [t for r in runs for t in r.ttft]
    span = sum(r.span for r in runs)
    light = sum(r.light_tokens for r in runs)
    heavy = sum(r.heavy_tokens for r in runs)
    errors = [e for r in runs for e in r.errors]
    return {
        "scheduling": scheduling,
        "rounds": len(runs),
        "light_ttft_p50_ms": ms(percentile(ttft, 50)),
        "light_ttft_p99_ms": ms(percentile(ttft, 99)),
        "light_ttft_max_ms": ms(max(ttft, default=None)),
        "light_chats": len(ttft),
        "light_chats_without_first_token": sum(r.censored for r in runs),
        "light_tok_s": round(light / span, 1),
        "light_stream_tok_s_p50": round(percentile([x for r in runs for x in r.light_streams], 50) or 0.0, 1),
        "tok_s": round((light + heavy) / span, 1),
        "tok_s_by_round": [round((r.light_tokens + r.heavy_tokens) / r.span, 1) for r in runs],
        "heavy_tok_s": round(heavy / span, 1),
        "heavy_streams_max": max((r.heavy_live_max for r in runs), default=0),
        "requests_done": {k: sum(r.requests[k] for r in runs) for k in ("light", "heavy")},
        "errors": errors[:10],
        "error_count": len(errors),
        "window_s": round(span, 1),
    }


def run_scenario(args: argparse.Namespace) -> int:
    """Run the three phases, print a summary, write ``--json``. Exit 0 unless a phase failed."""
    if args.url:
        print("tokenwire load: --scenario starts its own servers: give no URL", file=sys.stderr)
        return 2
    args.duration = args.duration or 60.0
    from server.load.benchmarks import _Server as Server

    secret = secrets.token_hex(16)
    report: dict[str, Any] = {
        "scenario": "noisy-neighbour",
        "config": {
            "light_users": LIGHT_USERS,
            "heavy_streams": args.heavy_streams,
            "heavy_max_tokens": args.heavy_max_tokens,
            "light_max_tokens": args.light_max_tokens,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "model": args.model or "default",
            "order": phase_order(args.rounds),
        },
    }
    runs: dict[str, list[PhaseRun]] = {name: [] for name in SCHEDULING}
    with tempfile.TemporaryDirectory(prefix="tokenwire-noisy-") as tmp:
        for i, name in enumerate(phase_order(args.rounds)):
            scheduling = SCHEDULING[name]
            cmd = ["serve", "--port", "0", "--data-dir", str(Path(tmp) / f"{i}-{name}"), "--log-level"]
            cmd += ["warning", "--auth-secret", secret, "--scheduling", scheduling]
            cmd += ["--model", args.model] if args.model else []
            with Server(cmd, "tokenwire ready") as s:
                runs[name].append(asyncio.run(run_phase(s.urls[0], secret, args, name != "alone")))
            report[name] = summary(runs[name], scheduling)
            print(f"{name}: {json.dumps(report[name])}", flush=True)
    alone, fifo, fair = report["alone"], report["fifo"], report["fair"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a is not None and b else None

    report["ratios"] = {
        "fair_p99_vs_alone": ratio(fair["light_ttft_p99_ms"], alone["light_ttft_p99_ms"]),
        "fair_p99_vs_fifo": ratio(fair["light_ttft_p99_ms"], fifo["light_ttft_p99_ms"]),
        "fair_tok_s_vs_fifo": ratio(fair["tok_s"], fifo["tok_s"]),
    }
    print(f"ratios: {json.dumps(report['ratios'])}", flush=True)
    if args.json_path is not None:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    failed = any(report[p]["error_count"] or not report[p]["light_chats"] for p in ("alone", "fifo", "fair"))
    return 1 if failed else 0


def add_scenario_arguments(p: argparse.ArgumentParser) -> None:
    """The scenario's own flags (``--duration``, ``--model``, ``--seed`` and ``--json`` are shared)."""
    g = p.add_argument_group("--scenario noisy-neighbour (starts its own servers; no URL)")
    g.add_argument("--heavy-streams", type=int, default=48, help="the heavy user's streams in flight (48)")
    g.add_argument("--heavy-max-tokens", type=int, default=256, help="max_tokens of a heavy stream (256)")
    g.add_argument("--light-max-tokens", type=int, default=32, help="max_tokens of a light chat (32)")
    g.add_argument("--light-requests", type=int, default=200, help="at most this many chats per light user")
    g.add_argument("--warmup", type=float, default=10.0, help="seconds of heavy load before measuring (10)")
    g.add_argument("--grace", type=float, default=60.0, help="seconds to wait for the window's last chats")
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="FIFO and fair phases each this many times, in ABBA order, pooled (default 1)",
    )
