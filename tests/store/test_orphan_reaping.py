"""The embedded Valkey: an orphan left by a killed server on the same data folder is stopped before a new
one starts, and nothing else is (a pid file may name a reused pid, even another Valkey's)."""

from __future__ import annotations

import os
from pathlib import Path

import redis

from server.store.embedded import EmbeddedValkey


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
        assert orphan is not None and orphan.wait(5) is not None  # stopped by the reaping; now reaped
        assert not _alive(orphan_pid) and _alive(pid)
        assert redis.Redis.from_url(again.url).ping()
    finally:
        if mine is not None:
            mine.stop()
        other.stop()
