"""The real ``tokenwire serve`` process, real model, real client, real socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import JSON_SUBPROTOCOL, Params
from server.client import Client, collect
from tests.conftest import delete_prefix
from tests.e2e.serve_process import ServeProcess


def _check_stream(text: str, deltas: list, done) -> None:  # type: ignore[no-untyped-def,type-arg]
    assert done is not None
    assert len(deltas) >= 2
    pos = 0
    for d in deltas:
        assert d.offset == pos
        pos += d.n
    assert done.offset == pos
    assert done.usage.completion_tokens == pos and done.usage.prompt_tokens > 0
    assert text


@pytest.fixture
def tiny_server(tiny_model_dir: Path, tmp_path: Path, redis_url: str) -> Iterator[str]:
    prefix = f"twtest:e2e:{tmp_path.name}:"
    p = ServeProcess(
        ["--model", str(tiny_model_dir), "--redis-url", redis_url, "--key-prefix", prefix], tmp_path
    )
    try:
        yield p.start()
    finally:
        assert p.stop() == 0, p.stderr_path.read_text()[-2000:]
        delete_prefix(redis_url, prefix)


async def test_serve_tiny_model_streams_over_both_subprotocols(tiny_server: str) -> None:
    for seed, sub in enumerate(("tokenwire.v1.msgpack", JSON_SUBPROTOCOL)):
        c = await Client.connect(tiny_server, subprotocol=sub)
        text, deltas, done, errors = await collect(
            c.chat("Hello", params=Params(max_tokens=16, temperature=0.8, seed=seed))
        )
        assert errors == []
        _check_stream(text, deltas, done)
        await c.close()


@pytest.mark.slow
async def test_serve_default_model_answers_paris(tmp_path: Path) -> None:
    """The acceptance path: default SmolLM2 from the PyPI GGUF, embedded Valkey, streamed answer."""
    p = ServeProcess([], tmp_path)
    url = p.start(timeout=240)
    try:
        c = await Client.connect(url)
        text, deltas, done, errors = await collect(
            c.chat("What is the capital of France?", params=Params(temperature=0, max_tokens=48))
        )
        assert errors == []
        _check_stream(text, deltas, done)
        assert done is not None and done.finish_reason == "stop"
        assert "Paris" in text
        await c.close()
    finally:
        assert p.stop() == 0, p.stderr_path.read_text()[-2000:]
