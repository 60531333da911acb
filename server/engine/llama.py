"""A Llama-family forward pass over the engine's slot KV cache, gpt-fast style: small functions with
tensor-shape comments, run on the Hugging Face model's own weight tensors (nothing is copied).

One call runs every token of a step through the layers together: the decode rows of all running
sequences (one token each) and the prefill chunks, packed into one flat batch of T tokens, so every
linear layer is a single matmul. Only attention is per group: one SDPA call per slot pool over all of its
decode rows (keys up to the longest live length among them, shorter rows masked), and one per prefill chunk.

Shapes: T tokens in the step, D hidden size, H query heads, KV key/value heads, Hd head dim, V vocab.
"""

from __future__ import annotations

import contextlib
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from server.engine import int4 as q4
from server.engine.mapped import map_like
from server.engine.profile import Lap, no_lap

Tensor = torch.Tensor

# Model types whose HF modules have exactly the Llama layout (q/k/v/o, gate/up/down, two RMSNorms,
# rotary over the whole head) and nothing more (no sliding window, no q/k norms, no soft-capping).
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})


@dataclass(frozen=True, slots=True)
class Shape:
    n_layers: int
    hidden: int  # D
    n_heads: int  # H
    n_kv_heads: int  # KV
    head_dim: int  # Hd
    vocab: int  # V
    eps: float
    max_positions: int

    @property
    def rep(self) -> int:
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True, slots=True)
class Linear:
    """A linear layer's weight [out, in] (and bias [out]), with a oneDNN-packed copy on CPU.

    Once the packed copy exists, ``w`` may be a meta tensor (its shape, no memory): every CPU GEMM reads
    the packed copy (or, in a step of a few tokens, ``int4``), so the plain one is dropped to keep one
    copy of the weights (``weights_of(..., keep_plain=False)``)."""

    w: Tensor
    b: Tensor | None = None
    packed: Tensor | None = None
    int4: q4.Int4 | None = None  # the checkpoint's own 4 bits, for steps of a few rows (int4.py)

    @property
    def in_features(self) -> int:
        return int(self.w.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.w.shape[0])


@dataclass(frozen=True, slots=True)
class Layer:
    # q/k/v and gate/up are each one GEMM on concatenated weights: fewer, larger calls (a decode step is
    # made of small ones), and q and k come out adjacent, so one rotary call covers both.
    attn_norm: Tensor  # [D]
    qkv: Linear  # [(H+2*KV)*Hd, D]: q, then k, then v
    o: Linear  # [D, H*Hd]
    mlp_norm: Tensor  # [D]
    gate_up: Linear  # [2*I, D]: gate, then up
    down: Linear  # [D, I]


@dataclass(frozen=True, slots=True)
class Weights:
    embed: Tensor  # [V, D]
    layers: tuple[Layer, ...]
    norm: Tensor  # [D]
    lm_head: Linear  # [V, D]
    cos: Tensor  # [P, Hd] rotary table for every position (float32)
    sin: Tensor  # [P, Hd]
    int4_rows: int = 0  # steps of at most this many tokens read the layers' 4-bit copies (int4.py)

    def reads_int4(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens reads the layers' 4-bit copies (few enough for them to win:
        measured at load); the forward, the bench's floor and its byte count ask the same."""
        return 0 < tokens <= self.int4_rows


def unsupported_reason(model: Any) -> str | None:
    """Why this model cannot run on the Llama path (None when it can)."""
    cfg = model.config
    mtype = getattr(cfg, "model_type", "")
    if mtype not in LLAMA_FAMILY:
        return f"model type {mtype!r} is not Llama-family"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", mtype == "mistral"):
        return "sliding-window attention"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP bias"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "rotary_emb"):
        return "module layout differs from LlamaForCausalLM"
    attn = layers[0].self_attn
    if hasattr(attn, "q_norm") or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention layout differs from Llama"
    return None


def shape_of(model: Any) -> Shape:
    return shape_of_config(model.config)


