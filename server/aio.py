"""asyncio helpers shared by the gateway, the worker and the store readers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


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
