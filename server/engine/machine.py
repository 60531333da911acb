"""What machine this is: the CPU model and the flags that decide which dtype and kernels are fast. The
bench prints it with every report; ``--dtype auto`` remembers its choice per machine by it."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

# Flags that change what is fast here: vector width, bf16 dot products, AMX tiles.
INTERESTING = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_info() -> dict[str, Any]:
    """The CPU model, its relevant flags, core count, torch's CPU capability and thread count."""
    import os

    import torch

    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: the model name is what platform knows
        pass
    return {
        "model": model,
        "flags": [f for f in INTERESTING if f in flags],
        "missing": [f for f in INTERESTING if flags and f not in flags],
        "cores": os.cpu_count(),
        "torch_capability": str(torch.backends.cpu.get_cpu_capability()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def cpu_line(info: dict[str, Any]) -> str:
    missing = ", ".join(info["missing"]) or "none"
    return (
        f"CPU: {info['model']}, {info['cores']} cores, torch {info['torch']} ({info['torch_capability']}, "
        f"{info['threads']} threads); flags: {' '.join(info['flags']) or '-'}; lacks: {missing}"
    )
