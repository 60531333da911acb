"""``tokenwire load URL``: run, show, write. Exit status 0 when every issued request succeeded and no text
was damaged, 1 otherwise, 2 when the server could not be reached at all."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from server.gctune import tune_for_long_lived_objects
from server.load.options import LoadConfig, add_arguments, config_from_args


async def run(
    cfg: LoadConfig, *, progress: bool, engine: Any = None, profile: bool = False
) -> dict[str, Any]:
    """Run ``cfg``, print the table, write ``--json``/``--plot``; returns the report.

    With ``engine`` (an engine not yet started) the workload goes straight into it (``--engine-only``);
    ``profile`` times its steps by phase (``--profile``).
    """
    from server.load.report import build_report, print_table, write_json, write_plot
    from server.load.runner import RunState, run_load

    live = None
    if progress:
        from server.load.live import LiveView

        live = LiveView()
    try:
        if engine is not None:
            from server.load.engine_only import run_engine_only

            state = RunState(cfg)
            if profile:
                from server.engine.profile import StepProfile

                engine.profile = StepProfile()  # laps at phase boundaries: a few µs a step
            if live is not None:
                live.attach(state, None)
            result = await run_engine_only(state, engine)
        else:
            result = await run_load(cfg, on_state=live.attach if live is not None else None)
    finally:
        if live is not None:
            await live.close()
    report = build_report(result)
    print_table(report)
    if profile and engine is not None and engine.profile is not None:
        report["engine_profile"] = step_breakdown(engine.profile.steps)
        print(profile_line(report["engine_profile"]))
    if cfg.json_path is not None:
        write_json(report, cfg.json_path)
    if cfg.plot_path is not None:
        write_plot(result, report, cfg.plot_path)
    return report


def step_breakdown(steps: list[Any]) -> dict[str, Any]:
    """The median decode step (no prefill chunk) at the most rows that at least 5 such steps had, phase
    by phase in ms, as ``tokenwire bench --profile`` breaks it down; {} when no step decoded."""
    from collections import Counter

    from server.bench.floor import breakdown, decode_steps

    decode = decode_steps(steps)
    if not decode:
        return {}
    counts = Counter(s.rows for s in decode)
    rows = max((r for r, n in counts.items() if n >= 5), default=max(counts))
    return {"rows": rows, "steps": counts[rows], "ms": breakdown(decode, rows)}


def profile_line(p: dict[str, Any]) -> str:
    if not p:
        return "engine profile: no decode step"
    ms = p["ms"]
    phases = ", ".join(f"{k} {v:.1f}" for k, v in ms.items() if k != "total" and v >= 0.05)
    at = f"at {p['rows']} rows ({p['steps']} steps)"
    return f"engine profile: the median decode step {at} took {ms['total']:.1f} ms: {phases}"


def _load_engine(model: str | None, threads: int | None) -> Any:
    """The engine ``tokenwire serve`` would build for this model, in this process."""
    from server.app import load_engine, use_threads

    use_threads(threads)
    return load_engine(model)[1]


def exit_status(report: dict[str, Any]) -> int:
    rq = report["requests"]
    idle = report.get("idle")
    if (rq["issued"] and rq["ok"] == 0) or (idle and idle["target"] and not idle["connected"]):
        return 2
    if rq["failed"] or report["drops"]["integrity_violations"]:
        return 1
    if idle and (idle["connected"] < idle["target"] or idle["lost"] or idle["closed_by_server"]):
        return 1
    return 0


def run_soak_from_args(args: argparse.Namespace) -> int:
    from server.load.soak import SoakConfig, print_report, run_soak

    if not args.url or not args.redis_url:
        print("tokenwire load: --scenario soak needs the server's URL and --redis-url", file=sys.stderr)
        return 2
    cfg = SoakConfig(
        url=args.url,
        redis_url=args.redis_url,
        requests=args.requests or 10_000,
        users=args.users,
        key_prefix=args.key_prefix,
        retention_s=args.retention,
        json_path=args.json_path,
    )
    report = asyncio.run(run_soak(cfg))
    print_report(report)
    rq = report["requests"]
    return 2 if rq["finished"] == 0 else (1 if rq["failed"] or not report["target_met"] else 0)


def run_from_args(args: argparse.Namespace) -> int:
    # Scenarios with their own shape of run (hostile-prompt goes through the normal config below).
    if args.scenario == "soak":
        return run_soak_from_args(args)
    if args.scenario == "noisy-neighbour":
        from server.load.noisy import run_scenario

        return run_scenario(args)
    if args.scenario == "gateway-loss":
        from server.load.gateway_loss import run_from_args as run_gateway_loss

        return run_gateway_loss(args)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"tokenwire load: {exc}", file=sys.stderr)
        return 2
    progress = not args.no_progress and sys.stderr.isatty()
    if cfg.scenario == "hostile-prompt":
        return _hostile(cfg)
    if cfg.scenario == "flood":
        return _flood(cfg, args.flood_clients, args.flood_duration)
    if cfg.scenario == "store-cost":
        return _store_cost(cfg, args.redis_url, args.key_prefix)
    engine = _load_engine(args.model, args.threads) if args.engine_only else None
    tune_for_long_lived_objects()  # thousands of idle connections: GC pauses would show up as RTT
    report = asyncio.run(run(cfg, progress=progress, engine=engine, profile=args.profile))
    return exit_status(report)


def _hostile(cfg: LoadConfig) -> int:
    import json

    from server.load.hostile import print_hostile, run_hostile

    if not cfg.url:
        print("tokenwire load: --scenario hostile-prompt needs a server URL", file=sys.stderr)
        return 2
    report = asyncio.run(run_hostile(cfg))
    print_hostile(report)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=2) + "\n")
    failed = report["alone"]["requests_failed"] + report["with_hostile"]["requests_failed"]
    return 1 if failed else 0


def _flood(cfg: LoadConfig, clients: int, duration_s: float) -> int:
    import json

    from server.load.flood import print_flood, run_flood

    if not cfg.url:
        print("tokenwire load: --scenario flood needs a server URL", file=sys.stderr)
        return 2
    report = asyncio.run(run_flood(cfg, clients, duration_s))
    print_flood(report)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(report["met"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenwire load", description="WebSocket load test for tokenwire")
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


def _store_cost(cfg: LoadConfig, redis_url: str | None, key_prefix: str) -> int:
    import json

    from server.load.store_cost import print_store_cost, run_store_cost

    if not cfg.url or not redis_url:
        print(
            "tokenwire load: --scenario store-cost needs the server's URL and --redis-url "
            "(a Redis of its own)",
            file=sys.stderr,
        )
        return 2
    report = asyncio.run(run_store_cost(cfg, redis_url, key_prefix))
    print_store_cost(report)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["load"]["requests_failed"] else 0
