"""Cluster mode with real processes on loopback: gateways and workers over one Redis, losing any of them.

Every test here checks the same invariants as the chaos test: each stream's offsets are contiguous, each
final text equals the uninterrupted run with the same seed, nothing is generated twice."""

from __future__ import annotations

import asyncio
import itertools
import signal
import socket
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from protocol import Accepted, Chat, Delta, Done, Error, Message, Params, ResumePoint
from server.client import Client, collect
from server.store.keys import CLUSTER_PARTITIONS, Keys
from tests.conftest import delete_prefix, delete_prefix_cluster
from tests.e2e.serve_process import ServeProcess

LEASE_TTL_S = 2.0
STREAMS = 20
# Long enough that every stream is still running when the last one has started, even on a busy machine:
# a kill then always lands mid-stream.
MAX_TOKENS = 160


@dataclass
class Cluster:
    prefix: str
    base: list[str]
    tmp: Path
    gateways: list[ServeProcess] = field(default_factory=list)
    workers: list[ServeProcess] = field(default_factory=list)
    keys: Keys = field(default_factory=Keys)

    def start_gateway(self) -> str:
        p = ServeProcess(self.base, self.tmp, command="gateway")
        self.gateways.append(p)
        return p.start()

    def worker(self, model: Path, *extra: str) -> ServeProcess:
        """A worker process, not started yet (``start()`` it, or ``start_worker``)."""
        p = ServeProcess(
            [*self.base, "--model", str(model), "--threads", "1", *extra], self.tmp, command="worker"
        )
        self.workers.append(p)
        return p

    def start_worker(self, model: Path, *extra: str) -> ServeProcess:
        p = self.worker(model, *extra)
        p.start()
        return p


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """ "redis" (the test Redis), or "cluster" for a test parametrised onto the session's 3-master Valkey
    cluster (tests/conftest.py; the processes find out from the URL alone)."""
    return str(getattr(request, "param", "redis"))


@pytest.fixture
def store_url(backend: str, redis_url: str, request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("cluster_url")) if backend == "cluster" else redis_url


@pytest.fixture
def cluster(store_url: str, backend: str, tmp_path: Path) -> Iterator[Cluster]:
    prefix = f"twtest:cluster:{uuid.uuid4().hex[:8]}:"
    c = Cluster(
        prefix, ["--redis-url", store_url, "--key-prefix", prefix, "--lease-ttl", str(LEASE_TTL_S)], tmp_path
    )
    c.keys = Keys(prefix, CLUSTER_PARTITIONS if backend == "cluster" else 1)
    try:
        yield c
    finally:
        for p in c.gateways + c.workers:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.kill()
            p.stop()
        (delete_prefix_cluster if backend == "cluster" else delete_prefix)(store_url, prefix)


@pytest.fixture
async def cluster_redis(store_url: str, backend: str, cluster: Cluster) -> AsyncIterator[Any]:
    r = RedisCluster.from_url(store_url) if backend == "cluster" else aioredis.from_url(store_url)
    yield r
    await r.aclose()


def _chat(i: int, tag: str) -> Chat:
    return Chat(
        id=f"{tag}-{i}",
        messages=(Message("user", f"Stream number {i}, tell me everything"),),
        # Greedy on a model without near ties: a continued stream (re-prefill on another worker, other
        # batch mates) must give exactly the uninterrupted text; sampled text could flip at a float-level
        # tie. cache=False: the reference run must generate again, not replay these from the cache.
        params=Params(max_tokens=MAX_TOKENS, temperature=0, cache=False),
    )


@dataclass
class Stream:
    chat: Chat
    text: str = ""
    offset: int = 0
    epoch: int | None = None
    done: Done | None = None
    last_delta_at: float = 0.0
    gaps: list[float] = field(default_factory=list)
    reconnects: int = 0


