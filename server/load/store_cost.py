"""``tokenwire load URL --scenario store-cost --redis-url R``: what the store pays per token (issue 28).

The server at URL must run on a Redis of its own (R): every figure is a difference of that server's
``INFO`` before and after a phase, so anything else using it would be counted too. Three phases:

* **load**: the workload of the other flags (``--users``, ``--requests`` …) over the WebSocket. Per
  generated token and per request: Redis commands (``INFO commandstats``, which counts the commands a Lua
  script runs as well as the script call itself), Redis CPU (``used_cpu_user`` + ``used_cpu_sys``),
  bytes the store received (``total_net_input_bytes``: what crosses the wire into it) and the memory the
  finished requests keep (``used_memory``, while they are retained);
* **resume**: finished replies replayed whole by new connections (a phone coming back), per resume;
* **sessions**: idle sessions, each with one short turn in its history: their keys' ``MEMORY USAGE``.

Everything a real deployment runs is counted, the idle loops too (heartbeats, blocking reads), since they
are part of the cost. Targets at 32 concurrent streams (``TARGETS``): at most 1.5 commands, 8 µs of Redis
CPU and 120 bytes per token.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from protocol import Done, Params, ResumePoint
from server.client import Client
from server.load.hostile import _gaps
from server.load.idle import cpu_s
from server.load.options import LoadConfig
from server.load.runner import run_load

TARGETS = {"commands_per_token": 1.5, "us_per_token": 8.0, "bytes_per_token": 120.0}
# Each target's figure among those net of the idle loops (``_net_per``).
NET_KEYS = {"commands_per_token": "commands", "us_per_token": "us", "bytes_per_token": "bytes_in"}
RESUMES = 64
SESSIONS = 64


def redis_cpu_s(info: dict[str, Any]) -> float:
    """Redis's CPU seconds so far, from its ``INFO`` (the cpu section): what every figure here calls its
    CPU."""
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _stats(r: aioredis.Redis) -> dict[str, Any]:
    """The server-wide counters the phases are measured by."""
    info = await r.info("all")
    stats = {k[8:]: v for k, v in info.items() if k.startswith("cmdstat_") and isinstance(v, dict)}
    by = {k: int(v["calls"]) for k, v in stats.items()}
    return {
        "by_command": by,
        # Microseconds spent executing each command. A script's call time includes the commands it runs,
        # which are counted under their own names too; the top-level commands' time less Redis's CPU is
        # what its event loop, its timers and the sockets cost.
        "us_by_command": {k: int(v["usec"]) for k, v in stats.items()},
        "commands": sum(by.values()),
        "cpu_s": redis_cpu_s(info),
        "net_in": int(info["total_net_input_bytes"]),
        "net_out": int(info["total_net_output_bytes"]),
        "used_memory": int(info["used_memory"]),
        "at": time.monotonic(),
    }


def _by_command(
    before: dict[str, Any], after: dict[str, Any], n: int, what: str = "by_command"
) -> dict[str, float]:
    """Calls (or, with ``what="us_by_command"``, execution µs) per ``n`` of each command that ran, most
    first: where the commands per token go."""
    b, a = before[what], after[what]
    diff = {k: (v - b.get(k, 0)) / max(1, n) for k, v in a.items() if v > b.get(k, 0)}
    return {k: round(v, 3) for k, v in sorted(diff.items(), key=lambda kv: -kv[1])}


def _per(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, float | None]:
    if n <= 0:
        return {"commands": None, "us": None, "bytes_in": None, "bytes_out": None, "memory_bytes": None}
    return {
        "commands": round((after["commands"] - before["commands"]) / n, 3),
        "us": round((after["cpu_s"] - before["cpu_s"]) * 1e6 / n, 2),
        "bytes_in": round((after["net_in"] - before["net_in"]) / n, 1),
        "bytes_out": round((after["net_out"] - before["net_out"]) / n, 1),
        "memory_bytes": round((after["used_memory"] - before["used_memory"]) / n, 1),
    }


def _net_per(
    idle0: dict[str, Any], idle1: dict[str, Any], before: dict[str, Any], after: dict[str, Any], n: int
) -> dict[str, float | None]:
    """Like ``_per`` once the idle server's own rate (measured from ``idle0`` to ``idle1``: heartbeats,
    refreshes, blocking reads, and Valkey's own timers) is taken off for the phase's duration. Those
    loops cost per second and per process (the timers per Valkey: benchmarks.py measures them before
    the cluster starts), not per token: at this CPU's few dozen tokens a second they are a third of the gross
    figure, at a GPU worker's thousands almost nothing. The capacity model counts them per process, so
    it takes these figures per token, and counts nothing twice."""
    idle_s = idle1["at"] - idle0["at"]
    phase_s = after["at"] - before["at"]
    if n <= 0 or idle_s <= 0:
        return {"commands": None, "us": None, "bytes_in": None}

    def net(key: str, scale: float) -> float:
        rate = (idle1[key] - idle0[key]) / idle_s
        return float(max(0.0, (after[key] - before[key]) - rate * phase_s)) * scale / n

    return {
        "commands": round(net("commands", 1), 3),
        "us": round(net("cpu_s", 1e6), 2),
        "bytes_in": round(net("net_in", 1), 1),
    }


async def _finished_replies(url: str, n: int) -> list[tuple[str, str, int]]:
    """``n`` short replies of one session: (session token, id, tokens), for the resume phase."""
    c = await Client.connect(url)
    try:
        assert c.welcome is not None
        out = []
        for i in range(n):
            rid = f"sc-{uuid.uuid4().hex[:12]}"
            done: Done | None = None
            msgs = [{"role": "user", "content": f"store cost reply {i}: tell me about rivers"}]
            async for f in c.chat(messages=msgs, id=rid, params=Params(max_tokens=48, cache=False)):
                if isinstance(f, Done):
                    done = f
            if done is not None and done.finish_reason in ("stop", "length"):
                out.append((c.welcome.session_token, rid, done.offset))
        return out
    finally:
        await c.close()


async def _resume_all(url: str, replies: list[tuple[str, str, int]]) -> int:
    """Each reply replayed whole on a new connection; the tokens received."""

    async def one(token: str, rid: str) -> int:
        c = await Client.connect(url, session_token=token, resume=(ResumePoint(rid, 0),))
        try:
            n = 0
            async for f in c.frames_for(rid):
                if isinstance(f, Done):
                    n = f.offset
            return n
        finally:
            await c.close()

    got = await asyncio.gather(*(one(t, rid) for t, rid, _ in replies))
    return sum(got)


async def _sessions(url: str, n: int) -> list[str]:
    """``n`` sessions, each with one short content-mode turn, left idle: their ids."""

    async def one(i: int) -> str:
        c = await Client.connect(url)
        try:
            assert c.welcome is not None
            async for _ in c.chat(f"hello {i}, one word please", params=Params(max_tokens=8, cache=False)):
                pass
            return c.welcome.session
        finally:
            await c.close()

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _session_bytes(r: aioredis.Redis, prefix: str, sessions: list[str]) -> dict[str, float]:
    """``MEMORY USAGE`` of every key naming one of ``sessions`` (the session and its history), each."""
    wanted = set(sessions)
    total, keys = 0, 0
    async for k in r.scan_iter(match=f"{prefix}*", count=1000):
        name = k.decode()
        if (":sess:" in name or ":hist:" in name) and name.rsplit(":", 1)[-1] in wanted:
            total += int(await r.memory_usage(k, samples=0) or 0)
            keys += 1
    n = max(1, len(sessions))
    return {"keys_per_session": round(keys / n, 2), "bytes_per_session": round(total / n, 1)}


async def run_store_cost(cfg: LoadConfig, redis_url: str, key_prefix: str) -> dict[str, Any]:
    """The three phases (module docstring); the report."""
    r = aioredis.from_url(redis_url)
    try:
        await asyncio.sleep(1.0)  # whatever the server did at start is over
        idle0 = await _stats(r)
        await asyncio.sleep(2.0)
        idle1 = await _stats(r)
        idle_s = idle1["at"] - idle0["at"]
        pid = cfg.server_pid
        server0 = cpu_s(pid) if pid is not None else None
        load = await run_load(cfg)
        after = await _stats(r)
        server1 = cpu_s(pid) if pid is not None else None
        summary = _gaps(load)
        tokens, requests = summary["tokens"], summary["requests_ok"]
        per_token = _per(idle1, after, tokens)
        per_request = _per(idle1, after, requests)

        replies = await _finished_replies(cfg.url, 8)
        todo = (replies * (RESUMES // max(1, len(replies)) + 1))[:RESUMES]
        before_resume = await _stats(r)
        replayed = await _resume_all(cfg.url, todo)
        after_resume = await _stats(r)
        per_resume = _per(before_resume, after_resume, len(todo))

        sessions = await _sessions(cfg.url, SESSIONS)
        session_bytes = await _session_bytes(r, key_prefix, sessions)
    finally:
        await r.aclose()
    store: dict[str, Any] = {
        "commands_per_token": per_token["commands"],
        "us_per_token": per_token["us"],
        "bytes_per_token": per_token["bytes_in"],
        "bytes_out_per_token": per_token["bytes_out"],
        "memory_bytes_per_token": per_token["memory_bytes"],
        "commands_per_token_by_name": _by_command(idle1, after, tokens),
        "us_per_token_by_name": _by_command(idle1, after, tokens, "us_by_command"),
        "net_of_idle_per_token": _net_per(idle0, idle1, idle1, after, tokens),
        "per_request": per_request,
        "per_resume": {**per_resume, "tokens_per_resume": round(replayed / max(1, len(todo)), 1)},
        "idle": {
            "commands_per_s": round((idle1["commands"] - idle0["commands"]) / idle_s, 1),
            "us_per_s": round((idle1["cpu_s"] - idle0["cpu_s"]) * 1e6 / idle_s, 1),
        },
        **session_bytes,
    }
    # --server-pid: that process's CPU per token over the load phase. Against `tokenwire cluster
    # --gateways 1 --workers 1` with the gateway's pid, what a gateway pays to stream a token (the
    # capacity model's gateway CPU); against `tokenwire serve`, gateway and engine together.
    server_us = None
    if server0 is not None and server1 is not None and tokens > 0:
        server_us = round((server1 - server0) * 1e6 / tokens, 2)
    store["server_pid_us_per_token"] = server_us
    met = {k: store[k] is not None and store[k] <= t for k, t in TARGETS.items()}
    net = store["net_of_idle_per_token"]
    met_net = {k: net[NET_KEYS[k]] is not None and net[NET_KEYS[k]] <= t for k, t in TARGETS.items()}
    return {
        "scenario": "store-cost",
        "config": cfg.describe(),
        "load": summary,
        "requests": requests,
        "tokens": tokens,
        "resumes": len(todo),
        "sessions": len(sessions),
        "store": store,
        "targets": TARGETS,
        "met": met,
        "met_net_of_idle": met_net,
    }


def print_store_cost(report: dict[str, Any]) -> None:
    s = report["store"]
    print(f"tokenwire load --scenario store-cost: {report['config']['url']}")
    print(
        f"  load: {report['requests']} requests, {report['tokens']} tokens, "
        f"{report['load']['tok_s']} tok/s, {report['load']['requests_failed']} failed"
    )
    print(
        f"  per token: {s['commands_per_token']} commands, {s['us_per_token']} us Redis CPU, "
        f"{s['bytes_per_token']} bytes in, {s['bytes_out_per_token']} bytes out, "
        f"{s['memory_bytes_per_token']} bytes kept"
    )
    net = s.get("net_of_idle_per_token") or {}
    print(
        f"  per token net of the idle server's loops: {net.get('commands')} commands, {net.get('us')} us, "
        f"{net.get('bytes_in')} bytes in"
    )
    pr, rs = s["per_request"], s["per_resume"]
    print(f"  per request: {pr['commands']} commands, {pr['us']} us, {pr['bytes_in']} bytes in")
    print(
        f"  per resume ({rs['tokens_per_resume']} tokens replayed): {rs['commands']} commands, "
        f"{rs['us']} us, {rs['bytes_out']} bytes out"
    )
    top = list(s.get("commands_per_token_by_name", {}).items())[:8]
    print("  commands per token: " + ", ".join(f"{k} {v}" for k, v in top))
    us = list(s.get("us_per_token_by_name", {}).items())[:8]
    # A script's call time includes the commands it runs, which are counted under their own names too.
    print(
        "  us executing per token (a script's includes its commands): " + ", ".join(f"{k} {v}" for k, v in us)
    )
    print(f"  idle session: {s['bytes_per_session']} bytes in {s['keys_per_session']} keys")
    if s.get("server_pid_us_per_token") is not None:
        print(f"  --server-pid process: {s['server_pid_us_per_token']} us CPU per token")
    print(f"  idle server: {s['idle']['commands_per_s']} commands/s, {s['idle']['us_per_s']} us/s")
    print("  targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in report["met"].items()))
