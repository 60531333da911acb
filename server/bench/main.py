"""The ``tokenwire bench`` command: every path on one workload, the hardware floor, the step profile.

A path that fails fails the bench (exit status 1, the failure in the table and the JSON): no ratio is
ever silently dropped.
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch

from server.bench import floor as fl
from server.bench.models import random_model
from server.bench.paths import (
    OUT_MAX,
    OUT_MIN,
    PATHS,
    POISSON_LOAD,
    PathResult,
    poisson_arrivals,
    run_engine,
    run_hf_cb,
    run_late_join,
    run_padded_loop,
    run_static,
    run_turns,
    workload,
)
from server.engine import llama
from server.engine.machine import cpu_info, cpu_line
from server.engine.model import load_model, pick_device
from server.engine.profile import StepRecord
from server.engine.runner import kv_bytes_per_token
from server.engine.threads import in_own_thread
from server.malloctune import keep_freed_memory_for_the_engine

T = TypeVar("T")

BASELINES = ("padded_loop", "static", "hf_cb")


def main(
    *,
    json_path: str | None = None,
    turns: int = 0,
    device: str | None = None,
    random_weights: str | None = None,
    requests: int = 32,
    seed: int = 0,
    model: str | None = None,
    dtype: str = "auto",
    paths: Sequence[str] = PATHS,
    profile: bool = False,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the bench; the results (as written to ``json_path``). ``results["failed"]`` lists failed paths."""
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise SystemExit(f"--paths: unknown {', '.join(unknown)} (known: {', '.join(PATHS)})")
    torch.set_grad_enabled(False)
    dev = pick_device(device)
    cpu = cpu_info()
    echo(cpu_line(cpu))
    # Every piece of torch work below runs in a thread that ends, so that whichever path runs next
    # (the engine in its own thread) finds no other thread holding an OpenMP pool, as in the server
    # (server/engine/threads.py): a pool left behind here slowed the engine's small steps by a quarter.
    loaded = _own(
        lambda: (
            random_model(random_weights, dev, dtype)
            if random_weights
            else load_model(model, device=dev, dtype=dtype)
        )
    )
    # As in a serving process once its model is loaded (server/malloctune.py): the paths' steps then
    # find what the last one freed, instead of faulting it in again; every path alike.
    keep_freed_memory_for_the_engine()
    dtype_name = loaded.dtype_name
    reqs = _own(lambda: workload(loaded, requests, seed, random_ids=bool(random_weights)))
    echo(
        f"tokenwire bench: {loaded.name} on {dev}, {loaded.dtype_note or dtype_name}; {len(reqs)} requests, "
        f"prompts {min(len(r.prompt_ids) for r in reqs)}-{max(len(r.prompt_ids) for r in reqs)} tokens, "
        f"outputs {OUT_MIN}-{OUT_MAX} ({sum(r.out_len for r in reqs)} useful tokens), greedy, EOS ignored"
    )
    echo(f"decode attention: {loaded.kernel_note or loaded.decode_kernel}")
    if loaded.int4_note:
        echo(f"4-bit weights: {loaded.int4_note}")
    results: dict[str, Any] = {
        "cpu": cpu,
        "dtype": dtype_name,
        "dtype_note": loaded.dtype_note,
        "decode_kernel": loaded.decode_kernel,
        "kernel_note": loaded.kernel_note,
        "int4_rows": loaded.int4_rows,
        "int4_note": loaded.int4_note,
        "failed": [],
    }
    step_log: list[StepRecord] = []
    runners: dict[str, Callable[[], PathResult]] = {
        "padded_loop": lambda: run_padded_loop(loaded, reqs),
        "static": lambda: run_static(loaded, reqs),
        "hf_cb": lambda: run_hf_cb(loaded, reqs),
        "engine": lambda: run_engine(loaded, reqs, step_log=step_log),
    }
    for name in PATHS:
        if name not in paths:
            continue
        try:
            run = (
                (lambda: _poisson(loaded, reqs, results, seed)) if name == "engine_poisson" else runners[name]
            )
            res = _own(run)
        except Exception as exc:  # reported, and it fails the bench
            res = PathResult(note=f"FAILED: {type(exc).__name__}: {exc}"[:300])
            results["failed"].append(name)
        results[name] = asdict(res)
        echo(_row(name, res))
    if step_log:
        out_lens = [r.out_len for r in reqs]
        _own(lambda: _floor(loaded, step_log, results, echo, profile=profile, out_lens=out_lens))
    if "engine" in paths and len(reqs) > 1 and "engine" not in results["failed"]:
        lj = _own(lambda: run_late_join(loaded, reqs))
        results["late_join"] = lj
        echo(
            f"late arrival while {lj['running']} decode: TTFT {lj['ttft_ms']} ms; its prefill alone "
            f"{lj['prefill_alone_ms']} ms + 2 decode steps of {lj['decode_step_ms']} ms = {lj['bound_ms']} ms"
        )
    if turns:
        reuse = _own(lambda: run_turns(loaded, turns, reuse=True))
        no_reuse = _own(lambda: run_turns(loaded, turns, reuse=False))
        results["turns"] = {"reuse": reuse, "no_reuse": no_reuse}
        echo(f"TTFT per turn, prefix reuse (ms):    {reuse}")
        echo(f"TTFT per turn, no prefix reuse (ms): {no_reuse}")
    _ratios(results, echo)
    if results["failed"]:
        echo(f"FAILED: {', '.join(results['failed'])} (see the notes above); the bench fails")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
        echo(f"wrote {json_path}")
    return results


