"""``--dtype auto``: bf16 on CUDA; on CPU, whichever of fp32 and bf16 runs a decode step clearly faster here.

CPUs differ: with AMX or AVX512-BF16 a bf16 step can take half the time of an fp32 one; on a CPU with
AVX2 only, bf16 GEMMs are emulated and usually slower. So the choice is measured: a few decode steps of
the model itself (32 rows over 128 cached positions, the Llama path the engine runs) in each dtype,
interleaved (fp32, bf16, fp32, ...) so that a noisy moment hits both, and compared by their medians.
bf16 is kept only when it is clearly faster (under ``BF16_MARGIN`` of fp32's step); a near tie keeps
the float default, which is exact. The choice and both figures are logged.

The choice is then remembered (``dtype-choices.json`` in the model cache folder) per CPU model and flags,
core and thread count, torch version and model, so later starts on the same machine skip the measurement
(a few seconds); a new machine, torch or model measures again. ``TOKENWIRE_DTYPE_REMEASURE=1`` forces it.

The same measurement, in the dtype that serves, picks how decode rows attend on CPU
(``pick_decode_kernel``): SDPA, or by hand with the scores as K @ q^T (``llama.DECODE_KERNELS``). Which is
faster depends on the CPU and the dtype, so it is timed, not assumed, and remembered the same way.
So is up to how many rows a decode step reads a 4-bit checkpoint's own 4 bits (``pick_int4_rows``,
``int4.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import structlog
import torch

log = structlog.get_logger(__name__)

MEASURE_ROWS = 32
MEASURE_CONTEXT = 128
MEASURE_REPS = 5
BF16_MARGIN = 0.9  # bf16 must take under 90% of fp32's step to be kept
KQ_MARGIN = 0.95  # the by-hand decode kernel must take under 95% of SDPA's step to be kept
INT4_ROWS = (1, 2, 4, 8, 16)  # decode steps timed on the 4-bit copies and on the packed weights
# The 4-bit step must take under 95% of the packed one at every row count up to R. The start's timings
# repeat to about 2% (five starts on a 2-core AVX512-BF16 EPYC: 8 rows at 0.91-0.93 of the packed step),
# and a row count that measured 0.91 was worth taking: 8 users' tokens came 7% faster with it (2026-12-07,
# alternated, 361.5 / 359.6 against 333.6 / 337.9 tok/s) where the old 90% margin stopped at 4 rows.
INT4_MARGIN = 0.95
INT4_CHOICES = tuple(str(r) for r in (0, *INT4_ROWS))  # what a remembered row count may be
SMALL_MODEL_PARAMS = 20_000_000  # below this a step is overhead, not matmuls: fp32, nothing to measure
CHOICES_FILE = "dtype-choices.json"
MAX_CHOICES = 64  # remembered (machine, torch, model) keys; the oldest go first


def decode_stepper(
    model: Any, *, rows: int = MEASURE_ROWS, context: int = MEASURE_CONTEXT, weights: Any = None
) -> Callable[..., float]:
    """A function that runs one decode step of ``rows`` sequences at position ``context`` - 1 and returns
    its seconds (the first call includes oneDNN creating its primitives: a warm-up). Its optional
    arguments: the decode kernel to attend with (``llama.DECODE_KERNELS``; default SDPA), and the
    ``llama.Weights`` to run (default: ``weights``, else the model's, built here once)."""
    from server.engine import llama

    shape = llama.shape_of(model)
    dtype = next(model.parameters()).dtype
    if weights is None:
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

    def step(kernel: str = "sdpa", w: Any = None) -> float:
        cache.decode_kernel = kernel
        with torch.inference_mode():
            t0 = time.perf_counter()
            llama.forward(weights if w is None else w, shape, cache, layout)
            return time.perf_counter() - t0

    return step


def interleaved_seconds(*models: Any) -> list[float]:
    """Median decode-step seconds of each model, their steps taken in turn (a warm-up each first)."""
    return _interleaved([decode_stepper(m) for m in models])


def _interleaved(steps: list[Callable[[], float]]) -> list[float]:
    for step in steps:
        step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(MEASURE_REPS):
        for step, ts in zip(steps, times, strict=True):
            ts.append(step())
    return [statistics.median(ts) for ts in times]


class DtypeChoice(NamedTuple):
    model: Any  # the model to serve, in ``dtype``
    dtype: torch.dtype
    figures: dict[str, float]  # both step times in ms; empty when nothing was measured
    remembered: bool = False  # the figures are an earlier start's, from the cache folder


def cast(model: Any, dtype: torch.dtype) -> Any:
    """``model.to(dtype)`` (in place; returns it), but the rotary frequency buffers (``inv_freq``) stay
    float32, as transformers keeps them when it loads a model in bf16: ``Module.to`` casts every float
    buffer, and a bf16 ``inv_freq`` (8 bits of mantissa) puts the rotary angle of position 1,000 off by
    up to a radian, so attention degrades with the length of the conversation."""
    kept = [(name, buf) for name, buf in model.named_buffers() if name.endswith("inv_freq")]
    model.to(dtype)  # replaces each buffer with a cast copy: ``kept`` still holds the originals
    for name, buf in kept:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buf)  # a buffer's setattr keeps it a buffer, as it was
    return model


