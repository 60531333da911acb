"""The final report of a load run: a JSON document, a table on the terminal, and a PNG.

Every count in the JSON adds up: ``requests.issued == requests.ok + requests.failed`` and the failures by
code sum to ``requests.failed``. Latencies are in milliseconds; TTFT runs from sending ``chat`` to the first
delta, inter-token latency is per token (the gap between consecutive deltas divided by the later delta's
token count; gaps across a reconnect are left out). ``tokens.per_s`` is every token streamed live (each
once, resumes included) over the window from the first request to the last ``done``; ``tokens.completion``
sums ``done.offset`` of the requests that finished.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.load.runner import BUCKET_S, LoadResult

MAX_LISTED_VIOLATIONS = 20
MAX_SERIES_POINTS = 120


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary_ms(seconds: Sequence[float], qs: Sequence[int] = (50, 95, 99)) -> dict[str, float | int | None]:
    """Count, mean, percentiles and max of a list of durations, in milliseconds."""
    out: dict[str, float | int | None] = {"n": len(seconds)}
    if not seconds:
        return out | {"mean": None, **{f"p{q}": None for q in qs}, "max": None}
    out["mean"] = round(1000 * sum(seconds) / len(seconds), 3)
    for q in qs:
        p = percentile(seconds, q)
        out[f"p{q}"] = None if p is None else round(1000 * p, 3)
    out["max"] = round(1000 * max(seconds), 3)
    return out


def rate_series(
    res: LoadResult, max_points: int = MAX_SERIES_POINTS
) -> tuple[float, list[float], list[float]]:
    """Tokens/s over time: (bucket width, bucket midpoints, rates). One-second buckets are merged so a
    long run has at most ``max_points``; the last bucket is usually cut short by the end of the window,
    so its rate is over the part of it that the window covers."""
    k = max(1, math.ceil(len(res.buckets) / max_points))
    merged = [sum(res.buckets[i : i + k]) for i in range(0, len(res.buckets), k)]
    full = k * BUCKET_S
    xs: list[float] = []
    ys: list[float] = []
    for i, n in enumerate(merged):
        start = i * full
        width = min(full, max(res.window_s - start, 0.0)) if i == len(merged) - 1 else full
        if width < full / 10:  # a sliver at the very end: a full-width bucket rather than a spike
            width = full
        xs.append(round(start + width / 2, 3))
        ys.append(round(n / width, 2))
    return full, xs, ys


def build_report(res: LoadResult) -> dict[str, Any]:
    recs = res.records
    ok = [r for r in recs if r.ok]
    failed = [r for r in recs if not r.ok]
    # Issued requests that never finished (cannot happen unless the run was interrupted) count as failed.
    unfinished = res.issued - len(recs)
    by_code: Counter[str] = Counter(r.error_code or f"finish_{r.finish_reason}" for r in failed)
    if unfinished:
        by_code["unfinished"] += unfinished
    violations = [v for r in recs for v in r.violations]
    lengths = Counter(r.length_reason or "unsaid" for r in recs if r.finish_reason == "length")
    tokens = sum(r.tokens for r in recs)
    streamed = sum(res.buckets)
    window = res.window_s
    ttft = [t for r in ok if (t := r.ttft) is not None]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.done_at - r.sent_at for r in ok if r.done_at is not None and r.sent_at is not None]
    report: dict[str, Any] = {
        "tool": "tokenwire load",
        "config": res.cfg.describe(),
        "servers": res.servers,
        "started_unix": round(res.started, 3),
        "window_s": round(window, 3),
        "open_files_limit": res.open_files_limit,
        "requests": {
            "issued": res.issued,
            "ok": len(ok),
            "failed": len(failed) + unfinished,
            "failed_by_code": dict(sorted(by_code.items())),
            "last_connect_error": res.connect_error or None,
            "finish_reasons": dict(sorted(Counter(r.finish_reason or "none" for r in recs).items())),
            # Of the "length" finishes, which limit ended them (done.length_reason): "context" means the
            # prompts filled the model's window, not that max_tokens was reached; "unsaid" where the door
            # has no such field (OpenAI's) or an older server sent none.
            "length_reasons": dict(sorted(lengths.items())),
            "per_s": round(len(ok) / window, 3) if window > 0 else None,
        },
        "tokens": {
            "completion": tokens,
            "streamed_live": streamed,
            "prompt": sum(r.prompt_tokens for r in recs),
            # Of those, what the server's usage says it did not compute (session turns, shared starts).
            "prompt_cached": sum(r.cached_tokens for r in recs),
            # Every token streamed live, failed requests' included: what the server delivered.
            "per_s": round(streamed / window, 2) if window > 0 else None,
            "per_request_mean": round(tokens / len(recs), 2) if recs else None,
        },
        "ttft_ms": summary_ms(ttft),
        "itl_ms": summary_ms(itl),
        "latency_ms": summary_ms(e2e),
        "drops": {
            "planned": sum(1 for r in recs if r.kill_at is not None),
            "kills": sum(r.kills for r in recs),
            "resumes": sum(r.resumes for r in recs),
            "unplanned_reconnects": sum(r.reconnects for r in recs),
            "chat_retries": sum(r.retries for r in recs),
            "resume_failed": sum(r.resume_failed for r in recs),
            "replays_verified": sum(1 for r in recs if r.verified),
            "integrity_violations": len(violations),
            "violations": [v.as_dict() for v in violations[:MAX_LISTED_VIOLATIONS]],
        },
        "wire": res.wire.report(),
        "timeseries": dict(zip(("bucket_s", "t_s", "tokens_per_s"), rate_series(res), strict=True)),
    }
    if res.arrival_lags:
        report["arrivals"] = {"n": len(res.arrival_lags), "lag_ms": summary_ms(res.arrival_lags)}
    if res.idle is not None:
        st = res.idle
        report["idle"] = {
            "target": st.target,
            "connected": st.connected,
            "connect_failed": dict(st.connect_failed),
            "connect_errors": dict(st.connect_errors),
            "closed_by_server": st.closed_by_server,
            "ramp_s": None if st.ramp_s is None else round(st.ramp_s, 3),
            "pings": st.pings,
            "pongs": st.pongs,
            "lost": st.lost,
            "rtt_ms": summary_ms(st.rtt, (50, 99)),
            "rtt_during_ramp_ms": summary_ms(st.rtt_ramp, (50, 99)),
            "server_rss_before_kib": st.rss_before_kib,
            "server_rss_after_kib": st.rss_after_kib,
            "server_kib_per_connection": None
            if st.kib_per_connection is None
            else round(st.kib_per_connection, 2),
            "server_us_per_connection_s": None
            if st.us_per_connection_s is None
            else round(st.us_per_connection_s, 3),
        }
    return report


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def _fmt(v: object, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}{unit}"
    return f"{v}{unit}"


def _finishes(rq: dict[str, Any]) -> str:
    """``stop 10, length 6 (max_tokens 5, context 1)``: how the requests ended, and which limit ended the
    length ones (a load whose prompts fill the context window says so here)."""
    parts = []
    for reason, n in rq["finish_reasons"].items():
        limits = rq["length_reasons"] if reason == "length" else None
        why = f" ({', '.join(f'{k} {v}' for k, v in limits.items())})" if limits else ""
        parts.append(f"{reason} {n}{why}")
    return ", ".join(parts) or "none"


def print_table(report: dict[str, Any]) -> None:
    """The report as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"tokenwire load: {report['config']['url']}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    rq, tk, dr = report["requests"], report["tokens"], report["drops"]
    t.add_row("window", _fmt(report["window_s"], " s"))
    if rq["issued"]:
        codes = ", ".join(f"{k} {v}" for k, v in rq["failed_by_code"].items()) or "none"
        t.add_row("requests", f"{rq['issued']} issued, {rq['ok']} ok, {rq['failed']} failed ({codes})")
        t.add_row("finishes", _finishes(rq))
        if rq.get("last_connect_error"):
            t.add_row("connect error", f"[yellow]{rq['last_connect_error']}[/yellow] (the last; retried)")
        t.add_row("tokens", f"{tk['completion']} completion, {_fmt(tk['per_s'])} tokens/s")
        if tk.get("prompt"):
            t.add_row("prompt tokens", f"{tk['prompt']}, {tk.get('prompt_cached', 0)} cached (usage)")
        for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "inter-token"), ("latency_ms", "request")):
            s = report[key]
            t.add_row(
                f"{label} ms",
                f"p50 {_fmt(s.get('p50'))}  p95 {_fmt(s.get('p95'))}  p99 {_fmt(s.get('p99'))}  (n {s['n']})",
            )
        t.add_row(
            "drops",
            f"{dr['kills']} kills, {dr['resumes']} resumes, {dr['unplanned_reconnects']} unplanned "
            f"reconnects, {dr['replays_verified']} replays verified",
        )
        style = "green" if dr["integrity_violations"] == 0 else "bold red"
        t.add_row("integrity violations", f"[{style}]{dr['integrity_violations']}[/{style}]")
        w = report["wire"]
        bpt, ratio = w["bytes_per_token"], w["ratio_to_sse"]
        t.add_row(
            "bytes/token",
            f"msgpack {_fmt(bpt['msgpack'])} ({_fmt(ratio['msgpack'])}x SSE), "
            f"json {_fmt(bpt['json'])} ({_fmt(ratio['json'])}x SSE), SSE {_fmt(bpt['sse'])}",
        )
    idle = report.get("idle")
    if idle:
        rtt = idle["rtt_ms"]
        t.add_row(
            "idle connections",
            f"{idle['connected']}/{idle['target']} held (ramp {_fmt(idle['ramp_s'], ' s')}), "
            f"{idle['pongs']}/{idle['pings']} pongs, {idle['lost']} lost, "
            f"{idle['closed_by_server']} closed by the server",
        )
        if idle["connect_errors"]:
            errs = ", ".join(f"{k} {v}" for k, v in idle["connect_errors"].items())
            t.add_row("connect errors", f"[yellow]{errs}[/yellow] (retried with backoff)")
        t.add_row("ping RTT ms", f"p50 {_fmt(rtt.get('p50'))}  p99 {_fmt(rtt.get('p99'))}  (n {rtt['n']})")
        if idle["server_kib_per_connection"] is not None:
            t.add_row("server memory", f"{_fmt(idle['server_kib_per_connection'])} KiB per idle connection")
        if idle.get("server_us_per_connection_s") is not None:
            cpu = _fmt(idle["server_us_per_connection_s"])
            t.add_row("server CPU", f"{cpu} us per idle connection per second")
    Console().print(t)


