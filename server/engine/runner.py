"""The torch side of a step: apply the scheduler's KV copies, lay the step's tokens out for one batched
forward pass over the slot cache, and sample one token per sequence that reached the end of its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from server.engine import llama
from server.engine.kv_cache import Move, Op, Swap
from server.engine.penalties import apply_penalties
from server.engine.profile import Lap, no_lap
from server.engine.sampling import sample, take_rows
from server.engine.scheduler import Batch, Work


@dataclass(frozen=True, slots=True)
class RunnerStats:
    kv_bytes: int
    bytes_per_token: int
    pools: tuple[tuple[int, int], ...]


def kv_bytes_per_token(model: Any, dtype: torch.dtype) -> int:
    s = llama.shape_of(model)
    return s.n_layers * 2 * s.n_kv_heads * s.head_dim * torch.empty(0, dtype=dtype).element_size()


class Runner:
    """Owns the model weights (the HF model's tensors, fused and oneDNN-packed on CPU; with ``keep_plain``
    off, the packed copies only) and the preallocated KV cache."""

    def __init__(
        self,
        model: Any,
        pools: Sequence[tuple[int, int]],
        *,
        device: str | torch.device,
        dtype: torch.dtype,
        keep_plain: bool = True,
        decode_kernel: str = "sdpa",
        int4: tuple[dict[str, Any], ...] | None = None,
        int4_rows: int = 0,
    ) -> None:
        reason = llama.unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the batching runner needs a Llama-family model: {reason}")
        self.device = torch.device(device)
        self.shape = llama.shape_of(model)
        max_len = max(length for _, length in pools)
        self.weights = llama.weights_of(
            model, max(max_len, 1), keep_plain=keep_plain, int4=int4, int4_rows=int4_rows
        )
        self.cache = llama.Cache(
            self.shape, list(pools), dtype=dtype, device=self.device, decode_kernel=decode_kernel
        )
        # On a GPU, greedy rows take their argmax where the logits are (``step``);
        # on CPU the logits are already on the host and every row goes through ``sample``.
        self.argmax_on_device = self.device.type != "cpu"
        self.stats = RunnerStats(
            kv_bytes=self.cache.data.numel() * self.cache.data.element_size(),
            bytes_per_token=kv_bytes_per_token(model, dtype),
            pools=tuple(pools),
        )

    def apply(self, ops: Sequence[Op]) -> None:
        for op in ops:
            if isinstance(op, Move):
                self.cache.move(op.src, op.dst, op.length)
            elif isinstance(op, Swap):
                self.cache.swap(op.a, op.b, op.length)

    @torch.inference_mode()
    def logits(self, batch: Batch, lap: Lap = no_lap) -> torch.Tensor:
        """Apply ``batch.ops``, run its work; float32 logits [R, V] for ``batch.sampled`` in order."""
        self.apply(batch.ops)
        lap("kv moves")
        if not batch.work:
            return torch.empty(0, self.shape.vocab)
        layout = self.layout(batch.work)
        lap("layout")
        return llama.forward(self.weights, self.shape, self.cache, layout, lap)

    def step(self, batch: Batch, lap: Lap = no_lap) -> list[int]:
        """One step: the sampled token of every ``batch.sampled`` sequence, in order."""
        logits = self.logits(batch, lap)
        sampled = batch.sampled
        if not sampled:
            return []
        seqs = [w.seq for w in sampled]
        params = [s.params for s in seqs]
        tokens = [0] * len(seqs)
        rest = list(range(len(seqs)))  # rows drawn on the host
        if self.argmax_on_device:
            # At 256 rows a step's float32 logits are 50 MB to copy to the host (and to scan there); a
            # greedy row needs only its argmax, after its penalties (applied where the logits are), so
            # only those ints cross. Same tokens: argmax takes the first of equal maxima on every device.
            greedy = [i for i, p in enumerate(params) if p.temperature <= 0.0]
            if greedy:
                g = apply_penalties(
                    take_rows(logits, greedy),
                    [params[i] for i in greedy],
                    [seqs[i].tokens for i in greedy],
                    [seqs[i].n_prompt for i in greedy],
                )
                for i, t in zip(greedy, g.argmax(dim=-1).tolist(), strict=True):
                    tokens[i] = int(t)
            rest = [i for i, p in enumerate(params) if p.temperature > 0.0]
        if rest:
            host = apply_penalties(
                take_rows(logits, rest).cpu(),
                [params[i] for i in rest],
                [seqs[i].tokens for i in rest],
                [seqs[i].n_prompt for i in rest],
            )
            # completion index of the token being drawn: a row's draw depends on (seed, offset) alone
            drawn = sample(host, [params[i] for i in rest], [seqs[i].completion_len for i in rest])
            for i, t in zip(rest, drawn, strict=True):
                tokens[i] = t
        lap("sampling")
        return tokens

    def _additive(self, hidden: torch.Tensor) -> torch.Tensor:
        """An attention mask made once a step, additive in the cache's dtype: 0 where a key is visible, -inf
        where ``hidden``. Given a bool mask, SDPA makes this itself in each of the step's calls, one per
        layer. On a 2-core AVX2 EPYC, alternated with the bool mask: the engine's attention phase at 28-32
        decode rows on the bench workload took a median 20.2 against 23.0 ms a step (lower in 5 of 6
        runs); alone, 30 layers at 32 rows (python -m server.bench.decode_attention), 22.6-24.7 against
        23.6-25.8 ms; a prefill chunk after a cached start, 30 layers on a 2-core AVX512-BF16 EPYC, 6-13%
        less. Same outputs."""
        return torch.zeros(hidden.shape, dtype=self.cache.data.dtype).masked_fill_(hidden, float("-inf"))

    def layout(self, work: Sequence[Work]) -> llama.StepLayout:
        """Token order: decode rows pool by pool in slot order, then prefill chunks."""
        dev = self.device
        decode = sorted((w for w in work if w.n == 1), key=lambda w: _slot(w))
        chunks = [w for w in work if w.n > 1]
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        last_token: dict[int, int] = {}  # id(work) -> index of its last token
        groups: list[llama.DecodeGroup] = []
        i = 0
        while i < len(decode):
            pool = _slot(decode[i])[0]
            j = i
            while j < len(decode) and _slot(decode[j])[0] == pool:
                j += 1
            members = decode[i:j]
            slots = [_slot(w)[1] for w in members]
            n_slots = slots[-1] + 1
            lens = [1] * n_slots  # idle slots in the range see one key: no fully masked rows
            for w, s in zip(members, slots, strict=True):
                lens[s] = w.start + 1
            length = max(lens)
            if self.device.type == "cuda":
                # CUDA's memory-efficient SDPA kernel wants the mask's rows 8-aligned and pads it again
                # in every layer's call otherwise: keys up to the next multiple of 8 (masked, within the
                # pool's slots), so that it pads nothing.
                length = min(-(-length // 8) * 8, self.cache.pools[pool][1])
            hidden = torch.arange(length)[None, :] >= torch.tensor(lens)[:, None]  # [n_slots, length]
            mask = self._additive(hidden)
            dense = slots == list(range(n_slots))
            groups.append(
                llama.DecodeGroup(
                    pool=pool,
                    tok_lo=i,
                    tok_hi=j,
                    n_slots=n_slots,
                    length=length,
                    mask=mask[:, None, None, :].to(dev),
                    rows=None if dense else torch.tensor(slots, device=dev),
                )
            )
            i = j
        prefill: list[llama.PrefillChunk] = []
        for w in decode:
            pool, slot = _slot(w)
            last_token[id(w)] = len(ids)
            ids.append(w.seq.tokens[w.start])
            positions.append(w.start)
            rows.extend(self.cache.rows_of(pool, slot, w.start))
        write_rows = [torch.tensor(rows, dtype=torch.long)]
        for w in chunks:
            pool, slot = _slot(w)
            lo = len(ids)
            ids.extend(w.ids)
            positions.extend(range(w.start, w.start + w.n))
            write_rows.append(self.cache.rows_range(pool, slot, w.start, w.n))
            causal: torch.Tensor | None = None
            if w.start > 0:  # continues a cached prefix or an earlier chunk: causal, shifted by start
                keys = torch.arange(w.start + w.n)
                hidden = keys[None, :] > (w.start + torch.arange(w.n))[:, None]  # [n, start + n]
                causal = self._additive(hidden).repeat(self.shape.rep, 1).to(dev)  # one per query head
            prefill.append(llama.PrefillChunk(pool, slot, lo, lo + w.n, w.start, causal))
            last_token[id(w)] = lo + w.n - 1
        logits_at = [last_token[id(w)] for w in work if w.sample]
        return llama.StepLayout(
            ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            write_rows=torch.cat(write_rows).to(dev),
            decode=groups,
            prefill=prefill,
            logits_at=torch.tensor(logits_at, dtype=torch.long, device=dev),
        )


def _slot(w: Work) -> tuple[int, int]:
    assert w.seq.slot is not None
    return w.seq.slot
