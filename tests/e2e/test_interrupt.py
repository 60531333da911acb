"""Ctrl-C while a reply streams (issue 29): the terminal signals the whole process group, the embedded
Valkey included. The store must outlive the processes that drain into it, so the stop is clean (exit 130,
no traceback, nothing left running) and the interrupted reply resumes after a restart, nothing lost."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from protocol import Chat, Delta, Done, Message, Params, Resume
from server.client import Client, collect
from tests.e2e.serve_process import LISTEN, ServeProcess
from tests.e2e.test_cluster_command import _alive, _free_consecutive_ports, _until_ready

MESSAGES = (Message("user", "Tell me a long story about tokens"),)
# Greedy on a model without near ties, and no cache: the reference run generates the same text.
PARAMS = Params(max_tokens=400, temperature=0, cache=False)
NO_STORE_URL = {k: v for k, v in os.environ.items() if k not in ("TOKENWIRE_REDIS_URL", "REDIS_URL")}


async def _read_some(url: str) -> tuple[str, int, str]:
    """Start the long reply and read its first tokens: (session token, offset, text seen)."""
    c = await Client.connect(url)
    assert c.welcome is not None
    await c.send(Chat(id="long", messages=MESSAGES, params=PARAMS))
    seen, offset = "", 0
    async for f in c.frames_for("long"):
        if isinstance(f, Delta):
            seen, offset = seen + f.text, offset + f.n
            if offset >= 5:
                break
    token = c.welcome.session_token
    await c.close()
    return token, offset, seen


async def _resume_rest(url: str, token: str, offset: int, seen: str) -> None:
    """Resume after the restart: the rest follows on exactly, and the whole is an uninterrupted run's."""
    c = await Client.connect(url, session_token=token)
    try:
        await c.send(Resume(id="long", offset=offset))
        frames = [f async for f in c.frames_for("long")]
        end = frames[-1]
        assert isinstance(end, Done) and end.finish_reason in ("stop", "length"), frames[-3:]
        pos, rest = offset, ""
        for d in (f for f in frames if isinstance(f, Delta)):
            assert d.offset == pos  # no gap, no repeat
            pos, rest = pos + d.n, rest + d.text
        assert end.offset == pos
        reference, _, _, _ = await collect(
            c.chat(messages=[m.to_wire() for m in MESSAGES], id="ref", params=PARAMS)
        )
        assert seen + rest == reference
    finally:
        await c.close()


