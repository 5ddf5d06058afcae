"""Watch: history then live, progress on idle streams, resume after disconnects and board restarts."""

from __future__ import annotations

import asyncio

import pytest
from boardkit import make_record, make_run, publish, upload

from weftboard.board.client import BoardClient
from weftboard.proto import errors
from weftboard.proto.v1 import board_pb2 as pb


async def collect(iterator, n: int, timeout: float = 10.0) -> list[pb.WatchEvent]:
    out: list[pb.WatchEvent] = []

    async def run():
        async for event in iterator:
            out.append(event)
            if len(out) >= n:
                return

    await asyncio.wait_for(run(), timeout)
    return out


def versions(events) -> list[int]:
    return [e.version.version for e in events if e.WhichOneof("event") == "version"]


async def test_history_then_live_then_progress(board, local_store):
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("r"))
        await publish(client, local_store, "r", [1, 2, 3])
        stream = client.watch("r", after_version=1, progress_interval_ms=200).__aiter__()
        first = await collect(stream, 2)
        assert versions(first) == [2, 3]
        await publish(client, local_store, "r", [4, 5])
        live = await collect(stream, 2)
        assert versions(live) == [4, 5]
        assert live[0].version.committed_at_ms > 0
        idle = await collect(stream, 1, timeout=3)
        assert idle[0].WhichOneof("event") == "progress"
        assert idle[0].progress.head == 5 and idle[0].progress.server_time_ms > 0
        await stream.aclose()


async def test_after_zero_streams_from_oldest(board, local_store):
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("r"))
        await publish(client, local_store, "r", [1, 2])
        stream = client.watch("r").__aiter__()
        assert versions(await collect(stream, 2)) == [1, 2]
        await stream.aclose()


async def test_resume_after_client_disconnect(board, local_store):
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("r"))
        await publish(client, local_store, "r", [1, 2])
        stream = client.watch("r").__aiter__()
        got = versions(await collect(stream, 2))
        await stream.aclose()  # disconnect
        await publish(client, local_store, "r", [3, 4, 5])
    async with BoardClient(board.address, board.admin_token) as client:
        stream = client.watch("r", after_version=got[-1]).__aiter__()
        got += versions(await collect(stream, 3))
        await stream.aclose()
    assert got == [1, 2, 3, 4, 5]


async def test_resume_across_board_restart(board, local_store):
    """The client's watch iterator survives a stop/start of the board on the same Redis."""
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("r"))
        await publish(client, local_store, "r", [1, 2])
        stream = client.watch("r", progress_interval_ms=200).__aiter__()
        got = versions(await collect(stream, 2))
        await board.stop()

        async def publish_after_restart():
            await asyncio.sleep(0.3)
            board.handle = await board._restart()  # same port, same Redis, same blobs
            board._stopped = False
            async with BoardClient(board.address, board.admin_token) as other:
                await other.wait_ready()  # the process-wide subchannel may still be in backoff
                await publish(other, local_store, "r", [3, 4])

        task = asyncio.create_task(publish_after_restart())
        events = []
        while versions(events) != [3, 4]:
            events += await collect(stream, 1, timeout=15)
            assert len(events) < 200
            if task.done():
                task.result()  # surface a failed publish
        await task
        got += versions(events)
        await stream.aclose()
    assert got == [1, 2, 3, 4]


async def test_many_watchers_each_get_every_commit_once(board, local_store):
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("r"))
        await publish(client, local_store, "r", [1])
        streams = [client.watch("r", after_version=1).__aiter__() for _ in range(50)]
        tasks = [asyncio.create_task(collect(s, 3)) for s in streams]
        await asyncio.sleep(0.5)  # let every stream open
        await publish(client, local_store, "r", [2, 3, 4])
        results = await asyncio.gather(*tasks)
        assert all(versions(r) == [2, 3, 4] for r in results)
        assert len(board.handle.fanout._feeds["r"].subs) == 50  # one shared feed served them all
        assert len(board.handle.fanout._feeds) == 1
        for s in streams:
            await s.aclose()


