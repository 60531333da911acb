"""Per-connection and per-user limits on chat requests (hostile or buggy clients)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocol import ErrorCode, ProtocolError


@dataclass(slots=True)
class TokenBucket:
    """``rate`` chats per second with bursts of ``burst``; local to one connection."""

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    at: float = field(default_factory=time.monotonic)

    def take(self) -> int:
        """0 if allowed, else how many ms until one more is allowed."""
        now = time.monotonic()
        if self.tokens < 0:
            self.tokens = self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0
        return max(1, int((1 - self.tokens) / self.rate * 1000))


def limited(id: str, what: str, retry_after_ms: int) -> ProtocolError:
    return ProtocolError(
        ErrorCode.RATE_LIMITED, f"{what}; retry in {retry_after_ms} ms", id=id, retry_after_ms=retry_after_ms
    )
