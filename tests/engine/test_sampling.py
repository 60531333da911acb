"""The sampler draws from exactly the temperature / top-k / top-p distribution, the same whether a row's
nucleus is found among the few top-k candidates or by sorting the whole vocabulary, and a row's draw
depends on its seed and offset only (never on its batch mates or its place in the batch)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from server.engine import sampling
from server.engine.api import SamplingParams
from server.engine.sampling import sample, token_uniform


def _expected(logits: torch.Tensor, p: SamplingParams) -> dict[int, float]:
    """The target distribution, computed the slow, obvious way (full sort)."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    if p.top_k:
        order = order[: p.top_k]
    mass = sum(float(probs[t]) for t in order)
    kept, before = [], 0.0
    for t in order:
        if before >= p.top_p:
            break
        kept.append(t)
        before += float(probs[t]) / mass
    total = sum(float(probs[t]) for t in kept)
    return {t: float(probs[t]) / total for t in kept}


@pytest.mark.parametrize(
    "top_k, top_p, temperature",
    [(0, 1.0, 1.0), (0, 0.8, 1.0), (3, 1.0, 1.0), (4, 0.7, 1.0), (0, 0.9, 0.5), (6, 0.95, 2.0)],
)
def test_draws_follow_the_truncated_distribution(top_k: int, top_p: float, temperature: float) -> None:
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0]])
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=5)
    n, rows = 20_000, 1_000
    # Each draw depends only on its seed and offset (batch mates change nothing: test_runner), so the
    # draws are made 1,000 rows at a time, as the engine batches them.
    seen: Counter[int] = Counter()
    for start in range(0, n, rows):
        seen.update(sample(logits.repeat(rows, 1), [p] * rows, list(range(start, start + rows))))
    want = _expected(logits[0], p)
    assert set(seen) <= set(want)  # nothing outside the top-k / nucleus, ever
    for t, q in want.items():
        assert abs(seen[t] / n - q) < 0.015, (t, seen[t] / n, q)


def _all_paths_agree(
    logits: torch.Tensor, params: list[SamplingParams], monkeypatch: pytest.MonkeyPatch
) -> None:
    offsets = list(range(len(params)))
    fast = [sample(logits, params, [o + 1000 * r for o in offsets]) for r in range(40)]
    monkeypatch.setattr(sampling, "CANDIDATES", ())  # straight to the full sort
    monkeypatch.setattr(sampling, "ADAPTIVE", False)
    full = [sample(logits, params, [o + 1000 * r for o in offsets]) for r in range(40)]
    pairs = [(a, b) for fa, fb in zip(fast, full, strict=True) for a, b in zip(fa, fb, strict=True)]
    differ = sum(a != b for a, b in pairs)
    # Identical draws; a float-level difference between two summation orders may flip a rare boundary.
    assert differ <= len(pairs) // 200, differ


def test_candidate_path_equals_the_full_sort_on_peaky_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 49_152, generator=g) * 2
    logits[:, :30] += 10  # an LM-like row: a few dozen plausible tokens
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(8)]
    _all_paths_agree(logits, params, monkeypatch)


def test_rows_whose_nucleus_is_wide_widen_their_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flat rows (nucleus beyond 64 and 1024 tokens) and a top-k above the first round's size."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 5_000, generator=g)
    logits[0] *= 0.01  # nearly uniform: the nucleus holds most of the vocabulary
    # The first 64 candidates hold about three quarters of the mass: close to top_p, not enough.
    logits[6] *= 0.5
    logits[6, :40] += 6
    params = [
        SamplingParams(temperature=1.0, top_p=0.95, seed=1),
        SamplingParams(temperature=1.0, top_p=0.5, seed=2),
        SamplingParams(temperature=1.5, top_p=1.0, seed=3),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=100, seed=4),
        SamplingParams(temperature=1.0, top_p=1.0, top_k=2_000, seed=5),
        SamplingParams(temperature=0.0, seed=6),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7),
    ]
    _all_paths_agree(logits, params, monkeypatch)


def test_wide_nuclei_take_a_sized_candidate_set_with_the_same_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose nucleus holds thousands of tokens (a small model at temperature 0.8): past the fixed
    candidate sets, a count sized by _nucleus_bound gives the full sort's draws without the full sort."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 49_152, generator=g) * 2.5
    logits[3] *= 1.6  # a narrower one, still past 1,024 tokens
    tops = (0.9, 0.5, 0.95, 0.9, 0.7, 0.8)
    params = [SamplingParams(temperature=0.8, top_p=p, seed=s) for s, p in enumerate(tops)]
    sorted_calls: list[int] = []
    real_topk = torch.Tensor.topk

    def spy(self: torch.Tensor, k: int, *args: object, **kw: object) -> object:
        sorted_calls.append(k)
        return real_topk(self, k, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "topk", spy)
    sample(logits, params, list(range(6)))
    assert max(sorted_calls) < 49_152 // 2, sorted_calls  # never the whole vocabulary
    assert max(sorted_calls) > 1_024, sorted_calls  # the fixed candidate sets were too small
    monkeypatch.setattr(torch.Tensor, "topk", real_topk)
    _all_paths_agree(logits, params, monkeypatch)


