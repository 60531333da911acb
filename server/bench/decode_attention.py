"""Decode attention and the KV writes alone, in the variants issue 26 weighed, alternated in one process.

``python -m server.bench.decode_attention [--rows 32] [--layers 30] [--reps 10] [--dtype float32] [--flex]``

A decode step's attention reads each running row's keys and values at its live length; the engine does it
with one SDPA per layer and pool over the pool's slot views (``llama.attention``), after writing the step's
new keys and values into their slots (``index_copy_``). This times, per step of ``--layers`` layers at
SmolLM2-135M's shape (3 KV heads of 64, 3 query heads per KV head), with a GEMM of the MLP's size between
calls as in a real step (so the cache is cold, as it is there):

* SDPA with the engine's bool mask, with a float mask, and matmul-softmax-matmul by hand (the scores
  as q @ K^T, or as K @ q^T with the softmax in float32);
* the KV cache head-major (the engine's ``[slot, head, position, Hd]``) against token-major
  (``[slot, position, head, Hd]``, so a token's heads are one write): both the writes and SDPA on its
  strided views;
* with ``--flex``, ``flex_attention`` compiled by Inductor with a block mask at the live lengths (slow to
  compile, and it needs a C++ compiler).

The engine README quotes this bench's figures; it prints the CPU it ran on first.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from server.engine import llama
from server.engine.machine import cpu_info, cpu_line
from server.engine.threads import in_own_thread

KV, REP, HD = 3, 3, 64  # SmolLM2-135M: 3 KV heads of 64, 9 query heads
SLOTS, SLOT_LEN = 37, 512  # the default CPU pool's slots of 512 positions (the engine's default on CPU)
MLP = (1536 * 2, 576)  # the gate/up GEMM run between calls


def run(
    rows: int = 32,
    layers: int = 30,
    reps: int = 10,
    *,
    dtype: torch.dtype = torch.float32,
    flex: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Median ms per step of each variant; also the largest difference of each from the engine's SDPA.
    ``dtype`` is the cache's, the queries' and the GEMM's, as when the engine serves in it."""
    torch.manual_seed(seed)
    if rows > SLOTS:
        raise ValueError(f"--rows at most {SLOTS}")
    head = llama.zeroed((layers, 2, SLOTS, KV, SLOT_LEN, HD), dtype, "cpu").normal_()
    token = llama.zeroed((layers, 2, SLOTS, SLOT_LEN, KV, HD), dtype, "cpu")
    token.copy_(head.transpose(3, 4))  # the same numbers, token-major: the outputs must match
    w, x = torch.randn(*MLP, dtype=dtype), torch.randn(rows, MLP[1], dtype=dtype)
    lens = torch.randint(60, 176, (rows,))  # prompts plus what they generated so far
    length = int(lens.max())
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]  # [rows, 1, 1, length]
    fmask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    q = torch.randn(rows, KV, REP, HD, dtype=dtype)  # a KV head's queries folded together, as the engine does
    k_new, v_new = torch.randn(rows, KV, HD, dtype=dtype), torch.randn(rows, KV, HD, dtype=dtype)
    scale = 1 / math.sqrt(HD)
    pos = 150  # the position this step writes

    def head_kv(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return head[i, 0, :rows, :, :length], head[i, 1, :rows, :, :length]

    def token_kv(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return head_major_view(token[i, 0, :rows, :length]), head_major_view(token[i, 1, :rows, :length])

    def by_hand(i: int) -> torch.Tensor:
        k, v = head_kv(i)
        s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(fmask)
        return torch.matmul(torch.softmax(s, -1), v)

    def by_hand_kq(i: int) -> torch.Tensor:
        # Scores as K @ q^T: the keys are the GEMM's A, read in place; q^T [Hd, rep] is tiny. The softmax
        # in float32, as SDPA's kernels do.
        k, v = head_kv(i)
        s = torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2).float().mul_(scale).add_(fmask)
        return torch.matmul(torch.softmax(s, -1).to(dtype), v)

    def write_head(i: int) -> None:
        head[i, 0, :rows, :, pos] = k_new
        head[i, 1, :rows, :, pos] = v_new

    def write_token(i: int) -> None:
        token[i, 0, :rows, pos] = k_new
        token[i, 1, :rows, pos] = v_new

    variants: dict[str, Callable[[int], Any]] = {
        "sdpa, bool mask (the engine)": lambda i: F.scaled_dot_product_attention(
            q, *head_kv(i), attn_mask=mask
        ),
        "sdpa, float mask": lambda i: F.scaled_dot_product_attention(q, *head_kv(i), attn_mask=fmask),
        "matmul-softmax-matmul": by_hand,
        "by hand, scores as K @ q^T": by_hand_kq,
        "sdpa, token-major KV": lambda i: F.scaled_dot_product_attention(q, *token_kv(i), attn_mask=mask),
        "KV writes, head-major (the engine)": write_head,
        "KV writes, token-major": write_token,
    }
    if flex:
        variants["flex_attention (Inductor)"] = _flex(q, lens, length, head_kv)
    ref = variants["sdpa, bool mask (the engine)"](0)
    diff = {
        name: float((fn(0) - ref).abs().max())
        for name, fn in variants.items()
        if not name.startswith("KV writes")
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for r in range(reps):
        for name, fn in order[r % len(order) :] + order[: r % len(order)]:  # no variant always first
            total = 0.0
            for i in range(layers):
                x @ w.t()  # what runs between two attention calls in a step: the caches go cold
                t0 = time.perf_counter()
                fn(i)
                total += time.perf_counter() - t0
            times[name].append(total * 1000)
    return {
        "rows": rows,
        "layers": layers,
        "dtype": str(dtype).removeprefix("torch."),
        "length": length,
        "ms_per_step": {name: round(statistics.median(t), 2) for name, t in times.items()},
        "max_diff": diff,
    }


def head_major_view(t: torch.Tensor) -> torch.Tensor:
    """[rows, length, KV, Hd] -> [rows, KV, length, Hd], a strided view (no copy)."""
    return t.transpose(1, 2)


def _flex(
    q: torch.Tensor,
    lens: torch.Tensor,
    length: int,
    head_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> Callable[[int], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    rows = q.shape[0]
    qh = q.reshape(rows, KV * REP, 1, HD)  # [B, H, 1, Hd]; enable_gqa maps 3 query heads to a KV head

    def live(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < lens[b]

    block = create_block_mask(live, rows, None, 1, length, device="cpu", BLOCK_SIZE=64)
    compiled = torch.compile(flex_attention, dynamic=False)

    def call(i: int) -> torch.Tensor:
        out: torch.Tensor = compiled(qh, *head_kv(i), block_mask=block, enable_gqa=True)
        return out.view(rows, KV, REP, HD)

    return call


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m server.bench.decode_attention", description=__doc__.split("\n")[0]
    )
    p.add_argument("--rows", type=int, default=32, help="decode rows (running sequences), at most 37")
    p.add_argument("--layers", type=int, default=30, help="layers per step (SmolLM2-135M: 30)")
    p.add_argument("--reps", type=int, default=10, help="steps per variant, alternated")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="the cache's and the queries' dtype (the engine serves bf16 where --dtype auto picks it)",
    )
    p.add_argument(
        "--flex", action="store_true", help="also flex_attention compiled by Inductor (slow start)"
    )
    a = p.parse_args(argv)
    print(cpu_line(cpu_info()), flush=True)
    torch.set_grad_enabled(False)
    # In a thread that ends, as the engine's forward runs (server/engine/threads.py).
    res = in_own_thread(lambda: run(a.rows, a.layers, a.reps, dtype=getattr(torch, a.dtype), flex=a.flex))
    print(
        f"{res['rows']} rows, {res['layers']} layers, {res['dtype']}, longest live length {res['length']}:"
        " median ms a step"
    )
    for name, ms in res["ms_per_step"].items():
        d = res["max_diff"].get(name)
        print(f"  {name:36s} {ms:8.2f}" + ("" if d is None else f"   max |diff| {d:.1e}"))


if __name__ == "__main__":
    main()
