"""Sessions: a conversation's history in Redis, and the signed token that lets a client reclaim it."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets

import redis.asyncio as aioredis

from server.store.keys import Keys
from server.store.requests import execute

# What new_id() makes (token_urlsafe); anything else in a session_token's first part is not ours.
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class SessionStore:
    """Session tokens are ``<session id>.<HMAC(secret, session id, owner)>``: only the owner who got a
    token in ``welcome`` can present it again, on any gateway sharing the secret."""

    def __init__(self, r: aioredis.Redis, keys: Keys, secret: bytes, ttl_ms: int) -> None:
        self.r = r
        self.keys = keys
        self.secret = secret
        self.ttl_ms = ttl_ms

    @staticmethod
    def new_id() -> str:
        return secrets.token_urlsafe(12)

    def token(self, session: str, owner: str) -> str:
        mac = hmac.new(self.secret, f"{session}\n{owner}".encode(), hashlib.sha256).hexdigest()[:32]
        return f"{session}.{mac}"

    @staticmethod
    def owner_for(session: str, user: str | None) -> str:
        """Who owns a session's requests: the authenticated user, or for anonymous use the session itself."""
        return user if user is not None else f"anon:{session}"

    def verify(self, token: str, user: str | None) -> str | None:
        """The session id if ``token`` was issued to this user (or this anonymous session); else None.

        Any string is safe to pass: a token of another shape (length, alphabet, non-ASCII) is None.
        """
        session, _, mac = token.partition(".")
        if not _SESSION_ID.fullmatch(session) or not mac:
            return None
        good = self.token(session, self.owner_for(session, user))
        # Bytes, not str: compare_digest raises TypeError on a str that is not ASCII.
        return session if hmac.compare_digest(good.encode(), token.encode("utf-8", "replace")) else None

    async def touch(self, session: str, owner: str, *, new: bool = False) -> None:
        """Record the session (idempotent) and extend its TTL and its history's. One pipelined round trip,
        not atomic: each command is idempotent, so a partial run is completed by the next touch. ``new``:
        an id made just now (``new_id``), which has no history yet to extend."""
        k = self.keys.session(session, owner)
        pipe = self.r.pipeline(transaction=False)
        pipe.hsetnx(k, "owner", owner)
        pipe.pexpire(k, self.ttl_ms)
        if not new:
            pipe.pexpire(self.keys.history(session, owner), self.ttl_ms)
        await execute(pipe)

    async def last_turn(self, session: str, owner: str) -> str:
        """The id of the session's latest content-mode turn ("" if none): the next turn waits for it to
        end, then passes it to ``RequestStore.submit(turn_after=...)``, which checks it atomically."""
        v = await self.r.hget(self.keys.session(session, owner), "turn")
        return "" if v is None else v.decode() if isinstance(v, bytes) else str(v)

    async def history(self, session: str, owner: str) -> list[dict[str, str]]:
        """The session's messages, oldest first (one LRANGE: a consistent snapshot). Its keys are in the
        owner's partition (keys.py), so the owner is part of their name."""
        raw = await self.r.lrange(self.keys.history(session, owner), 0, -1)
        return [json.loads(x) for x in raw]


async def shared_secret(r: aioredis.Redis, keys: Keys, configured: str | None) -> bytes:
    """The session-signing secret: the configured one, else one generated once and kept in Redis so that
    every gateway on this Redis signs and verifies alike (SET NX: the first gateway's secret wins)."""
    if configured:
        return configured.encode()
    k = keys.session_secret
    await r.set(k, secrets.token_hex(32), nx=True)
    v = await r.get(k)
    assert v is not None
    return v if isinstance(v, bytes) else str(v).encode()
