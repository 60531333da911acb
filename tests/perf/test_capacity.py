"""tokenwire capacity: the sizing arithmetic on given unit costs, and what it says when one is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.load.capacity import Budget, Load, main, plan, unit_costs


def _sections(tmp: Path, *, with_store: bool = True) -> Path:
    def write(name: str, results: dict[str, object]) -> None:
        (tmp / f"section-{name}.json").write_text(
            json.dumps({"measured": "2026-12-03 12:00 UTC", "results": results})
        )

    write("idle", {"idle": {"idle": {"server_kib_per_connection": 20.0, "server_us_per_connection_s": 1.0}}})
    write(
        "cluster",
        {
            "workers1_users32": {"tokens": {"per_s": 200.0}},
            "workers1_users128": {"tokens": {"per_s": 250.0}},
            "workers2_users128": {"tokens": {"per_s": 425.0}},
        },
    )
    if with_store:
        store = {
            "commands_per_token": 1.2,
            "us_per_token": 5.0,
            "bytes_per_token": 100.0,
            "bytes_out_per_token": 50.0,
            "per_request": {"memory_bytes": 4000.0},
            "per_resume": {"us": 100.0},
            "bytes_per_session": 500.0,
            "idle": {"us_per_s": 200.0},
            "server_pid_us_per_token": 10.0,
        }
        write("store", {"store_cost": {"store": store, "tokens": 6400, "requests": 64}})
    return tmp


def test_counts_follow_the_unit_costs(tmp_path: Path) -> None:
    from server.load.capacity import load_sections

    units = unit_costs(load_sections(_sections(tmp_path)))
    assert units["CPU worker tokens/s (1 core, saturated)"].value == 250.0  # the most users: saturated
    assert units["2 workers / 1 worker"].value == 1.7
    assert units["Redis CPU of an idle process"].value == 100.0  # a 1 + 1 cluster: two processes
    load = Load(users=1_000_000, streaming=50_000, tokens_per_s=100_000.0)
    budget = Budget(worker_tokens_per_s=5_000.0, utilization=0.5)
    plans, missing = plan(load, budget, units)
    assert missing == []
    by = {p.component: p for p in plans}
    gw = by["gateways"]
    # memory: 1e6 x 20 KiB / (8 GiB x 0.5) = 4.77 -> 5; cpu: (1e6 x 1 + 1e5 x 10) us/s = 2 cores over
    # 4 x 0.5 = 1; connections 1e6 / 250k = 4. Five needed, plus the spare.
    assert round(gw.limits["memory"], 2) == 4.77 and gw.limits["cpu"] == 1.0 and gw.limits["connections"] == 4
    assert (gw.count, gw.binding) == (6, "memory")
    wk = by["workers"]
    # 1e5 tok/s over 5,000 x 0.5 = 40; 50,000 streams over 256 = 195.3 -> 196, plus the spare.
    assert (wk.count, wk.binding) == (197, "streams")
    rs = by["Redis shards"]
    # cpu: 1e5 x 5 + (50,000 / 60) x 100 + (6 + 197) x 100 = 603,633 us/s over half a core = 1.21;
    # memory: 1e6 x 500 B + 1e5 / 100 tok x 86,400 s x 4000 B = 346 GB over 16 GiB = 20.2 -> 21.
    assert round(rs.limits["cpu"], 2) == 1.21
    assert (rs.count, rs.binding) == (21, "memory")


def test_a_missing_measurement_is_named_not_guessed(tmp_path: Path) -> None:
    from server.load.capacity import load_sections

    units = unit_costs(load_sections(_sections(tmp_path, with_store=False)))
    plans, missing = plan(Load(), Budget(), units)
    assert any("Redis CPU" in m for m in missing) and any("gateway CPU" in m for m in missing)
    assert next(p for p in plans if p.component == "Redis shards").count == 0


def test_cli_writes_the_document_with_sources(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bench = _sections(tmp_path)
    out, js = tmp_path / "CAPACITY.md", tmp_path / "plan.json"
    assert main(["--bench-dir", str(bench), "--markdown", str(out), "--json", str(js)]) == 0
    md = out.read_text()
    assert "| Redis CPU per token | 5 µs |" in md and "store-cost" in md
    assert "First to run out" in md and "What is extrapolated" in md
    assert json.loads(js.read_text())["plans"][0]["component"] == "gateways"
    assert main(["--bench-dir", str(tmp_path / "none")]) == 2


def test_the_cpu_of_an_idle_connection_says_how_often_it_pinged(tmp_path: Path) -> None:
    """An idle connection's CPU is mostly its pings, so the unit cost names the run's ping interval (the
    idle report's config) and keeps its section's date; an older report without it says nothing of it."""
    from server.load.capacity import load_sections

    bench = _sections(tmp_path)
    cpu = unit_costs(load_sections(bench))["gateway CPU per idle connection"]
    assert "pinging" not in cpu.source and cpu.measured == "2026-12-03 12:00 UTC"
    idle = json.loads((bench / "section-idle.json").read_text())
    idle["results"]["idle"]["config"] = {"ping_interval_s": 7.5}
    (bench / "section-idle.json").write_text(json.dumps(idle))
    units = unit_costs(load_sections(bench))
    cpu = units["gateway CPU per idle connection"]
    assert cpu.source.endswith(", each pinging every 7.5 s") and cpu.measured == "2026-12-03 12:00 UTC"
    assert "pinging" not in units["gateway memory per connection"].source


def _with_slower_idle_run(bench: Path, fast: float, slow: float, fast_us: float, slow_us: float) -> None:
    idle = json.loads((bench / "section-idle.json").read_text())
    idle["results"]["idle"]["config"] = {"ping_interval_s": fast}
    idle["results"]["idle"]["idle"]["server_us_per_connection_s"] = fast_us
    idle["results"]["idle_slow"] = {
        "config": {"ping_interval_s": slow},
        "idle": {"server_us_per_connection_s": slow_us},
    }
    (bench / "section-idle.json").write_text(json.dumps(idle))


def test_an_idle_connection_is_costed_at_the_loads_ping_period(tmp_path: Path) -> None:
    """The idle section's two runs (pinging every 5 s and every 15 s) give a line in pings a second: the
    model reads the load's period off it, exactly at the runs' periods, and sizes the gateways' CPU so."""
    from server.load.capacity import idle_cpu_at, load_sections

    bench = _sections(tmp_path)
    _with_slower_idle_run(bench, 5.0, 15.0, 30.0, 20.0)
    units = unit_costs(load_sections(bench))
    assert units["gateway CPU per idle connection, pinging less"].source.endswith("each pinging every 15 s")
    assert units["gateway CPU per idle connection, pinging less"].measured == "2026-12-03 12:00 UTC"
    # 10 µs/s over 2/15 pings a second between the runs: 75 µs a ping.
    assert idle_cpu_at(5.0, units) == 30.0 and idle_cpu_at(15.0, units) == 20.0
    assert abs(idle_cpu_at(7.5, units) - 25.0) < 1e-9  # 2/15 pings a second: halfway
    assert abs(idle_cpu_at(2.5, units) - 45.0) < 1e-9  # beyond the runs: the same line
    # Quieter than the server's ping interval (20 s): the server pings it, so it costs a ping every 20 s.
    assert abs(idle_cpu_at(20.0, units) - 18.75) < 1e-9
    assert idle_cpu_at(60.0, units) == idle_cpu_at(1e9, units) == idle_cpu_at(20.0, units)

    def gateway_cpu(ping_s: float) -> float:
        plans, _ = plan(Load(users=1_000_000, tokens_per_s=0.0, ping_interval_s=ping_s), Budget(), units)
        return next(p for p in plans if p.component == "gateways").limits["cpu"]

    # 1e6 connections x 20 µs/s = 20 cores over 4 cores x 0.6; at 5 s, 30 cores.
    assert abs(gateway_cpu(15.0) - 20 / 2.4) < 1e-9 and abs(gateway_cpu(5.0) - 30 / 2.4) < 1e-9
    for bad in ("0", "-5", "nan"):
        with pytest.raises(SystemExit) as exc:
            main(["--bench-dir", str(bench), "--ping-interval", bad])
        assert exc.value.code == 2


def test_an_idle_cost_the_noise_tilted_is_taken_at_the_larger_run(tmp_path: Path) -> None:
    """Fewer pings measured as costing more (noise larger than the difference) gives no line: the larger
    figure serves every period; with one run only, its figure does."""
    from server.load.capacity import idle_cpu_at, load_sections

    bench = _sections(tmp_path)
    assert idle_cpu_at(15.0, unit_costs(load_sections(bench))) == 1.0  # the one run's figure
    _with_slower_idle_run(bench, 5.0, 15.0, 20.0, 21.0)
    units = unit_costs(load_sections(bench))
    assert idle_cpu_at(15.0, units) == idle_cpu_at(60.0, units) == idle_cpu_at(1.0, units) == 21.0


def test_benchmarks_md_shows_the_idle_cpu_at_both_ping_periods() -> None:
    from server.load.benchmarks import _render_idle

    report = {
        "config": {"ping_interval_s": 5.0},
        "idle": {
            "connected": 10, "target": 10, "pings": 4, "pongs": 4, "lost": 0,
            "rtt_ms": {"p50": 1.0, "p99": 2.0},
            "server_kib_per_connection": 19.0, "server_us_per_connection_s": 29.3,
        },
    }  # fmt: skip
    slower = {"config": {"ping_interval_s": 15.0}, "idle": {"server_us_per_connection_s": 19.87}}
    md = "\n".join(_render_idle(report, slower))
    assert "| server CPU per connection, each pinging every 5 s | 29.30 µs per second held |" in md
    assert "| server CPU per connection, each pinging every 15 s | 19.87 µs per second held |" in md
    assert "every 15 s" not in "\n".join(_render_idle(report))  # an older run: the one row


def test_the_store_per_token_is_taken_net_of_the_idle_loops(tmp_path: Path) -> None:
    """The idle process's Redis CPU is counted per process; a per-token figure that still holds it would
    count it twice, so the model takes the store-cost run's net figures where they exist."""
    from server.load.capacity import load_sections

    bench = _sections(tmp_path)
    sec = json.loads((bench / "section-store.json").read_text())
    sec["results"]["store_cost"]["store"]["net_of_idle_per_token"] = {
        "commands": 1.1,
        "us": 3.0,
        "bytes_in": 90.0,
    }
    (bench / "section-store.json").write_text(json.dumps(sec))
    units = unit_costs(load_sections(bench))
    assert units["Redis CPU per token"].value == 3.0
    assert units["Redis commands per token"].value == 1.1
    assert units["bytes into Redis per token"].value == 90.0
    assert "net of the idle loops" in units["Redis CPU per token"].source


def test_store_cost_takes_the_idle_rate_off_for_the_phase() -> None:
    from server.load.store_cost import _net_per

    def snap(at: float, commands: int, cpu_s: float, net_in: int) -> dict[str, float]:
        return {"at": at, "commands": commands, "cpu_s": cpu_s, "net_in": net_in}

    # Idle: 10 commands, 2 ms of CPU, 500 bytes a second. The phase: 100 s, 10,000 commands, 0.5 s, 1 MB.
    idle0, idle1 = snap(0.0, 0, 0.0, 0), snap(2.0, 20, 0.004, 1000)
    before, after = snap(2.0, 20, 0.004, 1000), snap(102.0, 10_020, 0.504, 1_001_000)
    net = _net_per(idle0, idle1, before, after, 1000)
    assert net == {"commands": 9.0, "us": 300.0, "bytes_in": 950.0}
    # Never below zero (a phase quieter than the idle reading), and nothing per nothing.
    assert _net_per(idle0, idle1, before, snap(102.0, 30, 0.005, 1000), 10)["commands"] == 0.0
    assert _net_per(idle0, idle1, before, after, 0)["us"] is None


def test_gpu_workers_are_sized_with_the_store_cost_at_a_gpu_rate(tmp_path: Path) -> None:
    """A token costs the store what its log entry costs, shared by the entry's tokens, so GPU workers
    (fast streams, many tokens per entry) take the run at a GPU rate, and --log-flush-ms its own run; an
    older .bench without those runs falls back to the CPU-rate one, and says so in the source."""
    from server.load.capacity import load_sections

    bench = _sections(tmp_path)
    sec = json.loads((bench / "section-store.json").read_text())
    cpu = sec["results"]["store_cost"]
    sec["results"]["store_cost_fast_flush"] = {**cpu, "store": {**cpu["store"], "us_per_token": 2.0}}
    (bench / "section-store.json").write_text(json.dumps(sec))
    sections = load_sections(bench)
    assert unit_costs(sections)["Redis CPU per token"].value == 5.0
    gpu = unit_costs(sections, workers="gpu", log_flush_ms=250)["Redis CPU per token"]
    assert gpu.value == 2.0 and "--log-flush-ms 250" in gpu.source and "GPU" in gpu.source
    missing = unit_costs(sections, workers="gpu")["Redis CPU per token"]  # no GPU run every step
    assert missing.value == 5.0 and "TINY" not in missing.source

    out = tmp_path / "CAPACITY.md"
    args = ["--bench-dir", str(bench), "--markdown", str(out), "--worker-tokens-per-s", "5000"]
    assert main([*args, "--log-flush-ms", "250"]) == 0
    assert "| Redis CPU per token | 2 µs |" in out.read_text()


def test_benchmarks_md_judges_each_store_run_against_the_targets() -> None:
    from server.load.benchmarks import STORE_RUNS, _render_store

    def run(us: float, tok_s: float) -> dict[str, object]:
        store = {
            "commands_per_token": 1.0,
            "us_per_token": us,
            "bytes_per_token": 100.0,
            "per_request": {"commands": 50.0, "us": 500.0, "bytes_in": 4000.0, "bytes_out": 2000.0},
            "per_resume": {
                "tokens_per_resume": 48.0,
                "commands": 14.0,
                "us": 100.0,
                "bytes_in": 900,
                "bytes_out": 800,
            },
            "idle": {"commands_per_s": 8.0, "us_per_s": 2000.0},
            "bytes_per_session": 360.0,
            "keys_per_session": 2.0,
        }
        met = {"commands_per_token": True, "us_per_token": us <= 8, "bytes_per_token": True}
        return {
            "store": store, "config": {"users": 32}, "load": {"tok_s": tok_s}, "requests": 64, "tokens": 4400,
            "targets": {"commands_per_token": 1.5, "us_per_token": 8.0, "bytes_per_token": 120.0}, "met": met,
        }  # fmt: skip

    r = {key: run(30.0 - 7 * i, 180.0 if i < 2 else 3000.0) for i, (key, _) in enumerate(STORE_RUNS)}
    md = "\n".join(_render_store(r))
    assert "| before (83e411b) | CPU rate, every step | CPU rate, `--log-flush-ms 250` | GPU rate" in md
    assert "| Redis CPU per token, µs | 64.62 | 30.00 | 23.00 | 16.00 | 9.00 | ≤ 8 |" in md
    assert "3,000 tok/s, 93.8 per stream" in md
    assert "Targets, GPU rate, `--log-flush-ms 250`: commands per token met, us per token **missed**" in md
    # An older run without the GPU-rate columns still renders, with the columns it has.
    del r["store_cost_fast"], r["store_cost_fast_flush"]
    assert "GPU rate, every step" not in "\n".join(_render_store(r)).split("not run")[1]


def test_capacity_md_can_size_the_same_load_on_gpu_workers(tmp_path: Path) -> None:
    bench = _sections(tmp_path)
    sec = json.loads((bench / "section-store.json").read_text())
    cpu = sec["results"]["store_cost"]
    sec["results"]["store_cost_fast_flush"] = {**cpu, "store": {**cpu["store"], "us_per_token": 2.0}}
    (bench / "section-store.json").write_text(json.dumps(sec))
    out = tmp_path / "CAPACITY.md"
    assert main(["--bench-dir", str(bench), "--markdown", str(out), "--compare-gpu", "5000"]) == 0
    md = out.read_text()
    head, gpu = md.split("## The same load on GPU workers (5,000 tok/s each")
    assert "| Redis CPU per token | 5 µs |" in gpu  # the unit-cost table: the CPU deployment's
    assert "2 µs of Redis CPU" in gpu.split("## Unit costs")[0] and "--log-flush-ms 250" in gpu
    # 1e5 tok/s over 5,000 x 0.6 = 33.3; 50,000 streams over 256 = 195.3 -> 196, plus the spare.
    assert "| workers | 197 | 5,000 tok/s" in gpu and "| workers | 197 |" not in head


def test_an_idle_valkeys_own_timers_are_counted_per_shard_not_per_process(tmp_path: Path) -> None:
    """The store-cost run's idle rate is mostly its Valkey's own timers on a slow VM (measured alone
    before the cluster starts): per shard. Only the rest is what each process adds."""
    from server.load.capacity import load_sections

    bench = _sections(tmp_path)
    sec = json.loads((bench / "section-store.json").read_text())
    sec["results"]["store_cost"]["valkey_alone_us_per_s"] = 150.0
    (bench / "section-store.json").write_text(json.dumps(sec))
    units = unit_costs(load_sections(bench))
    assert units["Redis CPU of an idle process"].value == 25.0  # (200 - 150) / 2
    assert units["Redis CPU of an idle shard (its own timers)"].value == 150.0
    load = Load(users=1_000_000, streaming=50_000, tokens_per_s=100_000.0)
    rs = {p.component: p for p in plan(load, Budget(worker_tokens_per_s=5_000.0, utilization=0.5), units)[0]}
    # cpu: (1e5 x 5 + (50,000 / 60) x 100 + (6 + 197) x 25) us/s over half a core = 1.1768, then 21 shards
    # (memory, as above) x 150 us/s over half a core = 0.0063 more.
    assert round(rs["Redis shards"].limits["cpu"], 4) == round(1.17683 + 21 * 150 / 1e6 / 0.5, 4)
