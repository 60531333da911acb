"""Where a step's time goes, phase by phase: filled in only when ``tokenwire bench --profile`` asks.

The engine, runner and forward pass call ``lap(phase)`` at phase boundaries; a lap charges the time since
the previous one to ``phase``. On CPU every op is synchronous, so the laps add up to the step. On CUDA
they would time kernel launches, not kernels, and charge the step's GPU time to its first sync
(sampling's copy to the host): a profile there records each step's total only (``phases=False``), which
is right, since every step that samples ends in that sync.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

Lap = Callable[[str], None]


def no_lap(phase: str) -> None:
    """The lap of a step nobody profiles."""
    return


@dataclass(slots=True)
class StepRecord:
    rows: int  # decode rows (one token each)
    prefill: int  # prefill tokens
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    kv_tokens: int = 0  # KV positions the decode rows attend over (each row's live length), for the roofline


class StepProfile:
    """Per-step phase times. ``begin`` a step, ``lap`` at each boundary, ``end`` it."""

    def __init__(self, *, phases: bool = True) -> None:
        self.phases = phases  # False: step totals only (see the module's docstring)
        self.steps: list[StepRecord] = []
        self._t0 = self._t = time.perf_counter()
        self._phases: dict[str, float] = {}

    def begin(self) -> None:
        self._t0 = self._t = time.perf_counter()
        self._phases = {}

    def lap(self, phase: str) -> None:
        if not self.phases:
            return
        now = time.perf_counter()
        self._phases[phase] = self._phases.get(phase, 0.0) + now - self._t
        self._t = now

    def end(self, rows: int, prefill: int, kv_tokens: int = 0) -> None:
        self.steps.append(StepRecord(rows, prefill, time.perf_counter() - self._t0, self._phases, kv_tokens))

    def add_to_last(self, phase: str, seconds: float) -> None:
        """Time spent for the last step after it ended (the hand-off of its outputs)."""
        if self.steps:
            last = self.steps[-1]
            if self.phases:
                last.phases[phase] = last.phases.get(phase, 0.0) + seconds
            last.seconds += seconds
