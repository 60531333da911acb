"""Authentication of ``hello.token``: an HS256 JWT whose ``sub`` is the user (when auth is on)."""

from __future__ import annotations

import jwt

from protocol import ErrorCode, ProtocolError


def authenticate(token: str | None, secret: str | None) -> str | None:
    """The user id, or None for anonymous use when auth is off. Raises ProtocolError(unauthorized)."""
    if secret is None:
        return None
    if not token:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "hello.token: a JWT is required on this server")
    try:
        claims = jwt.decode(token, secret, algorithms=["HS256"], options={"require": ["sub", "exp"]})
    except jwt.ExpiredSignatureError:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "hello.token: the JWT has expired") from None
    except jwt.InvalidTokenError as exc:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, f"hello.token: invalid JWT ({exc})"[:200]) from None
    sub = claims["sub"]
    if not isinstance(sub, str) or not sub:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "hello.token: sub must be a non-empty string")
    return sub
