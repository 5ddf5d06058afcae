"""Trajectories: report, consume with consumer groups, acknowledge, redeliver, staleness."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from boardkit import make_run, publish

from weftboard.board.client import BoardClient
from weftboard.proto import errors
from weftboard.proto.v1 import board_pb2 as pb


@pytest_asyncio.fixture
async def client(board, local_store):
    async with BoardClient(board.address, board.admin_token) as c:
        await c.create_run(make_run("t"))
        await publish(c, local_store, "t", [1, 2, 3])
        yield c


def records(n: int, version: int = 3, start: int = 0) -> list[pb.TrajectoryRecord]:
    return [
        pb.TrajectoryRecord(
            run="t", island_id="isl", version=version, request_id=f"req-{start + i}",
            prompt_tokens=10, completion_tokens=20 + i, logprob_sum=-1.5, reward=0.5 if i % 2 else 0.0,
            labels={"k": "v"}, latency_ms=12.5,
        )
        for i in range(n)
    ]


async def test_each_record_once_per_group_until_acked(client):
    assert (await client.report_trajectories(records(25))).accepted == 25
    a1 = await client.consume_trajectories("t", "train", "w1", max_records=10)
    a2 = await client.consume_trajectories("t", "train", "w2", max_records=100)
    ids_a = [r.id for r in a1.records] + [r.id for r in a2.records]
    assert len(ids_a) == 25 and len(set(ids_a)) == 25  # split between consumers, no duplicate
    assert [r.record.request_id for r in [*a1.records, *a2.records]] == [f"req-{i}" for i in range(25)]
    assert a1.records[1].record.HasField("reward") and a1.records[1].record.labels["k"] == "v"
    assert a1.head == 3 and a1.records[0].staleness == 0
    # another group sees everything again
    other = await client.consume_trajectories("t", "eval", "e1", max_records=1000)
    assert len(other.records) == 25
    # nothing new for the first group; unacknowledged ones are not redelivered without asking
    empty = await client.consume_trajectories("t", "train", "w1", block_ms=100)
    assert list(empty.records) == []
    acked = await client.ack_trajectories("t", "train", ids_a[:20])
    assert acked.acked == 20
    assert (await client.ack_trajectories("t", "train", ids_a[:20])).acked == 0  # already acked
    await asyncio.sleep(0.15)
    redelivered = await client.consume_trajectories("t", "train", "w3", redeliver_after_ms=100)
    assert sorted(r.id for r in redelivered.records) == sorted(ids_a[20:])
    await client.ack_trajectories("t", "train", [r.id for r in redelivered.records])
    await asyncio.sleep(0.15)
    assert list((await client.consume_trajectories("t", "train", "w3", redeliver_after_ms=100)).records) == []


async def test_blocking_consume_wakes_on_report(client):
    waiter = asyncio.create_task(client.consume_trajectories("t", "g", "c", block_ms=5000))
    await asyncio.sleep(0.3)
    await client.report_trajectories(records(3))
    got = await asyncio.wait_for(waiter, 5)
    assert len(got.records) == 3


async def test_max_staleness_drops_and_acks(client, local_store):
    await client.report_trajectories(records(4, version=1) + records(3, version=3, start=4))
    await publish(client, local_store, "t", [4])
    got = await client.consume_trajectories("t", "g", "c", max_staleness=1)
    assert got.dropped_stale == 4 and got.head == 4
    assert [r.staleness for r in got.records] == [1, 1, 1]
    await asyncio.sleep(0.05)
    again = await client.consume_trajectories("t", "g", "c", redeliver_after_ms=10)
    assert sorted(r.id for r in again.records) == sorted(r.id for r in got.records)  # dropped ones were acked


async def test_stream_is_trimmed_to_maxlen(board_factory, local_store):
    running = await board_factory(blobs=local_store, trajectory_maxlen=100)
    async with BoardClient(running.address, running.admin_token) as c:
        await c.create_run(make_run("t"))
        for _ in range(10):
            await c.report_trajectories(records(100))
        got = await c.consume_trajectories("t", "g", "c", max_records=10000)
        assert 100 <= len(got.records) < 1000  # approximate trim keeps at least maxlen


async def test_largest_batch_in_one_call(client):
    assert (await client.report_trajectories(records(10_000))).accepted == 10_000
    got = await client.consume_trajectories("t", "g", "c", max_records=10_000)
    assert len(got.records) == 10_000
    assert got.records[-1].record.request_id == "req-9999"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c: c.report_trajectories(records(2) + [pb.TrajectoryRecord(run="u", island_id="i")]), "records\\[2\\].run"),
        (lambda c: c.report_trajectories([pb.TrajectoryRecord(run="t", island_id="bad id")]), "island_id"),
        (lambda c: c.report_trajectories([pb.TrajectoryRecord(run="t", island_id="i")] * 10001), "at most 10000"),
        (lambda c: c.consume_trajectories("t", "bad group", "c"), "group"),
        (lambda c: c.consume_trajectories("t", "g", ""), "consumer"),
        (lambda c: c.consume_trajectories("t", "g", "c", max_records=10001), "max_records"),
        (lambda c: c.consume_trajectories("t", "g", "c", block_ms=60001), "block_ms"),
        (lambda c: c.ack_trajectories("t", "g", ["not-an-id"]), "ids\\[0\\]"),
        # what Redis would refuse (an INTERNAL before): a trailing newline, other digits, past 64 bits
        (lambda c: c.ack_trajectories("t", "g", ["1-1", "1-1\n"]), "ids\\[1\\]"),
        (lambda c: c.ack_trajectories("t", "g", ["\u0661-\u0661"]), "ids\\[0\\]"),
        (lambda c: c.ack_trajectories("t", "g", [f"{1 << 64}-1"]), "ids\\[0\\]"),
    ],
)
async def test_malformed(client, call, match):
    with pytest.raises(errors.InvalidArgument, match=match):
        await call(client)


async def test_unknown_run(client):
    with pytest.raises(errors.NotFound):
        await client.report_trajectories([pb.TrajectoryRecord(run="nope", island_id="i")])
    with pytest.raises(errors.NotFound):
        await client.consume_trajectories("nope", "g", "c")
    assert (await client.report_trajectories([])).accepted == 0


async def test_sync_poll_waits_as_long_as_its_call_may_run(client, board, monkeypatch):
    """A poll blocking up to the board's maximum (60 s) waits for its RPC's own deadline
    (``timeout_s + block_ms / 1000``) plus a margin, not a fixed 60 s that would abandon the call
    while the board still reads, leaving what it then delivers pending."""
    from weftboard.publisher.trajectories import SyncTrajectoryConsumer

    waits: list[float | None] = []
    submit = asyncio.run_coroutine_threadsafe

    class Watched:
        def __init__(self, future) -> None:
            self.future = future

        def result(self, timeout=None):
            waits.append(timeout)
            return self.future.result(timeout)

        def __getattr__(self, name):
            return getattr(self.future, name)

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", lambda coro, loop: Watched(submit(coro, loop)))

    def consume() -> list:
        with SyncTrajectoryConsumer(board.address, "t", "sync", "c0", token=board.admin_token, timeout_s=10.0,
                                    block_ms=60_000) as sync:
            del waits[:]
            got = sync.poll()  # the records are there: it answers at once
            assert sync.ack(got) == len(got)
            return got

    await client.report_trajectories(records(2))
    got = await asyncio.to_thread(consume)
    assert [t.request_id for t in got] == ["req-0", "req-1"]
    poll_wait, ack_wait = waits[:2]
    assert poll_wait is not None and poll_wait > 10.0 + 60.0  # the call's deadline, and a margin beyond it
    assert ack_wait is not None and ack_wait > 10.0


async def test_a_consume_reply_ends_within_its_byte_budget_and_the_rest_follows(client):
    """Records near the size limit: one reply holds what fits in about 16 MiB (the board reads
    in chunks and stops in time, instead of a reply over gRPC's 64 MiB limit whose records
    would be left pending), and the next calls hand out the rest, each record once."""
    from weftboard.proto.limits import MAX_TRAJECTORY_RECORD_BYTES

    n = 400  # about 24 MiB in all
    big = records(n)
    for rec in big:
        rec.labels["pad"] = "z" * (MAX_TRAJECTORY_RECORD_BYTES - 200)
    for i in range(0, n, 50):
        assert (await client.report_trajectories(big[i:i + 50])).accepted == 50
    first = await client.consume_trajectories("t", "big", "c", max_records=1000)
    assert 0 < len(first.records) < n
    assert sum(r.record.ByteSize() for r in first.records) < 24 << 20
    got = [r.record.request_id for r in first.records]
    for _ in range(5):
        more = await client.consume_trajectories("t", "big", "c", max_records=1000)
        if not more.records:
            break
        got += [r.record.request_id for r in more.records]
    assert got == [f"req-{i}" for i in range(n)]
