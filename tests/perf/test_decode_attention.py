"""The decode-attention bench: every variant computes what the engine's SDPA computes, on the same keys,
in float32 and (to bf16's rounding) in bfloat16."""

from __future__ import annotations

from server.bench import decode_attention


def test_every_attention_variant_matches_the_engines_sdpa() -> None:
    res = decode_attention.run(rows=4, layers=2, reps=1)
    assert set(res["ms_per_step"]) >= {
        "sdpa, bool mask (the engine)",
        "sdpa, token-major KV",
        "KV writes, token-major",
    }
    assert all(ms > 0 for ms in res["ms_per_step"].values())
    # The token-major cache holds the same numbers, seen through a strided view: the same attention.
    assert set(res["max_diff"]) == {n for n in res["ms_per_step"] if not n.startswith("KV writes")}
    assert all(d < 1e-5 for d in res["max_diff"].values()), res["max_diff"]


def test_the_token_major_view_puts_heads_before_positions() -> None:
    import torch

    t = torch.arange(2 * 5 * 3 * 4).view(2, 5, 3, 4)  # [rows, length, KV, Hd]
    v = decode_attention.head_major_view(t)
    assert v.shape == (2, 3, 5, 4) and v[1, 2, 4, 3] == t[1, 4, 2, 3] and v.data_ptr() == t.data_ptr()


def test_in_bfloat16_every_variant_is_within_rounding_of_the_engines_sdpa() -> None:
    import torch

    res = decode_attention.run(rows=4, layers=2, reps=1, dtype=torch.bfloat16)
    assert res["dtype"] == "bfloat16"
    assert "by hand, scores as K @ q^T" in res["max_diff"]
    # bf16 keeps 8 bits of mantissa: outputs near 1 round to steps of 2^-7; a wrong attention is off by ~1.
    assert all(d <= 2**-5 for d in res["max_diff"].values()), res["max_diff"]
