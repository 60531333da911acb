"""The live progress bar (rich) of a running load test, on stderr."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Column

from server.load.idle import IdlePool
from server.load.report import percentile
from server.load.runner import RunState

REFRESH_S = 0.25
RATE_WINDOW_S = 5.0


class LiveView:
    """Shows requests (or time) done, tokens/s over the last few seconds, failures, resumes, integrity
    violations and the idle connections' ping RTT while the run goes on."""

    def __init__(self) -> None:
        # The description, bar, count and elapsed time keep their width; the stats take what is left
        # and wrap onto a second line on a narrow terminal (by default rich shrinks every column, and on
        # 80 columns the elapsed time came out as "…").
        def fixed(min_width: int | None = None) -> Column:
            return Column(no_wrap=True, overflow="ignore", min_width=min_width)

        self.progress = Progress(
            TextColumn("[bold]{task.description}", table_column=fixed()),
            BarColumn(bar_width=20, table_column=fixed(20)),
            TextColumn("{task.completed:>6.0f}/{task.total:.0f}", table_column=fixed()),
            TimeElapsedColumn(table_column=fixed(7)),
            TextColumn("{task.fields[stats]}", table_column=Column(ratio=1, overflow="fold")),
            console=Console(stderr=True),
        )
        self.state: RunState | None = None
        self.pool: IdlePool | None = None
        self.ok = 0
        self.failed = 0
        self.violations = 0
        self._task: TaskID | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._samples: deque[tuple[float, int]] = deque()

    def attach(self, state: RunState, pool: IdlePool | None) -> None:
        """Hook into a run (``run_load(on_state=...)``) and start refreshing."""
        self.state, self.pool = state, pool
        cfg = state.cfg
        prev = state.on_finish

        def on_finish(rec: Any) -> None:
            if rec.ok:
                self.ok += 1
            else:
                self.failed += 1
            self.violations += len(rec.violations)
            if prev is not None:
                prev(rec)

        state.on_finish = on_finish
        if cfg.idle_only:
            total, what = cfg.duration or 0.0, "idle (s)"
        elif cfg.requests is not None:
            total, what = float(cfg.requests), "requests"
        else:
            total, what = cfg.duration or 0.0, "seconds"
        self.progress.start()
        self._task = self.progress.add_task(what, total=total, stats="")
        self._ticker = asyncio.create_task(self._tick(), name="load-live")

    def _stats(self) -> str:
        st = self.state
        assert st is not None
        now = st.now()
        self._samples.append((now, st.tokens))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        rate = (st.tokens - n0) / (now - t0) if now > t0 else 0.0
        parts = []
        if not st.cfg.idle_only:
            parts.append(
                f"ok {self.ok} fail {self.failed} | {rate:,.0f} tok/s | kill {st.kills} "
                f"resume {st.resumes} | bad {self.violations}"
            )
        if self.pool is not None:
            s = self.pool.stats
            p99 = percentile(s.rtt[-2000:] or s.rtt_ramp[-2000:], 99)
            rtt = "-" if p99 is None else f"{1000 * p99:.1f} ms"
            parts.append(f"idle {s.connected}/{s.target} p99 {rtt}")
        return " | ".join(parts)

    def _completed(self) -> float:
        st = self.state
        assert st is not None
        if st.cfg.requests is not None and not st.cfg.idle_only:
            return float(self.ok + self.failed)
        return min(st.now(), st.cfg.duration or 0.0)

    async def _tick(self) -> None:
        while True:
            self._refresh()
            await asyncio.sleep(REFRESH_S)

    def _refresh(self) -> None:
        if self._task is not None and self.state is not None:
            self.progress.update(self._task, completed=self._completed(), stats=self._stats())

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            self._refresh()
        self.progress.stop()
