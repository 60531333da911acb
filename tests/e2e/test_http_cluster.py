"""Background responses in cluster mode, through the ``openai`` SDK: created on one gateway, read there
until cut, a worker killed with SIGKILL mid-response, then resumed with ``starting_after`` on the other
gateway. Each final text must equal an uninterrupted greedy run, and some responses must really have
moved from the killed worker to the other one."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from pathlib import Path

import redis.asyncio as aioredis
from openai import AsyncOpenAI

from protocol import Params
from server.client import Client, collect
from tests.e2e.test_cluster import (  # noqa: F401 (fixtures)
    Cluster,
    _freeze_mid_reply,
    _kill_busiest,
    _writers,
    backend,
    cluster,
    cluster_redis,
    store_url,
)

STREAMS = 20
MAX_TOKENS = 160
API_KEY = "cluster-key"


def _http(ws_url: str) -> str:
    return ws_url.replace("ws://", "http://").removesuffix("/ws")


def _input(i: int) -> str:
    return f"Stream number {i}, tell me everything"


async def _head(client: AsyncOpenAI, rid: str) -> tuple[str, int]:
    """Read a response's stream until it has at least 3 tokens, then drop the connection."""
    text, seq = "", 0
    events = await client.responses.retrieve(rid, stream=True)
    async for ev in events:
        if ev.type == "response.output_text.delta":
            text += ev.delta
            seq = ev.sequence_number
            if seq >= 3:
                break
    await events.close()
    return text, seq


async def _rest(client: AsyncOpenAI, rid: str, after: int) -> tuple[str, str]:
    """The text after token ``after`` and the final response's whole text."""
    rest, final = "", None
    async for ev in await client.responses.retrieve(rid, stream=True, starting_after=after):
        if ev.type == "response.output_text.delta":
            assert ev.sequence_number > after
            rest += ev.delta
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response.output_text
        elif ev.type in ("error", "response.failed"):
            raise AssertionError(ev)
    assert final is not None
    return rest, final


async def _reference(ws_url: str) -> list[str]:
    """The same conversations over the WebSocket, uninterrupted and never from the response cache."""

    async def one(i: int) -> str:
        c = await Client.connect(ws_url)
        text, _, done, errors = await collect(
            c.chat(
                messages=[{"role": "user", "content": _input(i)}],
                # An OpenAI call that sets temperature samples without the server's default penalties
                # (SPEC §15.2): the WebSocket reference asks for the same.
                params=Params(
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    repetition_penalty=1.0,
                    frequency_penalty=0.0,
                    cache=False,
                ),
            )
        )
        await c.close()
        assert errors == [] and done is not None
        return text

    return list(await asyncio.gather(*(one(i) for i in range(STREAMS))))


async def test_background_responses_survive_kill9_and_resume_on_another_gateway(
    cluster: Cluster,  # noqa: F811
    cluster_redis: aioredis.Redis,  # noqa: F811
    peaky_model_dir: Path,
) -> None:
    url0, url1 = cluster.start_gateway(), cluster.start_gateway()
    g0 = AsyncOpenAI(base_url=_http(url0), api_key=API_KEY, max_retries=0)
    g1 = AsyncOpenAI(base_url=_http(url1), api_key=API_KEY, max_retries=0)
    workers = {name: cluster.worker(peaky_model_dir, "--name", name) for name in ("w0", "w1")}
    starting: list[asyncio.Future[str]] = []
    try:
        created = await asyncio.gather(
            *(
                g0.responses.create(
                    model="default",
                    input=_input(i),
                    background=True,
                    temperature=0,
                    max_output_tokens=MAX_TOKENS,
                )
                for i in range(STREAMS)
            )
        )
        ids = [r.id for r in created]
        # The workers start only now, with every response queued (a cluster's gateway queues the default
        # model's requests while no worker is up), so all of them start at once: a worker takes up to 64
        # queued requests in one read. With the workers up first, a fresh-clone CI run found the first
        # responses finished before the last was created, and the freeze below never came.
        starting = [asyncio.ensure_future(asyncio.to_thread(w.start)) for w in workers.values()]
        # Frozen with every response mid-way; the heads are read from the store meanwhile.
        await _freeze_mid_reply(cluster_redis, cluster, workers, n=STREAMS, min_tokens=4)
        heads = await asyncio.wait_for(asyncio.gather(*(_head(g0, rid) for rid in ids)), 90)
        victim = await _kill_busiest(cluster_redis, cluster, workers)
        # The survivor may still have been starting when it was frozen; it must come up now. The victim's
        # start may end either way (killed before or after it said ready).
        await asyncio.wait_for(asyncio.gather(*starting, return_exceptions=True), 120)
        rests = await asyncio.wait_for(
            asyncio.gather(*(_rest(g1, rid, seq) for rid, (_, seq) in zip(ids, heads, strict=True))), 120
        )
        texts = []
        for (head, _), (rest, final) in zip(heads, rests, strict=True):
            assert head + rest == final  # nothing repeated, nothing skipped across gateways
            texts.append(final)
        for rid, text in zip(ids, texts, strict=True):
            got = await g1.responses.retrieve(rid)
            assert got.output_text == text and got.status in ("completed", "incomplete")
        assert texts == await _reference(url1)
        owner = "http:" + hashlib.sha256(API_KEY.encode()).hexdigest()[:32]
        request_ids = [rid.removeprefix("resp_") for rid in ids]
        writers = await _writers(cluster_redis, cluster.keys, dict.fromkeys(request_ids, owner), request_ids)
        moved = [ws for ws in writers if any(a != b for a, b in itertools.pairwise(ws))]
        # Some responses really were on the killed worker and finished elsewhere.
        assert moved and all(ws[0] == victim for ws in moved), (victim, writers)
    finally:
        # A worker left frozen or half-started by a failure would hold its start thread forever.
        for w, fut in zip(workers.values(), starting, strict=False):
            if not fut.done() and w.proc is not None:
                w.proc.kill()
        await asyncio.gather(*starting, return_exceptions=True)
        await g0.close()
        await g1.close()
