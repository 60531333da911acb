"""``tokenwire chat`` in a real terminal (a pty), as a person uses it: line editing and history, an empty
line that does not quit, /help /set /settings /new, Ctrl-C that stops the reply streaming (the server
cancels it) and returns to the prompt, and Ctrl-C or Ctrl-D at the prompt that quit cleanly.

The replies come from an engine that never finishes on its own, so the reply being stopped cannot end
before Ctrl-C reaches it; every step waits for what the terminal shows, never for a fixed time."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator
from pathlib import Path

import redis.asyncio as aioredis

from server.engine.api import GenerationRequest, StepOutput
from server.store.keys import Keys
from tests.fakes import FakeEngine
from tests.gateway.conftest import running_server

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][AB0-2]|\x1b[=>]|\r")
PROMPT = r"(?m)^>"  # prompt_toolkit draws "> " with cursor moves, so the space may not be a space
WAIT_S = 60.0  # generous bound for a busy machine; each wait ends as soon as its text appears


class EndlessEngine(FakeEngine):
    """One word per step, forever: only a cancel ends a reply. Records what it was asked and cancelled."""

    def __init__(self) -> None:
        super().__init__(step_s=0.02)
        self.asked: list[str] = []
        self.dropped: list[
            str
        ] = []  # a key may repeat: the worker cancels again any output it no longer holds

    def _intake(self, req: GenerationRequest, outs: list[StepOutput]) -> None:
        self.asked.append(req.messages[-1]["content"] if req.messages else "")
        super()._intake(req, outs)

    def _drop(self, key: str) -> None:
        self.dropped.append(key)
        super()._drop(key)

    def _step(self) -> list[StepOutput]:
        outs = []
        for key, run in list(self._runs.items()):
            outs.append(StepOutput(key, run.offset, 1, f" w{run.offset}", prompt_tokens=1))
            run.offset += 1
        time.sleep(self.step_s)
        return outs


class Terminal:
    """A child process on a pty of its own (its controlling terminal: Ctrl-C there is SIGINT)."""

    def __init__(self, args: list[str], home: Path) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x18\x00\x78\x00\x00\x00\x00\x00")  # 24 rows, 120 cols

        def own_terminal() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "TERM": "xterm-256color",
            "TOKENWIRE_CACHE": str(home),
            "NO_COLOR": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=ROOT,
            preexec_fn=own_terminal,  # setsid + controlling tty, before exec
        )
        os.close(slave)
        self.master = master
        os.set_blocking(master, False)
        self.raw = b""
        self.seen = 0  # how much of the screen text earlier waits consumed
        self._data = asyncio.Event()
        asyncio.get_running_loop().add_reader(master, self._read)

    def _read(self) -> None:
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            asyncio.get_running_loop().remove_reader(self.master)
        self.raw += chunk
        self._data.set()

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace"))

    async def expect(self, pattern: str) -> re.Match[str]:
        """Wait until ``pattern`` appears in the screen text after the previous match."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + WAIT_S
        while True:
            m = rx.search(self.text, self.seen)
            if m:
                self.seen = m.end()
                return m
            left = deadline - time.monotonic()
            assert left > 0, f"{pattern!r} never appeared; the terminal showed:\n{self.text[-3000:]}"
            self._data.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._data.wait(), min(left, 1.0))

    def send(self, data: str) -> None:
        os.write(self.master, data.encode())

    async def exit_code(self) -> int:
        deadline = time.monotonic() + WAIT_S
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"chat did not exit:\n{self.text[-3000:]}"
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def close(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self.master)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


async def _open(url: str, home: Path) -> Terminal:
    term = Terminal(["chat", url], home)
    try:
        await term.expect(r"connected to .*/help for commands")
        await term.expect(PROMPT)
    except BaseException:
        term.close()
        raise
    return term


