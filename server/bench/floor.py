"""The hardware's side of a decode step: the matmul-only floor, the roofline, and where the step's time goes.

The floor of a decode step at R rows is the time of the model's linear layers and its LM head on R rows,
nothing else (no attention, norms, rotary, sampling or bookkeeping), through the same GEMM calls the
engine makes (``llama.linear``: oneDNN on packed weights, the 4-bit copies at a few rows where a
checkpoint is 4-bit, or MKL/cuBLAS). The engine's median decode
step over that floor at the same R is how close a step comes to what the hardware can do for its GEMMs.

The floor leaves attention out, and attention is memory traffic: a decode row's query reads every key and
value of its sequence, 2 FLOPs per number read. So the **roofline** of a step is the larger of the floor
and the time to read what the step must read at the machine's read bandwidth, measured in the same run:
every weight of the linear layers and LM head in the step's dtype once (the layers' 4-bit copies where
the step reads those), plus every decode row's KV at its
real (live) length. ``step_over_roofline`` is the median decode step over its own roofline.

Attention's FLOPs are left out of the roofline on purpose: at one query per row they are 2 per KV number,
a fraction of what the bytes cost at this bandwidth (an fp32 KV number is 4 bytes: 0.5 FLOP per byte,
where a core does tens per byte it can read), so they never bind.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from server.engine import llama
from server.engine.profile import StepRecord

PHASES = (
    "linear",
    "attention",
    "norms+rotary",
    "other",
    "layout",
    "kv moves",
    "sampling",
    "schedule",
    "postprocess",
    "hand-off",
)
PHASE_NOTES = {
    "linear": "the model's linear layers and LM head (GEMMs)",
    "attention": "SDPA over the slot views, per pool",
    "norms+rotary": "RMSNorms and rotary embeddings",
    "other": "embedding, KV writes, SiLU*up, views",
    "layout": "the step's token layout as tensors (runner.layout)",
    "kv moves": "slot copies after sequences leave (Move/Swap)",
    "sampling": "logits to tokens (sampling.sample)",
    "schedule": "the scheduler's choice of work",
    "postprocess": "detokenising, stop strings, output rules",
    "hand-off": "on_step: every output to the worker",
}


def matmul_floor(weights: llama.Weights, rows: int, *, reps: int = 5) -> float:
    """Median seconds of one decode step's linear layers plus the LM head at ``rows`` rows."""
    dev = weights.embed.device
    dtype = weights.embed.dtype
    first = weights.layers[0]
    d = first.qkv.w.shape[1]
    inner = first.gate_up.w.shape[0] // 2
    attn = first.o.w.shape[1]
    x = torch.randn(rows, d, dtype=dtype, device=dev)
    a = torch.randn(rows, attn, dtype=dtype, device=dev)
    m = torch.randn(rows, inner, dtype=dtype, device=dev)

    small = weights.reads_int4(rows)  # as the forward decides

    def one() -> float:
        t0 = time.perf_counter()
        for L in weights.layers:
            llama.linear(x, L.qkv, small)
            llama.linear(a, L.o, small)
            llama.linear(x, L.gate_up, small)
            llama.linear(m, L.down, small)
        llama.linear(x, weights.lm_head)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.inference_mode():
        one()  # warm-up: oneDNN primitives are created on first use for each shape
        return statistics.median(one() for _ in range(reps))


FLOOR_ROW_COUNTS = 8  # row counts measured: the most frequent among the decode steps (and the largest)


def floors(
    weights: llama.Weights, rows: Iterable[int], *, reps: int = 3, also: Iterable[int] = ()
) -> dict[int, float]:
    """The floor at the row counts most decode steps ran at (at most FLOOR_ROW_COUNTS of them, always
    including the largest), and at the row counts in ``also``: measuring all of them takes minutes on a
    busy 2-core machine."""
    counts = Counter(rows)
    if not counts:
        return {}
    chosen = {max(counts), *(r for r, _ in counts.most_common(FLOOR_ROW_COUNTS - 1)), *also}
    return {r: matmul_floor(weights, r, reps=reps) for r in sorted(chosen)}


def floor_at(floor: dict[int, float], rows: int) -> float:
    """The floor at ``rows``, linearly interpolated between the two nearest row counts measured (a GEMM's
    time grows with its rows; between two measured counts a line is the plain estimate), and clamped to
    the nearest measured count outside their range."""
    if rows in floor:
        return floor[rows]
    below = [r for r in floor if r < rows]
    above = [r for r in floor if r > rows]
    if not below or not above:
        return floor[max(below)] if below else floor[min(above)]
    lo, hi = max(below), min(above)
    return floor[lo] + (floor[hi] - floor[lo]) * (rows - lo) / (hi - lo)