def shape_of_config(cfg: Any) -> Shape:
    """The shape from a transformers config (or anything with its attribute names: lite.py's)."""
    n_heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
    return Shape(
        n_layers=int(cfg.num_hidden_layers),
        hidden=int(cfg.hidden_size),
        n_heads=n_heads,
        n_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or n_heads),
        head_dim=head_dim,
        vocab=int(cfg.vocab_size),
        eps=float(cfg.rms_norm_eps),
        max_positions=int(getattr(cfg, "max_position_embeddings", 2048)),
    )


def _pack(w: Tensor) -> Tensor | None:
    """oneDNN's blocked copy of a CPU weight (what torch.compile's CPU backend uses): 1.3-1.7x faster
    GEMMs than MKL for 4-256 rows here. None where oneDNN is not available."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        return packed
    except (RuntimeError, AttributeError):
        return None


def _finish(w: Tensor, b: Tensor | None, pack: bool, keep_plain: bool) -> Linear:
    packed = _pack(w) if pack else None
    if packed is not None and not keep_plain:
        w = torch.empty(w.shape, dtype=w.dtype, device="meta")  # the shape stays, the memory goes
    return Linear(w, b, packed)


def _linear(module: Any, pack: bool, keep_plain: bool) -> Linear:
    w = module.weight.detach()
    b = getattr(module, "bias", None)
    return _finish(w, None if b is None else b.detach(), pack, keep_plain)


def _fused(modules: list[Any], pack: bool, keep_plain: bool) -> Linear:
    """One linear layer out of several that read the same input (their outputs side by side). The
    concatenated weight is a copy. Where it is what the runner reads (no packed copy: CUDA, or no
    oneDNN), the model's own weights become views of it, so that each weight lives once (the 1.7B model
    on a GPU held 2.2 GB twice) and the model's own forward, which the bench runs, reads the same numbers;
    with a packed copy, release_model_linears frees the model's tensors instead."""
    w = torch.cat([m.weight.detach() for m in modules])
    biases = [getattr(m, "bias", None) for m in modules]
    b = None
    if any(x is not None for x in biases):
        parts = [
            x.detach() if x is not None else w.new_zeros(m.weight.shape[0])
            for x, m in zip(biases, modules, strict=True)
        ]
        b = torch.cat(parts)
    lin = _finish(w, b, pack, keep_plain)
    if lin.packed is None:
        lo = 0
        for m in modules:
            hi = lo + m.weight.shape[0]
            m.weight.data = w[lo:hi]  # rows [lo, hi) of a contiguous tensor: contiguous too
            lo = hi
    return lin


def weights_of(
    model: Any,
    max_positions: int,
    *,
    pack: bool = True,
    keep_plain: bool = True,
    int4: tuple[dict[str, q4.Int4], ...] | None = None,
    int4_rows: int = 0,
) -> Weights:
    """The model's weights as plain tensors (packed copies for oneDNN with ``pack`` on CPU), plus rotary
    tables for positions [0, max_positions). With ``keep_plain`` off, a linear layer that has a packed
    copy keeps only that one (see ``release_model_linears`` for the model's own tensors). ``int4``: each
    layer's 4-bit copies (``int4.model_layers``, scales in bf16), read by steps of at most
    ``int4_rows`` tokens."""
    inner = model.model
    layers = []
    for i, layer in enumerate(inner.layers):
        a, m = layer.self_attn, layer.mlp
        fours = int4[i] if int4 is not None else {}
        layers.append(
            Layer(
                attn_norm=layer.input_layernorm.weight.detach(),
                qkv=_with_int4(_fused([a.q_proj, a.k_proj, a.v_proj], pack, keep_plain), fours.get("qkv")),
                o=_with_int4(_linear(a.o_proj, pack, keep_plain), fours.get("o")),
                mlp_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=_with_int4(_fused([m.gate_proj, m.up_proj], pack, keep_plain), fours.get("gate_up")),
                down=_with_int4(_linear(m.down_proj, pack, keep_plain), fours.get("down")),
            )
        )
    embed = inner.embed_tokens.weight.detach()
    # The model's own rotary module computes the tables, so rope scaling variants (llama3, linear, ...)
    # come out exactly as transformers computes them.
    positions = torch.arange(max_positions, device=embed.device)[None, :]  # [1, P]
    probe = torch.zeros(1, dtype=torch.float32, device=embed.device)
    cos, sin = inner.rotary_emb(probe, positions)  # [1, P, Hd] each
    return Weights(
        embed=embed,
        layers=tuple(layers),
        norm=inner.norm.weight.detach(),
        lm_head=_linear(model.lm_head, pack, keep_plain),
        cos=cos[0].float(),
        sin=sin[0].float(),
        int4_rows=int4_rows if int4 is not None else 0,
    )


