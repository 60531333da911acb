"""``--dtype auto`` on CPU: both dtypes are timed and the faster one is kept, with both figures logged."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from server.engine import dtype as dtype_mod
from server.engine import machine
from server.engine.model import load_model


def test_auto_keeps_fp32_for_a_model_too_small_to_matter(tiny_model_dir: Path) -> None:
    m = load_model(tiny_model_dir)
    assert m.dtype == torch.float32 and next(m.model.parameters()).dtype == torch.float32
    assert "too small" in m.dtype_note


Step = tuple[torch.dtype, str]  # a timed decode step's dtype and decode kernel


@pytest.fixture
def measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    """The dtype and decode kernel of every decode step timed, in order; the tiny model counts as big
    enough to time, and choices are remembered in a folder of this test's own."""
    monkeypatch.setattr(dtype_mod, "SMALL_MODEL_PARAMS", 0)
    monkeypatch.setenv("TOKENWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENWIRE_DTYPE_REMEASURE", raising=False)
    monkeypatch.delenv("TOKENWIRE_DECODE_KERNEL", raising=False)
    steps: list[Step] = []
    real = dtype_mod.decode_stepper

    def spy(model: Any, **kw: int) -> Callable[..., float]:
        step = real(model, **kw)
        dt = next(model.parameters()).dtype

        def timed(kernel: str = "sdpa") -> float:
            steps.append((dt, kernel))
            return step(kernel)

        return timed

    monkeypatch.setattr(dtype_mod, "decode_stepper", spy)
    return steps


def test_auto_times_both_dtypes_in_turn_and_keeps_bf16_only_when_clearly_faster(
    tiny_model_dir: Path, measured: list[Step]
) -> None:
    m = load_model(tiny_model_dir)
    # A warm-up each, then fp32 and bf16 in turn: a noisy moment hits both.
    f32, b16 = (torch.float32, "sdpa"), (torch.bfloat16, "sdpa")
    n = 2 * (1 + dtype_mod.MEASURE_REPS)
    assert measured[:n] == [f32, b16] + [f32, b16] * dtype_mod.MEASURE_REPS
    # Then the decode kernels in turn, in the dtype kept.
    sdpa, kq = (m.dtype, "sdpa"), (m.dtype, "kq")
    assert measured[n:] == [sdpa, kq] * (1 + dtype_mod.MEASURE_REPS)
    assert next(m.model.parameters()).dtype == m.dtype
    fig = m.dtype_figures
    assert fig["float32_ms"] > 0 and fig["bfloat16_ms"] > 0
    clearly = fig["bfloat16_ms"] < dtype_mod.BF16_MARGIN * fig["float32_ms"]
    assert m.dtype == (torch.bfloat16 if clearly else torch.float32)
    assert "float32" in m.dtype_note and "bfloat16" in m.dtype_note and "measured now" in m.dtype_note


@pytest.mark.parametrize(("bf16_s", "kept"), [(0.95, torch.float32), (0.85, torch.bfloat16)])
def test_a_near_tie_keeps_float32(
    tiny_model_dir: Path,
    measured: list[Step],
    monkeypatch: pytest.MonkeyPatch,
    bf16_s: float,
    kept: Any,
) -> None:
    monkeypatch.setattr(dtype_mod, "interleaved_seconds", lambda *models: [1.0, bf16_s])
    assert load_model(tiny_model_dir).dtype == kept


