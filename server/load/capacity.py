"""``tokenwire capacity``: how many gateways, workers and Redis shards a stated load needs.

Sizing is arithmetic on unit costs measured on this machine by the benchmarks (``make bench`` writes each
section's raw JSON to ``.bench/section-NAME.json``):

* **idle** (``tokenwire load --idle-only --server-pid``): a gateway's memory and CPU per held connection;
* **store** (``--scenario store-cost`` against a 1 + 1 cluster): Redis commands, CPU, bytes in and out
  and memory kept per generated token, bytes per idle session, tokens per request, and the gateway's CPU
  per streamed token;
* **cluster** (``tokenwire cluster --workers 1|2``): one CPU worker's tokens/s and how two scale;
* **gateway-loss** (``--scenario gateway-loss``): how fast the surviving gateways take a dead one's
  connections back, and the Redis operations per second that herd costs.

Everything else is a parameter with a stated default (a gateway's cores and memory, a Redis shard's CPU
and memory budget, a GPU worker's tokens/s). What the model extrapolates, it says: every unit cost is
measured at a few thousand connections and a few hundred tokens/s, and applied linearly far beyond.
Nothing here is measured at a million users.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from server.gateway.settings import GatewaySettings
from server.load.benchmarks import STORE_FLUSH_MS, pinging

KIB, GIB = 1024, 1 << 30
# The idle section's two runs (benchmarks._idle): every connection pinging every 5 s, then less often.
IDLE_CPU = "gateway CPU per idle connection"
IDLE_CPU_SLOW = "gateway CPU per idle connection, pinging less"
# A connection quiet this long gets the server's WebSocket Ping (server/gateway/keepalive.py), so no
# connection is ever quieter: a client pinging less often than this still costs a ping in this period.
SERVER_PING_S = GatewaySettings().ping_interval_s


@dataclass(slots=True)
class Unit:
    """One measured unit cost and where it came from."""

    name: str
    value: float | None
    unit: str
    source: str  # section, file and the command that produced it
    measured: str = ""  # when (the section's timestamp)
    ping_s: float | None = None  # an idle connection's cost: how often each connection pinged in the run


@dataclass(slots=True)
class Load:
    users: int = 1_000_000  # connected
    streaming: int = 50_000  # of them, receiving a reply at any moment
    tokens_per_s: float = 100_000.0
    sessions: int | None = None  # sessions kept in Redis (within --session-ttl); default: users
    resumes_per_s: float | None = None  # whole-reply resumes; default streaming / 60 (a flaky network)
    # How often each connected client pings (an idle connection's gateway CPU depends on it); default the
    # JS client's period while nothing is pending (client_js/src/client.js, heartbeat.idleIntervalMs).
    ping_interval_s: float = 15.0


@dataclass(slots=True)
class Budget:
    """What one process or shard may use, before headroom."""

    gateway_cores: float = 4.0
    gateway_memory_gib: float = 8.0
    gateway_max_connections: int = 250_000  # open files, ephemeral ports, kernel socket memory
    worker_tokens_per_s: float | None = None  # default: the measured CPU worker
    worker_streams: int = 256  # concurrent streams one worker's engine runs (its KV budget)
    redis_cpu: float = 0.5  # of the shard's one command thread: the rest is for herds, AOF, replication
    redis_memory_gib: float = 16.0
    retention_s: float = 24 * 3600.0
    utilization: float = 0.6  # gateways and workers planned at most this busy


@dataclass(slots=True)
class Plan:
    component: str
    count: int
    limits: dict[str, float]  # resource -> processes it alone would need (before the spare)
    binding: str
    per_process: str
    utilization: dict[str, float] = field(default_factory=dict)  # resource -> use / what `count` hold


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return None


def load_sections(bench_dir: Path) -> dict[str, dict[str, Any]]:
    """``make bench``'s saved sections by name (only those present)."""
    out = {}
    for name in ("idle", "store", "cluster", "gateway-loss", "e2e"):
        sec = _read(bench_dir / f"section-{name}.json")
        if sec is not None:
            out[name] = sec
    return out


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