async def _follow(
    urls: list[str], s: Stream, token_holder: dict[str, str], started: asyncio.Event | None
) -> None:
    """Run one stream to done; reconnect (round-robin over ``urls``) and resume whenever the socket dies."""
    attempt = 0
    sent = False
    while s.done is None:
        url = urls[attempt % len(urls)]
        attempt += 1
        try:
            resume = (ResumePoint(s.chat.id, s.offset, s.epoch),) if s.epoch is not None else ()
            c = await Client.connect(url, session_token=token_holder.get("t"), resume=resume)
        except OSError:
            await asyncio.sleep(0.2)
            continue
        assert c.welcome is not None
        token_holder["t"] = c.welcome.session_token
        try:
            if not sent or s.epoch is None:
                await c.send(s.chat)  # idempotent: the same id and payload attach to the same request
                sent = True
            while True:
                f = await c.recv()
                if getattr(f, "id", None) != s.chat.id:
                    continue
                if isinstance(f, Accepted):
                    assert s.epoch in (None, f.epoch)
                    s.epoch = f.epoch
                elif isinstance(f, Delta):
                    assert f.offset == s.offset, (s.chat.id, f.offset, s.offset)
                    now = time.monotonic()
                    if s.last_delta_at:
                        s.gaps.append(now - s.last_delta_at)
                    s.last_delta_at = now
                    s.text += f.text
                    s.offset += f.n
                    if started is not None and s.offset >= 3:
                        started.set()
                elif isinstance(f, Done):
                    assert f.offset == s.offset
                    s.done = f
                    break
                elif isinstance(f, Error):
                    raise AssertionError(f"{s.chat.id}: {f}")
        except Exception as exc:  # the socket died (kill -9, 1012): reconnect and resume
            if isinstance(exc, AssertionError):
                raise
            s.reconnects += 1
            await asyncio.sleep(0.05)
        finally:
            c.ws.transport.abort()


async def _reference(url: str) -> list[str]:
    """The same chats, uninterrupted (new ids, same messages and seeds), run side by side."""

    async def one(i: int) -> str:
        c = await Client.connect(url)
        ch = _chat(i, "ref")
        text, _, done, errors = await collect(
            c.chat(messages=[m.to_wire() for m in ch.messages or ()], id=ch.id, params=ch.params)
        )
        await c.close()
        assert errors == [] and done is not None
        return text

    return list(await asyncio.gather(*(one(i) for i in range(STREAMS))))


async def _writers(r: Any, keys: Keys, owner_of: dict[str, str], ids: list[str]) -> list[list[str]]:
    out = []
    for rid in ids:
        entries = await r.xrange(keys.log(owner_of[rid], rid))
        out.append([e[1][b"w"].decode() for e in entries if b"w" in e[1]])
    return out


async def _freeze_mid_reply(
    r: Any, c: Cluster, workers: dict[str, ServeProcess], n: int, min_tokens: int, patience_s: float = 60.0
) -> None:
    """SIGSTOP every worker once at least ``n`` requests are running with ``min_tokens`` or more logged
    each (the workers' running hashes: log key -> tokens logged), so that the kill that follows surely
    lands mid-reply. Without the freeze, a fresh-clone CI run once found every response already finished
    when the kill came: the tiny model is fast and a busy machine reads the heads slowly."""
    ks = c.keys
    deadline = asyncio.get_running_loop().time() + patience_s
    held: list[int] = []
    while asyncio.get_running_loop().time() < deadline:
        if any(w.proc is None for w in workers.values()):  # still being started (in a thread)
            await asyncio.sleep(0.005)
            continue
        held = [
            int(v)
            for w in workers
            for p in range(ks.partitions)
            for v in (await r.hgetall(ks.worker_requests(w, p))).values()
        ]
        if len(held) >= n and min(held) >= min_tokens:
            for w in workers.values():
                assert w.proc is not None
                w.proc.send_signal(signal.SIGSTOP)
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never {n} requests running with {min_tokens}+ tokens each: {held}")


async def _kill_busiest(r: Any, c: Cluster, workers: dict[str, ServeProcess]) -> str:
    """SIGKILL the worker with the most requests running now (its running sets in every partition), let
    the others go on (SIGCONT, after ``_freeze_mid_reply``) and return the victim's name. Always killing
    the first worker failed a fresh-clone run once: the shared queue hands requests to whichever worker
    reads first (18 to 2 in one run), and the first may hold none."""
    ks = c.keys
    parts = range(ks.partitions)
    running = {w: sum([await r.hlen(ks.worker_requests(w, p)) for p in parts]) for w in workers}
    victim = max(workers, key=lambda w: running[w])
    assert running[victim] > 0, f"every response ended before the kill: {running}"
    proc = workers[victim].proc
    assert proc is not None
    proc.send_signal(signal.SIGKILL)
    for name, w in workers.items():
        if name != victim and w.proc is not None:
            w.proc.send_signal(signal.SIGCONT)
    return victim


