"""Authentication of ``hello.token``: an HS256 JWT whose ``sub`` is the user (when auth is on)."""

from __future__ import annotations

import jwt

from protocol import ErrorCode, ProtocolError
from protocol.codec import unicode_only

# The optional JWT claim ``tier`` weights a user's fair share of the engine: a user of weight 2 gets twice
# the tokens of a user of weight 1 while both have work waiting. A number is the weight itself (0.1-100);
# a name maps through this table; anything else weighs 1. Documented in protocol/SPEC.md (Authentication).
TIER_WEIGHTS = {"free": 1.0, "standard": 1.0, "plus": 2.0, "pro": 4.0, "enterprise": 8.0}

# Clock skew between a token's issuer and this server: exp, nbf and iat are checked this loosely (an
# issuer whose clock ran one second ahead had its fresh tokens refused as "not yet valid").
LEEWAY_S = 60

# The owners of a server with auth off are named "anon:<session>" (store/sessions.py) and "http:<key
# hash>" or "http:anonymous" (http_common.py). A store shared by gateways with auth off and on (an operator
# turning auth on, a mixed cluster) must not let a JWT whose sub spells one of those names reach that
# owner's requests and sessions: such a sub is the user "jwt:<sub>", as is one that starts with "jwt:",
# so that no two subs name one user. Every other sub is the user as it is.
RESERVED_PREFIXES = ("anon:", "http:", "jwt:")


def user_of(sub: str) -> str:
    """The user (the owner of its requests) that a JWT's ``sub`` names; see RESERVED_PREFIXES."""
    return "jwt:" + sub if sub.startswith(RESERVED_PREFIXES) else sub


def tier_weight(tier: object) -> float:
    """The fair-share weight for a JWT ``tier`` claim (1.0 when absent or not understood)."""
    if isinstance(tier, bool):
        return 1.0
    if isinstance(tier, int | float):
        return float(tier) if 0.1 <= tier <= 100 else 1.0
    if isinstance(tier, str):
        return TIER_WEIGHTS.get(tier.lower(), 1.0)
    return 1.0


def authenticate(token: str | None, secret: str | None) -> str | None:
    """The user id, or None for anonymous use when auth is off. Raises ProtocolError(unauthorized)."""
    return authenticate_user(token, secret)[0]


def authenticate_user(token: str | None, secret: str | None) -> tuple[str | None, float]:
    """``(user id, fair-share weight)``; ``(None, 1.0)`` for anonymous use when auth is off. Raises
    ProtocolError(unauthorized)."""
    if secret is None:
        return None, 1.0
    if not token:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "hello.token: a JWT is required on this server")
    try:
        # No audience of its own: the secret is the deployment's, so an aud claim (many issuers add one)
        # is not checked, nor iss.
        claims = jwt.decode(
            token,
            secret,
            algorithms=["HS256"],
            options={"require": ["sub", "exp"], "verify_aud": False},
            leeway=LEEWAY_S,
        )
    except jwt.ExpiredSignatureError:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "hello.token: the JWT has expired") from None
    except jwt.InvalidTokenError as exc:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, f"hello.token: invalid JWT ({exc})"[:200]) from None
    for name in ("exp", "nbf", "iat"):
        # RFC 7519's NumericDate is a JSON number; PyJWT also takes a string of digits ("exp": "1796...").
        value = claims.get(name)
        if name in claims and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, f"hello.token: invalid JWT ({name} must be a number)")
    sub = claims["sub"]
    # No NUL: the engine names a keyless caller's prompt_cache_key scope "<owner>\0<key>"
    # (engine/scheduler.Seq.scope), which no user's name may spell.
    if not isinstance(sub, str) or not sub or "\0" in sub or not _unicode(sub):
        raise ProtocolError(
            ErrorCode.UNAUTHORIZED, "hello.token: sub must be a non-empty Unicode string without NUL"
        )
    return user_of(sub), tier_weight(claims.get("tier"))


def _unicode(text: str) -> bool:
    # A JSON escape in the token can spell a lone surrogate ("\ud800"), which is not Unicode text: as the
    # user it would fail where the store encodes its keys (a 500 / 1011 instead of unauthorized).
    try:
        unicode_only(text)
    except ValueError:
        return False
    return True
