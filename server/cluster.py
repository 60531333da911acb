"""``tokenwire cluster``: a local cluster for demos and tests — one shared Redis (embedded Valkey unless
``--redis-url``; with ``--redis-shards N`` a local Valkey cluster of N masters), N gateway processes on
consecutive ports and M worker processes, all stopped together on Ctrl-C or SIGTERM (each gets SIGTERM
first, so gateways close with 1012 and workers drain)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from server.logs import resolve_format

# Set to "parent" in a child's environment: a second SIGINT/SIGTERM does not force that child out
# (app._stop_on_signals); the cluster that started it decides that.
SECOND_SIGNAL_ENV = "TOKENWIRE_SECOND_SIGNAL"
STOP_GRACE_S = 20.0  # past the workers' drain: for their hand-back, the gateways' 1012s and exits


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _spawn(name: str, args: list[str], redis_url: str, log_format: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "server.cli", *args, "--log-format", log_format]
    # The store's URL (it may hold a password) goes in the environment, not the command line other
    # local users can read in ps. stdout is read for the "listening"/"ready" lines. stderr (the logs):
    # readable lines are relayed with the child's name in front, as its stdout lines are; JSON lines go
    # straight to ours, each naming its process (a prefix would make them invalid JSON).
    env = {
        **os.environ,
        "TOKENWIRE_REDIS_URL": redis_url,
        "TOKENWIRE_LOG_PROCESS": name,
        SECOND_SIGNAL_ENV: "parent",
    }
    stderr = subprocess.PIPE if log_format == "console" else None
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1, env=env)


def _relay(name: str, lines: IO[str], out: IO[str], ready: threading.Event | None = None) -> None:
    """A child's lines onto ours with its name in front: its stdout (``ready`` set by its listening or
    ready line) or its readable logs."""
    for line in lines:
        print(f"[{name}] {line.rstrip()}", file=out, flush=True)
        if ready is not None and line.startswith(("tokenwire listening", "tokenwire ready")):
            ready.set()


def run_cluster(args: argparse.Namespace) -> int:
    from server.argtypes import redis_url_problem
    from server.store.embedded import EmbeddedValkey, EmbeddedValkeyError
    from server.store.valkey_cluster import EmbeddedValkeyCluster, ValkeyClusterError

    valkey: EmbeddedValkey | EmbeddedValkeyCluster | None = None
    shards = getattr(args, "redis_shards", 0)
    url = args.redis_url or os.environ.get("TOKENWIRE_REDIS_URL")
    if url and (problem := redis_url_problem(url)) is not None:
        print(f"tokenwire cluster: $TOKENWIRE_REDIS_URL: {problem}", file=sys.stderr)
        return 2
    if shards < 0:
        print("tokenwire cluster: --redis-shards must be 1 or more (0: one embedded Valkey)", file=sys.stderr)
        return 2
    last = args.port + args.gateways - 1
    if args.port and last > 65535:
        # Checked before anything starts: the gateways take --port, --port + 1, ...
        print(
            f"tokenwire cluster: --port {args.port} with --gateways {args.gateways} needs ports up to "
            f"{last}; the last port is 65535",
            file=sys.stderr,
        )
        return 2
    if shards and args.redis_url:
        print(
            "tokenwire cluster: --redis-shards starts its own Valkey cluster; drop --redis-url",
            file=sys.stderr,
        )
        return 2
    if shards:
        # A Redis Cluster of its own: the processes find out from the URL (INFO cluster) and partition
        # the work queue (server/store/keys.py).
        valkey = EmbeddedValkeyCluster(shards)
        try:
            url = valkey.start()
        except ValkeyClusterError as exc:
            print(f"tokenwire cluster: {exc}", file=sys.stderr)
            return 2
        print(
            f"tokenwire cluster: Valkey cluster of {shards} masters on 127.0.0.1 ports "
            f"{', '.join(str(n.port) for n in valkey.nodes)}",
            flush=True,
        )
    elif not url:
        valkey = EmbeddedValkey(Path(args.data_dir or os.environ.get("TOKENWIRE_DATA") or ".tokenwire"))
        try:
            url = valkey.start()
        except EmbeddedValkeyError as exc:
            print(f"tokenwire cluster: {exc}", file=sys.stderr)
            return 2
    common = [
        "--key-prefix",
        args.key_prefix,
        "--lease-ttl",
        str(args.lease_ttl),
        "--retention",
        str(getattr(args, "retention", 24 * 3600.0)),
        "--session-ttl",
        str(getattr(args, "session_ttl", 24 * 3600.0)),
        "--history-max-messages",
        str(getattr(args, "history_max_messages", 64)),
        "--history-max-bytes",
        str(getattr(args, "history_max_bytes", 1 << 20)),
        "--log-level",
        args.log_level,
    ]
    procs: dict[str, subprocess.Popen[str]] = {}
    log_format = resolve_format(args.log_format)  # the children's stderr is a pipe: decided here, once
    cpus = sorted(os.sched_getaffinity(0))
    readies: list[threading.Event] = []
    relays: list[threading.Thread] = []  # the children's log relays: their last lines come out before ours
    stopping = threading.Event()
    failure = ""  # said last, once every child has stopped
    signals: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        if stopping.is_set():
            # A second signal while the children drain: stop them at once. They leave that to us
            # (SECOND_SIGNAL_ENV): a terminal's Ctrl-C reaches them as well as us, and our own SIGTERM
            # after it would otherwise count as their second.
            with contextlib.suppress(RuntimeError):  # a handler may interrupt our own print: reentrant
                print("tokenwire cluster: stopping at once", file=sys.stderr, flush=True)
            for p in procs.values():
                if p.poll() is None:
                    with contextlib.suppress(OSError):
                        p.kill()
        signals.append(signum)
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for i in range(args.workers):
            wargs = ["worker", *common, "--name", f"worker-{i}", "--threads", str(args.threads_per_worker)]
            wargs += ["--log-flush-ms", str(getattr(args, "log_flush_ms", 0.0))]
            wargs += ["--drain-timeout", str(args.drain_timeout)]
            wargs += ["--prompt-sharing", getattr(args, "prompt_sharing", "public")]
            for spec in args.model or ():
                wargs += ["--model", spec]
            procs[f"worker-{i}"] = proc = _spawn(f"worker-{i}", wargs, url, log_format)
            if args.pin_workers:
                # Set before the child has imported torch, so its every thread inherits the one CPU.
                os.sched_setaffinity(proc.pid, {cpus[i % len(cpus)]})
        for i in range(args.gateways):
            gargs = [
                "gateway",
                *common,
                "--name",
                f"gateway-{i}",
                "--host",
                args.host,
                "--port",
                str(args.port + i),
            ]
            procs[f"gateway-{i}"] = _spawn(f"gateway-{i}", gargs, url, log_format)
        for name, proc in procs.items():
            ev = threading.Event()
            readies.append(ev)
            assert proc.stdout is not None
            threading.Thread(target=_relay, args=(name, proc.stdout, sys.stdout, ev), daemon=True).start()
            if proc.stderr is not None:
                t = threading.Thread(target=_relay, args=(name, proc.stderr, sys.stderr), daemon=True)
                t.start()
                relays.append(t)
        while not stopping.is_set() and not all(ev.is_set() for ev in readies):
            failed = [(n, p.returncode) for n, p in procs.items() if p.poll() is not None]
            if failed:
                # One child that cannot start (a port in use, no model) fails the whole cluster: a
                # half-started cluster that never says "ready" helps nobody. Its own line said why.
                failure = f"tokenwire cluster: {failed[0][0]} failed to start (exit {failed[0][1]}); stopped"
                return 2
            time.sleep(0.1)
        if all(ev.is_set() for ev in readies):
            urls = ", ".join(f"ws://{args.host}:{args.port + i}/v1/ws" for i in range(args.gateways))
            print(
                f"tokenwire cluster ready: {_count(args.gateways, 'gateway')} ({urls}), "
                f"{_count(args.workers, 'worker')}",
                flush=True,
            )
        while not stopping.is_set():
            for name, p in procs.items():
                if p.poll() is not None and not getattr(p, "_reported", False):
                    print(f"tokenwire cluster: {name} exited with {p.returncode}", flush=True)
                    p._reported = True  # type: ignore[attr-defined]
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + args.drain_timeout + STOP_GRACE_S
        for p in procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for t in relays:
            t.join(2.0)
        # The store stops last (it runs in its own session, out of Ctrl-C's reach): the workers drain
        # into it.
        if valkey is not None:
            valkey.stop()
        if failure:
            print(failure, file=sys.stderr, flush=True)
    return 130 if signal.SIGINT in signals else 0