def _cdf(ax: Any, seconds: Sequence[float], label: str) -> None:
    xs = sorted(1000 * s for s in seconds)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def write_plot(res: LoadResult, report: dict[str, Any], path: Path) -> None:
    """Latency CDFs (TTFT, inter-token, idle ping RTT) and tokens/s over time, as a PNG (Agg backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_cdf, ax_ts = fig.subplots(1, 2)
    ok = [r for r in res.records if r.ok]
    series = [
        ([t for r in ok if (t := r.ttft) is not None], "TTFT"),
        ([x for r in ok for x in r.itl], "inter-token"),
    ]
    if res.idle is not None:
        series.append((res.idle.rtt, "idle ping RTT"))
    for values, label in series:
        if values:
            _cdf(ax_cdf, values, label)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("milliseconds (log)")
    ax_cdf.set_ylabel("fraction")
    ax_cdf.set_title("latency CDFs")
    ax_cdf.grid(True, which="both", alpha=0.3)
    if ax_cdf.get_legend_handles_labels()[0]:
        ax_cdf.legend(loc="lower right")
    _, xs, ys = rate_series(res)
    ax_ts.plot(xs, ys, marker=".")
    mean = report["tokens"]["per_s"]
    if mean:
        ax_ts.axhline(mean, linestyle="--", color="gray", label=f"mean {mean:,.0f} tokens/s")
        ax_ts.legend(loc="lower right")
    ax_ts.set_xlabel("seconds since start")
    ax_ts.set_ylabel("tokens/s (all users)")
    ax_ts.set_title("throughput over time")
    ax_ts.set_ylim(bottom=0)
    ax_ts.grid(True, alpha=0.3)
    rq = report["requests"]
    fig.suptitle(
        f"tokenwire load: {rq['ok']}/{rq['issued']} ok, {report['drops']['integrity_violations']} "
        f"integrity violations, {res.cfg.users} users"
    )
    fig.savefig(path, dpi=100)
