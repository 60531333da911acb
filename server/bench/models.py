"""Randomly initialised Llamas of known shapes, for benches with nothing to download."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from server.engine.model import LoadedModel

PRESETS: dict[str, dict[str, Any]] = {
    # Llama 3.2 1B's shape (vocabulary cut to SmolLM2's so prompts stay cheap to build).
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M's shape: the default model, without its weights.
    "135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # SmolLM2-1.7B's shape (its config.json): full multi-head attention (32 KV heads), rope_theta 130000.
    "1.7b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=130000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # A toy of the same architecture (grouped-query attention, tied embeddings): a whole bench in seconds
    # on a CPU, for smoke tests of the bench and its scripts (server/bench/gpu.sh --smoke). No figure
    # measured on it means anything.
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}


class IdTokenizer:
    """Stands in for a tokenizer with random weights: id N decodes to " tN" and back; other text
    encodes byte by byte (so the chat path and multi-turn prefix reuse work without a download)."""

    chat_template = None

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" t{int(i)}" for i in ids)

    def encode(self, text: str, **_: Any) -> list[int]:
        return [
            int(m[1]) % self.vocab if m[1] else 3 + ord(m[2]) % (self.vocab - 3)
            for m in re.finditer(r" t(\d+)|(.)", text, re.S)
        ]


def random_model(spec: str, device: str, dtype: str) -> LoadedModel:
    """A randomly initialised Llama from a preset name (``1b``, ``1.7b``, ``135m``, ``tiny``) or a
    config.json path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = PRESETS.get(spec.lower())
    if fields is None:
        path = Path(spec)
        if not path.is_file():
            known = ", ".join(PRESETS)
            raise SystemExit(f"--random-weights {spec}: neither a preset ({known}) nor a config.json")
        fields = json.loads(path.read_text())
    config = LlamaConfig(**fields)
    config.pad_token_id = 0
    config.eos_token_id = 2
    config.bos_token_id = 1
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model: Any = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    model.eval()
    loaded = LoadedModel(
        model=model,
        tokenizer=IdTokenizer(config.vocab_size),
        name=f"random-{spec}",
        eos_ids=frozenset({2}),
        device=device,
        dtype=torch.float32,
        load_seconds=0.0,
    )
    from server.engine.model import named_int4_rows, settle_decode_kernel, settle_dtype

    named_int4_rows()  # checked, though random weights are never 4-bit: a typo is never ignored
    settle_dtype(loaded, dtype)
    settle_decode_kernel(loaded)
    loaded.load_seconds = time.perf_counter() - t0
    return loaded
