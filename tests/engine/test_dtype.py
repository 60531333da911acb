"""``--dtype auto`` on CPU: both dtypes are timed and the faster one is kept, with both figures logged."""

from __future__ import annotations

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


@pytest.fixture
def measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtype of every decode step timed, in order; the tiny model counts as big enough to time, and
    choices are remembered in a folder of this test's own."""
    monkeypatch.setattr(dtype_mod, "SMALL_MODEL_PARAMS", 0)
    monkeypatch.setenv("TOKENWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENWIRE_DTYPE_REMEASURE", raising=False)
    steps: list[torch.dtype] = []
    real = dtype_mod.decode_stepper

    def spy(model: Any, **kw: int) -> Callable[[], float]:
        step = real(model, **kw)
        dt = next(model.parameters()).dtype

        def timed() -> float:
            steps.append(dt)
            return step()

        return timed

    monkeypatch.setattr(dtype_mod, "decode_stepper", spy)
    return steps


def test_auto_times_both_dtypes_in_turn_and_keeps_bf16_only_when_clearly_faster(
    tiny_model_dir: Path, measured: list[torch.dtype]
) -> None:
    m = load_model(tiny_model_dir)
    # A warm-up each, then fp32 and bf16 in turn: a noisy moment hits both.
    f32, b16 = torch.float32, torch.bfloat16
    assert measured == [f32, b16] + [f32, b16] * dtype_mod.MEASURE_REPS
    assert next(m.model.parameters()).dtype == m.dtype
    fig = m.dtype_figures
    assert fig["float32_ms"] > 0 and fig["bfloat16_ms"] > 0
    clearly = fig["bfloat16_ms"] < dtype_mod.BF16_MARGIN * fig["float32_ms"]
    assert m.dtype == (torch.bfloat16 if clearly else torch.float32)
    assert "float32" in m.dtype_note and "bfloat16" in m.dtype_note and "measured now" in m.dtype_note


@pytest.mark.parametrize(("bf16_s", "kept"), [(0.95, torch.float32), (0.85, torch.bfloat16)])
def test_a_near_tie_keeps_float32(
    tiny_model_dir: Path,
    measured: list[torch.dtype],
    monkeypatch: pytest.MonkeyPatch,
    bf16_s: float,
    kept: Any,
) -> None:
    monkeypatch.setattr(dtype_mod, "interleaved_seconds", lambda *models: [1.0, bf16_s])
    assert load_model(tiny_model_dir).dtype == kept


def test_the_choice_is_remembered_per_machine_torch_and_model(
    tiny_model_dir: Path, measured: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_model(tiny_model_dir)
    n = len(measured)
    assert n > 0
    again = load_model(tiny_model_dir)  # a later start: nothing timed, the same choice and figures
    assert len(measured) == n
    assert again.dtype == first.dtype and next(again.model.parameters()).dtype == first.dtype
    assert "remembered" in again.dtype_note
    assert again.dtype_figures == pytest.approx(first.dtype_figures, abs=0.01)
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
