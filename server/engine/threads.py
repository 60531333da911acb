"""Torch work off the engine's thread runs in threads that end: libgomp's thread pools and the decode step.

GNU OpenMP (the runtime torch's CPU wheels link) keeps a pool of worker threads for every thread that
has run a parallel region, for as long as that thread lives. While the pools together hold more threads
than the machine has cores, libgomp stops spin-waiting between parallel regions ("throttled" spinning)
and each region wakes its workers with a futex instead. A decode step is a hundred-odd small GEMMs, each
a parallel region, so that wake-up is most of a small step's cost. Measured on a 2-core Xeon, a
576x576 linear on one row: 26 µs from the only thread with a pool, 81-93 µs from the engine's thread
while the thread that loaded the model (the main thread, or an executor's thread that lives on) still
held its pool; the whole model's GEMMs at one row took 22 ms against 28.

So the model is loaded, converted and packed in a thread that ends (its pool goes with it), and the
engine's thread is left the only one with a pool; ``tokenwire bench`` runs each path the same way. On
that Xeon the engine went from 22.1 to 30.3 tok/s for one request and from 170 to 206 tok/s for 32
(``tokenwire bench --requests 1`` and ``--requests 32``, before and after).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_own_thread(fn: Callable[[], T], name: str = "tokenwire-torch") -> T:
    """``fn()`` run in a new thread that ends when it returns (blocking the caller until then); its
    result, or its exception raised here."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller, whatever it is
            error.append(exc)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]