def test_the_nucleus_bound_covers_the_nucleus() -> None:
    g = torch.Generator().manual_seed(5)
    scaled = torch.randn(8, 20_000, generator=g) * torch.linspace(0.5, 4, 8)[:, None]
    top_p = torch.tensor([0.5, 0.8, 0.9, 0.95, 0.99, 0.9, 0.7, 0.3])
    bound = sampling._nucleus_bound(torch.softmax(scaled, dim=-1), top_p)
    probs = torch.softmax(scaled.double(), dim=-1).sort(dim=-1, descending=True).values
    nucleus = ((probs.cumsum(dim=-1) - probs) < top_p.double()[:, None]).sum(dim=-1)
    assert bool((bound >= nucleus).all()), (bound, nucleus)
    assert bool((bound < 20_000).all())


def test_rows_that_keep_the_whole_vocabulary_need_no_order() -> None:
    """top_p 1 and no top_k: drawn in vocabulary order, with the softmax's own distribution."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0, 0.5]])
    p = SamplingParams(temperature=1.0, top_p=1.0, seed=9)
    n, rows = 20_000, 1_000
    # Each draw depends only on its seed and offset (batch mates change nothing: test_runner), so the
    # draws are made 1,000 rows at a time, as the engine batches them.
    seen: Counter[int] = Counter()
    for start in range(0, n, rows):
        seen.update(sample(logits.repeat(rows, 1), [p] * rows, list(range(start, start + rows))))
    want = torch.softmax(logits[0].double(), dim=-1)
    for t in range(5):
        assert abs(seen[t] / n - float(want[t])) < 0.015, (t, seen[t] / n, float(want[t]))


def test_a_rows_draw_does_not_depend_on_its_batch() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 2_000, generator=g) * 3
    params = [SamplingParams(temperature=0.7 + 0.1 * i, top_p=0.9, top_k=50 * i, seed=i) for i in range(5)]
    offsets = [3, 9, 0, 41, 7]
    together = sample(logits, params, offsets)
    alone = [sample(logits[i : i + 1], [params[i]], [offsets[i]])[0] for i in range(5)]
    backwards = sample(logits.flip(0), params[::-1], offsets[::-1])[::-1]
    assert together == alone == backwards


def test_greedy_rows_take_the_argmax_among_sampled_ones() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 1.0, 0.0], [0.0, 0.0, 9.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    out = sample(logits, params, [0, 0, 0])
    assert out[0] == 1 and out[2] == 2
    # A batch of greedy rows only (the argmax runs on the logits as they are, no copy of the rows).
    assert sample(logits, [SamplingParams(temperature=0.0)] * 3, [0, 0, 0]) == [1, 0, 2]


def test_uniforms_are_in_range_and_spread() -> None:
    us = [token_uniform(seed, o) for seed in range(20) for o in range(500)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.01
    assert len(set(us)) == len(us)


def test_a_draw_that_rounds_up_to_the_mass_takes_the_last_column_with_weight() -> None:
    """u * mass can round up to the mass itself (u < 1, float32): no cumulative weight passes it, and the
    draw is the last column with any weight, never one past the row or a column of weight 0."""
    weights = torch.tensor(
        [[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0]]
    )
    assert sampling._inverse_cdf(weights, torch.ones(4)).tolist() == [1, 0, 3, 3]
    assert sampling._inverse_cdf(weights, torch.zeros(4)).tolist() == [0, 0, 3, 0]
    assert sampling._inverse_cdf(weights, torch.tensor([0.6, 0.5, 0.5, 0.3])).tolist() == [1, 0, 3, 1]


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 1e-8])
def test_a_temperature_near_zero_takes_the_top_token_and_never_nan(temperature: float) -> None:
    # SPEC allows any temperature in (0, 2]. Below float32's range the division made +inf logits and the
    # softmax NaN: the draw then picked junk (the same token every step) instead of the near-greedy one.
    torch.manual_seed(3)
    logits = torch.randn(6, 500) * 8
    logits[:, 7] = -torch.inf  # a masked token stays masked
    top = logits.argmax(dim=-1).tolist()
    for top_p, top_k in ((1.0, 0), (0.9, 0), (1.0, 40)):
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=s) for s in range(6)]
        assert sample(logits, params, list(range(6))) == top