# The store section's runs (benchmarks.py, _store_run) by the workers' rate per stream and --log-flush-ms:
# what a token costs the store depends on how many tokens each log entry carries.
_GPU_RATE = " at a GPU worker's rate (TINY: server/bench/tiny_model.py, streamed as fast as a GPU streams)"
STORE_RUNS = {
    ("cpu", 0): ("store_cost", "", ""),
    ("cpu", STORE_FLUSH_MS): ("store_cost_flush", f" --log-flush-ms {STORE_FLUSH_MS}", ""),
    ("gpu", 0): ("store_cost_fast", " --model TINY", _GPU_RATE),
    ("gpu", STORE_FLUSH_MS): (
        "store_cost_fast_flush",
        f" --model TINY --log-flush-ms {STORE_FLUSH_MS}",
        _GPU_RATE,
    ),
}


def unit_costs(
    sections: dict[str, dict[str, Any]], *, workers: str = "cpu", log_flush_ms: int = 0
) -> dict[str, Unit]:
    """The measured unit costs the model uses (a value of None: that section was not run). The store's
    per-token costs come from the run at the workers' rate (``cpu``: the default model on this CPU;
    ``gpu``: a tiny model this CPU streams as fast as a GPU streams a real one) and ``log_flush_ms``;
    from the CPU-rate default run where that one is missing (an older ``.bench``)."""

    def when(name: str) -> str:
        return str(_get(sections, name, "measured") or "")

    idle = _get(sections, "idle", "results", "idle", "idle") or {}
    run, cluster_args, rate = STORE_RUNS[(workers, log_flush_ms)]
    store = _get(sections, "store", "results", run) or {}
    if not store:
        run, cluster_args, rate = STORE_RUNS[("cpu", 0)]
        store = _get(sections, "store", "results", run) or {}
    st = store.get("store") or {}
    cluster = _get(sections, "cluster", "results") or {}
    loss = _get(sections, "gateway-loss", "results", "gateway_loss") or {}
    src_idle = "idle: `tokenwire load --idle-only --idle 5000 --server-pid` on `tokenwire serve`"
    # An idle connection's CPU depends on how often it pings: say how often each run's connections did.
    ping_s = _get(sections, "idle", "results", "idle", "config", "ping_interval_s")
    slow_s = _get(sections, "idle", "results", "idle_slow", "config", "ping_interval_s")
    src_idle_cpu, src_slow = src_idle + pinging(ping_s), src_idle + pinging(slow_s)
    src_store = (
        "store: `tokenwire load --scenario store-cost --redis-url R --server-pid GW` on "
        f"`tokenwire cluster --gateways 1 --workers 1{cluster_args}`{rate}"
    )
    src_net = src_store + (" (net of the idle loops)" if st.get("net_of_idle_per_token") else "")
    per_request = None
    if store.get("requests"):
        per_request = store["tokens"] / store["requests"]
    one = _best(cluster, 1)
    two = _best(cluster, 2)
    u = [
        Unit("gateway memory per connection", idle.get("server_kib_per_connection"), "KiB", src_idle),
        Unit(
            IDLE_CPU,
            idle.get("server_us_per_connection_s"),
            "µs/s",
            src_idle_cpu,
            ping_s=_positive(ping_s),
        ),
        Unit(
            IDLE_CPU_SLOW,
            _get(sections, "idle", "results", "idle_slow", "idle", "server_us_per_connection_s"),
            "µs/s",
            src_slow,
            ping_s=_positive(slow_s),
        ),
        Unit("gateway CPU per streamed token", st.get("server_pid_us_per_token"), "µs", src_store),
        # Per token net of the idle server's loops where measured: those are counted per process below
        # ("Redis CPU of an idle process"), so the gross figure would count them twice.
        Unit("Redis commands per token", _net(st, "commands_per_token"), "", src_net),
        Unit("Redis CPU per token", _net(st, "us_per_token"), "µs", src_net),
        Unit("bytes into Redis per token", _net(st, "bytes_per_token"), "B", src_net),
        Unit("bytes out of Redis per token", st.get("bytes_out_per_token"), "B", src_store),
        Unit(
            "Redis memory kept per request (retained)",
            _get(st, "per_request", "memory_bytes"),
            "B",
            src_store,
        ),
        Unit("Redis CPU per whole-reply resume", _get(st, "per_resume", "us"), "µs", src_store),
        Unit("Redis memory per idle session", st.get("bytes_per_session"), "B", src_store),
        _idle_process(store, src_store),
        Unit(
            "Redis CPU of an idle shard (its own timers)",
            store.get("valkey_alone_us_per_s"),
            "µs/s",
            src_store + ": its Valkey before the cluster started",
        ),
        Unit("tokens per request", per_request, "", src_store),
        Unit(
            "CPU worker tokens/s (1 core, saturated)",
            one,
            "tok/s",
            "cluster: `tokenwire cluster --workers 1 --threads-per-worker 1 --pin-workers`, most users",
        ),
        Unit(
            "2 workers / 1 worker",
            None if not (one and two) else two / one,
            "x",
            "cluster: the same load on `--workers 2`",
        ),
        Unit(
            "gateway-loss: connections re-attached per second",
            _rate(loss),
            "conn/s",
            "gateway-loss: `tokenwire load --scenario gateway-loss` on `tokenwire cluster --gateways 4`",
        ),
        Unit(
            "gateway-loss: peak Redis ops/s per re-attaching connection/s",
            _ops_per_reconnect(loss),
            "ops",
            "gateway-loss: the same run",
        ),
    ]
    sec_of = {src_idle: "idle", src_idle_cpu: "idle", src_slow: "idle", src_store: "store"}
    for x in u:
        name = sec_of.get(x.source) or x.source.split(":", 1)[0]
        x.measured = when(name)
    return {x.name: x for x in u}


