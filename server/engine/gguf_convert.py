"""The default model's first start: its GGUF dequantised once into a plain Hugging Face folder.

transformers reads a GGUF through the ``gguf`` package, and one conversion (the tokenizer, the config,
then the weights) parsed the same file three times: 49,152 vocabulary strings and their merges as
Python objects each time, about 4 s a parse on a 2-core EPYC. Mapping the weights' names built gguf's
name table (every architecture's patterns) once per module of the model, 397 times for SmolLM2-135M,
another 5 s. ``read_once`` keeps one parse of each file and one table per (architecture, layers) for
the length of a conversion; the output is byte for byte the same (tests/engine/test_gguf_convert.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import structlog

log = structlog.get_logger(__name__)


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """While inside, ``gguf.GGUFReader(path)`` returns one reader per file and ``gguf.get_tensor_name_map``
    one table per (architecture, layers). transformers imports both from ``gguf`` when it calls them, so
    swapping the module's attributes reaches every read it makes; both are put back on the way out, and
    the readers (memory maps of the file) are dropped. Only the conversion's thread reads GGUF files."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: os.PathLike[str] | str, mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map  # type: ignore[misc]
        readers.clear()


def convert_once(gguf_file: Path, out: Path) -> None:
    """``convert_gguf`` unless ``out`` holds the model already, one process at a time: the workers of a
    ``tokenwire cluster`` start together, and without the lock each converted the same file (two at once
    on 2 cores, each twice as slow), then replaced the folder another had just renamed into place and
    begun to load. The others wait on the lock and find the folder done."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    # Read-only is enough for flock, and opens a lock file another user of a shared cache created.
    fd = os.open(out.with_name(out.name + ".lock"), os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("model.conversion_waiting", to=str(out), why="another process is converting the GGUF")
            fcntl.flock(fd, fcntl.LOCK_EX)  # let go when the file closes, or when that process dies
        if (out / "model.safetensors").is_file():
            return
        # Whoever wrote these half-done folders (half a GB each) is gone: it died holding this lock.
        for stale in out.parent.glob(out.name + ".tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        convert_gguf(gguf_file, out)
    finally:
        os.close(fd)


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """Dequantise a GGUF into a plain HF folder (safetensors + config + tokenizer) at ``out``, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    with read_once():
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
        )
    write_folder(model, tok, out)
    log.info("model.converted", gguf=str(gguf_file), to=str(out), seconds=round(time.perf_counter() - t0, 1))


def write_folder(model: Any, tok: Any, out: Path) -> None:
    """Save ``model`` and ``tok`` as a plain HF folder at ``out``: written beside it, then renamed into
    place, so a reader never sees half of one; a failure leaves nothing behind."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied to embed_tokens; safetensors refuses shared storage
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # transformers refuses save_pretrained on a GGUF-loaded model; the config is saved without the
        # quantization_config, which would otherwise make the reload look for the GGUF again.
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        # On disk before the rename: after a power cut the folder must not be there with a truncated
        # model.safetensors, which every later start would find and fail to load (~0.2 s for 538 MB).
        for f in [*tmp.iterdir(), tmp]:
            _fsync(f)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        _fsync(out.parent)
    except BaseException:  # a full disk, Ctrl-C: no half-written folder left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
