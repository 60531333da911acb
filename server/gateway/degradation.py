"""What the degradation ladder reads (submit.py): each model's recent time to first token as this gateway
saw it, and its queue depth in the store, cached for a second so that a burst of chats costs one read."""

from __future__ import annotations

import time

from server.gateway.models import Choice
from server.gateway.settings import GatewaySettings
from server.store.requests import RequestStore

TTFT_FRESH_S = 10.0  # a model's TTFT reading counts for degradation this long after it was seen
QUEUED_FRESH_S = 1.0  # a queue depth read from the store is reused this long


class Degradation:
    def __init__(self, settings: GatewaySettings, store: RequestStore) -> None:
        self.settings = settings
        self.store = store
        # Per model: time from accepting a new chat to its first delta, smoothed, and when last seen.
        self._ttft: dict[str, tuple[float, float]] = {}
        self._queued: dict[str, tuple[float, int]] = {}  # per route: (monotonic time read, queued)

    def observe_ttft(self, seconds: float, model: str = "") -> None:
        ewma, _ = self._ttft.get(model, (0.0, 0.0))
        ewma = seconds if not ewma else 0.8 * ewma + 0.2 * seconds
        self._ttft[model] = (ewma, time.monotonic())

    def ttft(self, model: str = "") -> float:
        """The model's recent TTFT as this gateway saw it; 0 once it is older than TTFT_FRESH_S (a model
        whose new chats all fell back gets no new readings, and must get a chance to show it recovered)."""
        ewma, at = self._ttft.get(model, (0.0, 0.0))
        return ewma if time.monotonic() - at <= TTFT_FRESH_S else 0.0

    async def queued(self, route: str = "") -> int:
        """Requests waiting in ``route``'s queue, at most QUEUED_FRESH_S old."""
        at, queued = self._queued.get(route, (0.0, 0))
        if time.monotonic() - at > QUEUED_FRESH_S:
            queued = await self.store.queued(route)
            self._queued[route] = (time.monotonic(), queued)
        return queued

    async def degraded(self, model: Choice | None = None) -> bool:
        """Whether new chats of ``model`` (default: the default model) should go down the degradation
        ladder now (its queue depth or TTFT past a threshold)."""
        st = self.settings
        name, route = (model.name, model.route) if model is not None else ("", "")
        if st.degrade_ttft_s and self.ttft(name) > st.degrade_ttft_s:
            return True
        if not st.degrade_queue_depth:
            return False
        return await self.queued(route) >= st.degrade_queue_depth
