"""The decode kernels (``llama.DECODE_KERNELS``) give the same attention: the by-hand K @ q^T against SDPA,
on random queries and caches, with rows that are and are not the group's first slots."""

from __future__ import annotations

import pytest
import torch

from server.engine import llama

SHAPE = llama.Shape(
    n_layers=1, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, vocab=100, eps=1e-5, max_positions=64
)


def _layout(
    lengths: list[int], slots: list[int], n_slots: int, length: int, dtype: torch.dtype
) -> llama.StepLayout:
    visible = torch.zeros(n_slots, 1, 1, length, dtype=torch.bool)
    for slot, n in zip(slots, lengths, strict=True):
        visible[slot, ..., :n] = True
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    rows = None if slots == list(range(len(slots))) else torch.tensor(slots)
    group = llama.DecodeGroup(
        pool=0, tok_lo=0, tok_hi=len(slots), n_slots=n_slots, length=length, mask=mask, rows=rows
    )
    empty = torch.empty(0, dtype=torch.long)
    return llama.StepLayout(
        ids=empty, positions=empty, write_rows=empty, decode=[group], prefill=[], logits_at=empty
    )


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize(
    ("lengths", "slots"),
    [([5, 17, 32, 1], [0, 1, 2, 3]), ([9, 30], [3, 1])],  # slots 0..n-1; some slots idle or mid-prefill
    ids=["first-slots", "scattered"],
)
def test_by_hand_kq_matches_sdpa(
    dtype: torch.dtype, tol: float, lengths: list[int], slots: list[int]
) -> None:
    torch.manual_seed(0)
    n_slots, length = 4, max(lengths)
    k = torch.randn(n_slots, SHAPE.n_kv_heads, 48, SHAPE.head_dim, dtype=dtype) * 2
    v = torch.randn_like(k)
    q = torch.randn(len(slots), SHAPE.n_heads, SHAPE.head_dim, dtype=dtype) * 2
    layout = _layout(lengths, slots, n_slots, length, dtype)
    ref = llama.attention(q, [(k, v)], layout, SHAPE, "sdpa")
    got = llama.attention(q, [(k, v)], layout, SHAPE, "kq")
    assert got.shape == ref.shape == (len(slots), SHAPE.n_heads * SHAPE.head_dim)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    # and against plain maths: each row sees its own slot's first `length` keys, a KV head per 3 heads
    for i, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
        for h in range(SHAPE.n_heads):
            kh, vh = k[slot, h // 3, :n].float(), v[slot, h // 3, :n].float()
            p = torch.softmax(kh @ q[i, h].float() / SHAPE.head_dim**0.5, -1)
            want = p @ vh
            torch.testing.assert_close(got[i].view(SHAPE.n_heads, -1)[h].float(), want, atol=tol, rtol=tol)


def test_an_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="decode kernel 'flash'"):
        llama.Cache(SHAPE, [(2, 16)], dtype=torch.float32, device="cpu", decode_kernel="flash")


def test_a_chunks_cache_rows_are_each_tokens_rows_in_order() -> None:
    # The runner writes a prefill chunk's K/V through rows_range (one tensor op), a decode row's through
    # rows_of: the same rows, token after token and head after head, in every pool.
    cache = llama.Cache(SHAPE, [(3, 16), (2, 40)], dtype=torch.float32, device="cpu")
    for pool, slot, start, n in ((0, 0, 0, 16), (0, 2, 5, 7), (1, 1, 0, 40), (1, 0, 33, 1)):
        want = [r for pos in range(start, start + n) for r in cache.rows_of(pool, slot, pos)]
        assert cache.rows_range(pool, slot, start, n).tolist() == want