def _clean(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "terminate called" not in stderr, stderr[-3000:]


def _valkey_pid(data: Path) -> int:
    return int((data / "valkey" / "tokenwire-valkey.pid").read_text())


async def _restart_and_resume(args: list[str], data: Path, token: str, offset: int, seen: str) -> None:
    """``tokenwire serve`` again on the same data: the interrupted reply continues exactly."""
    again = ServeProcess(args, data, env=NO_STORE_URL)
    url = again.start()
    try:
        await _resume_rest(url, token, offset, seen)
    finally:
        assert again.stop() == 0  # SIGTERM: a supervisor's stop exits 0


async def _start_cluster(
    model: Path, data: Path, log: Path, *extra: str
) -> tuple[asyncio.subprocess.Process, str]:
    """``tokenwire cluster`` (1 gateway, 1 worker) in a session of its own, as a terminal runs it, until
    it says ready: (process, its gateway's URL)."""
    port = _free_consecutive_ports(1)
    with log.open("a") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.cli", "cluster", "--gateways", "1", "--workers", "1",
            "--port", str(port), "--data-dir", str(data), "--model", str(model), *extra,
            stdout=asyncio.subprocess.PIPE, stderr=err, start_new_session=True, env=NO_STORE_URL,
        )  # fmt: skip
    assert proc.stdout is not None
    await _until_ready(proc.stdout)
    return proc, f"ws://127.0.0.1:{port}/v1/ws"


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """A process started in its own session, and all it started, gone (a test's cleanup)."""
    if proc.returncode is None:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def test_ctrl_c_on_serve_mid_reply_exits_130_and_the_reply_resumes(
    peaky_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    # A short drain: the reply is handed back unfinished, the case where the store must still be there.
    args = ["--model", str(peaky_model_dir), "--drain-timeout", "0.5"]
    first = ServeProcess(args, data, env=NO_STORE_URL, new_session=True)
    url = first.start()
    try:
        token, offset, seen = await _read_some(url)
        valkey = _valkey_pid(data)
        assert first.proc is not None
        os.killpg(first.proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        assert await asyncio.to_thread(first.proc.wait, 30) == 130
        assert not _alive(valkey)  # stopped last, by the server, not left behind
    finally:
        first.stop()
    _clean(first.stderr_path.read_text())
    await _restart_and_resume(args, data, token, offset, seen)


async def test_ctrl_c_on_cluster_mid_reply_exits_130_and_the_reply_resumes(
    peaky_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "cluster-data"
    log1, log2 = tmp_path / "first.stderr", tmp_path / "second.stderr"
    proc, url = await _start_cluster(peaky_model_dir, data, log1)
    try:
        token, offset, seen = await _read_some(url)
        valkey = _valkey_pid(data)
        os.killpg(proc.pid, signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 60) == 130
        assert not _alive(valkey)
    finally:
        await _kill_group(proc)
    _clean(log1.read_text())
    # The terminal's SIGINT reached the children as well, and the cluster's SIGTERM followed it: that is
    # one stop for them, a drain, not a second signal that forces them out.
    assert "stop.forced" not in log1.read_text()

    proc, url = await _start_cluster(peaky_model_dir, data, log2)
    try:
        await _resume_rest(url, token, offset, seen)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        await _kill_group(proc)


async def _serve_until(
    args: list[str], tmp_path: Path, env: dict[str, str], prefix: str
) -> tuple[asyncio.subprocess.Process, list[str], Path]:
    """``tokenwire serve`` on a free port in its own session, read up to the stdout line starting with
    ``prefix``: (process, lines so far, its stderr's file)."""
    err_path = tmp_path / "serve.stderr"
    with err_path.open("w") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.cli", "serve", "--port", "0", "--data-dir", str(tmp_path / "data"),
            *args, stdout=asyncio.subprocess.PIPE, stderr=err, start_new_session=True, env=env,
        )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    while not lines or not lines[-1].startswith(prefix):
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line, f"serve exited early: {lines} {err_path.read_text()[-2000:]}"
        lines.append(line)
    return proc, lines, err_path


def _packaged_model_or_skip() -> Path:
    from server.engine.model import ModelNotFound, default_model_dir

    try:
        return default_model_dir()
    except ModelNotFound as exc:
        pytest.skip(str(exc))


def _converted(cache: Path) -> list[Path]:
    """The packaged model's conversions finished in ``cache`` (written to a temporary folder first)."""
    return list(cache.glob("*/model.safetensors"))


async def test_a_stop_while_the_model_loads_does_not_wait_for_the_load(tmp_path: Path) -> None:
    """SIGTERM before the model is loaded: the process exits at once, not once the load is done (the
    load's thread was joined at exit: 15 s and more for a first start that converts the GGUF). The
    proof: the conversion it was in the middle of never finished."""
    _packaged_model_or_skip()
    cache = tmp_path / "cache"  # empty: the packaged model's first load converts its GGUF, seconds of work
    env = {**NO_STORE_URL, "TOKENWIRE_CACHE": str(cache)}
    proc, _, err = await _serve_until([], tmp_path, env, "tokenwire listening")
    try:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        assert proc.stdout is not None
        assert "tokenwire ready" not in (await proc.stdout.read()).decode()
        assert not _converted(cache)  # it exited before the load it was in could finish
    finally:
        await _kill_group(proc)
    _clean(err.read_text())


async def test_a_stop_while_a_second_model_loads_drains_the_first(
    peaky_model_dir: Path, tmp_path: Path
) -> None:
    """Two models: the first serves while the second loads. A SIGTERM then drains the first's worker
    (its running reply is handed back: the drain timeout is short) and does not wait for the second."""
    packaged = _packaged_model_or_skip()
    cache = tmp_path / "cache"
    env = {**NO_STORE_URL, "TOKENWIRE_CACHE": str(cache)}
    args = ["--model", f"a={peaky_model_dir}", "--model", f"b={packaged}", "--drain-timeout", "0.2"]
    proc, lines, err = await _serve_until(args, tmp_path, env, "tokenwire ready: model a")
    try:
        url = next(m.group(1) for line in lines if (m := LISTEN.search(line)))
        await _read_some(url)  # model a's reply runs on; model b is still converting
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        assert not _converted(cache)
    finally:
        await _kill_group(proc)
    text = err.read_text()
    _clean(text)
    assert "worker.handed_back" in text  # model a's worker drained, instead of being stopped cold


async def test_a_second_ctrl_c_during_the_drain_exits_at_once(peaky_model_dir: Path, tmp_path: Path) -> None:
    """The first SIGINT drains (up to --drain-timeout, a minute here); a second one exits 130 without
    waiting, and stops the embedded Valkey too. The reply is resumable after a restart all the same."""
    data = tmp_path / "data"
    args = ["--model", str(peaky_model_dir), "--drain-timeout", "60"]
    first = ServeProcess(args, data, env=NO_STORE_URL, new_session=True)
    url = first.start()
    try:
        token, offset, seen = await _read_some(url)
        valkey = _valkey_pid(data)
        assert first.proc is not None
        first.proc.send_signal(signal.SIGINT)
        await asyncio.sleep(0.1)  # the reply is far from done: the drain is still waiting for it
        first.proc.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(first.proc.wait, 30) == 130
        assert not _alive(valkey)
    finally:
        first.stop()
    stderr = first.stderr_path.read_text()
    _clean(stderr)
    assert "stop.forced" in stderr
    await _restart_and_resume(args, data, token, offset, seen)


async def test_a_second_ctrl_c_on_cluster_stops_it_at_once(peaky_model_dir: Path, tmp_path: Path) -> None:
    """The first Ctrl-C drains (a minute allowed here); a second one kills the children and the cluster
    exits 130 at once, the embedded Valkey stopped last."""
    data, log = tmp_path / "cluster-data", tmp_path / "cluster.stderr"
    proc, url = await _start_cluster(peaky_model_dir, data, log, "--drain-timeout", "60")
    try:
        await _read_some(url)
        valkey = _valkey_pid(data)
        os.killpg(proc.pid, signal.SIGINT)
        await asyncio.sleep(0.1)  # the reply is far from done: the workers are still draining
        os.killpg(proc.pid, signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 130
        assert not _alive(valkey)
    finally:
        await _kill_group(proc)
    text = log.read_text()
    _clean(text)
    assert "tokenwire cluster: stopping at once" in text
