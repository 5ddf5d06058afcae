"""Stopping background work for good.

Invariants:
- ``cancel_and_wait`` returns only once every task has ended. On Python < 3.12,
  ``asyncio.wait_for`` drops a cancellation that arrives together with its result, so a task
  inside one may carry on after a single ``cancel()``; a stop that awaited it once would wait
  forever. Each task still running after ``retry_s`` is cancelled again.
- ``thread_to_the_end`` lets a cancellation go on only once its thread has ended (a thread
  cannot be stopped): a destination's lock is never let go while its thread still writes,
  and what the thread finished is recorded, cancelled or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

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


async def thread_to_the_end(fn: Callable[..., T], *args: Any, then: Callable[[T], None]) -> None:
    """``fn(*args)`` on a worker thread; ``then(result)`` on the loop once it succeeded, even
    when the caller was cancelled meanwhile (the cancellation goes on after). A failure of
    ``fn`` is raised as it is, and ``then`` is not called."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        result = await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        if not work.cancelled() and work.exception() is None:
            then(work.result())
        raise
    then(result)
