"""tokenwire capacity: the sizing arithmetic on given unit costs, and what it says when one is missing."""

from __future__ import annotations

import json
from pathlib import Path

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
