"""The island's trajectory reporter against a real board: an outage of the board (longer
than any fixed retry budget) loses nothing, and a refusal no retry can cure (a token without
the right) drops the batch and says so instead of retrying forever; and stop ends even when a
record arrives in the same instant (Python < 3.12's wait_for then drops the cancellation)."""

from __future__ import annotations

import asyncio
import time

from boardkit import make_run

from weftboard.board.client import BoardClient
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.trajectories import TrajectoryConsumer
from weftboard.subscriber.trajectory_reporter import TrajectoryReporter, make_record


def record(run: str, request_id: str) -> pb.TrajectoryRecord:
    return make_record(run=run, island_id="i", version_start=1, version_end=1, request_id=request_id,
                       prompt_tokens=1, completion_tokens=2, logprobs=[-0.5], latency_ms=1.0, labels={})


async def until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_board_outage_loses_no_trajectory(board) -> None:
    admin = BoardClient(board.address, board.admin_token, timeout_s=2)
    reporter = TrajectoryReporter(admin, flush_interval_s=0.05, max_backoff_s=0.5)
    try:
        await admin.create_run(make_run("traj-outage"))
        reporter.start()
        reporter.submit(record("traj-outage", "before"))
        await until(lambda: reporter.sent == 1)
        await board.stop()
        for i in range(5):
            reporter.submit(record("traj-outage", f"during-{i}"))
        await asyncio.sleep(3.0)  # the outage: longer than the 1.4 s of retries that used to drop the batch
        assert reporter.sent == 1 and reporter.failed == 0
        await board.restart()
        await until(lambda: reporter.sent == 6)
        consumer = TrajectoryConsumer(admin, "traj-outage", "g", "c", block_ms=200)
        got = []
        for _ in range(20):
            got += await consumer.poll()
            if len(got) >= 6:
                break
        assert sorted(t.record.request_id for t in got) == ["before", *(f"during-{i}" for i in range(5))]
        assert reporter.failed == 0 and reporter.dropped == 0
    finally:
        await reporter.stop(timeout_s=1)
        await admin.close()


async def test_a_refused_batch_is_dropped_and_counted(board) -> None:
    admin = BoardClient(board.address, board.admin_token)
    await admin.create_run(make_run("traj-refused"))
    reader_token = (await admin.create_token("reader", pb.ROLE_READER)).token
    reader = BoardClient(board.address, reader_token)
    reporter = TrajectoryReporter(reader, flush_interval_s=0.05)
    try:
        reporter.start()
        reporter.submit(record("traj-refused", "x"))
        await until(lambda: reporter.failed == 1)  # PERMISSION_DENIED: retrying cannot cure it
        assert reporter.sent == 0
    finally:
        await reporter.stop(timeout_s=1)
        await reader.close()
        await admin.close()


class RecordingClient:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def report_trajectories(self, batch) -> None:
        self.sent += [r.request_id for r in batch]


async def test_stop_ends_when_a_record_arrives_with_the_cancellation() -> None:
    """The sender waits for more records of its batch (``wait_for`` on the queue); a record that
    arrives just as ``stop`` cancels it made Python 3.11's ``wait_for`` return the record and drop
    the cancellation, and the old ``stop`` then waited forever (a whole test run hung on it)."""
    client = RecordingClient()
    reporter = TrajectoryReporter(client, flush_interval_s=5.0, batch_size=100)
    reporter.start()
    reporter.submit(record("r", "a"))
    await asyncio.sleep(0.05)  # the sender holds "a" and waits for more
    reporter.submit(record("r", "b"))
    start = time.monotonic()
    await asyncio.wait_for(reporter.stop(timeout_s=1), 10)  # no await between: the same instant
    assert time.monotonic() - start < 3  # (the old stop waited until this wait_for cancelled it too)
    assert sorted(client.sent) == ["a", "b"]  # nothing lost either


async def test_an_oversized_record_is_refused_alone_and_batches_stay_within_a_call(board) -> None:
    """A record larger than the board takes is refused by ``submit`` (the board refuses it too,
    naming it), so the records around it still arrive; a batch larger than one call's byte
    budget goes in several calls."""
    from weftboard.proto import errors
    from weftboard.proto.limits import (
        MAX_TRAJECTORY_BATCH_BYTES,
        MAX_TRAJECTORY_RECORD_BYTES,
    )

    admin = BoardClient(board.address, board.admin_token)
    reporter = TrajectoryReporter(admin, flush_interval_s=0.05, batch_size=500)
    run = "traj-sizes"
    try:
        await admin.create_run(make_run(run))
        huge = record(run, "huge")
        huge.labels["blob"] = "x" * (MAX_TRAJECTORY_RECORD_BYTES + 1)
        try:
            await admin.report_trajectories([record(run, "beside"), huge])
            raise AssertionError("the board took a record over its limit")
        except errors.InvalidArgument as exc:
            assert "records[1]" in str(exc)
        half = record(run, "h")
        half.labels["blob"] = "y" * (MAX_TRAJECTORY_RECORD_BYTES // 2)
        n_big = 2 * MAX_TRAJECTORY_BATCH_BYTES // half.ByteSize() + 2  # more than two calls' worth
        assert reporter.submit(record(run, "first"))
        assert not reporter.submit(huge) and reporter.failed == 1
        for i in range(n_big):
            rec = pb.TrajectoryRecord()
            rec.CopyFrom(half)
            rec.request_id = f"big-{i}"
            assert reporter.submit(rec)
        reporter.start()
        await until(lambda: reporter.sent == n_big + 1, timeout_s=60)
        assert reporter.failed == 1 and reporter.dropped == 0
        consumer = TrajectoryConsumer(admin, run, "g", "c", block_ms=200)
        got = []
        for _ in range(50):
            got += await consumer.poll()
            if len(got) >= n_big + 1:
                break
        assert sorted(t.record.request_id for t in got) == sorted(["first", *(f"big-{i}" for i in range(n_big))])
    finally:
        await reporter.stop(timeout_s=5)
        await admin.close()
