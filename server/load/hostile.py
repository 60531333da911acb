"""``tokenwire load URL --scenario hostile-prompt``: does one hostile client stall everyone else?

The same normal workload runs twice against the server: alone, then while one more client sends a chat
of 63 long messages plus a short question (about 940 KiB in one frame, under the default 1 MiB frame
limit; messages mode) over and over, each as soon as the previous one ended. The report gives the normal
users' inter-token gap p99 and maximum in both runs; the server passes when the maximum with the hostile
client stays within twice the p99 without it (an engine that tokenised such a prompt on its own thread
froze every stream for seconds). Bounded: the hostile client stops when the normal run ends, or after
``HOSTILE_MAX`` chats.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

from protocol import Done, Error, Message, Params
from protocol.frames import Chat
from server.client import Client
from server.load.options import LoadConfig
from server.load.runner import LoadResult, run_load

HOSTILE_MESSAGES = 63
HOSTILE_MESSAGE_CHARS = 15_000
HOSTILE_MAX = 200
TARGET = 2.0  # max gap with the hostile client <= TARGET x p99 without it

_WORDS = (
    "the",
    "history",
    "of",
    "printing",
    "vaccines",
    "immune",
    "system",
    "sky",
    "blue",
    "chess",
    "sourdough",
    "hash",
    "table",
    "water",
    "cycle",
    "websocket",
    "polling",
    "revolution",
    "solar",
    "panel",
    "photosynthesis",
    "language",
    "climate",
    "compiler",
    "star",
    "sleep",
)


def hostile_messages(seed: int = 0) -> list[dict[str, str]]:
    """63 long turns (ordinary words, each message different) and a short question at the end."""
    rng = random.Random(seed)
    msgs = []
    for i in range(HOSTILE_MESSAGES):
        words: list[str] = []
        size = 0
        while size < HOSTILE_MESSAGE_CHARS:
            w = rng.choice(_WORDS)
            words.append(w)
            size += len(w) + 1
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(words)})
    msgs.append({"role": "user", "content": "So, in one sentence: what is this all about?"})
    return msgs


async def _hostile_client(
    cfg: LoadConfig, sent: asyncio.Event, stop: asyncio.Event, outcomes: Counter[str]
) -> None:
    """Send the hostile chat again and again until ``stop``; each one is read to its end (so at least
    one is answered in any run)."""
    msgs = tuple(Message(m["role"], m["content"]) for m in hostile_messages(cfg.seed))
    client = await Client.connect(cfg.url, token=cfg.token)
    try:
        for i in range(HOSTILE_MAX):
            if stop.is_set():
                return
            params = Params(max_tokens=8, cache=False)
            chat = Chat(id=f"hostile-{time.time_ns()}-{i}", messages=msgs, params=params)
            await client.send(chat)
            sent.set()
            async for frame in client.frames_for(chat.id):
                if isinstance(frame, Done):
                    outcomes[f"done:{frame.finish_reason}"] += 1
                    break
                if isinstance(frame, Error):
                    outcomes[f"error:{frame.code}"] += 1
                    if frame.code != "too_large":
                        break
                    # too_large is followed by done: read on
    finally:
        await client.close()


def _gaps(result: LoadResult) -> dict[str, Any]:
    ok = [r for r in result.records if r.ok]
    itl = sorted(x for r in ok for x in r.itl)
    ttft = sorted(r.first_at - r.sent_at for r in ok if r.first_at is not None and r.sent_at is not None)
    tokens = sum(r.tokens for r in ok)

    def pct(p: float, xs: list[float] = itl) -> float | None:
        if not xs:
            return None
        return round(xs[min(len(xs) - 1, round((len(xs) - 1) * p / 100))] * 1000, 1)

    return {
        "requests_ok": len(ok),
        "requests_failed": len(result.records) - len(ok),
        "tokens": tokens,
        "tok_s": round(tokens / result.window_s, 1) if result.window_s > 0 else None,
        "ttft_p50_ms": pct(50, ttft),
        "itl_p50_ms": pct(50),
        "itl_p99_ms": pct(99),
        "itl_max_ms": round(itl[-1] * 1000, 1) if itl else None,
    }


async def run_hostile(cfg: LoadConfig) -> dict[str, Any]:
    """Run the normal workload alone, then with the hostile client; the report (see the module doc)."""
    alone = _gaps(await run_load(cfg))
    sent, stop = asyncio.Event(), asyncio.Event()
    outcomes: Counter[str] = Counter()
    hostile = asyncio.create_task(_hostile_client(cfg, sent, stop, outcomes))
    try:
        # The normal users start once the first hostile chat is on its way.
        await asyncio.wait({hostile, asyncio.create_task(sent.wait())}, return_when=asyncio.FIRST_COMPLETED)
        with_hostile = _gaps(await run_load(cfg))
    finally:
        stop.set()
        try:
            await asyncio.wait_for(hostile, 120)
        except Exception as exc:  # the hostile client's fate is part of the report
            outcomes[f"client:{type(exc).__name__}"] += 1
    p99, worst = alone["itl_p99_ms"], with_hostile["itl_max_ms"]
    ratio = round(worst / p99, 2) if p99 and worst is not None else None
    size = len(json.dumps(hostile_messages(cfg.seed)).encode())
    return {
        "scenario": "hostile-prompt",
        "config": cfg.describe(),
        "hostile": {"messages": HOSTILE_MESSAGES + 1, "frame_bytes": size, "outcomes": dict(outcomes)},
        "alone": alone,
        "with_hostile": with_hostile,
        "max_with_over_p99_alone": ratio,
        "target": TARGET,
        "met": ratio is not None and ratio <= TARGET,
    }


def print_hostile(report: dict[str, Any]) -> None:
    a, h = report["alone"], report["with_hostile"]
    print(f"tokenwire load --scenario hostile-prompt: {report['config']['url']}")
    hostile = report["hostile"]
    print(f"hostile client: {hostile['frame_bytes']} bytes a chat; outcomes {hostile['outcomes']}")
    for name, r in (("alone", a), ("with hostile", h)):
        print(
            f"  {name:13s} ok {r['requests_ok']:4d} failed {r['requests_failed']:3d}  {r['tok_s']} tok/s  "
            f"inter-token p50 {r['itl_p50_ms']} p99 {r['itl_p99_ms']} max {r['itl_max_ms']} ms"
        )
    verdict = "met" if report["met"] else "MISSED"
    print(
        f"max gap with the hostile client / p99 alone: {report['max_with_over_p99_alone']}x "
        f"(target <= {report['target']}x: {verdict})"
    )
