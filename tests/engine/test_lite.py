"""engine/lite.py: serving loads a plain Llama folder without transformers' modeling code, and runs the same
numbers as the transformers-loaded model: the same weights, rotary tables, eos ids and chat prompts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.engine import lite, llama
from server.engine.api import GenerationRequest, SamplingParams
from server.engine.engine import BatchingEngine
from server.engine.model import LoadedModel, load_model
from tests.engine.test_batching_engine import msg, run_all

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is <|im_start|> in a chat template?"},
        {"role": "assistant", "content": "A marker."},
        {"role": "user", "content": "Unicode too: 日本語, émoji 🙂"},
    ],
]


def _same_weights(a: llama.Weights, b: llama.Weights) -> None:
    assert torch.equal(a.embed, b.embed) and torch.equal(a.norm, b.norm)
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)  # the rotary tables, bit for bit
    assert torch.equal(a.lm_head.w, b.lm_head.w)
    for x, y in zip(a.layers, b.layers, strict=True):
        for name in ("attn_norm", "mlp_norm"):
            assert torch.equal(getattr(x, name), getattr(y, name))
        for name in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(getattr(x, name).w, getattr(y, name).w)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lite_loads_the_same_model_as_transformers(tiny_model_dir: Path, dtype: str) -> None:
    hf = load_model(tiny_model_dir, dtype=dtype)
    lt = load_model(tiny_model_dir, dtype=dtype, lite=True)
    assert isinstance(lt.model, lite.LiteLlama) and not isinstance(hf.model, lite.LiteLlama)
    assert (lt.dtype, lt.eos_ids, lt.decode_kernel) == (hf.dtype, hf.eos_ids, hf.decode_kernel)
    assert llama.shape_of(lt.model) == llama.shape_of(hf.model)
    assert llama.unsupported_reason(lt.model) is None
    p = 64
    _same_weights(llama.weights_of(lt.model, p, pack=False), llama.weights_of(hf.model, p, pack=False))
    for messages in CONVERSATIONS:
        assert lt.encode_chat(messages) == hf.encode_chat(messages)
    ids = hf.encode_chat(CONVERSATIONS[1])
    assert lt.decode(ids) == hf.decode(ids)
    with pytest.raises(RuntimeError, match="no forward"):
        lt.model(torch.tensor([[1]]))


def test_a_serving_engine_on_lite_generates_what_it_does_on_transformers(tiny_model_dir: Path) -> None:
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    texts = []
    for use_lite in (False, True):
        m = load_model(tiny_model_dir, lite=use_lite)
        outs, _ = run_all(BatchingEngine(m, one_copy=True), [GenerationRequest("a", msg("Hello"), p)])
        texts.append([t for o in outs["a"] for t in o.token_ids])
    assert texts[0] == texts[1] and len(texts[0]) == 12


def test_what_lite_does_not_take_loads_through_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for f in tiny_model_dir.iterdir():
        (scaled / f.name).symlink_to(f)
    (scaled / "config.json").unlink()
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    cfg.pop("rope_scaling", None)
    (scaled / "config.json").write_text(json.dumps(cfg))
    assert lite.lite_reason(scaled) == "RoPE other than the default"
    assert lite.lite_reason(tmp_path) is not None  # no config.json at all
    m = load_model(scaled, lite=True)
    assert not isinstance(m.model, lite.LiteLlama)


def test_a_lite_load_imports_no_transformers_modeling_code(tiny_model_dir: Path) -> None:
    """The point of lite.py: the 90 MiB of transformers' modeling imports (torch.distributed.tensor,
    sympy) stay out of a serving process. A fresh interpreter, since this one has imported them."""
    code = (
        "import sys; from server.engine.model import load_model; "
        f"m = load_model({str(tiny_model_dir)!r}, lite=True); "
        "print(type(m.model).__name__, 'sympy' in sys.modules, 'transformers.modeling_utils' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split()[-3:] == ["LiteLlama", "False", "False"], out.stdout + out.stderr


def test_default_model_lite_matches_transformers() -> None:
    """The default model (SmolLM2 from its GGUF): tied LM head, transformers 5's rope_parameters, its
    chat template through PreTrainedTokenizerFast against AutoTokenizer."""
    hf = load_model(dtype="float32")
    lt = load_model(dtype="float32", lite=True)
    assert lt.model.lm_head.weight is lt.model.model.embed_tokens.weight  # tied as transformers ties it
    p = 256
    _same_weights(llama.weights_of(lt.model, p, pack=False), llama.weights_of(hf.model, p, pack=False))
    assert lt.eos_ids == hf.eos_ids
    for messages in CONVERSATIONS:
        assert lt.encode_chat(messages) == hf.encode_chat(messages)
    assert isinstance(lt, LoadedModel)


def test_the_default_rope_is_read_from_either_config_layout() -> None:
    """transformers 5 writes rope_parameters; folders saved by older versions (or another tool) have a
    top-level rope_theta and rope_scaling. Only the default RoPE loads lite; anything scaled falls back."""
    assert lite.rope_theta({"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}) == 100000.0
    assert lite.rope_theta({"rope_parameters": {"rope_theta": 5e5}}) == 5e5  # rope_type absent: default
    assert lite.rope_theta({"rope_theta": 500000.0, "rope_scaling": None}) == 500000.0
    assert lite.rope_theta({}) == 10000.0  # Llama's default base
    assert lite.rope_theta({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}) is None
    assert lite.rope_theta({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}) is None


def _linked_copy(src: Path, dst: Path, *, leave_out: str) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != leave_out:
            (dst / f.name).symlink_to(f)
    return dst


def test_a_sharded_checkpoint_loads_lite_from_its_index(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A larger checkpoint comes as shards and a model.safetensors.index.json (the tensor -> file map
    transformers writes): the lite load reads every shard it names, to the same weights as the single
    file; an index that names a shard outside the folder, or one that is not there, is said and falls
    back to transformers."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny_model_dir / lite.WEIGHTS_FILE))
    sharded = _linked_copy(tiny_model_dir, tmp_path / "sharded", leave_out=lite.WEIGHTS_FILE)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({k: state[k] for k in part}, str(sharded / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / lite.WEIGHTS_INDEX).write_text(json.dumps(index))
    assert lite.lite_reason(sharded) is None
    assert [f.name for f in lite.weight_files(sharded)] == sorted(halves)
    one = load_model(tiny_model_dir, dtype="float32", lite=True)
    two = load_model(sharded, dtype="float32", lite=True)
    assert isinstance(two.model, lite.LiteLlama)
    _same_weights(llama.weights_of(two.model, 64, pack=False), llama.weights_of(one.model, 64, pack=False))

    for bad, why in [
        ("../model.safetensors", "names a shard that is not a file in the folder"),
        ("model-00003-of-00002.safetensors", "names a shard that is not a file in the folder"),
        (None, "has no weight_map"),
    ]:
        broken = dict(index, weight_map=dict(weight_map, **{names[0]: bad}) if bad else {})
        (sharded / lite.WEIGHTS_INDEX).write_text(json.dumps(broken))
        assert why in (lite.lite_reason(sharded) or ""), bad
    (sharded / lite.WEIGHTS_INDEX).write_text("[1, 2]")  # JSON, but not an object
    assert "unreadable" in (lite.lite_reason(sharded) or "")
    (sharded / lite.WEIGHTS_INDEX).unlink()
    assert lite.lite_reason(sharded) == "no model.safetensors or model.safetensors.index.json"
