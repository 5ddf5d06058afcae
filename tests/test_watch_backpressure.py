"""A Watch whose client stops reading: the board's buffer for it stays bounded, and the
stream still skips no version and repeats none once the client reads again."""

from __future__ import annotations

import asyncio

import grpc
from boardkit import make_run, publish

from weftboard.board import fanout
from weftboard.board.client import BoardClient
from weftboard.board.fanout import TICK, FeedEvent, Mailbox, StagedEvent
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.proto.v1 import board_pb2_grpc

# A client's receive window of about a kilobyte: its gRPC stops taking messages after a few, as
# an island's does once its window is full (stopped, partitioned, or just not reading).
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


async def read_versions_until(call, last: int, timeout: float = 30.0) -> list[int]:
    """Versions of the stream's events, as sent (duplicates kept), until ``last`` arrives."""
    got: list[int] = []

    async def run() -> None:
        while not got or got[-1] < last:
            event = await call.read()
            assert event is not grpc.aio.EOF, f"the stream ended after {got[-1:]}"
            if event.WhichOneof("event") == "version":
                got.append(event.version.version)

    await asyncio.wait_for(run(), timeout)
    return got


async def test_a_stalled_watch_holds_a_bounded_mailbox_then_gets_every_version_in_order(
    board, local_store, monkeypatch
):
    """The client stops reading while 100-odd versions commit, the last of them overflowing
    the mailbox (so no later event marks the hole: the mailbox itself must); once it reads
    again it gets versions 2.. as they were committed."""
    limit = 16
    monkeypatch.setattr(fanout, "MAILBOX_LIMIT", limit, raising=False)  # read by new mailboxes
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("r"))
        await publish(client, local_store, "r", [1])
        async with grpc.aio.insecure_channel(board.address, options=SMALL_WINDOW) as channel:
            call = board_pb2_grpc.BoardStub(channel).Watch(
                pb.WatchRequest(run="r", after_version=1, progress_interval_ms=60_000),  # no TICK
                metadata=(("authorization", f"Bearer {board.admin_token}"),),
            )
            await publish(client, local_store, "r", [2])
            assert await read_versions_until(call, 2, timeout=10) == [2]  # the stream is open
            (sub,) = board.handle.fanout._feeds["r"].subs
            peak, last = 0, 2
            while last < 400:  # the client reads nothing meanwhile
                last += 1
                overflows = getattr(sub.queue, "overflows", 0)
                await publish(client, local_store, "r", [last])
                for _ in range(500):  # until the feed has put this version in the mailbox
                    if sub.feed.head >= last:
                        break
                    await asyncio.sleep(0.01)
                peak = max(peak, sub.queue.qsize())
                if last >= 100 and getattr(sub.queue, "overflows", 0) > overflows:
                    break  # this version overflowed it: nothing after it comes
            assert peak <= limit, f"the stalled stream's mailbox grew to {peak} items (limit {limit})"
            assert sub.queue.overflows > 1  # the stream did stall: its buffer was dropped
            got = await read_versions_until(call, last)  # the client reads again
            assert [2, *got] == list(range(2, last + 1))  # no gap, no repeat, in order
            assert sub.queue.qsize() <= limit
            call.cancel()


def test_an_overflowing_mailbox_keeps_the_newest_version_its_tick_and_its_error():
    box = Mailbox(limit=4)
    box.put_nowait(FeedEvent(1, b"1"))
    box.put_nowait(TICK)
    box.put_nowait(StagedEvent(3, b"hint"))
    box.put_nowait(FeedEvent(2, b"2"))
    assert box.qsize() == 4 and box.overflows == 0
    box.put_nowait(FeedEvent(3, b"3"))  # the fifth item: the hint and versions 1, 2 go
    assert list(box.items) == [FeedEvent(3, b"3"), TICK]
    assert box.overflows == 1 and box.dropped == 3
    error = ConnectionError("redis went away")
    for item in (StagedEvent(4, b"h"), FeedEvent(4, b"4"), error):
        box.put_nowait(item)
    assert list(box.items) == [FeedEvent(4, b"4"), TICK, error]  # the error stays last
    assert box.overflows == 2 and box.dropped == 5
    for n in range(5, 5000):  # a stalled reader: the mailbox never holds more than its limit
        box.put_nowait(StagedEvent(n, b"h") if n % 3 else FeedEvent(n, b"v"))
        assert box.qsize() <= 4


async def test_a_mailbox_that_dropped_items_wakes_its_reader_with_the_newest_version():
    box = Mailbox(limit=2)
    for n in range(1, 4):
        box.put_nowait(FeedEvent(n, b""))
    assert await box.get() == FeedEvent(3, b"")
    waiting = asyncio.create_task(box.get())
    await asyncio.sleep(0.01)
    box.put_nowait(FeedEvent(4, b""))
    assert await asyncio.wait_for(waiting, 1) == FeedEvent(4, b"")


def test_mailbox_limit_defaults_to_more_than_one_feed_read():
    assert Mailbox().limit == fanout.MAILBOX_LIMIT > fanout.XREAD_COUNT
    assert Mailbox(limit=0).limit == 1  # never below one item
