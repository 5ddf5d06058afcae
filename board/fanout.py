"""Fan-out of commit events to many Watch streams with one Redis reader per run.

A thousand watchers must not hold a thousand blocking XREAD connections. Each run with
at least one watcher gets one ``RunFeed`` task that XREADs the run's events stream and
puts every new record on each subscriber's queue.

Invariants (what makes Watch gap-free and duplicate-free):
- ``subscribe`` returns only after the feed has fixed its starting cursor (the last event
  id in the stream at that moment). Every event after the cursor reaches the queue; every
  event up to it is visible to an XRANGE the watcher issues *after* subscribing. So
  history-then-live has no gap. The watcher drops versions it already sent (duplicates)
  and fills any hole from XRANGE (defence in depth).
- A feed stops when its last subscriber leaves; a new subscriber starts a fresh one.
- If the feed's Redis read fails, every subscriber receives the exception and its stream
  ends with UNAVAILABLE; clients reconnect and resume by version.
"""

from __future__ import annotations

import asyncio
from typing import Union

import structlog

from weftboard.board.store import RedisStore, event_record, k_events
from weftboard.proto.v1 import board_pb2 as pb

log = structlog.get_logger(__name__)

FeedItem = Union[pb.VersionRecord, BaseException]


class RunFeed:
    def __init__(self, store: RedisStore, run: str, block_ms: int) -> None:
        self.store = store
        self.run = run
        self.block_ms = block_ms
        self.queues: set[asyncio.Queue[FeedItem]] = set()
        self.started = asyncio.Event()
        self.start_error: BaseException | None = None
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"weftboard-feed-{self.run}")

    async def _run(self) -> None:
        try:
            cursor = await self.store.last_event_id(self.run)
        except BaseException as exc:  # noqa: BLE001 - handed to subscribers
            self.start_error = exc
            self.started.set()
            return
        self.started.set()
        key = k_events(self.run)
        try:
            while True:
                reply = await self.store.blocking.xread({key: cursor}, block=self.block_ms, count=1000)
                if not reply:
                    continue
                entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
                for entry_id, fields in entries:
                    cursor = entry_id
                    record = event_record(fields)
                    for q in tuple(self.queues):
                        q.put_nowait(record)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            log.warning("watch feed failed", run=self.run, error=str(exc))
            for q in tuple(self.queues):
                q.put_nowait(exc)


class FanOut:
    """Per-run feeds shared by every Watch stream of this board process."""

    def __init__(self, store: RedisStore, block_ms: int = 5000) -> None:
        self.store = store
        self.block_ms = block_ms
        self._feeds: dict[str, RunFeed] = {}

    async def subscribe(self, run: str) -> asyncio.Queue[FeedItem]:
        feed = self._feeds.get(run)
        if feed is None or feed.task is None or feed.task.done():
            feed = RunFeed(self.store, run, self.block_ms)
            self._feeds[run] = feed
            feed.start()
        queue: asyncio.Queue[FeedItem] = asyncio.Queue()
        feed.queues.add(queue)
        await feed.started.wait()
        if feed.start_error is not None:
            feed.queues.discard(queue)
            self._feeds.pop(run, None)
            raise feed.start_error
        return queue

    def unsubscribe(self, run: str, queue: asyncio.Queue[FeedItem]) -> None:
        feed = self._feeds.get(run)
        if feed is None:
            return
        feed.queues.discard(queue)
        if not feed.queues and feed.task is not None:
            feed.task.cancel()
            self._feeds.pop(run, None)

    def cancel_all(self) -> list[asyncio.Task]:
        """Cancel every feed; returns their tasks. A feed blocked in XREAD may only notice
        once its connection is closed, so the caller closes the store before awaiting them."""
        feeds = list(self._feeds.values())
        self._feeds.clear()
        tasks = [f.task for f in feeds if f.task is not None]
        for task in tasks:
            task.cancel()
        return tasks
