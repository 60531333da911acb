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
        _penalise(logits, [params[i] for i in rows], rows, tokens, n_prompt, vocab)
    return logits


def _penalise(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    rows: Sequence[int],
    tokens: Sequence[Sequence[int]],
    n_prompt: Sequence[int],
    vocab: int,
) -> None:
    for p, i in zip(params, rows, strict=True):
        row = logits[i]  # [V], a view: edits land in logits
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(tokens[i])), dtype=torch.long)
            seen = seen[(seen >= 0) & (seen < vocab)]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            completion = torch.tensor(list(tokens[i][n_prompt[i] :]), dtype=torch.long)
            completion = completion[(completion >= 0) & (completion < vocab)]
            if completion.numel():
                counts = torch.bincount(completion, minlength=vocab).to(row.dtype)  # [V]
                row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