def _with_int4(lin: Linear, small: q4.Int4 | None) -> Linear:
    if small is None:
        return lin
    if lin.b is not None:  # the 4-bit GEMM (linear) adds no bias; int4.model_layers never offers one
        raise ValueError("a 4-bit copy for a linear layer with a bias")
    if (small.out_features, small.in_features) != (lin.out_features, lin.in_features):
        shape = (small.out_features, small.in_features)
        raise ValueError(f"a 4-bit copy of {shape} for a weight of {tuple(lin.w.shape)}")
    if small.scales_zeros.dtype != torch.bfloat16:  # the kernel's activations and scales are bf16 (int4.mm)
        raise ValueError(f"4-bit scales in {small.scales_zeros.dtype}, not bfloat16")
    return Linear(lin.w, lin.b, lin.packed, small)


class ReleasedLinear(torch.nn.Module):
    """Where a model's linear layer was, once the engine holds its only (packed) copy: calling it is a
    clear error, never numbers."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("this model's weights were released: the serving engine holds their only copy")


def release_model_linears(model: Any, weights: Weights) -> tuple[Weights, int]:
    """Keep one copy of the weights: the model's linear layers that live on as packed copies only are
    replaced by ``ReleasedLinear`` (their tensors freed), and what the forward still reads of the model
    (norms, biases) is copied out of the checkpoint's file mapping into memory of its own; the embedding
    is mapped on its own from the checkpoint file where it holds the same numbers (mapped.py), else copied
    too. transformers maps a
    safetensors file and its tensors are views of that mapping: while one of them lives (the embedding),
    every page of the file the packing read stays resident. Returns the weights to run (the same
    numbers, now in those copies) and the bytes of model tensors released.

    The model is a shell afterwards (config, embedding, norms, rotary module; calling it raises).
    Serving does this; the bench, which runs transformers on the same model afterwards, does not."""
    if not weights.layers or weights.layers[0].qkv.w.device.type != "meta":
        return weights, 0  # plain copies kept: the model's tensors are what the runner reads
    freed = 0
    embed = model.model.embed_tokens.weight
    owners: list[tuple[Any, str]] = []
    if weights.lm_head.w.device.type == "meta":
        owners.append((model, "lm_head"))
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        owners += [(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        owners += [(m, n) for n in ("gate_proj", "up_proj", "down_proj")]
    for parent, name in owners:
        w = getattr(parent, name).weight
        if w.data_ptr() == embed.data_ptr():
            continue  # tied to the embedding the forward still reads
        freed += w.numel() * w.element_size()
        # Not a meta weight: F.linear on a CPU input and a meta weight returns uninitialised memory.
        setattr(parent, name, ReleasedLinear(int(w.shape[1]), int(w.shape[0])))
    moved: dict[int, Tensor] = {}
    folder = getattr(model, "name_or_path", "")
    for name, p in model.named_parameters():  # tied parameters come once
        if p.device.type == "cpu":
            old = p.data_ptr()
            # The embedding: a table a step reads a few rows of, so mapped from the checkpoint where it
            # holds the same numbers (mapped.py: resident only where read); anything else a copy.
            table = map_like(folder, name, p.data) if old == embed.data_ptr() and folder else None
            p.data = table if table is not None else p.data.clone()
            moved[old] = p.data
    if not moved:
        return weights, freed

    def own(t: Tensor | None) -> Any:
        return moved.get(t.data_ptr(), t) if t is not None and t.device.type == "cpu" else t

    def own_linear(lin: Linear) -> Linear:
        return Linear(lin.w, own(lin.b), lin.packed, lin.int4)

    layers = tuple(
        Layer(
            attn_norm=own(x.attn_norm),
            qkv=own_linear(x.qkv),
            o=own_linear(x.o),
            mlp_norm=own(x.mlp_norm),
            gate_up=own_linear(x.gate_up),
            down=own_linear(x.down),
        )
        for x in weights.layers
    )
    return (
        Weights(
            embed=own(weights.embed),
            layers=layers,
            norm=own(weights.norm),
            lm_head=own_linear(weights.lm_head),
            cos=weights.cos,
            sin=weights.sin,
            int4_rows=weights.int4_rows,
        ),
        freed,
    )


# ---- the step's layout ---------------------------------------------------------------------------


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows of one pool: tokens [tok_lo, tok_hi) of the step, one per sequence, attending over
    the slot view [0, n_slots) of the pool. ``rows`` maps each token to its slot when the rows are not
    exactly slots 0..n-1 (some slots in the range are mid-prefill, or idle)."""

    pool: int
    tok_lo: int
    tok_hi: int
    n_slots: int
    length: int  # keys [0, length): the longest live length among the rows
    mask: Tensor  # [n_slots, 1, 1, length] additive, in the cache's dtype: 0 where a key is visible, -inf not
    rows: Tensor | None  # [tok_hi - tok_lo] slot index of each row, or None when rows == arange