def _own(fn: Callable[[], T]) -> T:
    """``fn()`` in a thread that ends (server/engine/threads.py), without autograd (a thread's own
    setting: ``torch.set_grad_enabled`` above holds for this thread only)."""

    def run() -> T:
        with torch.no_grad():
            return fn()

    return in_own_thread(run)


def _poisson(loaded: Any, reqs: Any, results: dict[str, Any], seed: int) -> PathResult:
    capacity = (results.get("engine") or {}).get("tok_s") or run_engine(loaded, reqs).tok_s or 1.0
    mean_out = statistics.mean(r.out_len for r in reqs)
    rate = POISSON_LOAD * capacity / mean_out
    res = run_engine(loaded, reqs, arrivals=poisson_arrivals(len(reqs), rate, seed))
    res.note = f"{rate:.2f} req/s ({POISSON_LOAD:.0%} of {capacity} tok/s); " + res.note
    return res


def _floor(
    loaded: Any,
    steps: list[StepRecord],
    results: dict[str, Any],
    echo: Callable[[str], None],
    *,
    profile: bool,
    out_lens: list[int],
) -> None:
    """The matmul-only floor at every decode row count the engine ran, the engine's step over it, and
    what the engine could win over the padded loop if both ran at that floor."""
    decode = fl.decode_steps(steps)
    if not decode:
        return
    weights = llama.weights_of(loaded.model, 8, int4=loaded.int4, int4_rows=loaded.int4_rows)
    # 1 row and every request's row too: the padded loop runs at len(out_lens) rows, the engine's last
    # steps at a few, and the bound below interpolates between measured counts.
    floor = fl.floors(weights, (s.rows for s in decode), also=(1, len(out_lens)))
    top = max(s.rows for s in decode)  # the largest decode step the engine ran (its floor is measured)
    summary = fl.step_over_floor(decode, floor)
    results["engine"].update(summary)
    results["floor"] = {
        "rows": top,
        "ms": round(floor[top] * 1000, 3),
        "by_rows_ms": {r: round(t * 1000, 2) for r, t in floor.items()},
    }
    at_top = [s.seconds for s in decode if s.rows == top]
    echo(
        f"{'matmul_floor':15s} {top / floor[top]:>8.1f} tok/s  one decode step of {top} rows: "
        f"linear layers + LM head {floor[top] * 1000:.1f} ms (measured now)"
    )
    echo(
        f"engine decode step over the floor at the same rows: median {summary['step_over_floor']}x over "
        f"{summary['steps_compared']} of {summary['decode_steps']} decode steps (at {top} rows: median step "
        f"{statistics.median(at_top) * 1000:.1f} ms, floor {floor[top] * 1000:.1f} ms)"
    )
    bound = fl.padded_bound(out_lens, floor)
    if bound:
        results["engine"]["padded_bound"] = bound
        echo(
            f"at the floor, engine / padded_loop would be {bound['bound']}x: {bound['decode_rows']} "
            f"decode rows ({bound['engine_ms']} ms of GEMMs) against {bound['decode_steps']} steps x "
            f"{bound['requests']} rows ({bound['padded_ms']} ms)"
        )
    kv_per_token = kv_bytes_per_token(loaded.model, loaded.dtype)
    line = fl.roofline(
        decode,
        floor,
        bandwidth=fl.read_bandwidth(weights.embed.device),
        weights=functools.partial(fl.weight_bytes, weights),
        kv_per_token=kv_per_token,
    )
    over = results["engine"]["step_over_roofline"] = line.pop("step_over_roofline")
    results["roofline"] = line
    if over is not None:
        m = line["median_step"]
        echo(
            f"roofline: reads at {line['bandwidth_gb_s']} GB/s (measured now); a step reads "
            f"{line['weight_mb']} MB of weights + its rows' live KV ({kv_per_token} B a token). Engine "
            f"decode step over max(floor, bytes / bandwidth): median {over}x "
            f"(the median step: {m['rows']} rows, {m['ms']} ms; {m['bytes_mb']} MB = {m['memory_ms']} ms "
            f"of reads, floor {m['floor_ms']} ms)"
        )
    if not any(s.phases for s in decode):
        # Not timed phase by phase (a GPU: server/engine/profile.py): the step's total only, said so.
        results["profile"] = {"rows": top, "ms": {}, "phases": "not timed on this device"}
        if profile:
            echo("decode step profile: phases are timed on CPU only (on a GPU a lap would time launches)")
        return
    parts = fl.breakdown(decode, top)
    results["profile"] = {"rows": top, "ms": parts}
    if profile and parts:
        total = parts["total"]
        echo(f"decode step profile at {top} rows (median ms over {len(at_top)} steps; total {total} ms):")
        for phase in fl.PHASES:
            ms = parts[phase]
            echo(f"  {phase:13s} {ms:8.2f} ms {100 * ms / total:5.1f}%  {fl.PHASE_NOTES[phase]}")
        echo(
            f"  {'(floor)':13s} {floor[top] * 1000:8.2f} ms {100 * floor[top] * 1000 / total:5.1f}%  "
            "the linear layers alone, measured apart"
        )


def _row(name: str, r: PathResult) -> str:
    f = [
        ("-" if x is None else f"{x:.1f}")
        for x in (r.tok_s, r.ttft_p50_ms, r.ttft_p99_ms, r.itl_p50_ms, r.itl_p99_ms)
    ]
    ttft, itl = f"TTFT p50 {f[1]:>8s} p99 {f[2]:>8s} ms", f"ITL p50 {f[3]:>7s} p99 {f[4]:>7s} ms"
    return f"{name:15s} {f[0]:>8s} tok/s  {ttft}  {itl}  {r.note}"


def _ratios(results: dict[str, Any], echo: Callable[[str], None]) -> None:
    engine = (results.get("engine") or {}).get("tok_s")
    if not engine:
        return
    for name in BASELINES:
        base = (results.get(name) or {}).get("tok_s")
        if base:
            results.setdefault("ratios", {})[name] = round(engine / base, 2)
            echo(f"engine / {name}: {engine / base:.2f}x")
