"""The publisher's bookkeeping of the versions between ``publish`` and their commit (``Pipeline``):
those in the snapshot stage (read, finish, snapshot), those queued, the one committing, and how
the pipeline stops (a failure, or a close without a flush).

Invariants (the state is guarded by ``cond``, which the publisher shares for its anchor ledger):
- ``pending()`` counts every version from its read's submission to its end: ``snapshotting``,
  then ``queue`` (snapshotted, in version order), then ``inflight`` (the one committing).
- Once failed or closed, the queue stays empty: it is emptied as ``failure`` or ``closed`` is
  set, ``enqueue`` refuses a job from then (its caller fails it) and ``take`` hands out none.
- Every version that leaves without its commit has its handles failed: with its own error, the
  publisher's failure, or, closed without one, ``Aborted`` naming the version (and saying so
  when its commit was under way: that one may have reached the board all the same).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections import deque

import structlog

from weftboard.proto.errors import Aborted, FailedPrecondition, WeftboardError
from weftboard.publisher.job import Job

log = structlog.get_logger("weftboard.publisher")


class Pipeline:
    def __init__(self, run: str, cond: threading.Condition) -> None:
        self.run = run
        self.cond = cond
        self.queue: deque[Job] = deque()
        self.snapshotting = 0
        self.inflight: Job | None = None
        self.failure: BaseException | None = None
        self.closed = False

    def pending(self) -> int:
        with self.cond:
            return len(self.queue) + self.snapshotting + (1 if self.inflight else 0)

    def check(self) -> None:
        """Raise the failure, or ``FailedPrecondition`` once closed."""
        if self.failure is not None:
            raise self.failure
        if self.closed:
            raise FailedPrecondition("the publisher is closed")

    def start(self) -> None:
        """A version enters the snapshot stage (its read is submitted)."""
        with self.cond:
            self.snapshotting += 1

    def enqueue(self, job: Job) -> bool:
        """Queue a snapshotted job for its commit; False, queueing nothing, once failed or closed."""
        with self.cond:
            if self.failure is not None or self.closed:
                return False
            self.snapshotting -= 1
            self.queue.append(job)
            self.cond.notify_all()
            return True

    def take(self) -> Job | None:
        """The next job to commit, now ``inflight``; None when the queue is empty, failed or closed."""
        with self.cond:
            if not self.queue or self.failure is not None or self.closed:
                return None
            job = self.inflight = self.queue.popleft()
            job.started = True
            return job

    def finished(self) -> None:
        """The job ``take`` handed out is committed, or failed."""
        with self.cond:
            self.inflight = None
            self.cond.notify_all()

    def close(self) -> None:
        """Queue and hand out nothing from now on; the versions left queued are aborted."""
        with self.cond:
            self.closed = True
        self.fail(None, [])

    def fail(self, exc: BaseException | None, jobs: list[Job], snapshotted: int = 0) -> None:
        """Fail ``jobs`` (``snapshotted`` of them leave the snapshot stage) and the queue. With ``exc``
        (wrapped in ``FailedPrecondition`` unless a ``WeftboardError``) the publisher fails, and the
        first failure stays; with None, they fail with that failure or, closed, with ``Aborted``."""
        wrapped = exc
        if exc is not None and not isinstance(exc, WeftboardError):
            wrapped = FailedPrecondition(f"publishing failed: {type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
        with self.cond:
            if wrapped is not None and self.failure is None:
                self.failure = wrapped
                log.error("publisher failed; later versions cannot be published", run=self.run, error=str(exc))
            wrapped = wrapped or self.failure
            jobs = jobs + list(self.queue)
            self.queue.clear()
            self.snapshotting -= snapshotted
            self.cond.notify_all()
        for job in jobs:
            error = wrapped or Aborted(f"the publisher was closed before version {job.version} committed"
                                       + ("; its commit was under way and may have reached the board (GetVersion "
                                          "tells)" if job.started else ""))
            for f in job.futures:
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # resolved meanwhile
                    f.set_exception(error)
