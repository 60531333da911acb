"""A serving model without transformers' modeling code: the module tree the engine reads, loaded from the
folder's safetensors file and config.json.

Serving never runs transformers' forward (the engine's own, llama.py, reads ``llama.Weights``), yet
importing transformers' Llama classes costs a process 90 MiB of memory by itself: ``transformers.activations``
imports its hub-kernel and model-loading code, and with it ``torch.distributed.tensor`` and sympy (measured
on an AVX512-BF16 EPYC, 2026-12-07: `from transformers import LlamaForCausalLM` took an idle process from
160 to 250 MiB anonymous). So ``tokenwire serve`` and ``worker`` load a plain Llama folder as this tree
instead: the same attribute names (``model.layers[i].self_attn.q_proj``, ``input_layernorm``,
``embed_tokens``, ``rotary_emb``, ``lm_head``, a ``config`` with the config.json's fields), the same
tensors (the file's, mapped as transformers maps them), the rotary tables by transformers' own ops for the
default RoPE, from one ``model.safetensors`` or the shards its ``model.safetensors.index.json`` names (as a
larger checkpoint comes). Anything else (rope scaling, biases, another architecture) loads through
transformers as before (``lite_reason`` says why), as do the bench and the tests that compare with
transformers' forward, which this tree does not have.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from server.engine import llama
from server.engine.mapped import WEIGHTS_FILE, WEIGHTS_INDEX, weight_map


def _config(path: Path) -> dict[str, Any]:
    data = json.loads((path / "config.json").read_text())
    if not isinstance(data, dict):
        raise ValueError("config.json is not an object")
    return data


def rope_theta(cfg: dict[str, Any]) -> float | None:
    """The default RoPE's base, from either config layout (transformers 5's ``rope_parameters`` or the
    older top-level ``rope_theta``); None for any other RoPE (scaled, dynamic, ...)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        if params.get("rope_type", "default") != "default":
            return None
        return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if cfg.get("rope_scaling"):
        return None
    return float(cfg.get("rope_theta", 10000.0))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files that hold the folder's weights: the shards its index names (each once, in
    order; mapped.weight_map checks them), else the single file. Raises ValueError, saying why, when
    neither is there whole."""
    wm = weight_map(path)
    if wm is None:
        if not (path / WEIGHTS_FILE).is_file():
            raise ValueError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX}")
        return [path / WEIGHTS_FILE]
    return [path / name for name in dict.fromkeys(wm.values())]


def lite_reason(path: Path) -> str | None:
    """Why the folder is not loaded as the lite tree (None when it is)."""
    try:
        cfg = _config(path)
    except (OSError, ValueError) as exc:
        return f"config.json unreadable: {exc}"
    if cfg.get("model_type") != "llama":
        return f"model type {cfg.get('model_type')!r} is not llama"
    if rope_theta(cfg) is None:
        return "RoPE other than the default"
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias") or cfg.get("attention_bias"):
        return "activation or biases differ from Llama's"
    try:
        weight_files(path)
    except ValueError as exc:
        return str(exc)
    if not (path / "tokenizer.json").is_file():
        return "no tokenizer.json"
    return None


class _Rotary(nn.Module):
    """transformers' default RoPE (LlamaRotaryEmbedding, rope_type "default"), op for op (but for its
    multiplication by an attention scaling of 1.0, exact), so the engine's tables (``llama.weights_of``)
    come out bit for bit as from transformers' module."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


class _Weight(nn.Module):
    """A module holding one ``weight`` (a linear layer's, a norm's, the embedding's): what the engine reads
    of transformers' modules. Not nn.Linear or nn.Embedding: their initialisation, even on the meta device,
    goes through torch._refs and imports torch._dynamo (and sympy), what this module is here to avoid."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


def _linear(n_in: int, n_out: int) -> _Weight:
    return _Weight(n_out, n_in)


class _Layer(nn.Module):
    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = _linear(hidden, heads * head_dim)
        self.self_attn.k_proj = _linear(hidden, kv_heads * head_dim)
        self.self_attn.v_proj = _linear(hidden, kv_heads * head_dim)
        self.self_attn.o_proj = _linear(heads * head_dim, hidden)
        self.mlp = nn.Module()
        self.mlp.gate_proj = _linear(hidden, inter)
        self.mlp.up_proj = _linear(hidden, inter)
        self.mlp.down_proj = _linear(inter, hidden)
        self.input_layernorm = _Weight(hidden)
        self.post_attention_layernorm = _Weight(hidden)


class LiteLlama(nn.Module):
    """The module tree of a transformers LlamaForCausalLM, without its forward (calling it raises)."""

    model: Any  # embed_tokens, layers, norm, rotary_emb: transformers' LlamaModel's names
    generation_config: Any  # eos_token_id, from generation_config.json

    def __init__(self, cfg: dict[str, Any], name_or_path: str) -> None:
        super().__init__()
        self.config = SimpleNamespace(**cfg)
        self.config._name_or_path = name_or_path  # as transformers sets it: the dtype choices' key reads it
        self.name_or_path = name_or_path  # the folder, where mapped.py finds the embedding
        s = llama.shape_of_config(self.config)  # the engine's reading of it: the same defaults
        inter = int(cfg["intermediate_size"])
        self.model = nn.Module()
        self.model.embed_tokens = _Weight(s.vocab, s.hidden)
        self.model.layers = nn.ModuleList(
            _Layer(s.hidden, inter, s.n_heads, s.n_kv_heads, s.head_dim) for _ in range(s.n_layers)
        )
        self.model.norm = _Weight(s.hidden)
        self.lm_head = _linear(s.hidden, s.vocab)
        self.head_dim = s.head_dim

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the lite serving model has no forward: the engine runs llama.forward")


def load(path: Path, dtype: torch.dtype) -> LiteLlama:
    """The folder's model as a LiteLlama in ``dtype`` on CPU (``lite_reason(path)`` must be None). Its
    tensors are views of the safetensors file's mapping where the file holds ``dtype`` already, as
    transformers' are; the engine's one-copy release (llama.release_model_linears) copies out what it
    keeps."""
    from safetensors.torch import load_file

    cfg = _config(path)
    with torch.device("meta"):
        model = LiteLlama(cfg, str(path))
    theta = rope_theta(cfg)
    assert theta is not None  # lite_reason checked it
    model.model.rotary_emb = _Rotary(model.head_dim, theta)
    state = {
        k: v if v.dtype == dtype else v.to(dtype)
        for f in weight_files(path)
        for k, v in load_file(str(f)).items()
    }
    tied = bool(cfg.get("tie_word_embeddings", True)) and "lm_head.weight" not in state
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight  # one parameter, as transformers ties them
    eos: Any = None
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    model.generation_config = SimpleNamespace(eos_token_id=eos)
    return model.eval()