def pick_cpu_dtype(model: Any, cache_dir: Path | None = None) -> DtypeChoice:
    """The clearly faster of fp32 and a bf16 copy (nothing is measured for a model too small to matter,
    or not on the Llama path: fp32), or the choice ``cache_dir`` remembers for this machine."""
    n_params = _measurable_params(model)
    if n_params is None:
        return DtypeChoice(model, torch.float32, {})
    key = _choice_key(model, n_params)
    known = _remembered(cache_dir, key, figures=("float32_ms", "bfloat16_ms"))
    if known is not None:
        figures = {k: float(known[k]) for k in ("float32_ms", "bfloat16_ms")}
        if known["chosen"] == "bfloat16":
            return DtypeChoice(cast(model, torch.bfloat16), torch.bfloat16, figures, remembered=True)
        return DtypeChoice(model, torch.float32, figures, remembered=True)
    bf16 = cast(copy.deepcopy(model), torch.bfloat16)
    fp32_s, bf16_s = interleaved_seconds(model, bf16)
    figures = {"float32_ms": fp32_s * 1000, "bfloat16_ms": bf16_s * 1000}
    keep_bf16 = bf16_s < BF16_MARGIN * fp32_s
    _remember(cache_dir, key, "bfloat16" if keep_bf16 else "float32", figures)
    if keep_bf16:
        return DtypeChoice(bf16, torch.bfloat16, figures)
    del bf16
    return DtypeChoice(model, torch.float32, figures)


class KernelChoice(NamedTuple):
    kernel: str  # one of llama.DECODE_KERNELS
    figures: dict[str, float]  # each kernel's step time in ms ("sdpa_ms", "kq_ms"); empty: nothing measured
    remembered: bool = False


def pick_decode_kernel(model: Any, cache_dir: Path | None = None) -> KernelChoice:
    """How decode rows attend on this CPU, in the model's dtype: a decode step of the model itself with
    each of ``llama.DECODE_KERNELS``, in turn, one set of weights; "kq" is kept only when its step is
    clearly faster (under ``KQ_MARGIN`` of SDPA's), else SDPA, the library's kernel. Remembered like the
    dtype (keyed by the dtype too); nothing is measured for a small or non-Llama model (SDPA)."""
    from server.engine import llama

    n_params = _measurable_params(model)
    if n_params is None:
        return KernelChoice("sdpa", {})
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    key = f"{_choice_key(model, n_params)}:decode-kernel:{dtype}"
    names = tuple(f"{k}_ms" for k in llama.DECODE_KERNELS)  # each kernel's figure, in that order
    known = _remembered(cache_dir, key, allowed=llama.DECODE_KERNELS, figures=names)
    if known is not None:
        return KernelChoice(str(known["chosen"]), {k: float(known[k]) for k in names}, remembered=True)
    step = decode_stepper(model)
    seconds = _interleaved([functools.partial(step, kernel) for kernel in llama.DECODE_KERNELS])
    figures = {name: s * 1000 for name, s in zip(names, seconds, strict=True)}
    chosen = "kq" if figures["kq_ms"] < KQ_MARGIN * figures["sdpa_ms"] else "sdpa"
    _remember(cache_dir, key, chosen, figures)
    return KernelChoice(chosen, figures)


class Int4Choice(NamedTuple):
    rows: int  # decode steps of at most this many rows read the 4-bit copies; 0: none does
    figures: dict[str, float]  # "plain_R_ms" and "int4_R_ms" for each R of INT4_ROWS measured
    remembered: bool = False


def int4_known_unused(model: Any, requested: str, cache_dir: Path | None) -> bool:
    """Whether this start will not use the 4-bit copies unless a row count is named, as far as the
    choices remembered on this machine tell: an earlier start measured them no faster in the dtype this
    one will serve. Then a start need not look for them (0.7 s for SmolLM2-135M). False when anything is
    unknown: then they are looked for."""
    n_params = _measurable_params(model)
    if n_params is None or requested not in ("auto", "bfloat16"):
        return False
    serves = requested
    if requested == "auto":
        known = _remembered(cache_dir, _choice_key(model, n_params), figures=("float32_ms", "bfloat16_ms"))
        if known is None:
            return False
        serves = str(known["chosen"])
    entry = _remembered(cache_dir, _int4_key(model, n_params, serves), allowed=INT4_CHOICES)
    return entry is not None and entry["chosen"] == "0"


