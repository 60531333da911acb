"""OpenAI's Responses WebSocket mode on a 2-gateway cluster, with the official SDK (issue 25): mid-reply,
the gateway every socket is on and the busiest worker are both killed with SIGKILL. The SDK's own
reconnect, with the documented ``on_reconnecting`` handler (``tw_resume``), reaches the other gateway
through a load balancer, and each reply goes on after the last ``sequence_number`` its client saw: the
joined text equals the stored output and an uninterrupted greedy run, the sequence numbers only grow, and
the replies that were on the killed worker finished on the other one."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import signal
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from openai import AsyncOpenAI

from protocol import Params
from server.client import Client, collect
from server.examples.openai_ws_resume import END, ResumeTracker
from tests.e2e.test_cluster import (  # noqa: F401 (fixtures)
    Cluster,
    _writers,
    backend,
    cluster,
    cluster_redis,
    store_url,
)

STREAMS = 6
MAX_TOKENS = 300  # the tiny model is fast: long enough that the kill lands mid-reply
API_KEY = "ws-cluster-key"


class Failover:
    """A load balancer in front of the gateways: each new connection goes to the first one that accepts
    it, and a connection whose gateway died is cut (the client sees 1006) so that it reconnects."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self._writers.add(cw)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        for port in self.ports:
            with contextlib.suppress(OSError):
                upstream = await asyncio.open_connection("127.0.0.1", port)
                break
        if upstream is None:
            cw.transport.abort()
            self._writers.discard(cw)
            return
        ur, uw = upstream
        self._writers.add(uw)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()

        try:
            await asyncio.wait(
                [asyncio.create_task(pipe(cr, uw)), asyncio.create_task(pipe(ur, cw))],
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for w in (cw, uw):  # either side gone: cut both, as a balancer does when a backend dies
                w.transport.abort()
                self._writers.discard(w)


def _input(i: int) -> str:
    return f"Reply number {i}, tell me everything"


class Reader:
    """One SDK socket reading one response, through the handler the README documents."""

    def __init__(self) -> None:
        self.tracker = ResumeTracker()
        self.events: list[Any] = []
        self.reconnects: list[dict[str, Any]] = []
        self.started = asyncio.Event()

    def on_reconnecting(self, event: Any) -> Any:
        overrides = self.tracker.on_reconnecting(event)
        self.reconnects.append(dict(overrides["extra_query"]))
        return overrides

    async def run(self, client: AsyncOpenAI, i: int) -> None:
        async with client.responses.connect(on_reconnecting=self.on_reconnecting, initial_delay=0.05) as conn:
            await conn.response.create(
                model="default", input=_input(i), temperature=0, max_output_tokens=MAX_TOKENS
            )
            async for ev in conn:
                self.tracker.see(ev)
                self.events.append(ev)
                if sum(e.type == "response.output_text.delta" for e in self.events) >= 3:
                    self.started.set()
                if ev.type in END or ev.type == "error":
                    return

    @property
    def text(self) -> str:
        return "".join(e.delta for e in self.events if e.type == "response.output_text.delta")


async def _reference(ws_url: str) -> list[str]:
    """The same inputs over tokenwire's WebSocket, uninterrupted (greedy, no penalty: what an OpenAI
    call that sets temperature asks for, SPEC §15.3) and never from the response cache."""

    async def one(i: int) -> str:
        c = await Client.connect(ws_url)
        params = Params(
            max_tokens=MAX_TOKENS, temperature=0, repetition_penalty=1.0, frequency_penalty=0.0, cache=False
        )
        try:
            chat = c.chat(messages=[{"role": "user", "content": _input(i)}], params=params)
            text, _, done, errors = await collect(chat)
        finally:
            await c.close()
        assert errors == [] and done is not None
        return text

    return list(await asyncio.gather(*(one(i) for i in range(STREAMS))))


async def test_the_sdk_reconnects_to_the_other_gateway_after_its_gateway_and_worker_die(
    cluster: Cluster,  # noqa: F811
    cluster_redis: aioredis.Redis,  # noqa: F811
    peaky_model_dir: Path,
) -> None:
    workers = {
        "w0": cluster.start_worker(peaky_model_dir, "--name", "w0"),
        "w1": cluster.start_worker(peaky_model_dir, "--name", "w1"),
    }
    urls = [cluster.start_gateway(), cluster.start_gateway()]
    ports = [int(u.split(":")[2].split("/")[0]) for u in urls]
    lb = Failover(ports)
    await lb.start()
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{lb.port}/v1", api_key=API_KEY, max_retries=0)
    readers = [Reader() for _ in range(STREAMS)]
    tasks = [asyncio.create_task(r.run(client, i)) for i, r in enumerate(readers)]
    try:
        await asyncio.wait_for(asyncio.gather(*(r.started.wait() for r in readers)), 60)
        # Freeze both workers at once, so that the replies are surely mid-way when the kill lands (the
        # tiny model is fast), then kill the one holding the most and let the other go on.
        for w in workers.values():
            assert w.proc is not None
            w.proc.send_signal(signal.SIGSTOP)
        ks = cluster.keys
        running = {
            name: sum([await cluster_redis.hlen(ks.worker_requests(name, p)) for p in range(ks.partitions)])
            for name in workers
        }
        victim = max(workers, key=lambda w: running[w])
        unfinished = [r for r in readers if not any(e.type in END for e in r.events)]
        assert running[victim] > 0 and unfinished, f"every reply ended before the kill: {running}"
        g0 = cluster.gateways[0].proc
        victim_proc = workers[victim].proc
        assert g0 is not None and victim_proc is not None
        g0.send_signal(signal.SIGKILL)  # every socket is on gateway 0: the balancer tried it first
        victim_proc.send_signal(signal.SIGKILL)
        for name, w in workers.items():
            if name != victim and w.proc is not None:
                w.proc.send_signal(signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await lb.stop()

    direct = AsyncOpenAI(base_url=urls[1].replace("ws://", "http://").removesuffix("/ws"), api_key=API_KEY)
    try:
        texts = []
        for r in readers:
            final = r.events[-1]
            assert final.type in ("response.completed", "response.incomplete"), final
            seqs = [e.sequence_number for e in r.events]
            assert all(a < b for a, b in itertools.pairwise(seqs)), seqs  # nothing repeated
            assert [e.type for e in r.events].count("response.created") == 1
            stored = await direct.responses.retrieve(final.response.id)
            assert r.text == final.response.output_text == stored.output_text  # nothing missing
            texts.append(r.text)
        for r in unfinished:  # each reconnected once, naming its response and where it was
            assert len(r.reconnects) == 1
            rid = r.events[0].response.id
            assert r.reconnects[0]["tw_resume"].startswith(rid + ":")
        assert texts == await _reference(urls[1])
    finally:
        await direct.close()
        await client.close()
    # Some replies really were on the killed worker and finished on the other: one switch of writer each.
    owner = "http:" + hashlib.sha256(API_KEY.encode()).hexdigest()[:32]
    ids = [r.events[0].response.id.removeprefix("resp_") for r in readers]
    writers = await _writers(cluster_redis, cluster.keys, dict.fromkeys(ids, owner), ids)
    moved = [ws for ws in writers if any(a != b for a, b in itertools.pairwise(ws))]
    assert moved and all(ws[0] == victim and ws[-1] != victim for ws in moved), (victim, writers)
