"""structlog set-up: one format for every log line of a process, on stderr.

``--log-format auto`` (the default, or ``$TOKENWIRE_LOG_FORMAT``) writes readable lines on a terminal and
JSON lines otherwise; ``console`` and ``json`` force one. The libraries' own stdlib loggers (websockets,
asyncio, redis) go through the same renderer, so a warning from them looks like ours, not like
``WARNING:websockets.server:...``. stdout is not a log: it carries only the few lines a script waits for
("tokenwire listening on ...", "tokenwire ready: ..."). Python warnings are logged too, and JSON lines
are not interrupted by progress bars.

``process`` (a cluster's child: ``gateway-0``, ``worker-1``) is added to every line, so the JSON lines
of a cluster's processes, merged on one stream, still say whose they are.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

FORMATS = ("auto", "console", "json")


def resolve_format(fmt: str | None = None) -> str:
    """``console`` or ``json``: ``fmt`` (or ``$TOKENWIRE_LOG_FORMAT``), with ``auto`` decided by whether
    stderr is a terminal."""
    fmt = fmt or os.environ.get("TOKENWIRE_LOG_FORMAT") or "auto"
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use {', '.join(FORMATS)}")
    if fmt == "auto":
        return "console" if sys.stderr.isatty() else "json"
    return fmt


def configure(level: str = "info", *, fmt: str | None = None, process: str | None = None) -> None:
    json = resolve_format(fmt) == "json"
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if process:
        shared.append(_add_process(process))
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # The libraries' stdlib loggers: quiet below WARNING (websockets logs every failed handshake at
    # INFO), rendered like ours.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    # Python warnings (PyJWT's about a short HMAC key, say) through the same handler: by default they
    # print two raw lines (message and source) to stderr.
    logging.captureWarnings(True)
    if json:
        # Progress bars (the GGUF reader draws one on a first start) are not log lines. tqdm reads this
        # when it is imported, which configure() precedes (torch and transformers load later).
        os.environ.setdefault("TQDM_DISABLE", "1")


def _add_process(name: str) -> structlog.typing.Processor:
    def add(_logger: object, _method: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
        event.setdefault("process", name)
        return event

    return add