def _int4_key(model: Any, n_params: int, dtype: str) -> str:
    # The margin is part of the key: a count remembered under another rule is measured again, once.
    return f"{_choice_key(model, n_params)}:int4-rows:{dtype}:margin-{INT4_MARGIN}"


def pick_int4_rows(model: Any, layers: Any, kernel: str, cache_dir: Path | None = None) -> Int4Choice:
    """Up to how many rows a decode step runs faster on the layers' 4-bit copies (``int4.py``; ``layers``
    as ``int4.model_layers`` gives them, scales in bf16) than on the packed weights: a
    decode step of the model at each of ``INT4_ROWS`` rows both ways, in turn (the 4-bit kernel's cost
    grows with the rows, the packed GEMMs' hardly). The largest R such that every count up to it ran
    under ``INT4_MARGIN`` of the packed step; 0 when one row does not. Remembered like the dtype."""
    from server.engine import llama

    n_params = _measurable_params(model)
    if n_params is None:
        return Int4Choice(0, {})
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    key = _int4_key(model, n_params, dtype)
    names = tuple(f"{kind}_{r}_ms" for r in INT4_ROWS for kind in ("plain", "int4"))
    known = _remembered(cache_dir, key, allowed=INT4_CHOICES, figures=names)
    if known is not None:
        return Int4Choice(int(known["chosen"]), {k: float(known[k]) for k in names}, remembered=True)
    fours = llama.weights_of(model, MEASURE_CONTEXT, int4=layers, int4_rows=max(INT4_ROWS))
    plain = dataclasses.replace(fours, int4_rows=0)
    figures: dict[str, float] = {}
    for rows in INT4_ROWS:
        step = decode_stepper(model, rows=rows, weights=fours)
        seconds = _interleaved([functools.partial(step, kernel, plain), functools.partial(step, kernel)])
        figures[f"plain_{rows}_ms"], figures[f"int4_{rows}_ms"] = (s * 1000 for s in seconds)
    chosen = 0
    for rows in INT4_ROWS:
        if figures[f"int4_{rows}_ms"] >= INT4_MARGIN * figures[f"plain_{rows}_ms"]:
            break
        chosen = rows
    _remember(cache_dir, key, str(chosen), figures)
    return Int4Choice(chosen, figures)


def _measurable_params(model: Any) -> int | None:
    """The model's parameter count when a decode step is worth timing (big enough, on the Llama path the
    engine runs); None when it is not, and the defaults stand."""
    from server.engine import llama

    n_params = int(sum(p.numel() for p in model.parameters()))
    if n_params < SMALL_MODEL_PARAMS or llama.unsupported_reason(model) is not None:
        return None
    return n_params


def _choice_key(model: Any, n_params: int) -> str:
    """What the choice depends on: the CPU (model, flags, cores, threads), torch and the model."""
    from server.engine.machine import cpu_info

    cpu = cpu_info()
    config = getattr(model, "config", None)
    name = str(getattr(config, "_name_or_path", "") or type(model).__name__)
    parts = [cpu["model"], " ".join(cpu["flags"]), cpu["cores"], cpu["threads"], cpu["torch"], name, n_params]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _remembered(
    cache_dir: Path | None,
    key: str,
    allowed: tuple[str, ...] = ("float32", "bfloat16"),
    figures: tuple[str, ...] = (),
) -> dict[str, Any] | None:
    """The remembered entry for ``key``, or None (then it is measured again): none, asked to measure
    again, or an entry that is not one this code wrote (a choice not ``allowed``, a figure missing or not
    a number), so that a damaged file costs a measurement, never a start."""
    if cache_dir is None or os.environ.get("TOKENWIRE_DTYPE_REMEASURE") == "1":
        return None
    entry = _read(cache_dir).get(key)
    if not isinstance(entry, dict) or entry.get("chosen") not in allowed:
        return None
    if all(isinstance(entry.get(f), int | float) and not isinstance(entry.get(f), bool) for f in figures):
        return entry
    return None


def _remember(cache_dir: Path | None, key: str, chosen: str, figures: dict[str, float]) -> None:
    if cache_dir is None:
        return
    choices = _read(cache_dir)
    choices.pop(key, None)
    choices[key] = {"chosen": chosen, **{k: round(v, 2) for k, v in figures.items()}, "at": int(time.time())}
    while len(choices) > MAX_CHOICES:
        choices.pop(next(iter(choices)))
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f".{CHOICES_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(choices, indent=1))
        tmp.replace(cache_dir / CHOICES_FILE)  # atomic: two processes starting at once never see half
    except OSError as exc:  # a read-only cache folder: measure again next time
        log.warning("model.dtype_not_remembered", error=str(exc))


def _read(cache_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((cache_dir / CHOICES_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
