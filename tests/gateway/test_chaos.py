"""Chaos: 50 multi-turn conversations on a tiny real model and the batching engine (what `tokenwire
serve` runs), every connection killed 1-3 times mid-stream (client-side aborts and server-side drops)
and, in some turns, right after sending the chat, before its `accepted`. Each conversation reconnects
with its session token and resumes (or, never having seen `accepted`, resends the identical chat); every
final text must equal the uninterrupted run, offsets must be contiguous, and the engine must have
started each request exactly once."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from websockets.exceptions import ConnectionClosed

from protocol import Accepted, Chat, Delta, Done, Error, Params, ResumePoint
from server.client import Client
from server.engine.api import GenerationRequest, StepCallback
from server.engine.engine import BatchingEngine
from server.engine.model import load_model
from server.store.keys import Keys
from tests.gateway.conftest import running_server
from tests.gateway.proxy import DropProxy

CONVERSATIONS = 50
TURNS = 3
MAX_TOKENS = 20


class CountingEngine:
    """Counts, per request, how many generations the engine was asked to start."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.starts: Counter[str] = Counter()

    def start(self, on_step: StepCallback) -> None:
        self.inner.start(on_step)

    def submit(self, request: GenerationRequest) -> None:
        self.starts[request.key] += 1
        self.inner.submit(request)

    def cancel(self, key: str) -> None:
        self.inner.cancel(key)

    def stop(self) -> None:
        self.inner.stop()


@dataclass
class Stats:
    kills: int = 0
    server_drops: int = 0
    early_kills: int = 0  # connections killed after sending a chat, before its accepted
    resumes: int = 0
    retries: int = 0
    texts: list[str] = field(default_factory=list)


def _chat(conv: int, turn: int, prefix: str) -> Chat:
    return Chat(
        id=f"{prefix}-{conv}-{turn}",
        content=f"Tell me about topic {conv} part {turn}",
        # cache=False: the chaos run must generate, not replay the reference run from the response cache.
        # Greedy on a model without near ties: the text does not depend on which requests share a batch.
        params=Params(max_tokens=MAX_TOKENS, temperature=0, cache=False),
    )


async def _run_conversation(
    url: str, conv: int, prefix: str, rng: random.Random | None, proxy: DropProxy | None, stats: Stats
) -> list[str]:
    texts: list[str] = []
    kill_budget = rng.randint(1, 3) if rng else 0
    # Spread the kills over this conversation's turns at random token offsets.
    kills: dict[int, list[int]] = {}
    for _ in range(kill_budget):
        kills.setdefault(rng.randrange(TURNS) if rng else 0, []).append(
            rng.randrange(1, MAX_TOKENS) if rng else 0
        )
    # And, in about a third of the turns, a kill right after the chat is sent, before its accepted.
    early = {t for t in range(TURNS) if rng is not None and rng.random() < 0.35}
    session_token: str | None = None
    client: Client | None = None
    for turn in range(TURNS):
        chat = _chat(conv, turn, prefix)
        plan = sorted(kills.get(turn, []))
        text, offset, epoch, accepted = "", 0, None, False
        sent = False
        kill_early = turn in early
        while True:
            if client is None:
                resume = (ResumePoint(chat.id, offset, epoch),) if accepted else ()
                client = await Client.connect(url, session_token=session_token, resume=resume)
                assert client.welcome is not None
                session_token = client.welcome.session_token
                if accepted:
                    stats.resumes += 1
                elif sent:
                    stats.retries += 1
                    sent = False  # never accepted: send the same chat again (idempotent by id)
            try:
                if not sent:
                    await client.send(chat)
                    sent = True
                    if kill_early:
                        kill_early = False
                        stats.early_kills += 1
                        if proxy is not None and rng is not None and rng.random() < 0.5:
                            stats.server_drops += 1
                            proxy.drop(client.ws.transport.get_extra_info("sockname")[1])
                        else:
                            client.ws.transport.abort()
                        raise ConnectionResetError
                while True:
                    f = await client.recv()
                    if getattr(f, "id", None) != chat.id:
                        continue
                    if isinstance(f, Accepted):
                        assert epoch in (None, f.epoch)
                        accepted, epoch = True, f.epoch
                    elif isinstance(f, Delta):
                        assert f.offset == offset, (chat.id, f.offset, offset)
                        text += f.text
                        offset += f.n
                        if plan and offset >= plan[0]:
                            plan.pop(0)
                            stats.kills += 1
                            if proxy is not None and rng is not None and rng.random() < 0.5:
                                stats.server_drops += 1
                                proxy.drop(client.ws.transport.get_extra_info("sockname")[1])
                            else:
                                client.ws.transport.abort()
                            raise ConnectionResetError
                    elif isinstance(f, Done):
                        assert f.offset == offset and f.usage.completion_tokens == offset
                        break
                    elif isinstance(f, Error):
                        raise AssertionError(f"{chat.id}: {f}")
                break
            except (ConnectionClosed, ConnectionResetError, OSError):
                if client is not None:
                    client.ws.transport.abort()
                client = None
        texts.append(text)
    if client is not None:
        await client.close()
    return texts


async def test_chaos_kills_and_resumes_lose_and_repeat_nothing(
    redis: aioredis.Redis, redis_url: str, keys: Keys, peaky_model_dir: Path
) -> None:
    engine = CountingEngine(BatchingEngine(load_model(peaky_model_dir)))
    async with running_server(redis, redis_url, keys, engine=engine) as server:  # type: ignore[arg-type]
        proxy = DropProxy(server.port)
        await proxy.start()
        url = f"ws://127.0.0.1:{proxy.port}/v1/ws"
        try:
            calm = Stats()
            reference = await asyncio.wait_for(
                asyncio.gather(
                    *(_run_conversation(url, i, "ref", None, None, calm) for i in range(CONVERSATIONS))
                ),
                120,
            )
            rng = random.Random(1234)
            rough = Stats()
            chaotic = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        _run_conversation(url, i, "chaos", random.Random(rng.random()), proxy, rough)
                        for i in range(CONVERSATIONS)
                    )
                ),
                120,
            )
        finally:
            await proxy.stop()
    assert rough.kills >= CONVERSATIONS and rough.server_drops > 0 and rough.early_kills > 0
    # Every kill after a delta was followed by exactly one resume (hello.resume), every kill before the
    # accepted by exactly one retry of the identical chat; the calm run needed neither.
    assert (rough.resumes, rough.retries) == (rough.kills, rough.early_kills)
    assert (calm.kills, calm.early_kills, calm.resumes, calm.retries) == (0, 0, 0, 0)
    assert chaotic == reference
    # Not vacuous: the texts are real (a sampled reply may rarely open with EOS and be empty, on both runs).
    texts = [t for conv in reference for t in conv]
    assert sum(1 for t in texts if t) >= 0.95 * len(texts)
    assert len(engine.starts) == 2 * CONVERSATIONS * TURNS
    assert set(engine.starts.values()) == {1}, [k for k, v in engine.starts.items() if v > 1]
