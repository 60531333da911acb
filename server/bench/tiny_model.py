"""A tiny randomly initialised Llama with a real byte-level BPE tokenizer and a chat template, built
in-process in well under a second: for tests that need the real engine path but not real answers, and
for the store-cost benchmark at a GPU worker's rate (benchmarks.py: a CPU streams this model's tokens as
fast as a GPU streams a real model's, and the store cannot tell the difference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you. naïve café 東京 🚀 résumé",
    "tokenwire streams tokens over WebSockets to browsers and phones that reconnect.",
] * 20


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    path: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    init_range: float = 0.02,
    four_bit: bool = False,
) -> Path:
    """Write a tiny Llama (config, safetensors, tokenizer) to ``path`` and return it.

    With the default init the greedy continuation is the same token over and over; ``init_range=0.5``
    gives peaky logits whose greedy text varies and whose top two logits stay far apart (gaps of 1e-3 and
    more), so greedy runs are reproducible across batchings and re-prefills despite float rounding.
    ``four_bit``: every layer's linear weight lies on a Q4_1 grid (per 32 inputs, 16 levels from the
    group's minimum to its maximum), as a GGUF's dequantised weights do (engine/int4.py).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
        initializer_range=init_range,
    )
    model = LlamaForCausalLM(config)
    if four_bit:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".layers." in name and p.dim() == 2:
                    p.copy_(q4_1_grid(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def q4_1_grid(w: Any) -> Any:
    """``w`` [out, in] rounded as GGUF's Q4_1 does: per 32 inputs, low = min, scale = (max - min) / 15,
    each value low + scale * round((value - low) / scale)."""
    import torch

    n, k = w.shape
    if k % 32:
        raise ValueError(f"{k} inputs: Q4_1 groups 32")
    groups = w.detach().float().reshape(n, k // 32, 32)
    low = groups.amin(-1, keepdim=True)
    scale = (groups.amax(-1, keepdim=True) - low) / 15
    step = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group stays itself
    return (low + scale * ((groups - low) / step).round()).reshape(n, k)