async def _launch(
    urls: list[str], tag: str
) -> tuple[list[Stream], list[dict[str, str]], list[asyncio.Task[None]]]:
    """STREAMS streams following ``urls``, returned once every one has its first tokens: the streams,
    each one's session-token holder, and the tasks that run them to done."""
    streams = [Stream(_chat(i, tag)) for i in range(STREAMS)]
    tokens = [dict[str, str]() for _ in streams]
    started = [asyncio.Event() for _ in streams]
    tasks = [
        asyncio.create_task(_follow(urls, s, t, e)) for s, t, e in zip(streams, tokens, started, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    return streams, tokens, tasks


@pytest.mark.parametrize("backend", ["redis", "cluster"], indirect=True)
async def test_kill9_worker_mid_stream(cluster: Cluster, cluster_redis: Any, peaky_model_dir: Path) -> None:
    workers = {
        "w0": cluster.start_worker(peaky_model_dir, "--name", "w0"),
        "w1": cluster.start_worker(peaky_model_dir, "--name", "w1"),
    }
    url = cluster.start_gateway()
    streams, tokens, tasks = await _launch([url], "kw")
    await _freeze_mid_reply(cluster_redis, cluster, workers, n=1, min_tokens=1)
    victim = await _kill_busiest(cluster_redis, cluster, workers)
    await asyncio.wait_for(asyncio.gather(*tasks), 90)

    assert all(s.done is not None for s in streams)
    assert [s.text for s in streams] == await _reference(url)
    # Fencing: a log is written by one worker, then (if it was on the victim) by another — never interleaved.
    sessions = {s.chat.id: t["t"].partition(".")[0] for s, t in zip(streams, tokens, strict=True)}
    writers = await _writers(
        cluster_redis,
        cluster.keys,
        {k: f"anon:{v}" for k, v in sessions.items()},
        [s.chat.id for s in streams],
    )
    moved = 0
    for ws in writers:
        switches = sum(1 for a, b in itertools.pairwise(ws) if a != b)
        assert switches <= 1, ws
        if switches:
            assert ws[0] == victim and ws[-1] != victim
            moved += 1
    assert moved > 0  # some streams really were on the killed worker
    # The streams that moved resumed within the lease TTL plus 2 s of the kill.
    longest = max(max(s.gaps, default=0.0) for s in streams)
    assert longest <= LEASE_TTL_S + 2.0 + 1.0, longest  # + the 1 s heartbeat period of the reaper


async def test_kill9_gateway_clients_resume_on_the_other(cluster: Cluster, peaky_model_dir: Path) -> None:
    cluster.start_worker(peaky_model_dir)
    url0 = cluster.start_gateway()
    url1 = cluster.start_gateway()
    streams, _, tasks = await _launch([url0, url1], "kg")
    g0 = cluster.gateways[0].proc
    assert g0 is not None
    g0.send_signal(signal.SIGKILL)
    running_at_kill = [s for s in streams if s.done is None]
    await asyncio.wait_for(asyncio.gather(*tasks), 90)
    assert running_at_kill and all(s.reconnects >= 1 for s in running_at_kill)
    assert all(s.done is not None for s in streams)
    assert [s.text for s in streams] == await _reference(url1)


async def test_sigterm_gateway_and_worker_under_load_fails_nothing(
    cluster: Cluster, peaky_model_dir: Path
) -> None:
    w0 = cluster.start_worker(peaky_model_dir, "--name", "w0", "--drain-timeout", "0.5")
    cluster.start_worker(peaky_model_dir, "--name", "w1")
    url0 = cluster.start_gateway()
    url1 = cluster.start_gateway()
    streams, _, tasks = await _launch([url0, url1], "st")
    g0 = cluster.gateways[0]
    assert g0.proc is not None and w0.proc is not None
    g0.proc.send_signal(signal.SIGTERM)
    w0.proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(asyncio.gather(*tasks), 90)
    assert g0.proc.wait(20) == 0 and w0.proc.wait(20) == 0  # both drained and exited cleanly
    assert all(s.done is not None and s.done.finish_reason in ("stop", "length") for s in streams)
    assert [s.text for s in streams] == await _reference(url1)


async def test_worker_process_answers_probes_and_metrics(cluster: Cluster, tiny_model_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = cluster.start_worker(tiny_model_dir, "--metrics-port", str(port))  # returns at "tokenwire ready"

    def get(path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()

    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, get, "/healthz") == (200, "ok\n")
    assert await loop.run_in_executor(None, get, "/readyz") == (200, "ok\n")
    status, body = await loop.run_in_executor(None, get, "/metrics")
    assert status == 200 and "tokenwire_requests_running" in body
    assert w.stop() == 0