def test_the_choice_is_remembered_per_machine_torch_and_model(
    tiny_model_dir: Path, measured: list[Step], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_model(tiny_model_dir)
    n = len(measured)
    assert n > 0
    again = load_model(tiny_model_dir)  # a later start: nothing timed, the same choices and figures
    assert len(measured) == n
    assert again.dtype == first.dtype and next(again.model.parameters()).dtype == first.dtype
    assert "remembered" in again.dtype_note
    assert again.dtype_figures == pytest.approx(first.dtype_figures, abs=0.01)
    assert again.decode_kernel == first.decode_kernel and "remembered" in again.kernel_note
    monkeypatch.setenv("TOKENWIRE_DTYPE_REMEASURE", "1")  # asked to measure again
    load_model(tiny_model_dir)
    assert len(measured) == 2 * n
    monkeypatch.delenv("TOKENWIRE_DTYPE_REMEASURE")
    real = machine.cpu_info
    monkeypatch.setattr(machine, "cpu_info", lambda: {**real(), "flags": ["avx2"]})  # another CPU
    load_model(tiny_model_dir)
    assert len(measured) == 3 * n


def test_a_named_dtype_is_used_as_given(tiny_model_dir: Path) -> None:
    m = load_model(tiny_model_dir, dtype="bfloat16")
    assert m.dtype == torch.bfloat16 and next(m.model.parameters()).dtype == torch.bfloat16


def test_the_decode_kernel_is_timed_in_the_dtype_that_serves(
    tiny_model_dir: Path, measured: list[Step]
) -> None:
    m = load_model(tiny_model_dir, dtype="bfloat16")  # a named dtype: only the kernels are timed
    b16 = torch.bfloat16
    assert measured == [(b16, "sdpa"), (b16, "kq")] * (1 + dtype_mod.MEASURE_REPS)
    assert "measured now" in m.kernel_note and "K @ q^T" in m.kernel_note
    assert m.decode_kernel in ("sdpa", "kq")


@pytest.mark.parametrize(("kq_s", "kept"), [(0.97, "sdpa"), (0.9, "kq")])
def test_the_by_hand_kernel_is_kept_only_when_clearly_faster(
    tiny_model_dir: Path, measured: list[Step], monkeypatch: pytest.MonkeyPatch, kq_s: float, kept: str
) -> None:
    monkeypatch.setattr(dtype_mod, "_interleaved", lambda steps: [1.0, kq_s])
    m = load_model(tiny_model_dir, dtype="float32")
    assert m.decode_kernel == kept and kept in m.kernel_note


def test_a_named_decode_kernel_is_used_without_timing(
    tiny_model_dir: Path, measured: list[Step], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENWIRE_DECODE_KERNEL", "kq")
    m = load_model(tiny_model_dir, dtype="float32")
    assert m.decode_kernel == "kq" and measured == []
    monkeypatch.setenv("TOKENWIRE_DECODE_KERNEL", "flash")
    with pytest.raises(ValueError, match="TOKENWIRE_DECODE_KERNEL=flash: one of sdpa, kq"):
        load_model(tiny_model_dir, dtype="float32")


@pytest.mark.parametrize(
    "damage",
    [
        lambda e: e.update({k: "x" for k in e if k.endswith("_ms")}),  # a figure not a number
        lambda e: e.pop(next(k for k in e if k.endswith("_ms"))),  # a figure missing
        lambda e: e.update(chosen="float64"),  # a choice this code never writes
    ],
    ids=["not-a-number", "missing", "unknown-choice"],
)
def test_a_damaged_choices_file_costs_a_measurement_not_a_start(
    tiny_model_dir: Path, tmp_path: Path, measured: list[Step], damage: Callable[[dict[str, Any]], Any]
) -> None:
    load_model(tiny_model_dir)
    n = len(measured)
    path = tmp_path / "cache" / dtype_mod.CHOICES_FILE
    choices = json.loads(path.read_text())
    assert len(choices) == 2  # the dtype's and the decode kernel's
    for entry in choices.values():
        damage(entry)
    path.write_text(json.dumps(choices))
    again = load_model(tiny_model_dir)
    assert len(measured) == 2 * n  # both measured again
    assert "measured now" in again.dtype_note and "measured now" in again.kernel_note


@pytest.mark.parametrize("how", ["auto", "bfloat16"])
def test_bf16_keeps_the_rotary_frequencies_in_float32(
    tiny_model_dir: Path, measured: list[Step], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # Module.to(bf16) casts every float buffer: the rotary inv_freq too, which put the angle of position
    # 1,000 off by up to a radian (|cos| off by 0.18 there, 0.71 by 4,096), the model and the engine's
    # tables alike, so bf16 serving attended worse the longer the conversation. transformers keeps it in
    # float32 when it loads in bf16; the auto choice on CPU (and CUDA's bf16) cast it after loading.
    monkeypatch.setattr(dtype_mod, "BF16_MARGIN", 1e9)  # auto keeps bf16 whatever the timings
    fp32 = load_model(tiny_model_dir, dtype="float32").model
    bf16 = load_model(tiny_model_dir, dtype=how).model
    assert next(bf16.parameters()).dtype == torch.bfloat16
    rotary = bf16.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32 and "inv_freq" in dict(rotary.named_buffers())
    positions = torch.arange(4096)[None]
    cos16, sin16 = rotary(torch.zeros(1), positions)
    cos32, sin32 = fp32.model.rotary_emb(torch.zeros(1), positions)
    torch.testing.assert_close((cos16, sin16), (cos32, sin32), rtol=0, atol=1e-6)
