"""glibc keeps what an engine's steps free (``malloctune.keep_freed_memory_for_the_engine``), so the
engine thread does not fault the same pages in again every step; ``load_engine`` sets it once the model
is loaded."""

from __future__ import annotations

import platform
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import server.app as app

# A thread that holds some long-lived blocks, then allocates and frees what a decode step does (small
# activations, then a 32-row step's logits, their float32 copy and a sampler buffer), 30 times; prints
# the page faults of a step after the first few. In a process of its own: mallopt is process-wide.
_STEPS = """
import resource, sys, threading
import torch
if sys.argv[1] == "keep":
    from server.malloctune import keep_freed_memory_for_the_engine
    keep_freed_memory_for_the_engine()
faults = []
def steps():
    held = [torch.ones(1 << 18) for _ in range(40)]
    for _ in range(30):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        acts = [torch.ones(1 << 16) for _ in range(20)]
        a, b, c = torch.ones(6 << 18), torch.ones(6 << 18), torch.ones(3 << 18)
        del a, b, c, acts
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    del held
t = threading.Thread(target=steps)
t.start()
t.join()
print(sum(faults[5:]) / len(faults[5:]))
"""

# A step above frees 15 MiB plus 5 MiB of activations: 5,120 pages.
_PAGES_A_STEP = (15 + 5) * 256


def _faults_a_step(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tuning")
def test_an_engine_thread_stops_faulting_in_what_its_last_step_freed() -> None:
    # Left to glibc, the thread's arena is trimmed after each step and faulted in again by the next: the
    # cause, pinned so that a glibc that stops doing it shows up here.
    assert _faults_a_step("plain") > 0.2 * _PAGES_A_STEP
    assert _faults_a_step("keep") < 0.01 * _PAGES_A_STEP


def test_load_engine_keeps_freed_memory_once_the_load_is_over(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import server.engine.model as model_module

    real = model_module.load_model
    loads: list[threading.Thread] = []
    kept: list[bool] = []  # for each call: had the load's thread ended?

    def spy(*args: Any, **kw: Any) -> Any:
        loads.append(threading.current_thread())
        return real(*args, **kw)

    monkeypatch.setattr(model_module, "load_model", spy)
    monkeypatch.setattr(app, "keep_freed_memory_for_the_engine", lambda: kept.append(not loads[0].is_alive()))
    app.load_engine(str(tiny_model_dir), dtype="float32")
    # After the load: its big temporaries, mmapped under glibc's own threshold, went back to the OS.
    assert kept == [True]
