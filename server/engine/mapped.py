"""A weight read straight from its checkpoint file: a private file mapping, resident only where read.

The serving engine keeps one copy of each weight (issue 26). The linear layers live on as oneDNN's packed
copies, which must be memory of their own. The token embedding is different: a step reads only the rows
of the tokens it embeds, so a table mapped from the safetensors file is resident only in the pages of the
tokens seen so far. A model whose LM head is tied to the embedding thus keeps the packed LM head in
memory and the table in the page cache: SmolLM2-135M's 113 MB table costs a few MB of resident memory
at idle instead of 113 MB, and N workers on one machine share those pages.

The mapping is private (``MAP_PRIVATE``): a write would copy the page, never reach the file. It is used
only when the file holds exactly the values the model holds, compared in full at load. A checkpoint
replaced by rename (how tokenwire writes its GGUF conversions) leaves the mapping on the old file.

safetensors' layout (8-byte little-endian header size, a JSON header of name -> dtype, shape and byte
offsets from the end of the header) is read here directly: the library's own loaders return copies.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch
from torch import Tensor

# safetensors' dtype names of the dtypes a table may be served in.
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


# A checkpoint folder's weights: one file, or shards and an index (tensor name -> shard file), as
# transformers writes them; lite.py reads the same names.
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def weight_map(folder: Path) -> dict[str, str] | None:
    """A sharded folder's index: tensor name -> shard file, every shard a file beside the index; None when
    the folder has no index. Raises ValueError, saying why, for an index that is not a weight map or that
    names a shard outside the folder or missing from it."""
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        return None
    try:
        wm = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{WEIGHTS_INDEX} unreadable: {exc}") from None
    if not isinstance(wm, dict) or not wm:
        raise ValueError(f"{WEIGHTS_INDEX} has no weight_map")
    for shard in set(wm.values()):
        # A shard is a file name beside the index (transformers writes model-0000i-of-0000n.safetensors).
        if not isinstance(shard, str) or Path(shard).name != shard or not (folder / shard).is_file():
            raise ValueError(f"{WEIGHTS_INDEX} names a shard that is not a file in the folder: {shard!r}")
    return wm


def _file_of(folder: Path, name: str) -> Path | None:
    """The safetensors file of ``folder`` that holds tensor ``name`` (single file or sharded)."""
    wm = weight_map(folder)
    if wm is not None:
        shard = wm.get(name)
        return folder / shard if shard is not None else None
    single = folder / WEIGHTS_FILE
    return single if single.is_file() else None


def _locate(path: Path, name: str) -> tuple[torch.dtype, tuple[int, ...], int, int] | None:
    """(dtype, shape, start, end) of tensor ``name`` in the safetensors file, offsets from the file's
    start; None when it is absent or of a dtype not served."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > _MAX_HEADER:
            return None
        header = json.loads(f.read(size))
    meta = header.get(name)
    if not isinstance(meta, dict) or meta.get("dtype") not in _DTYPES:
        return None
    begin, end = meta["data_offsets"]
    return _DTYPES[meta["dtype"]], tuple(int(d) for d in meta["shape"]), 8 + size + begin, 8 + size + end


def map_like(folder: str | Path, name: str, like: Tensor) -> Tensor | None:
    """Tensor ``name`` of the checkpoint in ``folder`` as a view of a private mapping of its file, when it
    equals ``like`` (same dtype, shape and values) and ``like`` is on the CPU; else None (the caller keeps
    its own copy). The pages the comparison read are handed back, so the table starts non-resident."""
    if like.device.type != "cpu" or not like.is_contiguous():
        return None
    try:
        path = _file_of(Path(folder), name)
        found = _locate(path, name) if path is not None else None
        if path is None or found is None:
            return None
        dtype, shape, start, end = found
        size = like.numel() * like.element_size()
        if dtype != like.dtype or shape != tuple(like.shape) or end - start != size:
            return None
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        with path.open("rb") as f:
            mm = mmap.mmap(f.fileno(), end - aligned, access=mmap.ACCESS_COPY, offset=aligned)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError, struct.error):
        return None
    # The tensor holds a reference to the mapping (torch.frombuffer), so the mapping lives as long as it.
    t = torch.frombuffer(mm, dtype=dtype, count=like.numel(), offset=start - aligned).view(like.shape)
    if not torch.equal(t, like):
        return None
    if hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_DONTNEED)  # clean private pages: dropped now, read again from the file on use
    return t