@contextlib.asynccontextmanager
async def chat_terminal(url: str, home: Path) -> AsyncIterator[Terminal]:
    term = await _open(url, home)
    try:
        yield term
    finally:
        term.close()


async def _until(cond: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_chat_in_a_terminal(redis: aioredis.Redis, redis_url: str, keys: Keys, tmp_path: Path) -> None:
    engine = EndlessEngine()
    async with running_server(redis, redis_url, keys, engine=engine) as server:
        async with chat_terminal(server.url, tmp_path) as term:
            term.send("\r")  # an empty line does not quit: the prompt comes back
            await term.expect(PROMPT)
            assert term.proc.poll() is None

            term.send("/help\r")
            await term.expect(r"/settings +show the connection")
            await term.expect(PROMPT)
            term.send("/set temperature 0.5\r")
            await term.expect(r"temperature = 0\.5")
            term.send("/settings\r")
            await term.expect(r"session +\S+")
            await term.expect(r"temperature +0\.5")
            await term.expect(r"max_tokens +\d+ \(server default\)")  # the server's value (/config.json)
            term.send("/set temperature 9\r")  # out of range: refused now, not at the next send
            await term.expect(r"temperature.*\(unchanged\)")
            await term.expect(PROMPT)

            # A reply streams; Ctrl-C stops it (the server cancels it) and the prompt returns.
            term.send("tell me a story\r")
            await term.expect(r" w3 w4")
            term.send("zzq")  # typed during the reply: not echoed into the middle of it
            await term.expect(r" w\d+ w\d+ w\d+")
            term.send("\x03")
            stopped = await term.expect(r"\[stopped\]")
            assert "zzq" not in term.text[: stopped.start()]
            await term.expect(PROMPT)
            term.send("\x7f\x7f\x7f")  # the typed-ahead text waits at the prompt: erase it
            await _until(lambda: len(set(engine.dropped)) == 1, "the server never cancelled the reply")
            assert engine.asked == ["tell me a story"]
            assert term.proc.poll() is None, "Ctrl-C during a reply must not end the session"

            # Line editing: type, move left, insert; the server gets the edited line, not escape codes.
            term.send("ab\x1b[DX\r")
            await term.expect(r" w3 w4")
            term.send("\x03")
            await term.expect(r"\[stopped\]")
            await _until(lambda: len(set(engine.dropped)) == 2, "the second reply was not cancelled")
            assert engine.asked[-1] == "aXb"

            # History: Up twice recalls the first question.
            await term.expect(PROMPT)
            term.send("\x1b[A\x1b[A\r")
            await term.expect(r" w3 w4")
            term.send("\x03")
            await term.expect(r"\[stopped\]")
            await _until(lambda: len(set(engine.dropped)) == 3, "the third reply was not cancelled")
            assert engine.asked[-1] == "tell me a story"

            term.send("/new\r")
            await term.expect(r"\[new conversation: session \S+\]")
            await term.expect(PROMPT)

            term.send("\x04")  # Ctrl-D at the prompt quits cleanly
            assert await term.exit_code() == 0
            assert "Traceback" not in term.text
        assert (tmp_path / "chat-history").read_text().count("tell me a story") == 2


async def test_ctrl_c_at_the_prompt_quits_cleanly(
    redis: aioredis.Redis, redis_url: str, keys: Keys, tmp_path: Path
) -> None:
    async with running_server(redis, redis_url, keys, engine=EndlessEngine()) as server:
        term = await _open(server.url, tmp_path)
        try:
            term.send("\x03")
            assert await term.exit_code() == 0
            assert "Traceback" not in term.text
        finally:
            term.close()


async def test_exit_command_quits(redis: aioredis.Redis, redis_url: str, keys: Keys, tmp_path: Path) -> None:
    async with running_server(redis, redis_url, keys, engine=EndlessEngine()) as server:
        term = await _open(server.url, tmp_path)
        try:
            term.send("/exit\r")
            assert await term.exit_code() == 0
        finally:
            term.close()
