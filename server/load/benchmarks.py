"""``make bench``: run every benchmark of DESIGN.md §6 side by side and rewrite BENCHMARKS.md.

Each figure comes from a real run started here: the engine table from ``tokenwire bench``, end to end
from ``tokenwire load`` against a real ``tokenwire serve``, idle connections against the same kind of
server, and 1 vs 2 workers from ``tokenwire cluster``. Ratios are computed from numbers measured in this
one run, on this machine. Usage: ``python -m server.load.benchmarks [--out BENCHMARKS.md] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LISTEN = re.compile(r"(ws://\S+/v1/ws)")


def _tw(*args: str) -> list[str]:
    return [sys.executable, "-m", "server.cli", *args]


def _run(cmd: list[str], timeout: float) -> None:
    print("$", " ".join(cmd[2:] if cmd[:3] == _tw()[:3] else cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=timeout)


class _Server:
    """A ``tokenwire`` server command in the background until its ready line."""

    def __init__(self, args: list[str], ready: str) -> None:
        self.args = args
        self.ready = ready
        self.proc: subprocess.Popen[str] | None = None
        self.urls: list[str] = []

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


def _load(url: str, out: Path, *args: str, timeout: float = 1800) -> dict[str, Any]:
    _run(_tw("load", url, *args, "--json", str(out), "--no-progress"), timeout)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.load.benchmarks")
    p.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"))
    p.add_argument("--work", type=Path, default=None, help="folder for the raw JSON (default: a temp dir)")
    p.add_argument(
        "--quick", action="store_true", help="smaller runs (for trying the script, not for figures)"
    )
    p.add_argument("--skip-engine", action="store_true", help="reuse <work>/engine.json from an earlier run")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="tokenwire-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Raised for this run and its children only (5,000 idle sockets), never system-wide.
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    n_req, idle_n, users = (16, 500, 8) if args.quick else (64, 5000, 32)
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"
    }

    engine_json = work / "engine.json"
    if not args.skip_engine:
        _run(_tw("bench", "--json", str(engine_json), "--turns", "10"), 3600)
    results["engine"] = json.loads(engine_json.read_text())
    if args.skip_engine:
        mtime = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(engine_json.stat().st_mtime))
        results["engine_from"] = f"{engine_json} (an earlier `tokenwire bench` run, {mtime})"

    data = work / "serve-data"
    with _Server(
        ["serve", "--port", "0", "--data-dir", str(data), "--log-level", "warning"], "tokenwire ready"
    ) as s:
        url = s.urls[0]
        results["load32"] = _load(
            url, work / "load32.json", "--users", str(users), "--requests", str(n_req), "--turns", "1",
            "--max-tokens", "16-128", "--prompt-words", "16-64", "--subprotocol", "both",
        )  # fmt: skip
    with _Server(
        ["serve", "--port", "0", "--data-dir", str(data), "--log-level", "warning"], "tokenwire ready"
    ) as s:
        assert s.proc is not None
        results["idle"] = _load(
            s.urls[0], work / "idle.json", "--idle-only", "--idle", str(idle_n), "--duration", "20",
            "--connect-concurrency", "200", "--server-pid", str(s.proc.pid),
        )  # fmt: skip

    for workers in (1, 2):
        port = 18800 + workers * 10
        cluster = [
            "cluster",
            "--gateways",
            "1",
            "--workers",
            str(workers),
            "--threads-per-worker",
            "1",
            "--port",
            str(port),
            "--data-dir",
            str(work / f"cluster{workers}"),
            "--log-level",
            "warning",
        ]
        with _Server(cluster, "tokenwire cluster ready") as s:
            results[f"workers{workers}"] = _load(
                f"ws://127.0.0.1:{port}/v1/ws", work / f"workers{workers}.json", "--users", str(users),
                "--requests", str(n_req), "--turns", "1", "--max-tokens", "16-128",
            )  # fmt: skip

    (work / "all.json").write_text(json.dumps(results, indent=2))
    args.out.write_text(render(results, quick=args.quick))
    print(f"wrote {args.out} (raw results in {work})", flush=True)
    return 0


def _f(v: Any, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def render(r: dict[str, Any], *, quick: bool = False) -> str:
    e = r["engine"]
    eng = (e.get("engine") or {}).get("tok_s")
    lines = [
        "# Benchmarks",
        "",
        "Regenerated by `make bench` (`python -m server.load.benchmarks`), which runs everything below in",
        f"one go on one machine ({r['machine']}) and writes this file. Ratios compare numbers of one run.",
        "Nothing here is edited by hand."
        + (" **This was a --quick run: not for comparison.**" if quick else ""),
        "",
        "## Engine (`tokenwire bench --turns 10`)",
        "",
        *(
            [f"This table was not re-measured in this run: it is read from {r['engine_from']}.", ""]
            if r.get("engine_from")
            else []
        ),
        "32 chat requests, output lengths drawn from 16-128, EOS ignored (every path does the same work).",
        "",
        "| path | useful tok/s | vs engine | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in ("ceiling", "static", "hf_cb", "engine", "engine_poisson"):
        x = e.get(name) or {}
        ratio = f"{eng / x['tok_s']:.2f}x" if eng and x.get("tok_s") else "—"
        lines.append(
            f"| {name} | {_f(x.get('tok_s'))} | {ratio} | {_f(x.get('ttft_p50_ms'), 0)} | "
            f"{_f(x.get('ttft_p99_ms'), 0)} | {_f(x.get('itl_p50_ms'))} | {_f(x.get('itl_p99_ms'))} |"
        )
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
    ld = r["load32"]
    e2e = ld["tokens"]["per_s"]
    lines += [
        "",
        "## End to end over WebSocket (`tokenwire load`, default model, `tokenwire serve`)",
        "",
        f"{ld['config']['users']} users, one request each at a time, "
        "output lengths 16-128, EOS honoured, msgpack and JSON users alternating.",
        "",
        "| | value |",
        "| --- | ---: |",
        f"| requests ok / failed | {ld['requests']['ok']} / {ld['requests']['failed']} |",
        f"| tokens/s end to end | {_f(e2e)} |",
        f"| engine-only tokens/s (the engine path of the table above) | {_f(eng)} |",
        f"| end to end / engine-only | {e2e / eng:.2f}x (target ≥ 0.85x) |" if eng else "| ratio | — |",
        f"| TTFT p50 / p95 / p99 ms | {_f(ld['ttft_ms'].get('p50'), 0)} / "
        f"{_f(ld['ttft_ms'].get('p95'), 0)} / {_f(ld['ttft_ms'].get('p99'), 0)} |",
        f"| inter-token p50 / p95 / p99 ms | {_f(ld['itl_ms'].get('p50'))} / {_f(ld['itl_ms'].get('p95'))} / "
        f"{_f(ld['itl_ms'].get('p99'))} |",
        "",
        "The two workloads are not identical (the load tool's prompts are random words and it honours EOS),",
        "so the ratio compares the server's throughput under the same concurrency, not the same tokens.",
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
    lines.append("\nTarget: msgpack ≤ 0.35x the SSE chunk.")
    idle = r["idle"]
    lines += [
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
    ]
    w1, w2 = r["workers1"]["tokens"]["per_s"], r["workers2"]["tokens"]["per_s"]
    lines += [
        "",
        "## Cluster: 1 vs 2 workers (`tokenwire cluster --gateways 1 --workers N --threads-per-worker 1`)",
        "",
        "| workers | tokens/s | requests ok |",
        "| ---: | ---: | ---: |",
        f"| 1 | {_f(w1)} | {r['workers1']['requests']['ok']} |",
        f"| 2 | {_f(w2)} | {r['workers2']['requests']['ok']} |",
        "",
        f"2 workers / 1 worker: {w2 / w1:.2f}x (target ≥ 1.6x)." if w1 else "",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
