"""``tokenwire load URL --scenario soak --redis-url R``: does the store's memory come back?

Connects its users and warms the server up (one request each, then the retention passes: the baseline),
sends N short requests, then waits out the server's retention, and reports the Redis it was given (the
server's own: ``used_memory``, key counts by type, stream lengths) at the start, at the peak (all N
finished and retained) and at the end, plus the bytes kept per finished request during retention. The
target (ARCHITECTURE.md, "Numbers that matter"): after retention, memory within 10 % of the start and
no stream longer than a small constant. Only keys under ``--key-prefix`` are counted; ``used_memory`` is
the whole server's, so give the soak a Redis of its own.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from protocol import Done, Error, Params
from server.client import Client

# After retention, memory within this fraction of the start, and no stream longer than this.
MEMORY_TOLERANCE = 0.10
MAX_STREAM_LEN = 16


@dataclass(slots=True)
class SoakConfig:
    url: str
    redis_url: str
    requests: int = 10_000
    users: int = 64
    key_prefix: str = "tw:"
    retention_s: float = 60.0  # the server's --retention: how long to wait after the last request
    max_tokens: int = 2
    settle_s: float = 120.0  # after retention, wait at most this long for expiry to catch up
    json_path: Path | None = None


async def snapshot(r: aioredis.Redis, prefix: str) -> dict[str, Any]:
    """Memory, key counts by type and stream lengths under ``prefix``."""
    keys = [k async for k in r.scan_iter(match=f"{prefix}*", count=1000)]
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.type(k)
    types = [t.decode() if isinstance(t, bytes) else str(t) for t in await pipe.execute()]
    streams = [k for k, t in zip(keys, types, strict=True) if t == "stream"]
    pipe = r.pipeline(transaction=False)
    for k in streams:
        pipe.xlen(k)
    lengths = await pipe.execute() if streams else []
    longest = sorted(zip(lengths, streams, strict=True), reverse=True)[:3]
    info = await r.info("memory")
    head = f"{prefix}req:".encode()
    return {
        "used_memory": int(info["used_memory"]),
        "keys": len(keys),
        "requests": sum(1 for k in keys if k.startswith(head)),  # request records kept
        "by_type": dict(Counter(types)),
        "streams": len(streams),
        "longest_streams": [{"key": k.decode(), "length": int(n)} for n, k in longest],
        "at": time.time(),
    }


async def _send(cfg: SoakConfig, client: Client, n: int, stats: Counter[str]) -> None:
    for i in range(n):
        while True:
            rid = uuid.uuid4().hex
            messages = [{"role": "user", "content": f"soak request {i}: say something short"}]
            params = Params(max_tokens=cfg.max_tokens, cache=False)
            outcome = "failed"
            async for f in client.chat(messages=messages, id=rid, params=params):
                if isinstance(f, Done):
                    outcome = "finished"
                elif isinstance(f, Error) and f.code in ("rate_limited", "overloaded"):
                    outcome = "limited"
                    await asyncio.sleep((f.retry_after_ms or 100) / 1000)
            stats[outcome] += 1
            if outcome != "limited":
                break


async def _settle(r: aioredis.Redis, cfg: SoakConfig, floor: int) -> dict[str, Any]:
    """Wait out the retention, then for Redis to expire what it released (lazily and in a background
    cycle): until at most ``floor`` keys are left or ``settle_s`` passes."""
    await asyncio.sleep(cfg.retention_s)
    snap = await snapshot(r, cfg.key_prefix)
    deadline = time.monotonic() + cfg.settle_s
    while snap["keys"] > floor and time.monotonic() < deadline:
        await asyncio.sleep(2.0)
        snap = await snapshot(r, cfg.key_prefix)
    return snap


async def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    r = aioredis.from_url(cfg.redis_url)
    clients = [await Client.connect(cfg.url) for _ in range(cfg.users)]
    try:
        # The baseline is the server in its steady state: every user connected (its session kept), the
        # server's connection pool and scripts warmed by one request each, and those retained and expired.
        warm: Counter[str] = Counter()
        await asyncio.gather(*(_send(cfg, c, 1, warm) for c in clients))
        before = await snapshot(r, cfg.key_prefix)
        start = await _settle(r, cfg, before["keys"] - 2 * warm["finished"])
        peak_memory = start["used_memory"]
        stats: Counter[str] = Counter()
        per_user = [cfg.requests // cfg.users + (u < cfg.requests % cfg.users) for u in range(cfg.users)]
        t0 = time.monotonic()
        users = asyncio.gather(*(_send(cfg, c, n, stats) for c, n in zip(clients, per_user, strict=True)))
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(users), 2.0)
                break
            except TimeoutError:
                peak_memory = max(peak_memory, int((await r.info("memory"))["used_memory"]))
        sent_s = time.monotonic() - t0
        peak = await snapshot(r, cfg.key_prefix)
        peak_memory = max(peak_memory, peak["used_memory"])
        end = await _settle(r, cfg, start["keys"])
        finished = stats["finished"]
        longest_end = max((s["length"] for s in end["longest_streams"]), default=0)
        report = {
            "scenario": "soak",
            "config": {
                "url": cfg.url,
                "requests": cfg.requests,
                "users": cfg.users,
                "max_tokens": cfg.max_tokens,
                "retention_s": cfg.retention_s,
                "key_prefix": cfg.key_prefix,
            },
            "requests": {
                "finished": finished,
                "failed": stats["failed"],
                "rate_limited_retries": stats["limited"],
            },
            "send_s": round(sent_s, 1),
            "start": start,
            "peak": {**peak, "used_memory_max_sampled": peak_memory},
            "end": end,
            # What one finished request costs while it is retained: the memory the requests kept at the
            # peak snapshot hold above the baseline, per request (record + token log + their overhead).
            "requests_kept_at_peak": peak["requests"] - start["requests"],
            "bytes_per_finished_request": round(
                (peak["used_memory"] - start["used_memory"]) / max(1, peak["requests"] - start["requests"])
            ),
            "end_vs_start_memory": round(end["used_memory"] / max(1, start["used_memory"]), 3),
            "longest_stream_at_end": longest_end,
            "target_met": end["used_memory"] <= start["used_memory"] * (1 + MEMORY_TOLERANCE)
            and longest_end <= MAX_STREAM_LEN,
        }
    finally:
        for c in clients:
            await c.close()
        await r.aclose()
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=2))
    return report


def print_report(report: dict[str, Any]) -> None:
    s, p, e = report["start"], report["peak"], report["end"]
    print(
        f"soak: {report['requests']['finished']} finished, {report['requests']['failed']} failed "
        f"in {report['send_s']} s"
    )
    for name, snap in (("start", s), ("peak", p), ("end", e)):
        longest = snap["longest_streams"][0]["length"] if snap["longest_streams"] else 0
        print(
            f"  {name:5} used_memory {snap['used_memory']:>12,} B  keys {snap['keys']:>7,}  "
            f"by type {snap['by_type']}  longest stream {longest}"
        )
    print(f"  bytes kept per finished request during retention: {report['bytes_per_finished_request']:,}")
    print(f"  end / start memory: {report['end_vs_start_memory']}  target met: {report['target_met']}")