def padded_bound(out_lens: Sequence[int], floor: dict[int, float]) -> dict[str, Any] | None:
    """engine / padded_loop if both ran every decode step at its matmul floor: what not computing
    finished rows can win on this workload with this machine's GEMMs, before either path's overhead.

    Both sample each request's first token in prefill, which they share, so only decode steps count:
    request i needs ``out_lens[i] - 1`` of them. The padded loop runs max(those) steps at all N rows; a
    continuous batcher at best runs step t with only the requests still decoding. A step's floor is
    far from proportional to its rows (the weights are read once per step whatever the rows), which is
    what bounds the ratio. The measured ratio is this bound times how much closer the engine's steps come
    to their floor than the padded loop's do."""
    need = [n - 1 for n in out_lens if n > 1]
    if not need or not floor:
        return None
    n, steps = len(out_lens), max(need)
    padded = steps * floor_at(floor, n)
    engine = sum(floor_at(floor, sum(1 for k in need if k > t)) for t in range(steps))
    return {
        "bound": round(padded / engine, 2),
        "requests": n,
        "decode_steps": steps,
        "decode_rows": sum(need),  # the rows the engine must compute, against steps * n padded
        "padded_ms": round(padded * 1000, 1),
        "engine_ms": round(engine * 1000, 1),
    }


def decode_steps(steps: Iterable[StepRecord]) -> list[StepRecord]:
    """Decode-only steps (no prefill chunk), the ones the floor compares with."""
    return [s for s in steps if s.prefill == 0 and s.rows > 0]


def step_over_floor(steps: list[StepRecord], floor: dict[int, float]) -> dict[str, Any]:
    """The median decode step over the floor at its own row count, and the step at the median."""
    ratios = [s.seconds / floor[s.rows] for s in steps if s.rows in floor]
    times = [s.seconds for s in steps]
    return {
        "step_over_floor": round(statistics.median(ratios), 2) if ratios else None,
        "decode_steps": len(steps),
        "steps_compared": len(ratios),  # decode steps at a row count whose floor was measured
        "median_step_ms": round(statistics.median(times) * 1000, 1) if times else None,
    }


def breakdown(steps: list[StepRecord], rows: int) -> dict[str, float]:
    """Median milliseconds per phase over the decode steps at ``rows`` rows (plus their median total)."""
    at = [s for s in steps if s.rows == rows]
    if not at:
        return {}
    out = {p: round(statistics.median(s.phases.get(p, 0.0) for s in at) * 1000, 2) for p in PHASES}
    out["total"] = round(statistics.median(s.seconds for s in at) * 1000, 2)
    return out


def read_bandwidth(device: torch.device | str = "cpu", *, mib: int = 512, reps: int = 5) -> float:
    """The machine's read bandwidth in bytes/s: the median of summing a ``mib`` MiB tensor (far larger
    than any cache), with the engine's threads."""
    dev = torch.device(device)
    x = torch.ones(mib << 18, dtype=torch.float32, device=dev)  # mib MiB of float32
    # A GPU reads 512 MiB in a fraction of a millisecond, against which one sync's latency counts:
    # several sums a timing there.
    inner = 10 if dev.type == "cuda" else 1
    times = []
    with torch.inference_mode():
        for i in range(reps + 1):
            t0 = time.perf_counter()
            for _ in range(inner):
                x.sum()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i:  # the first is warm-up
                times.append((time.perf_counter() - t0) / inner)
    return x.numel() * x.element_size() / statistics.median(times)


def weight_bytes(weights: llama.Weights, rows: int = 0) -> int:
    """Bytes a decode step of ``rows`` rows reads of weights: every linear layer and the LM head once, in
    the step's dtype, or the layers' 4-bit copies where such a step reads them (norms and the embedding
    rows it looks up are a few KB)."""
    size = weights.embed.element_size()
    small = weights.reads_int4(rows)
    lins = [x for layer in weights.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    total = weights.lm_head.in_features * weights.lm_head.out_features * size
    for x in lins:
        total += x.int4.nbytes if small and x.int4 is not None else x.in_features * x.out_features * size
    return total


def roofline(
    steps: list[StepRecord],
    floor: dict[int, float],
    *,
    bandwidth: float,
    weights: Callable[[int], int],
    kv_per_token: int,
) -> dict[str, Any]:
    """Each decode step (at a row count whose floor was measured) over max(floor, bytes / bandwidth),
    ``weights(rows)`` the bytes of weights a step of that many rows reads; the median, and the bytes of
    the median step."""
    at = []  # (step / its roofline, step, bytes read, roofline)
    for s in steps:
        if s.rows not in floor:
            continue
        nbytes = weights(s.rows) + s.kv_tokens * kv_per_token
        line = max(floor[s.rows], nbytes / bandwidth)
        at.append((s.seconds / line, s, nbytes, line))
    if not at:
        return {"step_over_roofline": None}
    at.sort(key=lambda x: x[0])
    _, mid, nbytes, line = at[len(at) // 2]
    return {
        "step_over_roofline": round(statistics.median(x[0] for x in at), 2),
        "bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "weight_mb": round(weights(mid.rows) / 1e6, 1),
        "median_step": {
            "rows": mid.rows,
            "ms": round(mid.seconds * 1000, 1),
            "kv_mb": round(mid.kv_tokens * kv_per_token / 1e6, 1),
            "bytes_mb": round(nbytes / 1e6, 1),
            "memory_ms": round(nbytes / bandwidth * 1000, 1),
            "floor_ms": round(floor[mid.rows] * 1000, 1),
            "roofline_ms": round(line * 1000, 1),
        },
    }
