"""Blocking transfers on worker threads that stop when the coroutine awaiting them is cancelled.

``asyncio.to_thread`` cannot stop its thread: a cancelled download would go on reading (and
writing its file) until the object ends. ``Stopper.run`` runs the transfer on a thread of its
own and, when the awaiting task is cancelled, stops it: it marks the stopper stopped, closes
every body being read (``reading``: an HTTP response's socket is shut down, which wakes a
read blocked in it), and waits for the thread to end before the cancellation goes on.

Invariants:
- Once ``run`` has raised ``CancelledError`` the transfer's thread has ended (or, stuck where
  nothing can wake it, is abandoned after ``STOP_WAIT_S`` with a warning): the caller may
  remove its files, nothing writes them afterwards.
- A body registered after the stop is closed at once; ``check()`` raises ``TransferStopped``
  between chunks, so a transfer that never blocks stops too.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import structlog

from weftboard.proto.errors import Unavailable

log = structlog.get_logger("weftboard.board.blobs")
T = TypeVar("T")
STOP_WAIT_S = 10.0  # how long a cancelled transfer's thread is waited for before it is abandoned


class TransferStopped(Unavailable):
    """The transfer was stopped because its caller was cancelled."""


class Stopper:
    """One transfer's stop switch (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._closers: dict[int, Callable[[], None]] = {}
        self._next = 0

    @property
    def stopped(self) -> bool:
        return self._stopped

    def check(self) -> None:
        if self._stopped:
            raise TransferStopped("the transfer was stopped: its caller was cancelled")

    @contextmanager
    def reading(self, close: Callable[[], None]) -> Iterator[None]:
        """While the body is read, ``close()`` is what stops it (called from another thread)."""
        with self._lock:
            stopped = self._stopped
            token = self._next
            self._next += 1
            if not stopped:
                self._closers[token] = close
        if stopped:
            close()
            self.check()
        try:
            yield
        finally:
            with self._lock:
                self._closers.pop(token, None)
        self.check()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            closers = list(self._closers.values())
            self._closers.clear()
        for close in closers:
            try:
                close()
            except Exception as exc:  # a body already closed, a socket gone: it stops either way
                log.debug("closing a stopped transfer's body failed", error=str(exc))

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a thread of its own; cancelled, stop it and wait for its thread first.

        Not the loop's default executor: a transfer holds its thread for the whole download,
        and that pool has only ``cpu_count + 4`` threads, so a version's parts would queue for
        a thread (and every ``to_thread`` call behind them) on a small host."""
        loop = asyncio.get_running_loop()
        work: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if work.done():
                return
            if error is not None:
                work.set_exception(error)
            else:
                work.set_result(result)  # type: ignore[arg-type]

        def body() -> None:
            try:
                outcome: tuple[T | None, BaseException | None] = (fn(*args), None)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits it
                loop.call_soon_threadsafe(settle, *outcome)

        threading.Thread(target=body, name="weftboard-transfer", daemon=True).start()
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            self.stop()
            await _outlast(work)
            raise


async def _outlast(work: asyncio.Future) -> None:
    """Wait (up to ``STOP_WAIT_S``) for a stopped transfer's thread, through further
    cancellations of the waiting task; its outcome is retrieved, not logged."""
    loop = asyncio.get_running_loop()
    end = loop.time() + STOP_WAIT_S
    while not work.done() and loop.time() < end:
        try:
            await asyncio.wait([work], timeout=end - loop.time())
        except asyncio.CancelledError:
            continue  # cancelled again while cleaning up: the first cancellation is re-raised after
    if not work.done():
        log.warning("a cancelled transfer's thread did not stop; abandoned", waited_s=STOP_WAIT_S)
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        return
    if not work.cancelled():
        work.exception()