@dataclass(slots=True)
class PrefillChunk:
    """Tokens [tok_lo, tok_hi) of one sequence at positions [start, start + n), in slot ``slot``."""

    pool: int
    slot: int
    tok_lo: int
    tok_hi: int
    start: int
    # When start > 0: [rep*n, start + n] additive (0 or -inf), in the cache's dtype: row r*n + i (query i
    # of a KV head's r-th query head) sees keys [0, start + i].
    mask: Tensor | None = None


@dataclass(slots=True)
class StepLayout:
    ids: Tensor  # [T] token ids
    positions: Tensor  # [T] position of each token in its sequence
    write_rows: Tensor  # [T*KV] row of the cache (viewed as [rows, Hd]) each new key/value goes to
    decode: list[DecodeGroup]
    prefill: list[PrefillChunk]
    logits_at: Tensor  # [R] tokens whose next-token logits are wanted


def zeroed(size: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> Tensor:
    """A zero tensor whose pages, on CPU, become resident only when written. ``torch.zeros`` writes every
    byte at start, so a 1 GiB KV budget was 1 GiB of resident memory before the first chat; calloc (via
    numpy) maps fresh zero pages from the OS instead, and reading an untouched page costs no memory."""
    if torch.device(device).type != "cpu":
        return torch.zeros(size, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = 1
    for d in size:
        n *= d
    raw = torch.from_numpy(np.zeros(n * itemsize, dtype=np.uint8))
    _no_huge_pages(raw)
    return raw.view(dtype).view(size)


MADV_NOHUGEPAGE = 15  # Linux's madvise advice (asm-generic/mman-common.h)


def _no_huge_pages(t: Tensor) -> None:
    """Ask Linux for 4 KiB pages under ``t``. numpy advises huge pages for any large array, so a write
    to one KV row made a whole 2 MiB page resident: after one short chat a cache of 60 (layer, K/V)
    regions held 120 MiB. Elsewhere (not Linux, no libc), nothing."""
    import ctypes
    import ctypes.util

    page = mmap.PAGESIZE
    start = t.data_ptr()
    first = -(-start // page) * page  # madvise wants a page-aligned start: the whole pages inside
    length = (start + t.numel() * t.element_size() - first) // page * page
    if length <= 0:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), MADV_NOHUGEPAGE)


# How a decode group's rows attend over their slots' keys and values:
# * "sdpa": F.scaled_dot_product_attention with the group's additive mask (flash attention on CUDA);
# * "kq": by hand, the scores as K @ q^T. A KV head's query block is rep (3) rows, so q @ K^T is a GEMM
#   whose large operand is transposed; K @ q^T reads the keys in place instead. On CPU, which is faster
#   depends on the machine and the dtype (bf16 on a 2-core Zen EPYC with AVX512-BF16: attention 8.6 against
#   12.1 ms a step; fp32 on the same: 15.9 against 10.8; the AMX Xeon's bf16 bench favoured SDPA), so the
#   engine measures both at load (dtype.pick_decode_kernel) and keeps the clearly faster.
DECODE_KERNELS = ("sdpa", "kq")


class Cache:
    """K and V of every layer in one preallocated tensor, seen as slot pools.

    ``data`` is [n_layers, 2, rows, Hd]; pool p occupies rows [base_p, base_p + S_p*KV*L_p) and is viewed
    as [S_p, KV, L_p, Hd] (slot-major, so the running slots 0..n-1 of a pool are one strided view)."""

    def __init__(
        self,
        shape: Shape,
        pools: list[tuple[int, int]],
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        decode_kernel: str = "sdpa",
    ) -> None:
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode kernel {decode_kernel!r}: one of {', '.join(DECODE_KERNELS)}")
        self.shape = shape
        self.pools = pools
        self.decode_kernel = decode_kernel  # how decode rows read this cache (llama.attention)
        self.bases: list[int] = []
        rows = 0
        for n_slots, length in pools:
            self.bases.append(rows)
            rows += n_slots * shape.n_kv_heads * length
        self.data = zeroed((shape.n_layers, 2, rows, shape.head_dim), dtype, device)
        # Every layer's K/V views per pool, made once: the forward asks for them 30 times a step.
        self.views = [[self._layer_pool(i, p) for p in range(len(pools))] for i in range(shape.n_layers)]

    def pool_view(self, pool: int) -> Tensor:
        """[n_layers, 2, S, KV, L, Hd] view of one pool."""
        n_slots, length = self.pools[pool]
        base = self.bases[pool]
        kv = self.shape.n_kv_heads
        part = self.data[:, :, base : base + n_slots * kv * length]
        return part.view(self.shape.n_layers, 2, n_slots, kv, length, self.shape.head_dim)

    def layer_pool(self, layer: int, pool: int) -> tuple[Tensor, Tensor]:
        """K and V of one layer and pool: [S, KV, L, Hd] each."""
        return self.views[layer][pool]

    def _layer_pool(self, layer: int, pool: int) -> tuple[Tensor, Tensor]:
        n_slots, length = self.pools[pool]
        base = self.bases[pool]
        kv = self.shape.n_kv_heads
        k = self.data[layer, 0, base : base + n_slots * kv * length]
        v = self.data[layer, 1, base : base + n_slots * kv * length]
        s = (n_slots, kv, length, self.shape.head_dim)
        return k.view(s), v.view(s)

    def rows_of(self, pool: int, slot: int, position: int) -> list[int]:
        """Cache rows of one token's KV heads (for write_rows)."""
        _, length = self.pools[pool]
        first = self.bases[pool] + slot * self.shape.n_kv_heads * length + position
        return [first + h * length for h in range(self.shape.n_kv_heads)]

    def rows_range(self, pool: int, slot: int, start: int, n: int) -> Tensor:
        """``rows_of`` for positions [start, start + n) of one slot, position after position, as one host
        tensor [n * KV]: a prefill chunk's rows without a Python loop over its tokens and heads (a
        2,048-token chunk of a 32-KV-head model is 65,536 rows: 12.6 ms in the loop)."""
        _, length = self.pools[pool]
        first = self.bases[pool] + slot * self.shape.n_kv_heads * length + start
        heads = torch.arange(self.shape.n_kv_heads) * length
        return (torch.arange(first, first + n)[:, None] + heads).reshape(-1)

    def move(self, src: tuple[int, int], dst: tuple[int, int], n: int) -> None:
        """Copy the first ``n`` positions of slot src=(pool, slot) to dst, in every layer."""
        if n <= 0 or src == dst:
            return
        a = self.pool_view(src[0])[:, :, src[1], :, :n]
        b = self.pool_view(dst[0])[:, :, dst[1], :, :n]
        b.copy_(a)

    def swap(self, x: tuple[int, int], y: tuple[int, int], n: int) -> None:
        """Exchange the first ``n`` positions of two slots of the same pool, in every layer."""
        if n <= 0 or x == y:
            return
        a = self.pool_view(x[0])[:, :, x[1], :, :n]
        b = self.pool_view(y[0])[:, :, y[1], :, :n]
        tmp = a.clone()
        a.copy_(b)
        b.copy_(tmp)


# ---- the forward pass ----------------------------------------------------------------------------


def linear(x: Tensor, lin: Linear, small: bool = False) -> Tensor:
    # x [T, in] -> [T, out]: cuBLAS on CUDA; on CPU, the GEMMs that measured fastest here (2 cores):
    if x.device.type != "cpu":
        return F.linear(x, lin.w, lin.b)
    if small and lin.int4 is not None:
        # A step of a few rows: the checkpoint's 4-bit weights, a quarter of bf16's bytes (int4.py).
        return q4.mm(x, lin.int4)
    if lin.packed is not None:
        # oneDNN on the packed weight: the fastest at every row count measured (1 row to prefill chunks).
        y: Tensor = torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.b, "none", [], "")
        return y
    x = x.contiguous()
    if x.shape[0] == 1:
        # One row would go to GEMV, which reads the weights ~1.5x slower than a two-column GEMM.
        y = torch.mm(lin.w, x.expand(2, -1).contiguous().t())[:, :1].t()
    else:
        # w @ x.T with x.T a transposed view: MKL is several times faster this way round than
        # x @ w.T (F.linear) for a couple of rows.
        y = torch.mm(lin.w, x.t()).t()
    return y if lin.b is None else y + lin.b


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # [T, D] -> [T, D]; in float32 then back, as transformers' LlamaRMSNorm does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x [T, heads, Hd]; cos/sin [T, 1, Hd] -> [T, heads, Hd]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention(
    q: Tensor, k_cache: list[tuple[Tensor, Tensor]], layout: StepLayout, shape: Shape, kernel: str = "sdpa"
) -> Tensor:
    # q [T, H, Hd] (keys/values of this step already written to the cache) -> [T, H*Hd]; ``kernel``: how
    # decode rows attend (DECODE_KERNELS); prefill chunks always take SDPA.
    T = q.shape[0]
    out = q.new_empty(T, shape.n_heads, shape.head_dim)
    kv, rep, hd = shape.n_kv_heads, shape.rep, shape.head_dim
    for g in layout.decode:
        k, v = k_cache[g.pool]
        qg = q[g.tok_lo : g.tok_hi].view(-1, kv, rep, hd)  # [n, KV, rep, Hd]: a KV head's queries share keys
        if g.rows is not None:
            full = q.new_zeros(g.n_slots, kv, rep, hd)
            full.index_copy_(0, g.rows, qg)
            qg = full
        kg, vg = k[: g.n_slots, :, : g.length], v[: g.n_slots, :, : g.length]  # [n_slots, KV, length, Hd]
        if kernel == "kq":
            # Scores as K @ q^T: the keys are the GEMM's large operand, read in place, and q^T [Hd, rep]
            # the tiny one; the softmax in float32, as SDPA's CPU kernels do (DECODE_KERNELS).
            s = torch.matmul(kg, qg.transpose(-1, -2)).transpose(-1, -2).float()  # [n_slots, KV, rep, length]
            s = s.mul_(hd**-0.5).add_(g.mask)
            o = torch.matmul(torch.softmax(s, -1).to(q.dtype), vg)
        else:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask)  # [n_slots, KV, rep, Hd]
        if g.rows is not None:
            o = o.index_select(0, g.rows)
        out[g.tok_lo : g.tok_hi] = o.reshape(-1, shape.n_heads, hd)
    for c in layout.prefill:
        k, v = k_cache[c.pool]
        n = c.tok_hi - c.tok_lo
        end = c.start + n
        kc = k[c.slot : c.slot + 1, :, :end]  # [1, KV, end, Hd]
        vc = v[c.slot : c.slot + 1, :, :end]
        if c.mask is None:
            qc = q[c.tok_lo : c.tok_hi].transpose(0, 1)[None]  # [1, H, n, Hd]
            # From position 0: plain causal, which CUDA runs with flash attention.
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
            out[c.tok_lo : c.tok_hi] = o[0].transpose(0, 1)  # [n, H, Hd]
        else:
            # A KV head's rep query heads folded into the query axis, so every SDPA kernel (not only
            # those with GQA support) takes it with the shifted causal mask.
            qf = q[c.tok_lo : c.tok_hi].view(n, kv, rep, hd).permute(1, 2, 0, 3).reshape(1, kv, rep * n, hd)
            o = F.scaled_dot_product_attention(qf, kc, vc, attn_mask=c.mask)  # [1, KV, rep*n, Hd]
            out[c.tok_lo : c.tok_hi] = (
                o.view(kv, rep, n, hd).permute(2, 0, 1, 3).reshape(n, shape.n_heads, hd)
            )
    return out.view(T, shape.n_heads * hd)


