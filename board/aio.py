"""Waiting with a time limit without ever losing a cancellation.

Invariants:
- ``within(awaitable, timeout_s)`` is ``asyncio.wait_for`` with one difference that matters
  on Python < 3.12 (gh-86296): when the caller is cancelled in the same turn of the loop as the
  awaited work completes, ``wait_for`` returns the result and drops the cancellation, so a
  long-lived loop that was told to stop goes on. ``within`` always raises ``CancelledError``
  once its caller is cancelled; the awaited work is cancelled and has ended before it does.
- On timeout the awaited work is cancelled, has ended, and ``asyncio.TimeoutError`` (the
  builtin ``TimeoutError`` from 3.11 on) is raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """The result of ``awaitable`` if it finishes within ``timeout_s`` seconds; else it is
    cancelled and ``asyncio.TimeoutError`` raised. A cancellation of the caller is never dropped."""
    work = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({work}, timeout=max(timeout_s, 0.0))
    except asyncio.CancelledError:
        await _end(work)
        raise
    if not done:
        await _end(work)
        raise asyncio.TimeoutError(f"not done within {timeout_s:g} s")
    return work.result()


async def _end(work: asyncio.Future) -> None:
    """Cancel ``work`` and wait until it has ended (its own result or error is left to it)."""
    work.cancel()
    await asyncio.wait({work})
    if not work.cancelled():
        work.exception()  # retrieved: no "exception was never retrieved" at exit
