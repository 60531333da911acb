"""Garbage-collector settings for processes that hold thousands of long-lived connections."""

from __future__ import annotations

import gc


def tune_for_long_lived_objects() -> None:
    """Freeze what start-up allocated and collect the young generation less often.

    Every connection owns a few hundred long-lived objects; with thousands of them a full collection
    walks them all and stalls the event loop for hundreds of milliseconds (seen as ping-RTT p99). Objects
    alive after start-up (modules, the model's Python objects) move out of the collector's way, and a
    larger first threshold makes young collections, and so the promotions that lead to full ones, rarer.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


# After this many closed connections, a full collection is due (at most one every MIN_INTERVAL_S); after
# a single one, within IDLE_INTERVAL_S.
CHURN_CONNECTIONS = 64
MIN_INTERVAL_S = 5.0
IDLE_INTERVAL_S = 60.0


class ChurnCollector:
    """Full collections driven by connection churn, which the thresholds above make rare.

    A connection that lived through a young collection is promoted, and when it closes, whatever of it
    sits in a reference cycle is garbage in an old generation that waits for a full collection, and with
    the thresholds above that may not come for hours. Under a flood of reconnecting clients the gateway
    grew by 200+ MB that way and kept it (``tokenwire load --scenario flood``); one ``gc.collect()`` gave
    it back. The cycles found then are broken where they were made (tests/gateway/test_churn_gc.py); this
    is the backstop for any left (asyncio's transports are cycles by design) or added later.

    So: a full collection once CHURN_CONNECTIONS connections have closed since the last one (at most
    one every MIN_INTERVAL_S), or within IDLE_INTERVAL_S of any. Closes, not opens: only a closed
    connection leaves garbage, and a full collection walks every live connection, hundreds of
    milliseconds with thousands held. Counting opens made 5,000 clients connecting and staying idle pay
    such a stall every 5 s while they arrived (ping RTT p99 663 ms, make bench's idle section); a set of
    long-lived connections, steady or growing, is never walked for nothing."""

    def __init__(
        self,
        churn: int = CHURN_CONNECTIONS,
        min_interval_s: float = MIN_INTERVAL_S,
        idle_interval_s: float = IDLE_INTERVAL_S,
    ) -> None:
        self.churn = churn
        self.min_interval_s = min_interval_s
        self.idle_interval_s = idle_interval_s
        self.closed = 0  # connections closed since the last full collection
        self.collections = 0
        self._since = 0.0  # seconds that closed connections have waited for a full collection

    def connection_closed(self) -> None:
        self.closed += 1

    def tick(self, elapsed_s: float) -> bool:
        """Called every ``min_interval_s``: collect if due. True when it collected."""
        self._since = self._since + elapsed_s if self.closed else 0.0
        if self.closed >= self.churn or (self.closed and self._since >= self.idle_interval_s):
            self.closed = 0
            self._since = 0.0
            gc.collect()
            self.collections += 1
            return True
        return False

    async def run(self) -> None:
        import asyncio

        while True:
            await asyncio.sleep(self.min_interval_s)
            self.tick(self.min_interval_s)
