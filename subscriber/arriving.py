"""A blob's bytes as they arrive: what lets an island apply a patch while it downloads.

A download (one stream or parallel byte ranges, on its own threads) ``put``s each chunk at
its offset; an applier on another thread ``wait``s for the byte span it needs next, or for
any one of several spans (``wait_any``), and reads it without a copy. An applier waiting on
several blobs at once (a patch's parts, applied in whatever order they arrive) ``watch``es
them with one ``threading.Event`` and asks each whether a span is ``ready``.

Invariants:
- ``wait``/``wait_any`` return only spans whose every byte has been put; a chunk put twice
  (a retried range) must carry the same bytes, and the blob's digest is what proves that:
  ``verified()`` is set by the fetcher only after the whole blob hashed to its record.
- ``fail(exc)`` wakes every waiter with that error (a download that gave up, a cancelled
  step); nothing waits forever on a download that ended.
- The buffer is one patch-sized ``bytearray``; a span handed out is a read-only view of it.
- ``ArrivingApplier``'s thread lives until its owner ``close``s it (a destination, closed by
  the subscriber that stops following); a later ``run`` starts a new one.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from weftboard.proto.errors import ApplyError, CorruptData, InvalidArgument, Unavailable

T = TypeVar("T")


class ArrivingBytes:
    def __init__(self, size: int) -> None:
        if size < 0:
            raise InvalidArgument(f"a blob has at least 0 bytes, got {size}")
        self.size = size
        self._buf = bytearray(size)
        self._starts: list[int] = []  # disjoint, merged [start, end) spans that arrived
        self._ends: list[int] = []
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._verified = False
        self._watchers: set[threading.Event] = set()

    # -- the download's side --------------------------------------------------------------

    def put(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Bytes ``data`` arrived at ``offset``. A chunk past the blob's end is the store's bytes
        not fitting the record (``CorruptData``: the step is retried from scratch, like a digest
        mismatch), not a caller's mistake that would end the island."""
        n = len(data)
        if offset < 0 or offset + n > self.size:
            raise CorruptData(f"chunk of {n} bytes at {offset} lies outside a {self.size}-byte blob")
        if n == 0:
            return
        self._buf[offset : offset + n] = data
        with self._cond:
            self._merge(offset, offset + n)
            self._wake()

    def verified(self) -> None:
        """The whole blob is here and hashed to its record (set by the fetcher)."""
        with self._cond:
            if self.arrived() != self.size:
                raise InvalidArgument(f"blob marked verified with {self.arrived()} of {self.size} bytes arrived")
            self._verified = True
            self._wake()

    def fail(self, exc: BaseException) -> None:
        """The download ended without the blob: every waiter raises ``exc``."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._wake()

    def _wake(self) -> None:  # with self._cond held
        self._cond.notify_all()
        for event in self._watchers:
            event.set()

    # -- the applier's side ---------------------------------------------------------------

    def arrived(self) -> int:
        """Bytes arrived so far."""
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def wait(self, start: int, end: int, timeout_s: float | None = None) -> memoryview:
        """The bytes ``[start, end)``, once they have all arrived."""
        self.wait_any([(start, end)], timeout_s)
        return memoryview(self._buf)[start:end].toreadonly()

    def wait_any(self, spans: Sequence[tuple[int, int]], timeout_s: float | None = None) -> list[int]:
        """Indices of the ``spans`` that have fully arrived; blocks until at least one has
        (an empty ``spans`` returns at once)."""
        for start, end in spans:
            if not 0 <= start <= end <= self.size:
                raise InvalidArgument(f"span [{start}, {end}) lies outside a {self.size}-byte blob")
        if not spans:
            return []
        with self._cond:
            while True:
                ready = [i for i, (s, e) in enumerate(spans) if self._covered(s, e)]
                if ready:
                    return ready
                if self._error is not None:
                    raise self._error
                if not self._cond.wait(timeout_s):
                    raise Unavailable(f"no awaited byte span of the blob arrived within {timeout_s} s")

    def ready(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` has fully arrived, without blocking; raises why it never
        will when the download failed first."""
        if not 0 <= start <= end <= self.size:
            raise InvalidArgument(f"span [{start}, {end}) lies outside a {self.size}-byte blob")
        with self._cond:
            if self._covered(start, end):
                return True
            if self._error is not None:
                raise self._error
            return False

    def watch(self, event: threading.Event) -> None:
        """Set ``event`` on every change from now on (bytes, verdict, failure) until ``unwatch``."""
        with self._cond:
            self._watchers.add(event)

    def unwatch(self, event: threading.Event) -> None:
        with self._cond:
            self._watchers.discard(event)

    def wait_verified(self, timeout_s: float | None = None) -> None:
        """Block until the fetcher verified the whole blob (or raise why it could not)."""
        with self._cond:
            while not self._verified:
                if self._error is not None:
                    raise self._error
                if not self._cond.wait(timeout_s):
                    raise Unavailable(f"the blob was not verified within {timeout_s} s")

    # -- span bookkeeping -----------------------------------------------------------------

    def _covered(self, start: int, end: int) -> bool:
        if start == end:
            return True
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def _merge(self, start: int, end: int) -> None:
        lo = bisect.bisect_left(self._ends, start)  # first span that ends at or after start
        hi = bisect.bisect_right(self._starts, end)  # spans from lo to hi touch [start, end)
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]


class ArrivingApplier:
    """A destination's thread for applies that wait on arriving bytes.

    Its own thread, not the loop's default pool: the apply blocks until bytes arrive, and the
    download that brings them may need a worker of that pool. Cancelled, ``run`` fails the
    blobs (a patch's parts) so the apply undoes its work and ends, and waits for that before
    re-raising: a destination's lock is never let go while its apply still runs. ``close``
    ends its thread (a later ``run`` makes another).
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    async def close(self) -> None:
        """End the thread (it is idle: ``run`` returns only once its apply ended)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True)

    async def run(self, parts: Sequence[ArrivingBytes], fn: Callable[..., T], *args: Any, what: str = "the apply") -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="weftboard-apply")
        work = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            for blob in parts:
                blob.fail(ApplyError(f"{what} was cancelled"))
            await asyncio.wait([work])
            if not work.cancelled():
                work.exception()  # the thread's echo of the cancellation: retrieved, not logged
            raise
