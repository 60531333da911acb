"""asyncio helpers shared by the gateway, the worker and the store readers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | asyncio.Task[None] | None]) -> None:
    """Cancel tasks and wait until they have ended.

    Cancelling once is not always enough: a library call interrupted mid-I/O may turn the CancelledError
    into its own connection error, which a retry loop then catches and carries on. So cancel again until
    the task is really done.
    """
    pending = {t for t in tasks if t is not None and not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)


async def in_daemon_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` run in a daemon thread of its own, awaited. Unlike the default executor, whose threads
    ``asyncio.run`` joins before it returns, a task cancelled while it awaits this leaves the thread
    behind: a process told to stop while it loads a model (seconds to minutes) exits at once, and the
    thread ends with it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return  # the awaiting task was cancelled: nobody wants the result
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn())
        except BaseException as exc:  # handed to the awaiting task, whatever it is
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    t = threading.Thread(target=run, name=name, daemon=True)
    _daemon_threads.add(t)
    t.start()
    return await fut


# in_daemon_thread's threads. One still running at exit (a load cut short) is in C++ code the runtime's
# exit handlers would destroy under it: "terminate called without an active exception", SIGABRT. So a
# process that leaves one behind ends with os._exit once its own cleanup is done (cli._run).
_daemon_threads: set[threading.Thread] = set()


def left_running() -> bool:
    """Whether a thread of in_daemon_thread is still running (its awaiting task was cancelled)."""
    return any(t.is_alive() for t in _daemon_threads)
