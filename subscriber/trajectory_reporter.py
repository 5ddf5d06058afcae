"""Batched, best-effort reporting of per-request metadata to the board's trajectory stream.

Invariants:
- ``submit`` never waits: the request path only appends to a bounded queue; a full queue
  drops the record and counts it (``dropped``), it never slows a response.
- One background task sends batches (up to ``batch_size`` records, or whatever arrived
  within ``flush_interval_s``). A send the board could not take now (UNAVAILABLE, a
  deadline: a board or Redis restarting) is retried with capped backoff until it goes
  through, so an outage loses nothing it outlasts; memory stays bounded by the queue, which
  drops new records (counted) while the batch waits. A send the board refuses (a token
  without the right, a bad record) cannot be cured by retrying: that batch is dropped and
  counted (``failed``). A batch resent after a lost answer may arrive twice: consumers
  deduplicate by ``request_id``.
- A record the board would refuse for its size (``proto.limits``) is refused by ``submit``
  (counted in ``failed``, logged), so it never takes its batch down with it; a batch goes to
  the board in calls of at most ``MAX_TRAJECTORY_BATCH_BYTES``, each sent and counted alone.
- ``stop`` flushes what is queued, bounded by a timeout. It cancels the sender until it has
  ended; the sender's waits never drop a cancellation (on Python < 3.12 ``asyncio.wait_for``
  returns a result that arrived together with a cancellation and drops the cancellation,
  which once left a stopping island waiting on a sender gone back to waiting for records),
  and a record taken off the queue as the cancellation came is kept for ``stop`` to send.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import structlog

from weftboard.board.aio import within
from weftboard.proto.errors import DeadlineExceeded, Unavailable, WeftboardError
from weftboard.proto.limits import (
    MAX_TRAJECTORY_BATCH,
    MAX_TRAJECTORY_BATCH_BYTES,
    MAX_TRAJECTORY_RECORD_BYTES,
)
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.subscriber.cancel import cancel_and_wait

log = structlog.get_logger(__name__)

MAX_RECORDS_PER_CALL = MAX_TRAJECTORY_BATCH


def make_record(
    *,
    run: str,
    island_id: str,
    version_start: int,
    version_end: int,
    request_id: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: list[float] | None,
    latency_ms: float,
    labels: Mapping[str, str],
    reward: float | None = None,
    replay_ref: str = "",
) -> pb.TrajectoryRecord:
    record = pb.TrajectoryRecord(
        run=run,
        island_id=island_id,
        version=version_start,
        version_end=version_end,
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        logprob_sum=float(sum(logprobs)) if logprobs else 0.0,
        logprob_min=float(min(logprobs)) if logprobs else 0.0,
        latency_ms=latency_ms,
        labels=dict(labels),
        replay_ref=replay_ref,
        created_at_ms=int(time.time() * 1000),
    )
    if reward is not None:
        record.reward = reward
    return record


def byte_bounded(records: list[pb.TrajectoryRecord], limit: int) -> list[list[pb.TrajectoryRecord]]:
    """``records`` in order, cut into runs of at most ``limit`` serialized bytes (a record over
    the limit alone makes a run of one)."""
    calls: list[list[pb.TrajectoryRecord]] = []
    size = 0
    for record in records:
        n = record.ByteSize()
        if not calls or size + n > limit:
            calls.append([])
            size = 0
        calls[-1].append(record)
        size += n
    return calls


class TrajectoryReporter:
    def __init__(
        self,
        client: Any,
        *,
        max_queue: int = 10_000,
        batch_size: int = 500,
        flush_interval_s: float = 0.2,
        max_backoff_s: float = 5.0,
    ) -> None:
        self._client = client
        self._queue: asyncio.Queue[pb.TrajectoryRecord] = asyncio.Queue(max_queue)
        self.batch_size = min(batch_size, MAX_RECORDS_PER_CALL)
        self.flush_interval_s = flush_interval_s
        self.max_backoff_s = max_backoff_s
        self.sent = 0
        self.dropped = 0
        self.failed = 0
        self._task: asyncio.Task | None = None
        self._pending: list[pb.TrajectoryRecord] = []  # the batch the task holds, resent by stop()

    def submit(self, record: pb.TrajectoryRecord) -> bool:
        """Queue one record without waiting; False (and counted) when the queue is full, or
        when the record is larger than the board takes (``failed``)."""
        size = record.ByteSize()
        if size > MAX_TRAJECTORY_RECORD_BYTES:
            self.failed += 1
            log.warning("trajectory record too large for the board; dropped", request_id=record.request_id,
                        bytes=size, limit=MAX_TRAJECTORY_RECORD_BYTES)
            return False
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self.dropped += 1
            return False
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="trajectory-reporter")

    async def _next_batch(self) -> list[pb.TrajectoryRecord]:
        """Collect the next batch into ``_pending`` (taken off the queue, so ``stop`` must find
        them there if it cancels the collection half way)."""
        batch = self._pending = [await self._queue.get()]
        deadline = time.monotonic() + self.flush_interval_s
        while len(batch) < self.batch_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            record = await self._get_within(remaining)
            if record is None:
                break
            batch.append(record)
        return batch

    async def _get_within(self, timeout_s: float) -> pb.TrajectoryRecord | None:
        """The next queued record within ``timeout_s``, else None. A record taken off the queue
        as the caller is cancelled goes into ``_pending`` before the cancellation goes on (so
        ``stop`` sends it), and the cancellation is never dropped (``asyncio.wait_for`` on
        Python < 3.12 drops one that arrives with its result)."""
        getter = asyncio.ensure_future(self._queue.get())
        try:
            done, _ = await asyncio.wait({getter}, timeout=timeout_s)
        except asyncio.CancelledError:
            if await _ended(getter) is not None:
                self._pending.append(getter.result())
            raise
        if not done:
            return await _ended(getter)
        return getter.result()

    async def _send(self, batch: list[pb.TrajectoryRecord]) -> None:
        """Send until the board takes the batch, in calls of at most ``MAX_TRAJECTORY_BATCH_BYTES``
        (the caller bounds the wait, if it must)."""
        for call in byte_bounded(batch, MAX_TRAJECTORY_BATCH_BYTES):
            await self._send_call(call)

    async def _send_call(self, batch: list[pb.TrajectoryRecord]) -> None:
        delay = 0.2
        while True:
            try:
                await self._client.report_trajectories(batch)
                self.sent += len(batch)
                return
            except (Unavailable, DeadlineExceeded) as exc:
                log.info("trajectory batch waits for the board", records=len(batch), retry_in_s=delay,
                         error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
            except WeftboardError as exc:
                self.failed += len(batch)
                log.warning("trajectory batch refused by the board; dropped", records=len(batch), error=str(exc))
                return

    async def _run(self) -> None:
        while True:
            await self._send(await self._next_batch())  # (the batch is _pending until sent)
            self._pending = []

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Send everything queued now (used by ``stop`` and by tests)."""
        deadline = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < deadline:
            batch = []
            while not self._queue.empty() and len(batch) < self.batch_size:
                batch.append(self._queue.get_nowait())
            await within(self._send(batch), max(deadline - time.monotonic(), 0.1))

    async def stop(self, timeout_s: float = 5.0) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            await cancel_and_wait([task])
        try:
            if self._pending:
                batch, self._pending = self._pending, []
                await within(self._send(batch), timeout_s)
            await self.flush(timeout_s)
        except (TimeoutError, WeftboardError) as exc:
            log.warning("trajectory flush at stop incomplete", error=str(exc), queued=self._queue.qsize())


async def _ended(getter: asyncio.Future) -> pb.TrajectoryRecord | None:
    """Cancel a queue ``getter`` and wait for it: the record it had already taken, else None."""
    await cancel_and_wait([getter])
    return None if getter.cancelled() else getter.result()
