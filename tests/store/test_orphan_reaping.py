"""The embedded Valkey: an orphan left by a killed server on the same data folder is stopped before a new
one starts, and nothing else is (a pid file may name a reused pid, even another Valkey's)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import redis

from server.store.embedded import EmbeddedValkey, exited


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_orphan_reaping_touches_only_the_valkey_of_this_folder(tmp_path: Path) -> None:
    other = EmbeddedValkey(tmp_path / "other", persist=False)
    other.start()
    mine: EmbeddedValkey | None = None
    try:
        pid = int(other._pidfile.read_text())
        # Our folder's pid file names the other folder's Valkey (the pid was reused). Before: killed,
        # because its command line says "valkey".
        ours = tmp_path / "ours"
        (ours / "valkey").mkdir(parents=True)
        (ours / "valkey" / "tokenwire-valkey.pid").write_text(str(pid))
        mine = EmbeddedValkey(ours, persist=False)
        mine.start()
        assert _alive(pid)
        assert redis.Redis.from_url(other.url).ping()
        # A Valkey left running on our own folder (its server was killed) is stopped before ours starts.
        orphan_pid = int(mine._pidfile.read_text())
        orphan, mine._proc = mine._proc, None  # forget it, as a SIGKILLed server would
        again = EmbeddedValkey(ours, persist=False)
        again.start()
        mine = again
        # Stopped by the reaping with SIGTERM (a clean exit, its AOF flushed), not SIGKILL; reaped here.
        assert orphan is not None and orphan.wait(5) == 0
        assert not _alive(orphan_pid) and _alive(pid)
        assert redis.Redis.from_url(again.url).ping()
    finally:
        if mine is not None:
            mine.stop()
        other.stop()


def test_a_zombie_counts_as_exited() -> None:
    # An orphan that was this process's own child stays a zombie after it exits until it is reaped; the
    # reaping must not wait on it (it used to wait 5 s after SIGTERM, then 5 s after SIGKILL).
    live = subprocess.Popen(["sleep", "30"])
    done = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while _alive(done.pid):  # until it has exited (a zombie: _alive says no)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert exited(done.pid) and not exited(live.pid)
    finally:
        live.kill()
        live.wait()
        done.wait()
    assert exited(done.pid)  # reaped: gone
