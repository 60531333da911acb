"""``tokenwire serve`` and a cluster's ``worker`` with two models (``--model NAME=DIR`` twice, two real tiny
Llama folders): both are listed (welcome.models, GET /v1/models) and a chat naming one is served by it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import Accepted, Done, Error, Params
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
