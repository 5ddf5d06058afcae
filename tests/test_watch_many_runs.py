"""Watch on more runs than the board has Redis connections: every run's commits still arrive.

A feed that held a blocking XREAD connection per watched run starved once the runs outnumbered
the pool (``redis_max_connections``): later feeds waited for a connection and their watchers
got UNAVAILABLE. Feeds now read without blocking, woken by the commit's notification."""

from __future__ import annotations

import asyncio
import time

from boardkit import make_run, publish

from weftboard.board.client import BoardClient

RUNS = 12


async def _first_version(client: BoardClient, run: str, staged: bool) -> int:
    # no reconnect: a stream that ends with UNAVAILABLE (its feed failed) fails the test
    async for event in client.watch(run, after_version=0, progress_interval_ms=60_000, reconnect=False,
                                    staged_parts=staged):
        if event.WhichOneof("event") == "version":
            return event.version.version
    raise AssertionError(f"the watch of {run} ended")


async def test_watchers_of_more_runs_than_redis_connections_all_see_commits(board_factory, local_store):
    board = await board_factory(blobs=local_store, redis_max_connections=4)
    runs = [f"many-{i}" for i in range(RUNS)]
    async with BoardClient(board.address, board.admin_token) as client:
        for run in runs:
            await client.create_run(make_run(run))
        # half of them ask for staged-part hints, whose Pub/Sub connections must not take the
        # pool that the board's requests need either
        watches = [asyncio.ensure_future(_first_version(client, run, i % 2 == 0)) for i, run in enumerate(runs)]
        # idle for longer than a wait for a pooled connection may take (5 s), as runs between
        # versions are: a feed that waits for a connection held by other runs' feeds fails then
        await asyncio.sleep(6.5)
        assert not any(w.done() for w in watches), [w.exception() for w in watches if w.done()]
        start = time.monotonic()
        for run in runs:
            await publish(client, local_store, run, [1])
        got = await asyncio.wait_for(asyncio.gather(*watches), 10)
        assert got == [1] * RUNS
        # woken by the commits' notifications, not found by the feeds' safety poll
        assert time.monotonic() - start < 3.0


async def test_a_commit_wakes_the_feed_and_a_lost_listener_comes_back(redis_url, local_store):
    """On a single Redis: the notification wakes the feed (its poll is a minute here); when
    the listener's connection is killed, it subscribes again and commits still arrive at once."""
    from boardkit import make_record

    from weftboard.board.fanout import FanOut, FeedEvent
    from weftboard.board.store import RedisStore

    store = RedisStore(redis_url)
    fanout = FanOut(store, poll_s=60.0)
    try:
        await store.create_run(make_run("woken"))
        sub = await fanout.subscribe("woken", 60.0)
        await asyncio.wait_for(fanout.listening.wait(), 10)
        await asyncio.sleep(0.2)
        await store.commit(await make_record(local_store, "woken", 1))
        item = await asyncio.wait_for(sub.queue.get(), 5)
        assert isinstance(item, FeedEvent) and item.version == 1
        # kill the listener's connection from the server side
        clients = await store.redis.client_list(_type="pubsub")
        assert clients, "no Pub/Sub client on the server"
        for client in clients:
            await store.redis.client_kill_filter(_id=client["id"])
        await asyncio.sleep(0.1)
        await asyncio.wait_for(fanout.listening.wait(), 10)
        await asyncio.sleep(0.2)
        await store.commit(await make_record(local_store, "woken", 2))
        item = await asyncio.wait_for(sub.queue.get(), 5)
        assert isinstance(item, FeedEvent) and item.version == 2
    finally:
        for task in fanout.cancel_all():
            task.cancel()
        await store.close()


async def _drive_until(coro, done, seconds: float) -> None:
    """Run ``coro`` by hand, as a task would, until ``done()`` or ``seconds`` pass; it is left
    suspended where it waits."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        yielded = coro.send(None)
        if yielded is None:
            await asyncio.sleep(0)
        else:
            await asyncio.wait([yielded], timeout=max(0.0, deadline - time.monotonic()))


async def test_a_dropped_listener_or_hint_feed_closes_without_awaiting(redis_url):
    """A feed's coroutine closed while it waits (its task dropped with a closed loop) ends at
    once: before, the listener's retry (a sleep) and the feeds' connection close awaited after
    GeneratorExit ("coroutine ignored GeneratorExit")."""
    from weftboard.board.fanout import FanOut, RunFeed
    from weftboard.board.store import RedisStore

    store = RedisStore(redis_url)
    fanout = FanOut(store, poll_s=60.0)
    try:
        listen = fanout._listen()
        await _drive_until(listen, fanout.listening.is_set, 10)
        assert fanout.listening.is_set()  # subscribed: waiting for a message
        listen.close()  # raises RuntimeError if the coroutine awaits again
        await store.create_run(make_run("hinted"))
        staged = RunFeed(store, "hinted", 60.0, 0.05, fanout.listening)._run_staged()
        await _drive_until(staged, lambda: False, 0.5)
        staged.close()
    finally:
        await store.close()
