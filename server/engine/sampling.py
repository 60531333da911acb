"""Batched sampling with per-request temperature, top-k, top-p and seed.

Randomness for a request's token at offset ``o`` is one uniform number computed from (seed, o) alone, so
a request's text depends on its seed and never on its batch mates, and a request resumed on another
worker (re-prefill) draws exactly what it would have drawn.

Why it looks the way it does: sorting the whole vocabulary (49,152 tokens for SmolLM2) for 32 rows took
about 50 ms a step on this CPU, as long as the model's own decode step, and the per-row torch generators
another 30 ms; sampled requests ran at half the speed of greedy ones. A nucleus is almost always a few
dozen tokens, so each row is sampled from its ``torch.topk`` candidates (a partial selection, ~1 ms for
the batch), widening the candidate set only for the rare row whose nucleus does not fit, and drawn by
inverse CDF with a hashed uniform instead of a generator. The distribution is exactly the one a full
sort gives: probabilities are normalised over the whole vocabulary (or over the top-k when top_k is set),
and a row is only sampled from candidates that provably contain its whole nucleus.

Wider rows happen too. SmolLM2-135M writing a story keeps a nucleus of a few tokens at temperature 0.8,
top_p 0.9 (median 3, at most 127 over 200 steps), but at temperature 1.0, top_p 0.95 half its steps
pass 64 tokens and one in 40 passes 1,024; a flat row sent the batch to a full sort (56 ms for 32 rows
on a 2-core EPYC, most of a decode step). So a row whose nucleus is wider than the last fixed candidate
set gets a candidate count sized for it (``_nucleus_bound``: a histogram of its probabilities by powers
of two, one pass over the vocabulary) and a partial ``topk`` of that size, which is still the sorted
prefix a full sort would give. A row with top_p = 1 and no top_k (which OpenAI clients often send) keeps the
whole vocabulary, so it needs no order at
all: it is drawn by inverse CDF in vocabulary order (the same distribution; no sort).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from server.engine.api import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads (seed, offset) over the 64-bit space
_MASK = (1 << 63) - 1
_M64 = (1 << 64) - 1
CANDIDATES = (64, 1024)  # candidate-set sizes tried in turn before the whole (sorted) vocabulary
ADAPTIVE = True  # then a candidate count sized for each row's nucleus (_nucleus_bound) before a full sort
_BUCKETS = 64  # powers of two below a row's top probability, for _nucleus_bound
_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32: the least temperature divided by
# Rows whose temperature is below this are shifted by their maximum before the division: above it no logit
# a model makes, nor one a penalty capped (penalties.LOGIT_CAP, 1e30), can overflow float32 (3.4e38).
_SHIFT_BELOW = 1e-3


def token_seed(seed: int, offset: int) -> int:
    return (seed * _MIX + offset * 0xBF58476D1CE4E5B9 + 1) & _MASK


def token_uniform(seed: int, offset: int) -> float:
    """The uniform draw in [0, 1) for a request's token at ``offset`` (splitmix64's finaliser)."""
    z = token_seed(seed, offset)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], offsets: Sequence[int]) -> list[int]:
    """Pick one token per row. logits: [B, V] (any float dtype, any device); returns B token ids."""
    # On the host: the draw's small tensors (temperatures, uniforms) are made here, and its candidate
    # search ends in Python lists. The batching runner passes host rows already (a no-op then); the
    # generic engine (simple.py) passes its model's logits as they are, which on a GPU used to fail at
    # the first division by the temperatures.
    logits = logits.float().cpu()
    out = [0] * logits.shape[0]
    greedy_rows = [i for i, p in enumerate(params) if p.temperature <= 0.0]
    if greedy_rows:
        # Every row greedy (the common case of a greedy batch): no copy of the [B, V] logits first,
        # which took as long as the argmax itself (~0.6 ms at 32 rows of SmolLM2's vocabulary).
        picks = take_rows(logits, greedy_rows).argmax(dim=-1).tolist()
        for i, t in zip(greedy_rows, picks, strict=True):
            out[i] = int(t)
    rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if not rows:
        return out
    vocab = logits.shape[-1]
    temps = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32).clamp_(min=_TINY)
    picked = take_rows(logits, rows)
    scaled = picked / temps[:, None]
    small = temps < _SHIFT_BELOW
    if bool(small.any()):
        # SPEC allows any temperature in (0, 2]. Below about 1e-3 a logit over it could overflow to +inf
        # (1e-40 made any logit over 3e-2 infinite; 5e-324 is 0 in float32) and softmax then gives NaN:
        # such rows divide their logits less their maximum instead (the same distribution, as softmax
        # does not change when a row is shifted), so the top token is 0 and the rest finite or -inf.
        s = small.nonzero().squeeze(1)
        x = picked.index_select(0, s)
        scaled[s] = (x - x.max(dim=-1, keepdim=True).values) / temps[s, None]
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    top_k = torch.tensor([params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows])
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32)
    uniform = torch.tensor([token_uniform(params[i].seed, offsets[i]) for i in rows], dtype=torch.float32)
    whole = (top_k >= vocab) & (top_p >= 1.0)
    if bool(whole.any()):
        # Nothing is cut from these rows, so the order of the vocabulary does not matter: inverse CDF over
        # it as it is, with no sort.
        w = whole.nonzero().squeeze(1)
        pick = _inverse_cdf(take_rows(probs, w), uniform[w])
        for r, t in zip(w.tolist(), pick.tolist(), strict=True):
            out[rows[r]] = int(t)
    pending = (~whole).nonzero().squeeze(1)
    sizes: list[int | None] = [*CANDIDATES, *([None] if ADAPTIVE else []), vocab]
    for size in sizes:
        if len(pending) == 0:
            break
        p_probs = take_rows(probs, pending)
        if size is None:
            need = _nucleus_bound(p_probs, top_p[pending])
            k = int(torch.where(top_k[pending] < vocab, top_k[pending], need).max())
            if k > vocab // 2:
                continue  # nearly the whole vocabulary: the full sort is no slower
        k = min(size if size is not None else k, vocab)
        # topk returns the k largest, sorted; with k == V that is the full sort the rare last round needs.
        vals, idx = p_probs.topk(k, dim=-1)  # [P, k]
        rk, rp = top_k[pending], top_p[pending]
        within_k = torch.arange(k)[None, :] < rk[:, None]  # ranks inside the row's own top-k
        has_top_k = rk < vocab
        # A row with a top-k normalises over it, so all of it must be among the candidates (else it waits
        # for a larger round); a row without one keeps the whole vocabulary's normalisation, which the
        # softmax gave. Either way these are the probabilities a full sort would give.
        waits = has_top_k & (rk > k)
        vals = vals.masked_fill(~within_k, 0.0)
        norm = torch.where(has_top_k, vals.sum(dim=-1), torch.ones(()))
        cand = vals / norm[:, None]
        cum = cand.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        kept = cand * ((cum - cand) < rp[:, None])
        # The nucleus is inside these candidates when their mass already reaches top_p, or when the
        # row's top-k (or the vocabulary) ends inside them.
        done = ~waits & (has_top_k | (cum[:, -1] >= rp) | (k == vocab))
        if bool(done.any()):
            d = done.nonzero().squeeze(1)
            pick = _inverse_cdf(kept[d], uniform[pending[d]])
            tokens = idx[d].gather(1, pick[:, None]).squeeze(1)
            for r, t in zip(pending[d].tolist(), tokens.tolist(), strict=True):
                out[rows[r]] = int(t)
        pending = pending[~done]
    return out


def take_rows(t: torch.Tensor, rows: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (in order) of ``t``: ``t`` itself when they are all of its rows, as in most steps,
    since indexing copies ([32, 49,152] float32 rows by a Python list took 1.5 ms). On ``t``'s device."""
    if len(rows) == t.shape[0]:
        return t
    index = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.long, device=t.device)
    return t.index_select(0, index)


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[R] the column of each row drawn by inverse CDF: the first whose cumulative weight passes
    ``uniform`` times the row's total weight. weights: [R, K] (unnormalised, >= 0); uniform: [R] in [0, 1)."""
    cum = weights.cumsum(dim=-1)
    pick = torch.searchsorted(cum, (uniform * cum[:, -1])[:, None], right=True).squeeze(1)
    # The first column whose cumulative weight passes the draw has weight, unless u * mass rounded up to
    # the mass itself and none passes: then the last column with any weight. Only such rows pay for the
    # search (a pass over [R, V] as long as the cumsum).
    over = pick >= weights.shape[-1]
    if bool(over.any()):
        o = over.nonzero().squeeze(1)
        pick[o] = (weights[o] > 0).cumsum(dim=-1).argmax(dim=-1)
    return pick


def _nucleus_bound(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[P] a candidate count per row that holds its whole nucleus: the tokens whose probability is within
    a power of two of the bucket where the row's cumulative mass (by buckets, largest first) reaches
    top_p, plus one bucket of margin, so float rounding of the later cumulative sum cannot leave the
    nucleus short. Every token of the counted buckets is at least as probable as every token outside,
    so these are a prefix of the sorted row."""
    top = probs.max(dim=-1, keepdim=True).values
    bucket = torch.floor(-torch.log2(probs / top)).clamp_(0, _BUCKETS - 1).long()  # [P, V]
    mass = torch.zeros(len(probs), _BUCKETS).scatter_add_(1, bucket, probs)
    count = torch.zeros(len(probs), _BUCKETS).scatter_add_(1, bucket, torch.ones_like(probs))
    reach = (mass.cumsum(dim=-1) < top_p[:, None]).sum(dim=-1)  # first bucket where the mass reaches top_p
    upto = (reach + 1).clamp_(max=_BUCKETS - 1)  # ... plus one bucket of margin
    return count.cumsum(dim=-1).gather(1, upto[:, None]).squeeze(1).long()
