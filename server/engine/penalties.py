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
from itertools import chain

import torch

from server.engine.api import SamplingParams

# The largest logit a penalty makes: finite, and far enough below float32's 3.4e38 that sampling's
# division by a temperature of 1e-3 or more keeps it finite (sampling._SHIFT_BELOW).
LOGIT_CAP = 1e30


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
    ``logits`` itself (modified in place) when some row needed it, unchanged otherwise.

    Sparse on purpose: only the (row, token) pairs a request has seen are read and written, a few thousand
    numbers a step. A dense [rows, vocab] count table (and its temporaries) cost 7-9 ms a step at 32 rows
    of SmolLM2's 49,152-token vocabulary on a 2-core EPYC, a seventh of a decode step, for every chat
    using the default frequency penalty. Each penalised logit gets the same float32 arithmetic as the
    dense formula, so the result is bit-identical (tests/engine/test_penalties.py checks it)."""
    rows = [i for i, p in enumerate(params) if needs_penalty(p)]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    # The pairs are found on the host (a few thousand ids) and the edit made where the logits are, so a
    # GPU's greedy rows keep their logits there (Runner.argmax_on_device).
    dev, dt = logits.device, logits.dtype
    with torch.inference_mode():  # the runner's logits are inference tensors: edit them in that mode
        rep = [i for i in rows if params[i].repetition_penalty != 1.0 and tokens[i]]
        if rep:
            # Each token seen, once (a token seen twice is penalised once, as transformers does).
            r, t, _ = _seen(rep, [_valid(tokens[i], vocab) for i in rep], vocab)
            penalty = torch.tensor([p.repetition_penalty for p in params], dtype=dt)[r].to(dev)
            r, t = r.to(dev), t.to(dev)
            vals = logits[r, t]
            # Capped: a penalty near 0 (SPEC allows any in (0, 2]; 1e-300 is 0 in float32) made a seen
            # token's logit infinite, and sampling's softmax NaN. At the cap the seen tokens tie.
            out = torch.where(vals > 0, vals / penalty, vals * penalty)
            # -inf times a penalty of 0 is NaN: a masked token stays masked. The cap is upward only, as a
            # penalty of at most 2 cannot take a finite negative logit to -inf.
            out = torch.where(out.isnan(), vals, out)
            logits[r, t] = out.clamp_(max=LOGIT_CAP)
        freq = [i for i in rows if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0]
        if freq:
            r, t, counts = _seen(freq, [_valid(tokens[i][n_prompt[i] :], vocab) for i in freq], vocab)
            if r.numel():
                c = counts.to(dt)
                f = torch.tensor([p.frequency_penalty for p in params], dtype=dt)[r]
                pres = torch.tensor([p.presence_penalty for p in params], dtype=dt)[r]
                cut = (c * f + (c > 0).to(dt) * pres).to(dev)
                r, t = r.to(dev), t.to(dev)
                logits[r, t] = logits[r, t] - cut
    return logits


def _valid(ids: Sequence[int], vocab: int) -> Sequence[int]:
    return ids if not ids or (min(ids) >= 0 and max(ids) < vocab) else [t for t in ids if 0 <= t < vocab]


def _seen(
    rows: Sequence[int], seqs: Sequence[Sequence[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of ``seqs`` (``seqs[j]`` belongs to batch row ``rows[j]``) as
    row and token index tensors, with how often each pair occurs."""
    ids = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
    owner = torch.repeat_interleave(
        torch.tensor(rows, dtype=torch.long), torch.tensor([len(s) for s in seqs], dtype=torch.long)
    )
    pairs, counts = torch.unique(owner * vocab + ids, return_counts=True)
    return pairs // vocab, pairs % vocab, counts
