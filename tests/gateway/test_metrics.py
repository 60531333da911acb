"""/metrics parses with prometheus-client's parser and moves when requests run; log lines carry the
request's bound fields and no prompt or completion text."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import urllib.request
from pathlib import Path

import redis.asyncio as aioredis
import structlog
from prometheus_client.parser import text_string_to_metric_families

from protocol import Params
from server.client import Client, collect
from server.logs import configure
from server.store.keys import Keys
from tests.gateway.conftest import Running, running_server


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_parse_and_move(server: Running) -> None:
    loop = asyncio.get_running_loop()
    before = await loop.run_in_executor(None, _scrape, server.port)
    c = await Client.connect(server.url)
    _, _, done, _ = await collect(c.chat("count me", id="m1", params=Params(max_tokens=7)))
    await collect(c.chat("count me", id="m1", params=Params(max_tokens=7)))  # idempotent attach
    after = await loop.run_in_executor(None, _scrape, server.port)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # The worker counts a step's tokens after its write to Redis returns, and a client may see the done
    # (read from Redis) first: wait for the last step's counters rather than race them.
    for _ in range(300):
        if delta("tokenwire_requests_finished_total", reason="length") >= 1:
            break
        await asyncio.sleep(0.05)
        after = await loop.run_in_executor(None, _scrape, server.port)
    await c.close()
    assert done is not None
    assert delta("tokenwire_tokens_generated_total") == done.offset == 7
    assert delta("tokenwire_chat_requests_total", outcome="new") == 1
    assert delta("tokenwire_chat_requests_total", outcome="attach") == 1
    assert delta("tokenwire_requests_finished_total", reason="length") == 1
    assert delta("tokenwire_ttft_seconds_count") == 1
    assert delta("tokenwire_inter_token_seconds_count") >= 1
    assert delta("tokenwire_redis_step_write_seconds_count") >= 1
    assert after[("tokenwire_connections_open", ())] >= 1
    for name in ("tokenwire_queue_depth", "tokenwire_requests_running", "tokenwire_streams_attached"):
        assert (name, ()) in after
    # The process's own resident memory (prometheus-client's standard process collector), what an
    # operator watches for the one copy of the weights the engine keeps.
    status = await loop.run_in_executor(None, Path("/proc/self/status").read_text)
    rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    assert 0.5 * rss < after[("process_resident_memory_bytes", ())] < 2 * rss


async def test_replies_cut_by_the_context_window_are_counted(server: Running) -> None:
    """tokenwire_requests_context_full_total counts the length ends whose length_reason is context, not
    those of max_tokens: what tells an operator that conversations outgrow the model."""
    loop = asyncio.get_running_loop()
    before = await loop.run_in_executor(None, _scrape, server.port)
    c = await Client.connect(server.url)
    one = [{"role": "user", "content": "hi"}]
    _, _, asked, _ = await collect(c.chat(messages=one, id="asked", params=Params(max_tokens=3)))
    server.engine.context = 5  # one prompt token and four of completion fill the fake's window
    _, _, cut, _ = await collect(c.chat(messages=one, id="cut", params=Params(max_tokens=50)))
    await c.close()
    assert asked is not None and asked.length_reason == "max_tokens"
    assert cut is not None and cut.length_reason == "context"

    def delta(after: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # The worker counts after its write returns; the client may see the done first (as above).
    for _ in range(300):
        after = await loop.run_in_executor(None, _scrape, server.port)
        if delta(after, "tokenwire_requests_finished_total", reason="length") >= 2:
            break
        await asyncio.sleep(0.05)
    assert delta(after, "tokenwire_requests_finished_total", reason="length") == 2
    assert delta(after, "tokenwire_requests_context_full_total") == 1


async def test_bad_frames_are_counted_by_code(server: Running) -> None:
    loop = asyncio.get_running_loop()
    before = await loop.run_in_executor(None, _scrape, server.port)
    c = await Client.connect(server.url)
    await c.send_raw(b"\xc1", encode=False)
    await c.recv()
    after = await loop.run_in_executor(None, _scrape, server.port)
    key = ("tokenwire_errors_total", (("code", "bad_frame"),))
    assert after[key] - before.get(key, 0.0) == 1
    await c.close()


async def test_request_log_lines_are_bound_and_carry_no_text(server: Running) -> None:
    buf = io.StringIO()
    handlers = logging.getLogger().handlers[:]
    configure("info", fmt="json")
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(file=buf), cache_logger_on_first_use=False
    )
    try:
        c = await Client.connect(server.url)
        await collect(c.chat("my secret prompt words", id="logged", params=Params(max_tokens=5)))
        await c.close()
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers[:] = handlers
    lines = [json.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
    mine = [x for x in lines if x.get("request_id") == "logged"]
    events = {x["event"] for x in mine}
    assert {"request.accepted", "request.started", "request.finished"} <= events
    for x in mine:
        assert x.get("session") and x.get("server") and "user" in x, x
    assert "secret prompt" not in buf.getvalue()


async def test_kv_cache_gauge_is_fed_by_the_batching_engine(
    redis: aioredis.Redis, redis_url: str, keys: Keys, tiny_model_dir: Path
) -> None:
    from server.engine.engine import BatchingEngine
    from server.engine.model import load_model

    engine = BatchingEngine(load_model(tiny_model_dir))
    async with running_server(redis, redis_url, keys, engine=engine) as server:
        loop = asyncio.get_running_loop()
        c = await Client.connect(server.url)
        _, _, done, _ = await collect(c.chat("keep my turn", params=Params(max_tokens=6, temperature=0)))
        assert done is not None
        # The session's KV stays cached for its next turn (prefix reuse), so the gauge stays above 0
        # until the worker's done has been written; wait for the engine's own figure, then compare.
        for _ in range(300):
            if engine.kv_usage() > 0:
                break
            await asyncio.sleep(0.05)
        after = await loop.run_in_executor(None, _scrape, server.port)
        await c.close()
    gauge = after[("tokenwire_kv_cache_usage_ratio", ())]
    assert 0 < gauge <= 1 and gauge == engine.kv_usage()
