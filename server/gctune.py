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