def forward(w: Weights, shape: Shape, cache: Cache, layout: StepLayout, lap: Lap = no_lap) -> Tensor:
    """Run one step's tokens through the model, writing their K/V into the cache; returns float32
    logits [R, V] at ``layout.logits_at``. ``lap`` marks phase boundaries for the step profile."""
    T = layout.ids.shape[0]
    H, kv, hd = shape.n_heads, shape.n_kv_heads, shape.head_dim
    inter = w.layers[0].gate_up.w.shape[0] // 2 if w.layers else 0  # I
    cos = w.cos[layout.positions].to(w.embed.dtype)[:, None, :]  # [T, 1, Hd]
    sin = w.sin[layout.positions].to(w.embed.dtype)[:, None, :]
    x = F.embedding(layout.ids, w.embed)  # [T, D]
    small = w.reads_int4(T)
    lap("other")
    for i, L in enumerate(w.layers):
        h = rms_norm(x, L.attn_norm, shape.eps)
        lap("norms+rotary")
        qkv = linear(h, L.qkv, small).reshape(T, H + 2 * kv, hd)  # [T, H+2KV, Hd]
        lap("linear")
        qk = rotate(qkv[:, : H + kv], cos, sin)  # [T, H+KV, Hd]: q and k in one call
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + kv :]
        lap("norms+rotary")
        cache.data[i, 0].index_copy_(0, layout.write_rows, k.reshape(T * kv, hd))
        cache.data[i, 1].index_copy_(0, layout.write_rows, v.reshape(T * kv, hd))
        lap("other")
        a = attention(q, cache.views[i], layout, shape, cache.decode_kernel)
        lap("attention")
        x = x + linear(a, L.o, small)  # [T, D]
        lap("linear")
        h = rms_norm(x, L.mlp_norm, shape.eps)
        lap("norms+rotary")
        gu = linear(h, L.gate_up, small)  # [T, 2I]
        lap("linear")
        gu = F.silu(gu[:, :inter]) * gu[:, inter:]  # [T, I]
        lap("other")
        x = x + linear(gu, L.down, small)  # [T, I] -> [T, D]
        lap("linear")
    last = rms_norm(x.index_select(0, layout.logits_at), w.norm, shape.eps)  # [R, D]
    lap("norms+rotary")
    logits = linear(last, w.lm_head).float()  # [R, V]
    lap("linear")
    return logits