def _positive(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and x > 0 else None


def idle_cpu_at(ping_s: float, units: dict[str, Unit]) -> float | None:
    """An idle connection's gateway CPU (µs/s) when each connection pings every ``ping_s``: read off the
    straight line, in pings a second, through the idle section's two runs (exact at their periods, an
    extrapolation beyond them); the one run's figure where only one was measured, and the larger of the
    two where noise tilts the line the wrong way (fewer pings costing more). A period longer than the
    server's ping interval is costed at that interval: the server pings a connection quiet that long, and
    its control frame costs less than a client's ``ping`` (the safe side)."""
    ping_s = min(ping_s, SERVER_PING_S)
    a, b = units.get(IDLE_CPU), units.get(IDLE_CPU_SLOW)
    if a is None or a.value is None:
        return None
    if b is None or b.value is None or a.ping_s is None or b.ping_s is None or a.ping_s == b.ping_s:
        return a.value
    slope = (a.value - b.value) / (1 / a.ping_s - 1 / b.ping_s)  # µs per ping
    if slope <= 0:
        return max(a.value, b.value)
    return max(0.0, b.value + slope * (1 / ping_s - 1 / b.ping_s))


def _net(st: dict[str, Any], key: str) -> Any:
    """A store figure per token net of the idle loops (store_cost.py), else the gross one (older runs)."""
    from server.load.store_cost import NET_KEYS

    net = (st.get("net_of_idle_per_token") or {}).get(NET_KEYS[key])
    return net if net is not None else st.get(key)


def _idle_process(store: dict[str, Any], src: str) -> Unit:
    """What one idle process (its heartbeats, refreshes, blocking reads) costs Redis a second: the idle
    server's rate less what its Valkey spent alone (counted per shard), over the 1 + 1 cluster's two
    processes. An older run without the Valkey's own figure counts all of it per process."""
    idle = _get(store, "store", "idle", "us_per_s")
    alone = store.get("valkey_alone_us_per_s")
    name = "Redis CPU of an idle process"
    if idle is None:
        return Unit(name, None, "µs/s", src)
    if alone is None:
        return Unit(name, float(idle) / 2, "µs/s", src + " (÷ 2)")
    return Unit(name, max(0.0, float(idle) - float(alone)) / 2, "µs/s", src + " (less its Valkey alone, ÷ 2)")


def _best(cluster: dict[str, Any], workers: int) -> float | None:
    """The highest users' load on a cluster of ``workers``: its saturated tokens/s."""
    runs = [
        (int(k.rsplit("users", 1)[1]), _get(v, "tokens", "per_s"))
        for k, v in cluster.items()
        if k.startswith(f"workers{workers}_users")
    ]
    runs = [r for r in runs if r[1]]
    return float(max(runs)[1]) if runs else None


def _rate(loss: dict[str, Any]) -> float | None:
    moved, secs = loss.get("connections_moved"), loss.get("idle_reattach_s")
    if not moved or not secs:
        return None
    return float(moved) / float(secs)


def _ops_per_reconnect(loss: dict[str, Any]) -> float | None:
    peak, rate = loss.get("peak_redis_ops_per_s"), _rate(loss)
    if not peak or not rate:
        return None
    return float(peak) / rate


def _need(x: float) -> int:
    return max(1, math.ceil(x - 1e-9))


def plan(load: Load, budget: Budget, units: dict[str, Unit]) -> tuple[list[Plan], list[str]]:
    """The deployment for ``load``; and what could not be sized (a unit cost not measured)."""

    def v(name: str) -> float | None:
        u = units.get(name)
        return None if u is None else u.value

    missing: list[str] = []
    plans: list[Plan] = []

    # Gateways: memory and CPU of the connections and the streamed tokens; one spare, so that the loss
    # of any one leaves the others enough room for its connections (the gateway-loss herd).
    kib, cpu_tok = v("gateway memory per connection"), v("gateway CPU per streamed token")
    cpu_idle = idle_cpu_at(load.ping_interval_s, units)  # at the load's ping period, not the runs'
    limits: dict[str, float] = {
        "connections": load.users / budget.gateway_max_connections,
    }
    if kib is None:
        missing.append("gateway memory (run `make bench BENCH_ONLY=idle`)")
    else:
        limits["memory"] = load.users * kib * KIB / (budget.gateway_memory_gib * GIB * budget.utilization)
    if cpu_idle is None or cpu_tok is None:
        missing.append("gateway CPU (run `make bench BENCH_ONLY=idle,store`)")
    else:
        cores = (load.users * cpu_idle + load.tokens_per_s * cpu_tok) / 1e6
        limits["cpu"] = cores / (budget.gateway_cores * budget.utilization)
    need = max(limits.values())
    g = _need(need) + 1
    plans.append(
        Plan(
            "gateways",
            g,
            limits,
            max(limits, key=lambda k: limits[k]),
            f"{budget.gateway_cores:g} cores, {budget.gateway_memory_gib:g} GiB, "
            f"{load.users / g:,.0f} connections each ({load.users / (g - 1):,.0f} after losing one)",
            _use(limits, g, {"memory": budget.utilization, "cpu": budget.utilization}),
        )
    )

    # Workers: tokens/s and concurrent streams; one spare, whose streams the others continue.
    tok = budget.worker_tokens_per_s or v("CPU worker tokens/s (1 core, saturated)")
    wl: dict[str, float] = {"streams": load.streaming / budget.worker_streams}
    if tok is None:
        missing.append("worker tokens/s (give --worker-tokens-per-s or run `make bench BENCH_ONLY=cluster`)")
    else:
        wl["tokens/s"] = load.tokens_per_s / (tok * budget.utilization)
    w = _need(max(wl.values())) + 1
    plans.append(
        Plan(
            "workers",
            w,
            wl,
            max(wl, key=lambda k: wl[k]),
            f"{tok or 0:,.0f} tok/s, {budget.worker_streams} streams"
            + (" (a measured CPU worker)" if not budget.worker_tokens_per_s else ""),
            _use(wl, w, {"tokens/s": budget.utilization}),
        )
    )

    # Redis shards: the command thread's CPU and memory. Each shard is a primary (its replica doubles
    # the memory, not the shard count).
    us_tok, us_resume, us_idle = (
        v("Redis CPU per token"),
        v("Redis CPU per whole-reply resume"),
        v("Redis CPU of an idle process"),
    )
    kept, session, per_req = (
        v("Redis memory kept per request (retained)"),
        v("Redis memory per idle session"),
        v("tokens per request"),
    )
    rl: dict[str, float] = {}
    resumes = load.resumes_per_s if load.resumes_per_s is not None else load.streaming / 60
    if kept is None or session is None or not per_req:
        missing.append("Redis memory (run `make bench BENCH_ONLY=store`)")
    else:
        sessions = load.sessions if load.sessions is not None else load.users
        requests_kept = load.tokens_per_s / per_req * budget.retention_s
        rl["memory"] = (sessions * session + requests_kept * max(0.0, kept)) / (budget.redis_memory_gib * GIB)
    if us_tok is None or us_resume is None or us_idle is None:
        missing.append("Redis CPU (run `make bench BENCH_ONLY=store`)")
    else:
        us = load.tokens_per_s * us_tok + resumes * us_resume + (g + w) * us_idle
        cpu = us / 1e6 / budget.redis_cpu
        # Each shard's own timers, on the shards the rest needs (they are a small share of a core: the
        # count this adds to is never more than one shard off).
        shard_idle = v("Redis CPU of an idle shard (its own timers)") or 0.0
        rl["cpu"] = cpu + _need(max(cpu, rl.get("memory", 0.0))) * shard_idle / 1e6 / budget.redis_cpu
    s = _need(max(rl.values())) if rl else 0
    plans.append(
        Plan(
            "Redis shards",
            s,
            rl,
            max(rl, key=lambda k: rl[k]) if rl else "—",
            f"{budget.redis_cpu:g} of a core, {budget.redis_memory_gib:g} GiB (primaries; a replica each)",
            _use(rl, s, {"cpu": budget.redis_cpu}),
        )
    )
    return plans, missing


def _use(needs: dict[str, float], count: int, planned: dict[str, float]) -> dict[str, float]:
    """Each resource's use as a share of what ``count`` processes hold at 100 % (``needs`` counts
    processes at the planned share ``planned``, 1 where not given), in normal operation."""
    return {k: x * planned.get(k, 1.0) / count for k, x in needs.items()} if count else {}


def first_to_run_out(plans: list[Plan]) -> tuple[str, str, float] | None:
    """The resource closest to its limit once sized: what a growing load exhausts first."""
    best = None
    for p in plans:
        for res, u in p.utilization.items():
            if best is None or u > best[2]:
                best = (p.component, res, u)
    return best


def herd(load: Load, plans: list[Plan], units: dict[str, Unit]) -> str | None:
    """The loss of one gateway at this scale, extrapolated from the measured herd."""
    rate, ops = (
        units["gateway-loss: connections re-attached per second"].value,
        units["gateway-loss: peak Redis ops/s per re-attaching connection/s"].value,
    )
    g = next(p.count for p in plans if p.component == "gateways")
    if not rate or g < 2:
        return None
    moved = load.users / g
    # The measured rate came from 3 surviving gateways on 2 shared cores: per surviving gateway, and
    # linear in their number (extrapolated).
    secs = moved / (rate / 3 * (g - 1))
    line = f"losing one of {g} gateways moves {moved:,.0f} connections; re-attached in about {secs:,.0f} s"
    if ops:
        line += f" at about {ops * moved / secs:,.0f} Redis ops/s over all shards"
    return line + " (extrapolated from the gateway-loss run)"


def _deployment(load: Load, budget: Budget, units: dict[str, Unit]) -> list[str]:
    """The deployment table for ``load`` and what it says about it."""
    plans, missing = plan(load, budget, units)
    first = first_to_run_out(plans)
    lines = [
        "| component | count | each | needs (by resource, before the spare) | bound by |",
        "| --- | ---: | --- | --- | --- |",
    ]
    for p in plans:
        needs = ", ".join(f"{k} {x:,.1f}" for k, x in p.limits.items())
        lines.append(f"| {p.component} | {p.count} | {p.per_process} | {needs} | {p.binding} |")
    lines.append("")
    lines.append("Gateways and workers include one spare: the loss of any one leaves the rest enough room.")
    if first:
        lines.append(
            f"First to run out as the load grows: **{first[0]} {first[1]}** "
            f"({first[2]:.0%} of what the deployment holds, in normal operation)."
        )
    h = herd(load, plans, units)
    if h:
        lines.append(f"Gateway loss: {h}.")
    if missing:
        lines += ["", "Not sized (no measurement): " + "; ".join(missing) + "."]
    return lines


def _pings(load: Load, units: dict[str, Unit]) -> str:
    """How the load's idle connections are costed (idle_cpu_at)."""
    runs = " and ".join(
        f"{u.ping_s:g} s"
        for u in (units.get(IDLE_CPU), units.get(IDLE_CPU_SLOW))
        if u is not None and u.value is not None and u.ping_s is not None
    )
    how = f"measured pinging every {runs}" if runs else "not measured"
    return f"each client pings every {load.ping_interval_s:g} s (an idle connection's CPU {how})."


def _val(x: Unit) -> str:
    return "not measured" if x.value is None else f"{x.value:,.3g} {x.unit}".strip()


def render(
    load: Load,
    budget: Budget,
    units: dict[str, Unit],
    *,
    markdown: bool,
    gpu: tuple[Budget, dict[str, Unit]] | None = None,
) -> str:
    """The report; ``gpu``: the same load sized again with GPU workers (their rate a parameter, the
    store's cost per token from its run at a GPU rate), as a second deployment."""
    lines = []
    if markdown:
        lines += [
            "# Capacity",
            "",
            "Generated by `tokenwire capacity --markdown CAPACITY.md` from this machine's benchmark runs",
            "(`make bench` keeps them in `.bench/`). Every unit cost below is measured, with its source; the",
            "sizing applies them linearly to a load a thousand times larger than any run here: **that is the",
            "extrapolation**. Re-run `make bench` on your own hardware (and `--worker-tokens-per-s` with",
            "your GPU worker's measured rate) before trusting the counts.",
            "",
        ]
    lines += [
        "## Load",
        "",
        f"{load.users:,} connected users, {load.streaming:,} of them streaming, {load.tokens_per_s:,.0f} "
        f"tokens/s; {(load.sessions or load.users):,} sessions kept; "
        f"{(load.resumes_per_s if load.resumes_per_s is not None else load.streaming / 60):,.0f} resumes/s; "
        + _pings(load, units),
        "",
        "## Deployment",
        "",
        *_deployment(load, budget, units),
    ]
    if gpu is not None:
        gb, gu = gpu
        store = gu["Redis CPU per token"]
        lines += [
            "",
            f"## The same load on GPU workers ({gb.worker_tokens_per_s or 0:,.0f} tok/s each: a parameter, "
            "not measured here)",
            "",
            "A GPU streams each reply many times faster than this CPU, so each token log entry carries "
            f"several tokens and a token costs the store and the gateway less: {_val(store)} of Redis CPU, "
            f"{_val(gu['bytes into Redis per token'])} in and "
            f"{_val(gu['gateway CPU per streamed token'])} of gateway CPU per token, from {store.source}.",
            "",
            *_deployment(load, gb, gu),
        ]
    lines += [
        "",
        "## Unit costs",
        "",
        "| unit cost | value | source | measured |",
        "| --- | ---: | --- | --- |",
    ]
    for x in units.values():
        val = _val(x)
        lines.append(f"| {x.name} | {val} | {x.source} | {x.measured or '—'} |")
    lines += [
        "",
        "## Parameters (not measured)",
        "",
        f"gateway {budget.gateway_cores:g} cores, {budget.gateway_memory_gib:g} GiB, at most "
        f"{budget.gateway_max_connections:,} connections; worker "
        + (
            f"{budget.worker_tokens_per_s:,.0f} tok/s (given)"
            if budget.worker_tokens_per_s
            else "tok/s measured"
        )
        + f", {budget.worker_streams} streams; Redis shard {budget.redis_cpu:g} of a core and "
        f"{budget.redis_memory_gib:g} GiB; retention {budget.retention_s:,.0f} s; gateways and workers at "
        f"most {budget.utilization:.0%} busy.",
        "",
        "## What is extrapolated",
        "",
        "* Every cost is linear in the load: measured at up to 5,000 idle connections and a few hundred",
        "  tokens/s on 2 cores, applied to a million connections and 100,000 tokens/s.",
        "* Gateway memory is the process's RSS per connection; the kernel's socket buffers are not in it.",
        "* An idle connection's gateway CPU depends on how often its client pings. The idle section measures",
        "  it with every connection pinging every 5 s, then every 15 s; the model reads the load's period",
        "  (`--ping-interval`, by default 15 s: the JS client's while nothing is pending,",
        "  `heartbeat.idleIntervalMs`) off the straight line through the two, in pings a second: exact at",
        "  those periods, an extrapolation beyond them. A longer period than the server's ping interval",
        f"  ({SERVER_PING_S:g} s) is costed at that interval: the server pings a connection quiet that long.",
        "* Redis CPU per token is from one Valkey whose clients were a 1 + 1 cluster; a shard serving many",
        "  gateways pays the same per command, but more connections each.",
        "* The worker count is tokens/s over one worker's rate: a GPU worker's rate is a parameter.",
        "* The herd after a gateway loss scales the measured re-attach rate by the surviving gateways.",
        "* A gateway's log reader names every log it follows in each XREAD (the store-cost run follows",
        "  32), so a read costs in proportion to them; the reader pauses in proportion too, which bounds",
        "  its reads (`python -m server.bench.fanin`). This model counts the per-token figure of 32 logs",
        "  only: watch `XREAD` in `INFO commandstats` as gateways fill.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenwire capacity", description=__doc__.split("\n\n")[0])
    dl, db = Load(), Budget()
    p.add_argument("--bench-dir", type=Path, default=Path(".bench"), help="make bench's raw results (.bench)")
    p.add_argument("--users", type=int, default=dl.users, help="connected users (default 1,000,000)")
    p.add_argument("--streaming", type=int, default=dl.streaming, help="of them streaming (default 50,000)")
    p.add_argument("--tokens-per-s", type=float, default=dl.tokens_per_s, help="tokens/s (default 100,000)")
    p.add_argument("--sessions", type=int, default=None, help="sessions kept in Redis (default: --users)")
    p.add_argument(
        "--ping-interval",
        type=float,
        default=dl.ping_interval_s,
        help="seconds between a connected client's pings (default 15: the JS client's while idle)",
    )
    p.add_argument(
        "--resumes-per-s", type=float, default=None, help="whole-reply resumes/s (default streaming/60)"
    )
    p.add_argument(
        "--worker-tokens-per-s",
        type=float,
        default=None,
        help="one worker's tokens/s (a GPU's; default: the measured CPU worker)",
    )
    p.add_argument("--worker-streams", type=int, default=db.worker_streams, help="streams per worker")
    p.add_argument(
        "--log-flush-ms",
        type=int,
        choices=(0, STORE_FLUSH_MS),
        default=0,
        help=f"the workers' --log-flush-ms: the store's cost per token is measured at 0 and {STORE_FLUSH_MS}",
    )
    p.add_argument("--gateway-cores", type=float, default=db.gateway_cores)
    p.add_argument("--gateway-memory-gib", type=float, default=db.gateway_memory_gib)
    p.add_argument("--gateway-max-connections", type=int, default=db.gateway_max_connections)
    p.add_argument("--redis-cpu", type=float, default=db.redis_cpu, help="share of a shard's core to plan")
    p.add_argument("--redis-memory-gib", type=float, default=db.redis_memory_gib)
    p.add_argument("--retention", type=float, default=db.retention_s, help="the servers' --retention, s")
    p.add_argument("--utilization", type=float, default=db.utilization, help="gateways/workers, 0-1")
    p.add_argument(
        "--compare-gpu",
        type=float,
        metavar="TOK_S",
        help="--markdown: also size the load on GPU workers of TOK_S tokens/s each (store at a GPU rate)",
    )
    p.add_argument(
        "--compare-gpu-flush-ms",
        type=int,
        choices=(0, STORE_FLUSH_MS),
        default=STORE_FLUSH_MS,
        help=f"those GPU workers' --log-flush-ms (default {STORE_FLUSH_MS})",
    )
    p.add_argument("--json", type=Path, help="write the plan and unit costs as JSON")
    p.add_argument("--markdown", type=Path, help="write the report as Markdown (CAPACITY.md)")
    args = p.parse_args(argv)
    for name in (
        "users",
        "streaming",
        "tokens_per_s",
        "worker_streams",
        "gateway_cores",
        "gateway_memory_gib",
        "ping_interval",
    ):
        if not getattr(args, name) > 0:  # NaN too
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 < args.utilization <= 1 or not 0 < args.redis_cpu <= 1:
        p.error("--utilization and --redis-cpu must be in (0, 1]")
    load = Load(
        args.users, args.streaming, args.tokens_per_s, args.sessions, args.resumes_per_s, args.ping_interval
    )
    budget = Budget(
        args.gateway_cores,
        args.gateway_memory_gib,
        args.gateway_max_connections,
        args.worker_tokens_per_s,
        args.worker_streams,
        args.redis_cpu,
        args.redis_memory_gib,
        args.retention,
        args.utilization,
    )
    sections = load_sections(args.bench_dir)
    if not sections:
        print(
            f"tokenwire capacity: no benchmark results in {args.bench_dir} (run `make bench`)",
            file=sys.stderr,
        )
        return 2
    # A worker's rate given: GPU workers, whose streams are fast enough to fill a log entry with tokens.
    units = unit_costs(
        sections, workers="gpu" if args.worker_tokens_per_s else "cpu", log_flush_ms=args.log_flush_ms
    )
    plans, missing = plan(load, budget, units)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "plans": [
                        {"component": x.component, "count": x.count, "needs": x.limits, "binding": x.binding}
                        for x in plans
                    ],
                    "first_to_run_out": first_to_run_out(plans),
                    "missing": missing,
                    "units": {
                        k: {"value": u.value, "unit": u.unit, "source": u.source, "ping_s": u.ping_s}
                        for k, u in units.items()
                    },
                },
                indent=2,
            )
            + "\n"
        )
    if args.markdown:
        gpu = None
        if args.compare_gpu and not args.worker_tokens_per_s:
            gb = dataclasses.replace(budget, worker_tokens_per_s=args.compare_gpu)
            gpu = (gb, unit_costs(sections, workers="gpu", log_flush_ms=args.compare_gpu_flush_ms))
        args.markdown.write_text(render(load, budget, units, markdown=True, gpu=gpu))
    console = Console()
    t = Table(title=f"{load.users:,} users, {load.streaming:,} streaming, {load.tokens_per_s:,.0f} tok/s")
    for col in ("component", "count", "each", "bound by"):
        t.add_column(col)
    for x in plans:
        t.add_row(x.component, str(x.count), x.per_process, x.binding)
    console.print(t)
    first = first_to_run_out(plans)
    if first:
        console.print(f"first to run out: {first[0]} {first[1]} ({first[2]:.0%})")
    for m in missing:
        console.print(f"[yellow]not sized: {m}[/yellow]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
