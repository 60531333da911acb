"""``tokenwire serve`` and a cluster's ``worker`` with two models (``--model NAME=DIR`` twice, two real tiny
Llama folders): both are listed (welcome.models, GET /v1/models) and a chat naming one is served by it."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import Accepted, Cancel, Chat, Done, Error, Message, Params
from server.client import Client
from tests.conftest import delete_prefix
from tests.e2e.serve_process import ServeProcess


def _http(ws_url: str, path: str) -> tuple[int, bytes]:
    url = ws_url.replace("ws://", "http://").replace("/v1/ws", path)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _until(check: object, what: str, timeout_s: float = 120.0) -> None:
    """Wait for a condition of a child process (loading two models takes a while on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _models(ws_url: str) -> list[str]:
    status, body = _http(ws_url, "/v1/models")
    return [m["id"] for m in json.loads(body)["data"]] if status == 200 else []


@pytest.fixture
def prefix(tmp_path: Path, redis_url: str) -> Iterator[str]:
    p = f"twtest:e2e-models:{tmp_path.name}:"
    yield p
    delete_prefix(redis_url, p)


async def _chat_on(url: str, model: str | None) -> str | None:
    """Chat once naming ``model``; the model ``accepted`` says serves it (after checking it ran to done)."""
    c = await Client.connect(url)
    try:
        served: str | None = None
        async for f in c.chat("hello", params=Params(max_tokens=3, model=model)):
            assert not isinstance(f, Error), f
            if isinstance(f, Accepted):
                served = f.model
            if isinstance(f, Done):
                return served
        raise AssertionError("no done")
    finally:
        await c.close()


async def test_serve_two_models(
    tiny_model_dir: Path, peaky_model_dir: Path, tmp_path: Path, redis_url: str, prefix: str
) -> None:
    p = ServeProcess(
        [
            *["--model", f"big={tiny_model_dir}", "--model", f"light={peaky_model_dir}"],
            *["--fallback", "big=light", "--redis-url", redis_url, "--key-prefix", prefix],
        ],
        tmp_path,
    )
    url = p.start()
    try:
        _until(lambda: _http(url, "/readyz")[0] == 200, "both models loaded")
        assert _models(url) == ["big", "light", "default"]
        c = await Client.connect(url)
        assert c.welcome is not None and c.welcome.models == ("big", "light")
        await c.close()
        assert await _chat_on(url, None) == "big"
        assert await _chat_on(url, "light") == "light"
        config = json.loads(_http(url, "/config.json")[1])
        assert config["model"] == "big" and config["models"] == ["big", "light"]
    finally:
        assert p.stop() == 0, p.stderr_path.read_text()[-2000:]


async def test_cluster_gateway_lists_the_models_its_workers_hold(
    tiny_model_dir: Path, peaky_model_dir: Path, tmp_path: Path, redis_url: str, prefix: str
) -> None:
    store = ["--redis-url", redis_url, "--key-prefix", prefix]
    worker = ServeProcess(
        [*store, "--model", f"big={tiny_model_dir}", "--model", f"light={peaky_model_dir}"],
        tmp_path / "w",
        command="worker",
    )
    gateway = ServeProcess(store, tmp_path / "g", command="gateway")
    url = gateway.start()
    try:
        assert _models(url) == ["default"]  # no worker yet: only the alias
        worker.start()
        _until(lambda: _models(url) == ["big", "light", "default"], "the worker's models listed")
        assert await _chat_on(url, "light") == "light"
        assert await _chat_on(url, None) == "big"
    finally:
        assert worker.stop() == 0, worker.stderr_path.read_text()[-2000:]
        assert gateway.stop() == 0, gateway.stderr_path.read_text()[-2000:]


async def test_the_readmes_fallback_command_moves_chats_past_its_trigger(
    tiny_model_dir: Path, peaky_model_dir: Path, tmp_path: Path, redis_url: str, prefix: str
) -> None:
    """README "Several models": ``--fallback smol=tiny --degrade-queue-depth 8``. Past 8 chats waiting
    for smol, new chats are accepted by tiny (issue 29: --fallback alone never moved one)."""
    p = ServeProcess(
        [
            *["--model", f"smol={tiny_model_dir}", "--model", f"tiny={peaky_model_dir}"],
            *["--fallback", "smol=tiny", "--degrade-queue-depth", "8"],
            *["--redis-url", redis_url, "--key-prefix", prefix],
        ],
        tmp_path,
    )
    url = p.start()
    clients: list[Client] = []
    try:
        _until(lambda: _http(url, "/readyz")[0] == 200, "both models loaded")
        # 96 long chats on 6 connections (a connection's burst is 20 chats): the worker runs 64 at once,
        # the rest wait in smol's queue, well past 8, for seconds (each reply is 400 tokens).
        clients = [await Client.connect(url) for _ in range(7)]
        load = Params(max_tokens=400, temperature=0.0, cache=False)
        story = (Message("user", "tell me a long story"),)
        for i, c in enumerate(clients[:6]):
            for j in range(16):  # messages mode: a session's content-mode turns would run one by one
                await c.send(Chat(id=f"load-{i}-{j}", messages=story, params=load))
        first = [await _accepted(c, 16) for c in clients[:6]]
        # The very first chat found smol's queue empty. (Later ones of the load may already move, once
        # the gateway reads the depth again after a second: on a slow machine sending them takes that.)
        assert first[0][0] == "smol", first
        await asyncio.sleep(1.2)  # the gateway reads the queue depth again after a second
        late = clients[6]
        hello = (Message("user", "hello"),)
        for j in range(4):
            await late.send(Chat(id=f"late-{j}", messages=hello, params=Params(max_tokens=3, cache=False)))
        moved = await _accepted(late, 4)
        assert "tiny" in moved, moved
        # The load is done with: cancelled, and read to its ends, so that the server stops at once and
        # the connections close without deltas queued behind their close handshakes.
        for i, c in enumerate(clients[:6]):
            for j in range(16):
                await c.send(Cancel(id=f"load-{i}-{j}"))
        for c in clients[:6]:
            await _dones(c, 16)
    finally:
        for c in clients:
            await c.close()
        assert p.stop() == 0, p.stderr_path.read_text()[-2000:]


async def _accepted(c: Client, n: int) -> list[str | None]:
    """The models of the next ``n`` ``accepted`` frames on ``c`` (other frames skipped)."""
    models: list[str | None] = []
    while len(models) < n:
        f = await asyncio.wait_for(c.recv(), 60)
        assert not isinstance(f, Error), f
        if isinstance(f, Accepted):
            models.append(f.model)
    return models


async def _dones(c: Client, n: int) -> None:
    """Read ``c``'s frames until ``n`` of its requests have ended (``done``)."""
    ended = 0
    while ended < n:
        f = await asyncio.wait_for(c.recv(), 60)
        ended += isinstance(f, Done)
