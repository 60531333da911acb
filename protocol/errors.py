"""Error codes carried in ``error`` frames and the WebSocket close codes tokenwire uses."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """The ``code`` of an ``error`` frame (SPEC.md §6). Clients switch on these strings."""

    BAD_FRAME = "bad_frame"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    RESUME_FAILED = "resume_failed"
    OVERLOADED = "overloaded"
    RATE_LIMITED = "rate_limited"
    TOO_LARGE = "too_large"
    MODEL_NOT_FOUND = "model_not_found"
    INTERNAL = "internal"


class CloseCode(enum.IntEnum):
    """WebSocket close codes (RFC 6455 §7.4 plus the registered 1012)."""

    NORMAL = 1000
    GOING_AWAY = 1001
    PROTOCOL_ERROR = 1002
    POLICY_VIOLATION = 1008  # too many bad frames in a row, failed authentication
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    SERVICE_RESTART = 1012  # server draining: reconnect (elsewhere) and resume


class ProtocolError(Exception):
    """A frame or an action the protocol refuses; becomes an ``error`` frame, never a crash.

    ``id`` is the request id the error is about, when the offending frame carried a readable one.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        id: str | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id
        self.retry_after_ms = retry_after_ms

    def __repr__(self) -> str:
        return f"ProtocolError({self.code.value!r}, {self.message!r}, id={self.id!r})"
