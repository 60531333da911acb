"""``tokenwire load URL --scenario flood``: hostile clients against every door at once (issue 24).

Two phases against the same server. **alone**: the normal workload (``--users`` streaming users). **flood**:
the same workload while ``--flood-clients`` anonymous hostile clients run for ``--flood-duration``
seconds, each doing everything at once:

* a long content-mode turn, then maximum-size content-mode chats (they would wait for it) and
  maximum-size messages-mode chats, as fast as its socket takes them;
* ``resume`` frames past every cap, and new connections whose ``hello.resume`` holds 256 points;
* HTTP bodies of 1 MiB, and bodies trickled a byte at a time. The 1 MiB chat completions ask for a
  stream: a non-streamed completion answers only once generated, so its status line could not tell a
  held request from one being served; a streamed one's status line is its acceptance (or refusal).

Every hostile frame or request must get an answer (or its connection closed) within ``ANSWER_S``
(trickled bodies: within the server's request deadline plus that). The report gives the gateway's RSS
growth (peak minus before, from ``/proc/PID``: pass ``--server-pid``), its RSS ``AFTER_S`` after the flood
stopped, the normal users' maximum inter-token gap in the flood over their p99 alone, the unanswered
count and the refusals by code. Bounded in time; traffic goes only to the server's URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from protocol import Chat, Error, Hello, Message, Params, Resume, ResumePoint, Waiting
from protocol.frames import MAX_RESUME_POINTS, Accepted
from server.client import Client
from server.load.hostile import _gaps
from server.load.options import LoadConfig
from server.load.runner import run_load

ANSWER_S = 2.0  # every hostile frame is answered (or its connection closed) within this
AFTER_S = 30.0  # the gateway's RSS is read again this long after the flood
TRICKLE_DEADLINE_S = 30.0  # the server's default HTTP request deadline (--http-request-timeout)
FRAME_CHARS = 900_000  # under the default 1 MiB frame limit, with msgpack's overhead
TARGETS = {"gateway_rss_growth_mb": 64.0, "gateway_rss_after_mb": 16.0, "normal_max_gap_over_p99": 2.0}


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass
class Ledger:
    """What the hostile clients sent and what came back: ids waiting for an answer, with the time sent."""

    pending: dict[str, float] = field(default_factory=dict)
    late: int = 0  # answered, but after ANSWER_S (a server that reads slowly makes them wait)
    unanswered: int = 0  # never answered, nor their connection closed
    unanswered_kinds: Counter[str] = field(default_factory=Counter)  # which door: ws, resume point, http
    late_kinds: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    answered: Counter[str] = field(default_factory=Counter)
    sent: int = 0

    def send(self, key: str) -> None:
        self.pending[key] = time.monotonic()
        self.sent += 1

    def answer(self, key: str, what: str) -> None:
        at = self.pending.pop(key, None)
        if at is None:
            return
        self.answered[what] += 1
        if what.startswith("error:"):
            self.refused[what[6:]] += 1
        # A trickled body is answered at the server's request deadline, by design: late only after it.
        allowed = ANSWER_S + (TRICKLE_DEADLINE_S if key.startswith("trickle") else 0.0)
        if time.monotonic() - at > allowed:
            self.late += 1
            self.late_kinds[_kind(key)] += 1

    def close_all(self, prefix: str) -> None:
        """The connection closed: what it still waited for counts as answered by the close."""
        for key in [k for k in self.pending if k.startswith(prefix)]:
            self.answer(key, "closed")

    def expire(self, limit_s: float = ANSWER_S, prefix: str = "") -> None:
        now = time.monotonic()
        for key, at in list(self.pending.items()):
            if key.startswith(prefix) and now - at > limit_s:
                del self.pending[key]
                self.miss(key)

    def miss(self, key: str) -> None:
        self.unanswered += 1
        self.unanswered_kinds[_kind(key)] += 1


def _kind(key: str) -> str:
    if ".rp" in key:
        return "hello.resume"
    if key.endswith(".long"):
        return "ws long turn"
    return "http" if key.startswith("http") else "trickle" if key.startswith("trickle") else "ws"


async def _ws_hostile(url: str, n: int, ledger: Ledger, stop: asyncio.Event) -> None:
    """One hostile WebSocket client: a long turn, then big chats and resumes as fast as it can send."""
    big = "x" * FRAME_CHARS
    msgs = (Message("user", "y" * FRAME_CHARS),)
    conn_no = 0
    while not stop.is_set():
        conn_no += 1
        prefix = f"h{n}.{conn_no}."
        try:
            client = await Client.connect(url, hello=False)
        except Exception:
            await asyncio.sleep(0.2)
            continue
        points = tuple(ResumePoint(id=f"{prefix}rp{i}", offset=0) for i in range(MAX_RESUME_POINTS))
        for p in points:
            ledger.send(p.id)

        async def read(client: Client = client, prefix: str = prefix) -> None:
            with contextlib.suppress(Exception):
                while True:
                    f = await client.recv()
                    fid = getattr(f, "id", None)
                    if not isinstance(fid, str):
                        continue
                    if isinstance(f, Error):
                        ledger.answer(fid, f"error:{f.code}")
                    elif isinstance(f, Waiting | Accepted):
                        ledger.answer(fid, f.type)
            ledger.close_all(prefix)

        reader: asyncio.Task[None] | None = None
        try:
            # Everything after the handshake is inside this try: the client is closed however the
            # connection ends (the server closing it, or the flood's end cancelling this task).
            await client.send(Hello(resume=points))
            reader = asyncio.create_task(read())
            long = Chat(id=f"{prefix}long", content="tell me a long story", params=Params(max_tokens=256))
            await client.send(long)
            ledger.send(long.id)
            i = 0
            until = time.monotonic() + 10  # a new connection (and hello.resume) every 10 s
            while not stop.is_set() and time.monotonic() < until and not reader.done():
                i += 1
                kind = i % 3
                rid = f"{prefix}{i}"
                if kind == 0:
                    frame: Any = Chat(id=rid, content=big, params=Params(max_tokens=8))
                elif kind == 1:
                    frame = Chat(id=rid, messages=msgs, params=Params(max_tokens=8))
                else:
                    frame = Resume(id=rid, offset=0)
                await client.send(frame)
                ledger.send(rid)  # from when the socket took it: the server's answer is due from then
        except Exception:
            pass
        finally:
            with contextlib.suppress(BaseException):
                await client.close()
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            ledger.close_all(prefix)


async def _http_hostile(host: str, port: int, n: int, ledger: Ledger, stop: asyncio.Event) -> None:
    """1 MiB bodies as fast as they are answered, and a trickled body now and then."""
    content = "z" * ((1 << 20) - 100)
    body = {"model": "default", "stream": True, "messages": [{"role": "user", "content": content}]}
    raw = json.dumps(body).encode()
    i = 0
    while not stop.is_set():
        i += 1
        key = f"http{n}.{i}"
        ledger.send(key)
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(raw)}\r\n\r\n".encode()
                + raw
            )
            line = await asyncio.wait_for(reader.readline(), ANSWER_S * 5)
            status = line.split(b" ")[1].decode() if line.count(b" ") >= 1 else "closed"
            ledger.answer(key, f"http:{status}" if status.startswith("2") else f"error:http_{status}")
        except (TimeoutError, OSError, IndexError):
            ledger.answer(key, "closed")
        finally:
            if writer is not None:
                writer.close()  # also when the flood's end cancels this task mid-request


async def _trickler(host: str, port: int, n: int, ledger: Ledger, stop: asyncio.Event) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        key = f"trickle{n}.{i}"
        ledger.send(key)
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")

            async def drip(writer: asyncio.StreamWriter = writer) -> None:
                with contextlib.suppress(Exception):
                    while True:
                        writer.write(b" ")
                        await writer.drain()
                        await asyncio.sleep(0.5)

            dripping = asyncio.create_task(drip())
            try:
                line = await asyncio.wait_for(reader.readline(), TRICKLE_DEADLINE_S + ANSWER_S)
                status = line.split(b" ")[1].decode() if line.count(b" ") >= 1 else "closed"
                ledger.answer(key, f"error:http_{status}")
            except TimeoutError:
                del ledger.pending[key]
                ledger.miss(key)
            finally:
                dripping.cancel()
                writer.close()
        except OSError:
            ledger.answer(key, "closed")


async def run_flood(cfg: LoadConfig, clients: int, duration_s: float) -> dict[str, Any]:
    """The two phases (see the module docstring); the report."""
    pid = cfg.server_pid
    alone = _gaps(await run_load(cfg))
    before = rss_mb(pid)
    ledger = Ledger()
    stop = asyncio.Event()
    u = urlsplit(cfg.url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    hostile = [asyncio.create_task(_ws_hostile(cfg.url, n, ledger, stop)) for n in range(clients)]
    http_clients = max(1, clients // 2)
    hostile += [asyncio.create_task(_http_hostile(host, port, n, ledger, stop)) for n in range(http_clients)]
    hostile += [asyncio.create_task(_trickler(host, port, n, ledger, stop)) for n in range(http_clients)]
    peak = before or 0.0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_mb(pid) or 0.0)
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    await asyncio.sleep(1.0)  # the flood is on before the normal users start
    flood = _gaps(await run_load(cfg))
    await asyncio.sleep(max(0.0, duration_s - (time.monotonic() - started)))
    stop.set()
    await asyncio.wait(hostile, timeout=TRICKLE_DEADLINE_S + 10)
    for t in hostile:
        t.cancel()
    await asyncio.gather(*hostile, return_exceptions=True)  # their finally blocks close every socket
    ledger.expire(limit_s=0.0, prefix="")  # whatever still waits now was never answered
    await asyncio.sleep(AFTER_S)
    after = rss_mb(pid)
    sampler.cancel()
    p99, worst = alone["itl_p99_ms"], flood["itl_max_ms"]
    result = {
        "gateway_rss_before_mb": round(before, 1) if before is not None else None,
        "gateway_rss_growth_mb": round(peak - before, 1) if before is not None else None,
        "gateway_rss_after_mb": round(after - before, 1)
        if after is not None and before is not None
        else None,
        "normal_max_gap_over_p99": round(worst / p99, 2) if p99 and worst is not None else None,
        # The figure: neither an answer nor a close within ANSWER_S (late ones included).
        "unanswered": ledger.unanswered + ledger.late,
        "never_answered": ledger.unanswered,
        "unanswered_kinds": dict(ledger.unanswered_kinds),
        "late": ledger.late,
        "late_kinds": dict(ledger.late_kinds),
        "sent": ledger.sent,
        "refused": dict(ledger.refused),
        "answered": dict(ledger.answered),
        "normal_failed": flood["requests_failed"],
    }
    met = {k: (result[k] is not None and result[k] <= t) for k, t in TARGETS.items()}
    met["unanswered"] = result["unanswered"] == 0
    met["normal_complete"] = flood["requests_failed"] == 0 and alone["requests_failed"] == 0
    return {
        "scenario": "flood",
        "config": cfg.describe(),
        "hostile_clients": clients,
        "duration_s": duration_s,
        "alone": alone,
        "flood": {**result, **{"with_flood": flood}},
        "targets": TARGETS,
        "met": met,
    }


def print_flood(report: dict[str, Any]) -> None:
    f = report["flood"]
    url, k = report["config"]["url"], report["hostile_clients"]
    print(f"tokenwire load --scenario flood: {url}, {k} hostile clients")
    a, w = report["alone"], f["with_flood"]
    for name, r in (("alone", a), ("flood", w)):
        print(
            f"  {name:6s} ok {r['requests_ok']:4d} failed {r['requests_failed']:3d}  {r['tok_s']} tok/s  "
            f"inter-token p50 {r['itl_p50_ms']} p99 {r['itl_p99_ms']} max {r['itl_max_ms']} ms"
        )
    print(
        f"  hostile frames/requests sent {f['sent']}, unanswered within {ANSWER_S:g} s {f['unanswered']}: "
        f"never {f['never_answered']} {f['unanswered_kinds']}, late {f['late']} {f['late_kinds']}"
    )
    print(f"  refused: {f['refused']}")
    print(
        f"  gateway RSS growth {f['gateway_rss_growth_mb']} MB, after {f['gateway_rss_after_mb']} MB; "
        f"max gap / p99 alone {f['normal_max_gap_over_p99']}x"
    )
    print("  targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in report["met"].items()))
