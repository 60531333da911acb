"""The 4-bit weights a checkpoint already holds, run as 4 bits in the decode steps of a few rows (CPU).

The default model comes from a Q4_1 GGUF: every weight of its linear layers is ``low + q * scale`` with
``q`` in 0..15, one (scale, low) per group of 32 inputs. Converted to a Hugging Face folder, those values
are float32 numbers on that grid, and the engine serves them in bf16 or float32: 2 or 4 bytes a weight,
where the checkpoint's information is half a byte. A decode step of a few rows reads every weight once and
does little else with it, so its GEMMs are bound by those bytes: on a 2-core Xeon with AMX, the layers'
GEMMs at one row took 14.3 ms in bf16 through oneDNN against 5.4 ms through torch's 4-bit kernel
(``_weight_int4pack_mm_for_cpu``, bf16 activations). That kernel unpacks the weights again for every few
rows, though, so its cost grows with the rows (48.6 against 17.6 ms at 32): it pays only for the steps of
a lone user or a quiet server, and which row counts it wins is measured at load
(``dtype.pick_int4_rows``), never assumed. Its float32 path is not vectorised (100 ms at one row), so it
runs with bf16 activations only: a CPU serving float32 (chosen by ``--dtype auto``; never when float32 is
asked for) rounds a small step's activations to bf16 for these GEMMs, up to the row count measured as in
bf16 (a 1-row step on an AVX2-only EPYC, which serves float32, took 25.5 ms so against 43.2), at about
70 MiB, which an idle float32 server has room for under 1 GB since serving loads without transformers'
modeling code (lite.py).

Nothing is quantised here: ``exact`` finds a weight's grid and returns None unless every value lies on
it, to float32 precision. A checkpoint in bf16 or float32 that was never 4-bit keeps its plain GEMMs. The
4-bit copy is made from the float32 load, before any cast (its groups' scales then go to bf16, as the
kernel asks), and is kept beside the packed bf16 or float32 copy, which every larger step reads: 0.625
bytes a weight, 66 MB for SmolLM2-135M's layers. The LM head is not 4-bit (Q8_0 in the GGUF): it stays
on oneDNN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Tensor = torch.Tensor

GROUP = 32  # inputs per (scale, low) pair: Q4_1's block
LEVELS = 15  # q in 0..LEVELS
INNER_K_TILES = 2  # the CPU packing's tiling of the input dimension (K must divide by 16 x this)
OUT_MULTIPLE = 16  # the CPU packing's blocks of outputs: N must divide by this
EXACT_TOLERANCE = 1e-4  # a value may sit this far off its grid point, in units of its group's scale


@dataclass(frozen=True, slots=True)
class Int4:
    """One linear layer's weight [out, in] in torch's packed 4-bit CPU form."""

    packed: Tensor  # uint8 [out, in / 2], as _convert_weight_to_int4pack_for_cpu lays it out
    scales_zeros: Tensor  # [in / GROUP, out, 2]: each group's scale and the value at q = 8
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes a GEMM reads of this weight."""
        return self.packed.numel() * self.packed.element_size() + (
            self.scales_zeros.numel() * self.scales_zeros.element_size()
        )

    def to(self, dtype: torch.dtype) -> Int4:
        """The same weight with its scales in ``dtype``: the kernel's activations' (bf16, ``mm``)."""
        return Int4(self.packed, self.scales_zeros.to(dtype), self.out_features, self.in_features)


def exact(w: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(q, scale, low)`` when every value of the float32 weight ``w`` [out, in] is ``low + q * scale``
    for its group of GROUP inputs, q an integer in 0..LEVELS; else None. q is uint8 [out, in], scale and
    low float32 [out, in / GROUP]. A group's grid is read off its own values: Q4_1's quantiser sets low to
    the group's minimum and scale to (max - min) / 15, so both ends occur (a group whose values all lie on
    a coarser grid is found exact too, with its own extremes)."""
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % GROUP or w.shape[1] % (16 * INNER_K_TILES):
        return None
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    low = groups.amin(-1)
    scale = (groups.amax(-1) - low) / LEVELS
    step = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    q = torch.round((groups - low[..., None]) / step)
    off = (low[..., None] + q * scale[..., None] - groups).abs() / step
    if not bool(torch.isfinite(off).all()) or float(off.amax()) > EXACT_TOLERANCE:
        return None
    return q.to(torch.uint8).reshape(n, k), scale, low


def pack(parts: list[tuple[Tensor, Tensor, Tensor]]) -> Int4:
    """One Int4 out of the exact forms of weights that read the same input, their outputs side by side
    (q/k/v, gate/up: as the engine fuses them). Scales stay float32 until ``Int4.to``."""
    q = torch.cat([p[0] for p in parts]).to(torch.int32)
    scale = torch.cat([p[1] for p in parts])
    low = torch.cat([p[2] for p in parts])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    # The kernel computes (q - 8) * scale + zero, so zero is the value at q = 8.
    scales_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous()
    return Int4(packed, scales_zeros, int(q.shape[0]), int(q.shape[1]))


def mm(x: Tensor, w: Int4) -> Tensor:
    """x [T, in] -> [T, out], in x's dtype; computed with bf16 activations (the kernel's float32 path is
    not vectorised), so a float32 x is rounded to bf16 on the way in."""
    a = x.to(w.scales_zeros.dtype).contiguous()
    y: Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(a, w.packed, GROUP, w.scales_zeros)
    return y.to(x.dtype)


def model_layers(model: Any) -> tuple[dict[str, Int4], ...] | None:
    """Every layer's linear weights in 4 bits, fused as the engine runs them ({"qkv", "o", "gate_up",
    "down"} -> Int4), when the model is a float32 Llama on CPU whose layers' weights are all exactly 4-bit
    (``exact``); else None. The first weight off the grid ends the search. Biases are not covered: a layer
    with one keeps its plain GEMMs (None)."""
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        mods = {
            "qkv": [a.q_proj, a.k_proj, a.v_proj],
            "o": [a.o_proj],
            "gate_up": [m.gate_proj, m.up_proj],
            "down": [m.down_proj],
        }
        out: dict[str, Int4] = {}
        for name, group in mods.items():
            parts = []
            for mod in group:
                if getattr(mod, "bias", None) is not None or mod.weight.device.type != "cpu":
                    return None
                form = exact(mod.weight.detach())
                if form is None:
                    return None
                parts.append(form)
            if sum(int(p[0].shape[0]) for p in parts) % OUT_MULTIPLE:
                return None
            out[name] = pack(parts)
        layers.append(out)
    return tuple(layers) or None
