"""Start the real ``tokenwire serve`` as a subprocess on port 0 and wait until it is ready."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

LISTEN = re.compile(r"tokenwire listening on (ws://\S+)")


class ServeProcess:
    """``tokenwire serve`` (or ``gateway`` / ``worker`` with ``command``) as a child process."""

    def __init__(
        self,
        args: list[str],
        data_dir: Path,
        env: dict[str, str] | None = None,
        command: str = "serve",
        *,
        new_session: bool = False,
    ) -> None:
        # new_session: a process group of its own, which a test can signal whole as a terminal's Ctrl-C does
        self.args = args
        self.command = command
        self.data_dir = data_dir
        self.env = {**os.environ, **(env or {})}
        self.new_session = new_session
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.stderr_path = data_dir / f"{command}-{id(self)}.stderr"

    def start(self, timeout: float = 120.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "server.cli", self.command]
        if self.command == "serve":
            cmd += ["--port", "0", "--data-dir", str(self.data_dir)]
        elif self.command == "gateway":
            cmd += ["--port", "0"]
        cmd += self.args
        self._stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=self.env,
            start_new_session=self.new_session,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(
                    f"serve exited ({self.proc.poll()}): {self.stderr_path.read_text()[-3000:]}"
                )
            m = LISTEN.search(line)
            if m:
                self.url = m.group(1)
            if line.startswith("tokenwire ready") or (self.command == "gateway" and self.url):
                return self.url
        raise TimeoutError(f"serve not ready in {timeout}s: {self.stderr_path.read_text()[-3000:]}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        return self.proc.returncode
