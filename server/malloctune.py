"""glibc malloc settings, per kind of process: a gateway gives big freed blocks back to the OS, a process
with an engine keeps what the engine's steps free. Process-wide (mallopt), so each process picks one; on
a libc other than glibc these do nothing."""

from __future__ import annotations

import contextlib

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h


def _glibc_call(name: str, *args: int) -> None:
    """Call one of glibc's malloc tuning functions; elsewhere (not glibc), nothing."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):
        getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)(*args)


def return_freed_memory_to_the_os() -> None:
    """Make glibc give large freed blocks back to the OS. Its mmap threshold starts at 128 KiB but rises
    to the size of any mmapped block freed, so after the first 1 MiB frame every later one is carved out
    of the heap, and a flood of big frames leaves the process that much larger for good. A fixed
    threshold keeps blocks of 256 KiB and more (frames, bodies, their decoded strings) in mmap, freed at
    once. Elsewhere (not glibc) this does nothing.

    Only for a process with no engine (``run_gateway``; one with an engine keeps its steps' memory,
    below): the setting is process-wide, and an engine's tensors of 256 KiB and more (a decode step's
    activations and logits, dozens a step) would then each be a fresh mmap, page-faulted in and unmapped
    again. In ``tokenwire serve`` that cost
    39% of its tokens/s (2026-12-05, a 2-core EPYC, the e2e workload over HTTP, alternated: 266.7 / 270.2
    with it against 436.2 / 442.0 without)."""
    _fixed_thresholds(mmap_bytes=256 * 1024, trim_bytes=1 << 20)


def keep_freed_memory_for_the_engine() -> None:
    """Make glibc keep the memory an engine's steps free, for the next step. Left to itself, glibc trims
    the engine thread's arena whenever a step's freed tensors leave more than twice its (dynamic) mmap
    threshold free at the top, and drops the arena's heap when it empties; the next step faults the same
    pages in again, zeroed. A decode step's logits, their float32 copy and the sampler's buffers are
    several MiB a step, so that was tens of thousands of page faults a second on the engine thread. A
    fixed trim threshold of 64 MiB (a thread arena's heap is at most 64 MiB, so those are never trimmed)
    and a fixed mmap threshold of 32 MiB (the most glibc's dynamic one reaches: what it settles at after
    the first large tensors) stop it.
    Measured on a 2-core Xeon with AMX, bf16, ``tokenwire serve`` from the commit before and with this,
    alternated three times (2026-12-07; 256 streamed chat completions of 32 users over HTTP, after 64
    to warm up): 64,000-73,000 page faults a second before, 1,200-3,100 after; 453 / 470 / 475 tokens/s
    before against 495 / 508 / 515 after (the 64 of the first load: 404-424 against 429-448); 1,343-1,350
    MiB resident after the loads against 1,368-1,369 (idle, 704-710 either way).

    Called once the model is loaded (``load_engine``): the load's big temporaries were mmapped under
    the dynamic threshold and went back to the OS when freed. The cost is memory the process keeps
    rather than faults in again: at most 64 MiB free at the top of the main heap, and each engine-side
    thread arena at its largest step. Elsewhere (not glibc) this does nothing."""
    _fixed_thresholds(mmap_bytes=32 << 20, trim_bytes=64 << 20)


def _fixed_thresholds(*, mmap_bytes: int, trim_bytes: int) -> None:
    # Setting a threshold turns glibc's dynamic thresholds off (mallopt(3)).
    _glibc_call("mallopt", M_MMAP_THRESHOLD, mmap_bytes)
    _glibc_call("mallopt", M_TRIM_THRESHOLD, trim_bytes)


def trim_heap() -> None:
    """glibc's ``malloc_trim``: hand the heap's free pages back to the OS (elsewhere, nothing)."""
    _glibc_call("malloc_trim", 0)
