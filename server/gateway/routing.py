"""Session affinity: a session's requests prefer one worker, chosen by rendezvous hashing, so that its
KV cache (the previous turns) is reused; when that worker is gone or saturated, any worker takes them."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Mapping

import structlog

from server.store.requests import RequestStore

log = structlog.get_logger(__name__)


def rendezvous(session: str, workers: list[str]) -> str | None:
    """The worker with the highest hash of (session, worker): stable while that worker lives, and when
    one worker leaves only its own sessions move."""
    if not workers:
        return None
    return max(workers, key=lambda w: hashlib.blake2b(f"{session}\x00{w}".encode(), digest_size=8).digest())


class Router:
    """Caches the live workers and their load (refreshed at most every ``ttl_s``)."""

    def __init__(self, store: RequestStore, ttl_s: float = 1.0) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._workers: Mapping[str, tuple[int, int]] = {}
        self._at = 0.0
        self._lock = asyncio.Lock()

    async def prefer(self, session: str) -> str:
        """The worker this session should go to, or "" for the shared queue."""
        if not session:
            return ""
        async with self._lock:
            if time.monotonic() - self._at > self.ttl_s:
                try:
                    workers = await self.store.live_workers()
                    # Affinity is for the default model's requests: only workers holding it (or saying
                    # nothing, as before models had names) read that model's work from their own queue.
                    models = await self.store.served_models()
                    self._workers = {
                        w: load for w, load in workers.items() if models.get(w, ("", ""))[1] == ""
                    }
                except Exception as exc:  # routing is an optimisation: never fail a request over it
                    log.warning("router.refresh_failed", error=str(exc))
                self._at = time.monotonic()
        w = rendezvous(session, sorted(self._workers))
        if w is None:
            return ""
        running, capacity = self._workers[w]
        return "" if capacity and running >= capacity else w