async def test_watch_errors(board, local_store):
    async with BoardClient(board.address, board.admin_token) as client:
        with pytest.raises(errors.NotFound):
            await collect(client.watch("missing"), 1)
        await client.create_run(make_run("r"))
        await publish(client, local_store, "r", [1])
        with pytest.raises(errors.InvalidArgument, match="progress_interval_ms"):
            await collect(client.watch("r", progress_interval_ms=50), 1)
        with pytest.raises(errors.OutOfRange, match="beyond the head"):
            await collect(client.watch("r", after_version=7), 1)
        with pytest.raises(errors.InvalidArgument, match="run"):
            await collect(client.watch("bad run"), 1)


def kinds(events) -> list[str]:
    return [e.WhichOneof("event") for e in events]


async def test_staged_parts_reach_only_watchers_that_asked_then_the_commit_names_them(board, local_store):
    """StagePart relays a hint for head+1 to opted-in watchers; the commit of that version may
    name several part blobs; a hint for a version already committed is refused."""
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("r"))
        await publish(client, local_store, "r", [1, 2])
        asking = client.watch("r", after_version=2, staged_parts=True, progress_interval_ms=5000).__aiter__()
        plain = client.watch("r", after_version=2, progress_interval_ms=5000).__aiter__()
        got_asking = asyncio.create_task(collect(asking, 3))
        got_plain = asyncio.create_task(collect(plain, 1))
        await asyncio.sleep(0.5)  # let both streams open (a hint sent before that is lost, by design)
        part_a = await upload(local_store, "r", b"part a of version 3")
        part_b = await upload(local_store, "r", b"part b of version 3, longer")
        assert (await client.stage_part("r", 3, part_a)).head == 2
        await client.stage_part("r", 3, part_b)
        record = await make_record(local_store, "r", 3)
        record.artifacts[0].ClearField("blobs")
        record.artifacts[0].blobs.extend([part_a, part_b])
        asked: list[str] = []
        stat = local_store.stat

        async def counted_stat(key: str):
            asked.append(key)
            return await stat(key)

        local_store.stat = counted_stat  # the board's blob store is this object
        try:
            await client.commit_version(record)
        finally:
            del local_store.stat
        assert part_a.key not in asked and part_b.key not in asked  # StagePart's checks stand in
        events = await got_asking
        assert kinds(events) == ["staged", "staged", "version"]
        assert [e.staged.blob.digest for e in events[:2]] == [part_a.digest, part_b.digest]
        assert all(e.staged.version == 3 and e.staged.base_version == 2 for e in events[:2])
        assert [b.digest for b in events[2].version.artifacts[0].blobs] == [part_a.digest, part_b.digest]
        assert kinds(await got_plain) == ["version"]  # no hints for a stream that did not ask
        with pytest.raises(errors.FailedPrecondition, match="the head is 3"):
            await client.stage_part("r", 3, part_a)  # version 3 is committed: nothing to stage
        await asking.aclose()
        await plain.aclose()


async def test_stage_part_refuses_what_no_commit_could_name(board, local_store):
    from weftboard.proto.domain import blob_key

    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("r"))
        part = await upload(local_store, "r", b"a part")
        with pytest.raises(errors.FailedPrecondition, match="version 1 is an anchor"):
            await client.stage_part("r", 1, part)
        await publish(client, local_store, "r", [1])
        with pytest.raises(errors.FailedPrecondition, match="the head is 1"):
            await client.stage_part("r", 1, part)
        assert (await client.stage_part("r", 3, part)).head == 1  # a version after the next: max_pending > 1
        missing = pb.BlobRef(digest="xxh3-128:" + "0" * 32, size=part.size)
        missing.key = blob_key("r", missing.digest)
        with pytest.raises(errors.FailedPrecondition, match="does not exist"):
            await client.stage_part("r", 2, missing)
        with pytest.raises(errors.FailedPrecondition, match="has 6 bytes, not 7"):
            await client.stage_part("r", 2, pb.BlobRef(key=part.key, digest=part.digest, size=7))
        with pytest.raises(errors.InvalidArgument, match="content-addressed key"):
            await client.stage_part("r", 2, pb.BlobRef(key="elsewhere", digest=part.digest, size=part.size))
        assert (await client.stage_part("r", 2, part)).head == 1
        twice = await make_record(local_store, "r", 2)
        twice.artifacts[0].blobs.append(twice.artifacts[0].blobs[0])
        with pytest.raises(errors.InvalidArgument, match="same part twice"):
            await client.commit_version(twice)


