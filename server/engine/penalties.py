"""Repetition, frequency and presence penalties: logits adjusted for tokens a request has already seen.

Small models fall into loops (one sentence repeated until max_tokens, then fed back as history on the
next turn). Two families of remedy are common and both are offered, per request:

* ``repetition_penalty`` (CTRL, Keskar et al. 2019; transformers' ``RepetitionPenaltyLogitsProcessor``):
  every token present in the prompt or the reply so far has its logit divided by the penalty when
  positive and multiplied by it when negative. 1.0 is off.
* ``frequency_penalty`` / ``presence_penalty`` (OpenAI's API): the logit of a token that occurs ``c``
  times in the reply so far loses ``c * frequency + (c > 0) * presence``. 0 is off.

Applied to the float32 logits of only the rows that ask for a penalty, before sampling (greedy included),
so a batch without penalties costs nothing and a request's text never depends on its batch mates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from server.engine.api import SamplingParams


def needs_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    tokens: Sequence[Sequence[int]],
    n_prompt: Sequence[int],
) -> torch.Tensor:
    """Penalised logits. ``logits``: [B, V] float32, one row per ``params``; ``tokens[i]`` is row i's prompt
    followed by its completion so far, of which the first ``n_prompt[i]`` are the prompt. Returns
    ``logits`` itself (modified in place) when some row needed it, unchanged otherwise."""
    rows = [i for i, p in enumerate(params) if needs_penalty(p)]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    with torch.inference_mode():  # the runner's logits are inference tensors: edit them in that mode
        rep = [i for i in rows if params[i].repetition_penalty != 1.0 and tokens[i]]
        if rep:
            ids, _ = _padded([_valid(tokens[i], vocab) for i in rep])  # [R, L]
            index = torch.tensor(rep)
            sub = logits[index]  # [R, V] (a copy)
            vals = sub.gather(1, ids)  # [R, L]: each seen token's logit (padding repeats a seen token)
            penalty = torch.tensor([params[i].repetition_penalty for i in rep], dtype=sub.dtype)[:, None]
            sub.scatter_(1, ids, torch.where(vals > 0, vals / penalty, vals * penalty))
            logits[index] = sub
        freq = [i for i in rows if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0]
        if freq:
            ids, weight = _padded([_valid(tokens[i][n_prompt[i] :], vocab) for i in freq])
            index = torch.tensor(freq)
            counts = torch.zeros(len(freq), vocab, dtype=logits.dtype)
            counts.scatter_add_(1, ids, weight.to(logits.dtype))  # [R, V]: occurrences in the reply
            f = torch.tensor([params[i].frequency_penalty for i in freq], dtype=logits.dtype)[:, None]
            p = torch.tensor([params[i].presence_penalty for i in freq], dtype=logits.dtype)[:, None]
            logits[index] -= counts * f + (counts > 0).to(logits.dtype) * p
    return logits


def _valid(ids: Sequence[int], vocab: int) -> Sequence[int]:
    return ids if not ids or (min(ids) >= 0 and max(ids) < vocab) else [t for t in ids if 0 <= t < vocab]


def _padded(seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, L] token ids (short rows padded with token 0) and [R, L] weights (1 real, 0 padding)."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    weight = torch.zeros(len(seqs), width)
    for r, s in enumerate(seqs):
        if s:
            ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
            weight[r, : len(s)] = 1.0
            ids[r, len(s) :] = s[0]  # padding repeats a real token: gather/scatter of it is harmless
    return ids, weight
