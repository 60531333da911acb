"""mapped.py: a checkpoint tensor read through a private file mapping, used only when it holds exactly the
numbers the model holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from server.engine.mapped import map_like


def _mapping_of(t: torch.Tensor) -> str:
    """The /proc/self/maps line of the mapping ``t``'s first byte lies in ("" if none)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line
    return ""


def test_an_equal_tensor_is_a_private_mapping_of_its_file(tmp_path: Path) -> None:
    table = torch.randn(300, 24)
    other = torch.randn(7)
    save_file({"a.other": other, "model.embed_tokens.weight": table}, str(tmp_path / "model.safetensors"))
    got = map_like(tmp_path, "model.embed_tokens.weight", table)
    assert got is not None and torch.equal(got, table) and got.shape == table.shape
    assert got.data_ptr() != table.data_ptr()
    if Path("/proc/self/maps").exists():
        assert str(tmp_path / "model.safetensors") in _mapping_of(got)
    # Private: a write stays in this process, the file keeps its numbers.
    got[0, 0] = 12345.0
    again = map_like(tmp_path, "model.embed_tokens.weight", table)
    assert again is not None and torch.equal(again, table)


def test_bfloat16_and_a_sharded_checkpoint(tmp_path: Path) -> None:
    table = torch.randn(64, 16).to(torch.bfloat16)
    save_file({"x": torch.zeros(3)}, str(tmp_path / "part-1.safetensors"))
    save_file({"emb": table}, str(tmp_path / "part-2.safetensors"))
    index = {"weight_map": {"x": "part-1.safetensors", "emb": "part-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = map_like(tmp_path, "emb", table)
    assert got is not None and got.dtype == torch.bfloat16 and torch.equal(got, table)


@pytest.mark.parametrize(
    "like",
    [
        torch.ones(10, 4),  # other numbers (the model changed them after loading)
        torch.zeros(10, 4, dtype=torch.bfloat16),  # served in another dtype
        torch.zeros(4, 10),  # another shape
        torch.zeros(10, 4)[:, :2],  # not contiguous
    ],
)
def test_anything_but_the_same_numbers_is_not_mapped(tmp_path: Path, like: torch.Tensor) -> None:
    save_file({"t": torch.zeros(10, 4)}, str(tmp_path / "model.safetensors"))
    assert map_like(tmp_path, "t", like) is None


def test_no_checkpoint_or_no_such_tensor_is_not_mapped(tmp_path: Path) -> None:
    t = torch.zeros(3)
    assert map_like(tmp_path, "t", t) is None  # no safetensors here
    save_file({"t": t}, str(tmp_path / "model.safetensors"))
    assert map_like(tmp_path, "missing", t) is None
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)  # not a safetensors file
    assert map_like(tmp_path, "t", t) is None


def test_an_index_naming_a_shard_outside_the_folder_is_not_mapped(tmp_path: Path) -> None:
    """The index is read as the lite load reads it (mapped.weight_map): a shard must be a file beside it."""
    table = torch.randn(8, 4)
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"emb": table}, str(tmp_path / "outside.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"emb": "../outside.safetensors"}})
    )
    assert map_like(folder, "emb", table) is None