async def test_a_commit_says_whether_a_watcher_asks_for_staged_parts(board, local_store):
    """The publisher's cue to stage parts: true while some Watch stream of the run asked for
    hints (not one that did not), false again once the last such stream closed."""
    async with BoardClient(board.address, board.admin_token) as client:

        async def wanted(version: int) -> bool:
            return (await client.commit_version(await make_record(local_store, "r", version))).staged_parts_wanted

        await client.create_run(make_run("r"))
        await publish(client, local_store, "r", [1])
        assert not await wanted(2)
        plain = client.watch("r", after_version=2, progress_interval_ms=5000).__aiter__()
        got_plain = asyncio.create_task(collect(plain, 1))
        await asyncio.sleep(0.3)
        assert not await wanted(3)  # a watcher that did not ask
        assert versions(await got_plain) == [3]
        asking = client.watch("r", after_version=3, staged_parts=True, progress_interval_ms=5000).__aiter__()
        got_asking = asyncio.create_task(collect(asking, 1))
        part = await upload(local_store, "r", b"a part of version 4")
        for _ in range(100):  # hints before the stream is open are lost: stage until one arrives
            await client.stage_part("r", 4, part)
            await asyncio.wait([got_asking], timeout=0.1)
            if got_asking.done():
                break
        assert [e.WhichOneof("event") for e in got_asking.result()] == ["staged"]
        record = await make_record(local_store, "r", 4)
        first = await client.commit_version(record)
        retried = await client.commit_version(record)  # a retry, as after a lost answer
        assert first.staged_parts_wanted and retried.already_committed and retried.staged_parts_wanted
        await asking.aclose()
        # The board lets the channel go once it sees the stream closed, a moment later.
        for v in range(5, 45):
            if not await wanted(v):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("commits still said parts were wanted 2 s after the last asking stream closed")
        await plain.aclose()


async def test_a_watch_cancelled_while_its_feed_starts_leaves_no_feed_behind(redis_url):
    """The client of the first Watch of a run goes away during the feed's first Redis round
    trip: its subscription is dropped, so the run's feed (an XREAD loop and a ticker) stops
    instead of queueing every later commit for nobody."""
    from weftboard.board.fanout import FanOut
    from weftboard.board.store import RedisStore

    class SlowStore(RedisStore):
        async def last_event_id(self, run: str):
            await asyncio.sleep(0.3)  # one slow Redis round trip
            return await super().last_event_id(run)

    store = SlowStore(redis_url)
    fanout = FanOut(store, tick_s=0.05)
    try:
        watch = asyncio.ensure_future(fanout.subscribe("r", 1.0))
        await asyncio.sleep(0.05)
        feed = fanout._feeds["r"]
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await asyncio.sleep(0.4)
        assert "r" not in fanout._feeds and not feed.subs and feed.task.done()
        # a later watcher gets a feed of its own that starts and serves
        sub = await asyncio.wait_for(fanout.subscribe("r", 1.0), 5)
        assert fanout._feeds["r"] is sub.feed and sub.feed is not feed and sub.feed.start_error is None
        fanout.unsubscribe(sub)
    finally:
        for task in fanout.cancel_all():
            task.cancel()
        await store.close()
