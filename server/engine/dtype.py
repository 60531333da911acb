"""``--dtype auto``: bf16 on CUDA; on CPU, whichever of fp32 and bf16 runs a decode step faster here.

CPUs differ: with AMX or AVX512-BF16 a bf16 step can take half the time of an fp32 one; on a CPU with
AVX2 only, bf16 GEMMs are emulated and usually slower. So the choice is measured at start: a few decode
steps of the model itself (32 rows over 128 cached positions, the Llama path the engine runs) in each
dtype, and the faster one is kept. The choice and both figures are logged.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

MEASURE_ROWS = 32
MEASURE_CONTEXT = 128
MEASURE_REPS = 3
SMALL_MODEL_PARAMS = 20_000_000  # below this a step is overhead, not matmuls: fp32, nothing to measure


def decode_step_seconds(model: Any, *, rows: int = MEASURE_ROWS, context: int = MEASURE_CONTEXT) -> float:
    """Median seconds of a decode step of ``rows`` sequences at position ``context`` - 1."""
    from server.engine import llama

    shape = llama.shape_of(model)
    dtype = next(model.parameters()).dtype
    weights = llama.weights_of(model, context)
    cache = llama.Cache(shape, [(rows, context)], dtype=dtype, device="cpu")
    pos = context - 1
    write = [r for slot in range(rows) for r in cache.rows_of(0, slot, pos)]
    group = llama.DecodeGroup(
        pool=0,
        tok_lo=0,
        tok_hi=rows,
        n_slots=rows,
        length=context,
        mask=torch.ones(rows, 1, 1, context, dtype=torch.bool),
        rows=None,
    )
    layout = llama.StepLayout(
        ids=torch.randint(3, shape.vocab, (rows,)),
        positions=torch.full((rows,), pos),
        write_rows=torch.tensor(write),
        decode=[group],
        prefill=[],
        logits_at=torch.arange(rows),
    )
    times = []
    with torch.inference_mode():
        for i in range(MEASURE_REPS + 1):  # the first is warm-up (oneDNN creates its primitives)
            t0 = time.perf_counter()
            llama.forward(weights, shape, cache, layout)
            if i:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pick_cpu_dtype(model: Any) -> tuple[Any, torch.dtype, dict[str, float]]:
    """Time an fp32 model against a bf16 copy; returns the faster model, its dtype and both step times
    in ms (empty when nothing was measured: a model too small to matter, or not on the Llama path)."""
    from server.engine import llama

    n_params = sum(p.numel() for p in model.parameters())
    if n_params < SMALL_MODEL_PARAMS or llama.unsupported_reason(model) is not None:
        return model, torch.float32, {}
    fp32_s = decode_step_seconds(model)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16_s = decode_step_seconds(bf16)
    figures = {"float32_ms": fp32_s * 1000, "bfloat16_ms": bf16_s * 1000}
    if bf16_s < fp32_s:
        return bf16, torch.bfloat16, figures
    del bf16
    return model, torch.float32, figures
