"""One log format per process (issue 29: stdout, stderr and the libraries' warnings looked different):
structlog's events and the stdlib loggers' records render alike, in the format asked for, naming the
process when a cluster told it its name."""

from __future__ import annotations

import io
import json
import logging
import os
import warnings
from collections.abc import Iterator

import pytest
import structlog

from server import logs


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    handlers = logging.getLogger().handlers[:]
    level = logging.getLogger().level
    try:
        yield
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers[:] = handlers
        logging.getLogger().setLevel(level)
        logging.captureWarnings(False)


def test_json_lines_for_ours_and_the_libraries(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("info", fmt="json", process="worker-1")
    structlog.get_logger("x").info("model.loaded", seconds=1.5)
    logging.getLogger("websockets.server").warning("handshake failed from %s", "127.0.0.1")
    logging.getLogger("websockets.server").info("below warning: dropped")
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert [x["event"] for x in lines] == ["model.loaded", "handshake failed from 127.0.0.1"]
    for x in lines:
        assert (
            x["process"] == "worker-1" and x["timestamp"].endswith("Z") and x["level"] in ("info", "warning")
        )
    assert lines[1]["logger"] == "websockets.server"


def test_warnings_are_log_lines_and_json_turns_progress_bars_off(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, with --log-format json, PyJWT's warning about a short key came out as two raw lines (the
    # message and its source), and the GGUF reader's progress bar as a run of carriage returns.
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    logs.configure("info", fmt="json")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("The HMAC key is 16 bytes long", UserWarning, stacklevel=1)
    (line,) = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert line["level"] == "warning" and "The HMAC key is 16 bytes long" in line["event"]
    assert os.environ["TQDM_DISABLE"] == "1"


def test_console_lines_for_ours_and_the_libraries(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("info", fmt="console")
    structlog.get_logger("x").warning("store.slow", ms=12)
    logging.getLogger("redis").warning("reconnecting")
    err = capsys.readouterr().err
    out = err.splitlines()
    assert len(out) == 2
    assert all("[warning  ]" in line for line in out), out
    assert not any(line.startswith("WARNING:") for line in out)
    assert "process" not in err  # a process on its own is not named


def test_the_format_asked_for_or_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal
    assert logs.resolve_format("auto") == "json"
    assert logs.resolve_format("console") == "console"
    monkeypatch.setenv("TOKENWIRE_LOG_FORMAT", "console")
    assert logs.resolve_format(None) == "console"
    with pytest.raises(ValueError, match="log format"):
        logs.resolve_format("xml")
