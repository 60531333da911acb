"""``tokenwire cluster`` starts gateways on consecutive ports and workers, and stops all of it on Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import uuid
from pathlib import Path

from protocol import Params
from server.client import Client, collect
from tests.conftest import delete_prefix


def _free_consecutive_ports(n: int) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        # The stack closes every socket, the one whose bind failed included (a leaked socket is a
        # ResourceWarning, which this suite treats as an error: it failed a fresh-clone run once).
        with contextlib.ExitStack() as stack:
            try:
                for i in range(n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", base + i))
            except OSError:
                continue
            return base
    raise RuntimeError("no free consecutive ports")


async def test_cluster_command_serves_on_every_gateway_and_stops_on_ctrl_c(
    tiny_model_dir: Path, redis_url: str
) -> None:
    port = _free_consecutive_ports(2)
    prefix = f"twtest:clustercmd:{uuid.uuid4().hex[:8]}:"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server.cli", "cluster", "--gateways", "2", "--workers", "2",
        "--port", str(port), "--redis-url", redis_url, "--key-prefix", prefix, "--model", str(tiny_model_dir),
        "--pin-workers", "--log-format", "console",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert proc.stderr is not None
    logs = asyncio.create_task(proc.stderr.read())
    try:
        assert proc.stdout is not None
        lines = await _until_ready(proc.stdout)
        assert f"ws://127.0.0.1:{port}/v1/ws" in lines[-1] and f"ws://127.0.0.1:{port + 1}/v1/ws" in lines[-1]
        assert sum("tokenwire ready" in x for x in lines) == 2  # both workers
        for p in (port, port + 1):
            c = await Client.connect(f"ws://127.0.0.1:{p}/v1/ws")
            _, _, done, errors = await collect(c.chat("hi", params=Params(max_tokens=5, seed=1)))
            assert errors == [] and done is not None and done.offset >= 1
            await c.close()
        children = _children(proc.pid)
        assert len(children) == 4
        # --pin-workers: each worker (every thread of it) on one CPU, round robin; gateways unpinned.
        ours = sorted(os.sched_getaffinity(0))
        pinned = {}
        for c in children:
            argv = (Path("/proc") / str(c) / "cmdline").read_bytes().split(b"\0")
            cpus = os.sched_getaffinity(c)
            if b"worker" in argv:
                name = argv[argv.index(b"--name") + 1].decode()
                pinned[name] = cpus
                for t in (Path("/proc") / str(c) / "task").iterdir():
                    assert os.sched_getaffinity(int(t.name)) == cpus
            else:
                assert cpus == set(ours)
        assert pinned == {f"worker-{i}": {ours[i % len(ours)]} for i in range(2)}
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 60) == 130  # interrupted, as shells expect
        assert not [c for c in children if _alive(c)]
        # One format: every child's log line readable (--log-format console, though its stderr is a
        # pipe) and named like its stdout lines.
        err = (await asyncio.wait_for(logs, 30)).decode().splitlines()
        names = tuple(f"[{kind}-{i}] " for kind in ("gateway", "worker") for i in range(2))
        assert [x for x in err if x and not x.startswith((*names, "tokenwire cluster"))] == [], err
        assert any(x.startswith("[worker-0] ") and "[info     ] model.loaded" in x for x in err), err
        assert not any(x.lstrip("[]-abcdefghijklmnopqrstuvwxyz0123456789 ").startswith("{") for x in err)
    finally:
        logs.cancel()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # exited, not yet reaped: the error above counts
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        delete_prefix(redis_url, prefix)


async def _until_ready(stdout: asyncio.StreamReader) -> list[str]:
    """The cluster command's stdout lines up to its ready line (the last one)."""
    lines: list[str] = []
    while not lines or not lines[-1].startswith("tokenwire cluster ready"):
        line = (await asyncio.wait_for(stdout.readline(), 120)).decode()
        assert line, f"cluster exited early: {lines}"
        lines.append(line)
    return lines


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_cluster_command_with_redis_shards_runs_on_its_own_valkey_cluster(tiny_model_dir: Path) -> None:
    """--redis-shards 3: a 3-master Valkey cluster of its own, which gateway and worker find out about
    from the URL alone; a chat works; Ctrl-C stops the processes and the cluster's nodes."""
    port = _free_consecutive_ports(1)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server.cli", "cluster", "--gateways", "1", "--workers", "1",
        "--port", str(port), "--redis-shards", "3", "--model", str(tiny_model_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        env={k: v for k, v in os.environ.items() if k != "TOKENWIRE_REDIS_URL"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = await _until_ready(proc.stdout)
        [said] = [x for x in lines if "Valkey cluster of 3 masters" in x]
        node_ports = [int(p) for p in said.rsplit("ports", 1)[1].replace(",", " ").split()]
        assert len(node_ports) == 3
        children = _children(proc.pid)
        nodes = [c for c in children if b"valkey" in (Path("/proc") / str(c) / "cmdline").read_bytes()]
        assert len(nodes) == 3
        c = await Client.connect(f"ws://127.0.0.1:{port}/v1/ws")
        _, _, done, errors = await collect(c.chat("hi", params=Params(max_tokens=5, seed=1)))
        assert errors == [] and done is not None and done.offset >= 1
        await c.close()
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 60) == 130  # interrupted, as shells expect
        assert not [c for c in children if _alive(c)]  # the gateway, the worker and the 3 nodes
        for p in node_ports:
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", p)) != 0  # nothing listens there any more
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # exited, not yet reaped: the error above counts
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
