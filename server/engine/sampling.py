"""Batched sampling with per-request temperature, top-k, top-p and seed.

Randomness for a request's token at offset ``o`` comes from a generator seeded with (seed, o) alone, so
a request's text depends on its seed and never on its batch mates, and a request resumed on another
worker (re-prefill) draws exactly what it would have drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from server.engine.api import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads (seed, offset) over the 64-bit space
_MASK = (1 << 63) - 1


def token_seed(seed: int, offset: int) -> int:
    return (seed * _MIX + offset * 0xBF58476D1CE4E5B9 + 1) & _MASK


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], offsets: Sequence[int]) -> list[int]:
    """Pick one token per row. logits: [B, V] (any float dtype); returns B token ids."""
    logits = logits.float()
    out = [0] * logits.shape[0]
    greedy_rows = [i for i, p in enumerate(params) if p.temperature <= 0.0]
    if greedy_rows:
        picks = logits[greedy_rows].argmax(dim=-1).tolist()
        for i, t in zip(greedy_rows, picks, strict=True):
            out[i] = int(t)
    rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if not rows:
        return out
    sub = logits[rows]  # [R, V]
    temps = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32)
    sub = sub / temps[:, None]
    sorted_logits, sorted_idx = sub.sort(dim=-1, descending=True)  # [R, V]
    vocab = sub.shape[-1]
    ranks = torch.arange(vocab)[None, :]  # [1, V]
    ks = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in rows])
    mask = ranks >= ks[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    top_ps = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    cum_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(cum_before >= top_ps[:, None], 0.0)
    for j, i in enumerate(rows):
        g = torch.Generator().manual_seed(token_seed(params[i].seed, offsets[i]))
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, and needs one generator call.
        noise = torch.empty(vocab).exponential_(generator=g)
        choice = int((probs[j] / noise).argmax())
        out[i] = int(sorted_idx[j, choice])
    return out
