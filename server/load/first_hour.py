"""What a newcomer waits for (issue 29), measured on the real default model for ``make bench``: how long
``tokenwire serve`` takes to say ready (the first start on a fresh data folder and later ones), its
resident memory once ready and idle, and how long after a ``kill -9`` and a restart a reply that was
streaming goes on (its first token after the restart, counted from the restart's spawn). The README's
figures come from here, with the machine they were measured on."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from protocol import Chat, Delta, Params, Resume
from server.client import Client
from server.load.idle import rss_kib

STARTS = 3


class _Serve:
    def __init__(self, data: Path, cache: Path) -> None:
        self.t0 = time.monotonic()
        env = {k: v for k, v in os.environ.items() if k != "TOKENWIRE_REDIS_URL"}
        env["TOKENWIRE_CACHE"] = str(cache)  # the converted model: empty before the first start
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", "0", "--data-dir", str(data)]
        self.stderr = data.parent / f"{data.name}-serve.stderr"
        data.parent.mkdir(parents=True, exist_ok=True)
        with self.stderr.open("a") as err:
            self.proc = subprocess.Popen(
                [*cmd, "--log-level", "warning"], stdout=subprocess.PIPE, stderr=err, text=True, env=env
            )
        self.url = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "tokenwire listening on " in line:
                self.url = line.split("tokenwire listening on ", 1)[1].split()[0]
            if line.startswith("tokenwire ready"):
                self.ready_s = time.monotonic() - self.t0
                return
        tail = self.stderr.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"tokenwire serve exited before it was ready: {tail}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


async def _resume_after_kill9(work: Path) -> dict[str, Any]:
    data = work / "kill9-data"
    first = _Serve(data, work / "start-cache")
    try:
        c = await Client.connect(first.url)
        assert c.welcome is not None
        token = c.welcome.session_token
        await c.send(
            Chat(id="long", content="Tell me a long story about a river.", params=Params(max_tokens=400))
        )
        offset = 0
        async for f in c.frames_for("long"):
            if isinstance(f, Delta):
                offset += f.n
                if offset >= 8:
                    break
        first.stop(signal.SIGKILL)
        c.ws.transport.abort()
    finally:
        first.stop(signal.SIGKILL)
    second = _Serve(data, work / "start-cache")
    try:
        c = await Client.connect(second.url, session_token=token)
        await c.send(Resume(id="long", offset=offset))
        async for f in c.frames_for("long"):
            if isinstance(f, Delta):
                break
        first_token_s = time.monotonic() - second.t0
        await c.close()
        return {
            "restart_ready_s": round(second.ready_s, 2),
            "first_token_after_restart_s": round(first_token_s, 2),
        }
    finally:
        second.stop()


def run_first_hour(work: Path) -> dict[str, Any]:
    data, cache = work / "start-data", work / "start-cache"
    shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    starts, rss = [], []
    for i in range(STARTS):  # the first as on a fresh machine (it converts the packaged model), then warm
        s = _Serve(data, cache)
        try:
            starts.append(round(s.ready_s, 2))
            time.sleep(5.0)  # idle, after whatever the start left running
            kib = rss_kib(s.proc.pid)
            rss.append(round(kib / 1024, 1) if kib else None)
        finally:
            s.stop()
        print(f"start {i + 1}: ready in {starts[-1]} s, {rss[-1]} MiB idle", flush=True)
    resume = asyncio.run(_resume_after_kill9(work))
    print(f"after kill -9: {resume}", flush=True)
    return {"first_start_s": starts[0], "later_starts_s": starts[1:], "idle_rss_mib": rss, **resume}
