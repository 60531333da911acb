"""``--dtype auto`` on CPU: both dtypes are timed and the faster one is kept, with both figures logged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.engine import dtype as dtype_mod
from server.engine.model import load_model


def test_auto_keeps_fp32_for_a_model_too_small_to_matter(tiny_model_dir: Path) -> None:
    m = load_model(tiny_model_dir)
    assert m.dtype == torch.float32 and next(m.model.parameters()).dtype == torch.float32
    assert "too small" in m.dtype_note


def test_auto_times_both_dtypes_and_keeps_the_faster(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dtype_mod, "SMALL_MODEL_PARAMS", 0)
    timed: list[torch.dtype] = []
    real = dtype_mod.decode_step_seconds

    def spy(model: object, **kw: int) -> float:
        timed.append(next(model.parameters()).dtype)  # type: ignore[attr-defined]
        return real(model, **kw)

    monkeypatch.setattr(dtype_mod, "decode_step_seconds", spy)
    m = load_model(tiny_model_dir)
    assert timed == [torch.float32, torch.bfloat16]
    assert next(m.model.parameters()).dtype == m.dtype
    fig = m.dtype_figures
    assert fig["float32_ms"] > 0 and fig["bfloat16_ms"] > 0
    assert m.dtype == (torch.bfloat16 if fig["bfloat16_ms"] < fig["float32_ms"] else torch.float32)
    assert "float32" in m.dtype_note and "bfloat16" in m.dtype_note


def test_a_named_dtype_is_used_as_given(tiny_model_dir: Path) -> None:
    m = load_model(tiny_model_dir, dtype="bfloat16")
    assert m.dtype == torch.bfloat16 and next(m.model.parameters()).dtype == torch.bfloat16
