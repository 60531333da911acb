"""Torch work off the engine's thread runs in threads that end (server/engine/threads.py): the thread
is a new one, it has ended when the call returns, and results and errors come back to the caller."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from server.engine.threads import in_own_thread


def test_runs_in_a_new_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 7

    assert in_own_thread(work) == 7
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_an_error_reaches_the_caller() -> None:
    def fail() -> None:
        raise KeyError("lost")

    with pytest.raises(KeyError, match="lost"):
        in_own_thread(fail)


def test_loading_an_engine_leaves_no_thread_behind(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's load (model, dtype, packing) happens in a thread that has ended by the time the
    engine exists: no thread that ran torch is left holding an OpenMP pool beside the engine's."""
    import server.engine.model as model_module
    from server.app import load_engine

    real = model_module.load_model
    ran: list[threading.Thread] = []

    def spy(*args: Any, **kw: Any) -> Any:
        ran.append(threading.current_thread())
        return real(*args, **kw)

    monkeypatch.setattr(model_module, "load_model", spy)
    before = set(threading.enumerate())
    _loaded, engine = load_engine(str(tiny_model_dir), dtype="float32")
    assert ran and ran[0] is not threading.current_thread() and not ran[0].is_alive()
    assert set(threading.enumerate()) <= before  # nothing new still running (the engine is not started)
    engine.start(lambda outs: None)
    engine.stop()
