"""``tokenwire load``'s live line on a narrow terminal: the count and the elapsed time stay whole."""

from __future__ import annotations

import io
import re

from rich.console import Console

from server.load.live import LiveView


def test_an_80_column_terminal_keeps_the_elapsed_time() -> None:
    view = LiveView()
    task = view.progress.add_task("requests", total=2000, stats="")
    stats = "ok 1234 fail 0 | 1,234 tok/s | kill 12 resume 12 | bad 0 | idle 5000/5000 p99 1.2 ms"
    view.progress.update(task, completed=1234, stats=stats)
    console = Console(file=io.StringIO(), width=80)
    console.print(view.progress.get_renderable())
    out = console.file.getvalue()  # type: ignore[attr-defined]
    first = out.splitlines()[0]
    assert first.startswith("requests ")
    assert "1234/2000" in first
    assert re.search(r"\b0:00:0\d\b", first), out
    assert "…" not in out
    # Every stat is still there, wrapped onto the following lines.
    assert re.sub(r"\s+", " ", out).count("idle 5000/5000 p99 1.2 ms") == 1
