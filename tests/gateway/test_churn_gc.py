"""Closed connections' garbage goes back: the gateway's collector runs a full collection after connection
churn (the young-generation threshold of gctune makes full ones rare), and a closed WebSocket is not a
reference cycle through the front door's subprotocol hook."""

from __future__ import annotations

import gc
import weakref

from server.gctune import ChurnCollector


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_full_collection_comes_after_churn_and_frees_old_cycles() -> None:
    c = ChurnCollector(churn=3, min_interval_s=1.0, idle_interval_s=10.0)
    gc.collect()
    x = _Cycle()
    ref = weakref.ref(x)
    gc.collect()  # x survives: promoted to the oldest generation, as a long-lived connection would be
    del x
    assert ref() is not None  # garbage now, and only a full collection frees it
    assert not c.tick(1.0)  # no connection opened: nothing to do, however long it waits
    assert not c.tick(100.0)
    c.connection_opened()
    c.connection_opened()
    assert not c.tick(1.0)  # under the churn threshold and within the idle interval
    c.connection_opened()
    assert c.tick(1.0) and c.collections == 1 and c.opened == 0
    assert ref() is None


def test_a_single_new_connection_is_collected_after_the_idle_interval() -> None:
    c = ChurnCollector(churn=64, min_interval_s=1.0, idle_interval_s=5.0)
    c.connection_opened()
    assert [c.tick(1.0) for _ in range(5)] == [False, False, False, False, True]
    assert [c.tick(1.0) for _ in range(10)] == [False] * 10  # nothing opened since
