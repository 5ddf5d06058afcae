"""Stopping background tasks for good.

Invariant: ``cancel_and_wait`` returns only once every task has ended. On Python < 3.12,
``asyncio.wait_for`` drops a cancellation that arrives together with its result, so a task
inside one may carry on after a single ``cancel()``; a stop that awaited it once would wait
forever. Each task still running after ``retry_s`` is cancelled again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

CANCEL_RETRY_S = 0.5


async def cancel_and_wait(tasks: Iterable[asyncio.Task], retry_s: float = CANCEL_RETRY_S) -> None:
    """Cancel ``tasks`` until each has ended; their results and errors are left to them (a
    task's failure is reported where it happens)."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=retry_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at exit
