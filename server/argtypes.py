"""argparse types for the command line's numbers and Redis URLs. Each names what it wants, so a bad value
is one line that says what to write (argparse puts the flag's name in front of it) instead of a
traceback, or a server that starts and then cancels every chat (``--detach-timeout -1`` did)."""

from __future__ import annotations

import argparse
import math

MAX_SECONDS = 1e9  # about 31 years: past it a duration is a typo (and overflows Redis' expiries in ms)


def _whole(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None


def _number(value: str, what: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
    if math.isnan(x):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return x


def port(value: str) -> int:
    """A TCP port: 0-65535 (0 picks a free one)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {value!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535 (0 picks a free one), got {n}")
    return n


def at_least_one(value: str) -> int:
    """A count that must be something: processes, threads, a cap that 0 would turn into a refusal."""
    n = _whole(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {n}")
    return n


def count(value: str) -> int:
    """A count where 0 means no limit, or off: 0 or more."""
    n = _whole(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {n}")
    return n


MIN_SECONDS = 0.001  # the store counts in ms: a shorter duration that must pass would be 0 there


def _seconds(value: str, *, zero_ok: bool) -> float:
    s = _number(value, "seconds")
    if not (0 <= s <= MAX_SECONDS) or (s < MIN_SECONDS and not zero_ok):
        least = "0" if zero_ok else f"at least {MIN_SECONDS:g}"
        raise argparse.ArgumentTypeError(
            f"expected {least} and at most {MAX_SECONDS:.0e} seconds, got {value}"
        )
    return s


def positive_seconds(value: str) -> float:
    """A duration that must pass (a timeout, a TTL, a lease, a run): at least a millisecond."""
    return _seconds(value, zero_ok=False)


def seconds(value: str) -> float:
    """A duration where 0 means none (a drain, a threshold): 0 seconds or more."""
    return _seconds(value, zero_ok=True)


def flush_ms(value: str) -> float:
    ms = _number(value, "milliseconds")
    if not 0 <= ms <= 1000:
        raise argparse.ArgumentTypeError(f"expected 0 to 1000 ms, got {value}")
    return ms


def temperature(value: str) -> float:
    """``chat --temperature``: params.temperature's range (SPEC 4.2), checked here to name the flag."""
    t = _number(value, "a number from 0 to 2")
    if not 0 <= t <= 2:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 2, got {value}")
    return t


def max_tokens(value: str) -> int:
    """``chat --max-tokens``: params.max_tokens' range (SPEC 4.2)."""
    from protocol.frames import MAX_MAX_TOKENS

    n = at_least_one(value)
    if n > MAX_MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_MAX_TOKENS}, got {n}")
    return n


def redis_url_problem(url: str) -> str | None:
    """Why ``url`` is not a Redis URL this server can use, or None: checked before anything starts, so a
    typo is one line, not a redis-py traceback (and not a silent connection to localhost's database 0)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        return f"{url!r} is not a URL ({exc})"
    if parts.scheme not in ("redis", "rediss", "unix"):
        return f"{url!r}: expected redis://host[:port][/db], rediss:// (TLS) or unix://path"
    if parts.scheme == "unix":
        return None if parts.path else f"{url!r}: a unix:// URL needs the socket's path"
    if not parts.hostname:
        return f"{url!r}: no host (write redis://127.0.0.1:6379/0, say)"
    db = parts.path.strip("/")
    if db and not (db.isascii() and db.isdigit()):  # isdigit() alone takes U+00B2, which int() refuses
        return f"{url!r}: the database after the host must be a number, got {db!r}"
    return None


def redis_url(value: str) -> str:
    problem = redis_url_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value
