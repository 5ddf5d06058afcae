"""Fan-out of commit events to many Watch streams with one Redis reader per run.

A thousand watchers must not hold a thousand blocking XREAD connections, nor a thousand
watched runs. Each run with at least one watcher gets one ``RunFeed`` task that reads the
run's events stream and puts every new record on each subscriber's queue. A feed holds no
Redis connection while it waits: the commit script publishes the run's name on
``COMMITS_CHANNEL``, one listener per board process (``FanOut``) wakes that run's feed, and
the feed reads what follows its cursor with an XREAD that does not block.

Invariants (what makes Watch gap-free and duplicate-free):
- ``subscribe`` returns only after the feed has fixed its starting cursor (the last event
  id in the stream at that moment). Every event after the cursor reaches the queue; every
  event up to it is visible to an XRANGE the watcher issues *after* subscribing. So
  history-then-live has no gap. The watcher drops versions it already sent (duplicates)
  and fills any hole from XRANGE (defence in depth).
- A feed stops when its last subscriber leaves; a new subscriber starts a fresh one.
- The events stream, read from the feed's cursor, is what a feed delivers; a notification only
  says when to read. A feed clears its wake-up before each read, so a commit during a read
  wakes it again, and it reads at least every ``poll_s`` seconds while the listener is not
  subscribed (every ``QUIET_POLL_S`` while it is), so a lost notification (the listener
  reconnecting; a replica of an older board that does not publish) costs latency, never an
  event. The listener wakes every feed when it (re)subscribes and when it loses its connection.
- Every board replica runs its own feeds over the same durable stream (on a Redis Cluster,
  the node of the run's slot), so watchers on any replica see every commit once, in order;
  replicas share nothing else.
- If the feed's Redis read fails, every subscriber receives the exception and its stream
  ends with UNAVAILABLE; clients reconnect and resume by version.
- Each commit is serialized once (a ``WatchEvent`` as bytes) and the same bytes are
  written to every stream: a record of a large model is tens of kilobytes, and
  serializing it once per watcher would dominate the fan-out.
- Idle streams get a ``TICK`` from one ticker task per feed (at most one pending per
  subscription) once they have written nothing for their progress interval (late by at most
  a twentieth of the shortest interval, and at most ``MAX_TICK_S``); no stream holds a timer
  of its own.
- Each subscription's queue is a ``Mailbox`` (one reader, no task accounting): with thousands
  of streams, per-item queue overhead is paid thousands of times per commit.
- A mailbox holds at most ``MAILBOX_LIMIT`` items, so a stream whose client stopped reading (a
  stopped island, a partition: its handler waits in ``write``) holds a constant amount of
  memory however long the run commits. On overflow it drops every buffered version event but
  the newest and every staged-part hint, and keeps its TICK and feed error. The newest event is
  then the next version the handler sees, after a hole: it fills the hole from the durable log
  (XRANGE, from the last version it sent), so the stream still skips no version and repeats
  none; only hints are lost (they may be, see below).
- Staged-part hints (``StagePart``) come over Redis Pub/Sub, not the durable log: a feed
  listens only while one of its subscriptions asked for them, and only those get them (so the
  channel's subscriber count tells a publisher whether anyone wants them). They may be lost
  (a hint: the committed record is what counts), never reordered with respect to one
  publisher's calls. On a Redis Cluster the channel lives on the node of the run's slot
  (``RedisStore.staged_listener``), where every replica publishes and counts listeners.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Union

import structlog

from weftboard.board.aio import within
from weftboard.board.store import COMMITS_CHANNEL, RedisStore, event_record, k_staged
from weftboard.proto.v1 import board_pb2 as pb

log = structlog.get_logger(__name__)



@dataclass(frozen=True)
class FeedEvent:
    version: int
    payload: bytes  # a serialized WatchEvent carrying the VersionRecord


@dataclass(frozen=True)
class StagedEvent:
    version: int  # the uncommitted version the part belongs to
    payload: bytes  # a serialized WatchEvent carrying the StagedPart


FeedItem = Union[FeedEvent, StagedEvent, "_Tick", BaseException]


MAX_TICK_S = 0.25  # the longest pause between two passes of a feed's ticker
POLL_S = 1.0  # a feed reads its run's events at least this often while notifications are down
QUIET_POLL_S = 30.0  # ... and this often while the listener is subscribed (a notification may still be lost)
LISTEN_BACKOFF_S = 0.25  # the first pause before the commit listener subscribes again
MAX_LISTEN_BACKOFF_S = 5.0
XREAD_COUNT = 1000  # the most events one XREAD of a feed hands to every mailbox at once
# The most items a subscription's mailbox holds (read when a mailbox is made). Twice a feed's
# XREAD batch, so one burst does not overflow a stream that keeps up; an overflow costs only
# an XRANGE of the versions dropped, and the payloads are shared by every mailbox.
MAILBOX_LIMIT = 2 * XREAD_COUNT


class _Tick:
    """Queue marker: this subscription has been idle for its progress interval."""


TICK = _Tick()


class Mailbox:
    """A bounded single-consumer queue: what ``asyncio.Queue`` does for one reader, at a
    fraction of its cost per item (no task accounting, no loop lookup per call). The fan-out
    puts one item per commit in every subscription's mailbox, thousands per commit.

    It never holds more than ``limit`` items: a put that would exceed it first drops every
    ``StagedEvent`` and every ``FeedEvent`` but the newest, keeping TICK and a feed error (so
    a drop is never a wait or a failure). The reader then sees a version after a hole, which
    the Watch handler fills from the durable log: dropping versions here skips none there."""

    __slots__ = ("items", "waiter", "loop", "limit", "overflows", "dropped", "label")

    def __init__(self, limit: int | None = None, label: str = "") -> None:
        self.items: deque[FeedItem] = deque()
        self.waiter: asyncio.Future | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the reader's, known from its first wait
        self.limit = max(MAILBOX_LIMIT if limit is None else limit, 1)
        self.overflows = 0  # how many times it dropped what it held
        self.dropped = 0  # items dropped, in all
        self.label = label  # the run, for the log

    def put_nowait(self, item: FeedItem) -> None:
        items = self.items
        items.append(item)
        if len(items) > self.limit:
            self._shed()
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _shed(self) -> None:
        """Keep the newest version event (first: the reader fills the hole up to it) and what
        is neither a version event nor a hint (at most one TICK, and the feed's error, which
        no version event follows)."""
        items = self.items
        newest: FeedEvent | None = None
        kept: deque[FeedItem] = deque()
        for queued in items:
            if isinstance(queued, FeedEvent):
                newest = queued
            elif not isinstance(queued, StagedEvent):
                kept.append(queued)
        if newest is not None:
            kept.appendleft(newest)
        dropped = len(items) - len(kept)
        self.items = kept
        self.overflows += 1
        self.dropped += dropped
        log.info("a watch stream fell behind: dropped its buffered events; it refills versions from the log",
                 run=self.label, dropped=dropped, overflows=self.overflows)

    async def get(self) -> FeedItem:
        while not self.items:
            if self.loop is None:
                self.loop = asyncio.get_running_loop()
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()

    def qsize(self) -> int:
        return len(self.items)


@dataclass(eq=False)
class Subscription:
    feed: RunFeed
    interval_s: float
    staged: bool = False  # also receives StagedEvent hints
    queue: Mailbox = field(default_factory=Mailbox)
    last_write: float = 0.0  # time.monotonic() of the last message written to the stream
    tick_pending: bool = False

    def __post_init__(self) -> None:
        self.queue.label = self.feed.run

    @property
    def head(self) -> int:
        return self.feed.head

    def wrote(self) -> None:
        self.last_write = time.monotonic()


class RunFeed:
    """One run's reader of the events stream and its subscribers.

    ``head`` is the newest version this feed has seen; Progress messages use it, so an
    idle stream costs no Redis round trip. Idle detection is one ticker per feed rather
    than a timer per stream re-armed on every event (a thousand streams)."""

    def __init__(self, store: RedisStore, run: str, poll_s: float, tick_s: float,
                 listening: asyncio.Event | None = None) -> None:
        self.store = store
        self.run = run
        self.poll_s = poll_s
        self.listening = listening  # set while notifications come (``FanOut``): the poll can be slow
        self.wake = asyncio.Event()  # set by ``FanOut``'s listener when the run committed
        self.tick_s = tick_s
        self.head = 0
        self.subs: set[Subscription] = set()
        self.started = asyncio.Event()
        self.start_error: BaseException | None = None
        self.task: asyncio.Task | None = None
        self.ticker: asyncio.Task | None = None
        self.staged_task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"weftboard-feed-{self.run}")
        self.ticker = asyncio.create_task(self._tick(), name=f"weftboard-ticker-{self.run}")

    def listen_staged(self) -> None:
        """Start relaying staged-part hints (once per feed, on its first subscription asking)."""
        if self.staged_task is None or self.staged_task.done():
            self.staged_task = asyncio.create_task(self._run_staged(), name=f"weftboard-staged-{self.run}")

    def stop_staged(self) -> None:
        """Stop relaying hints (its last subscription asking left): the channel loses this
        feed as a subscriber, which is how publishers learn nobody here wants parts."""
        if self.staged_task is not None:
            self.staged_task.cancel()
            self.staged_task = None

    def cancel(self) -> list[asyncio.Task]:
        tasks = [t for t in (self.task, self.ticker, self.staged_task) if t is not None]
        for task in tasks:
            task.cancel()
        return tasks

    async def _tick(self) -> None:
        """Every pass looks at every subscription, so passes are spaced by a twentieth of the
        shortest progress interval among them (at least ``tick_s``, at most ``MAX_TICK_S``): a
        TICK is at most that late, and thousands of streams with intervals of seconds are not
        scanned twenty times a second."""
        pause = self.tick_s
        while True:
            await asyncio.sleep(pause)
            now = time.monotonic()
            shortest = MAX_TICK_S * 20
            for sub in tuple(self.subs):
                shortest = min(shortest, sub.interval_s)
                if not sub.tick_pending and now - sub.last_write >= sub.interval_s:
                    sub.tick_pending = True
                    sub.queue.put_nowait(TICK)
            pause = max(self.tick_s, shortest / 20)

    async def _run(self) -> None:
        try:
            cursor = await self.store.last_event_id(self.run)
        except BaseException as exc:  # noqa: BLE001 - handed to subscribers
            self.start_error = exc
            self.started.set()
            return
        self.head = int(cursor.split(b"-", 1)[0])  # event ids are "<version>-1"
        self.started.set()
        try:
            while True:
                self.wake.clear()  # before the read: a commit during it wakes the next wait
                entries = await self.store.events_from(self.run, cursor, XREAD_COUNT)
                for entry_id, fields in entries:
                    cursor = entry_id
                    record = event_record(fields)
                    self.head = max(self.head, record.version)
                    event = FeedEvent(record.version, pb.WatchEvent(version=record).SerializeToString())
                    for sub in tuple(self.subs):
                        sub.queue.put_nowait(event)
                if len(entries) < XREAD_COUNT:  # caught up: wait for the run's next commit
                    notified = self.listening is not None and self.listening.is_set()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await within(self.wake.wait(), max(self.poll_s, QUIET_POLL_S) if notified else self.poll_s)
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: closed, not run (see _listen)
            raise
        except BaseException as exc:  # noqa: BLE001
            log.warning("watch feed failed", run=self.run, error=str(exc))
            for sub in tuple(self.subs):
                sub.queue.put_nowait(exc)

    async def _run_staged(self) -> None:
        pubsub = None
        try:
            pubsub = await self.store.staged_listener(self.run)
            await pubsub.subscribe(k_staged(self.run))
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is None or message.get("type") != "message":
                    continue
                payload = message["data"]
                try:
                    version = pb.WatchEvent.FromString(payload).staged.version
                except Exception:  # noqa: BLE001 - a malformed hint is dropped, not fatal
                    log.warning("dropping a malformed staged-part hint", run=self.run)
                    continue
                event = StagedEvent(version, payload)
                for sub in tuple(self.subs):
                    if sub.staged:
                        sub.queue.put_nowait(event)
        except asyncio.CancelledError:
            raise
        except GeneratorExit:  # closed, not run (see _listen): nothing may be awaited
            pubsub = None
            raise
        except BaseException as exc:  # noqa: BLE001 - hints are best effort; versions still flow
            log.warning("staged-part feed failed; hints stop until the next watcher", run=self.run, error=str(exc))
        finally:
            if pubsub is not None:
                with contextlib.suppress(Exception):  # closing a broken connection may fail too
                    await pubsub.aclose()


class FanOut:
    """Per-run feeds shared by every Watch stream of this board process, and the one listener
    of ``COMMITS_CHANNEL`` that wakes them (started with the first feed)."""

    def __init__(self, store: RedisStore, poll_s: float = POLL_S, tick_s: float = 0.05) -> None:
        self.store = store
        self.poll_s = poll_s
        self.tick_s = tick_s
        self._feeds: dict[str, RunFeed] = {}
        self._listener: asyncio.Task | None = None
        self.listening = asyncio.Event()  # set while the listener is subscribed

    async def subscribe(self, run: str, interval_s: float, *, staged: bool = False) -> Subscription:
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen(), name="weftboard-commits-listener")
        feed = self._feeds.get(run)
        if feed is None or feed.task is None or feed.task.done():
            if feed is not None:
                feed.cancel()
            feed = RunFeed(self.store, run, self.poll_s, self.tick_s, self.listening)
            self._feeds[run] = feed
            feed.start()
        sub = Subscription(feed, interval_s, staged=staged)
        sub.wrote()
        feed.subs.add(sub)
        if staged:
            feed.listen_staged()
        try:
            await feed.started.wait()
        except BaseException:  # the Watch was cancelled while the feed started: nobody will read it
            self.unsubscribe(sub)
            raise
        if feed.start_error is not None:
            self.unsubscribe(sub)
            raise feed.start_error
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        feed = sub.feed
        feed.subs.discard(sub)
        if not feed.subs:
            feed.cancel()
            if self._feeds.get(feed.run) is feed:
                del self._feeds[feed.run]
        elif sub.staged and not any(s.staged for s in feed.subs):
            feed.stop_staged()

    def _wake_all(self) -> None:
        for feed in self._feeds.values():
            feed.wake.set()

    async def _listen(self) -> None:
        """Wake the feed of each run named on ``COMMITS_CHANNEL``, and every feed whenever the
        subscription (re)starts: commits published while it was not subscribed are read then.
        A lost connection is retried with backoff; the feeds poll meanwhile."""
        backoff = LISTEN_BACKOFF_S
        while True:
            pubsub = None
            try:
                pubsub = await self.store.commits_listener()
                await pubsub.subscribe(COMMITS_CHANNEL)
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is None:
                        continue
                    if message.get("type") == "subscribe":
                        backoff = LISTEN_BACKOFF_S
                        self.listening.set()
                        self._wake_all()
                    elif message.get("type") == "message":
                        data = message["data"]
                        feed = self._feeds.get(data.decode() if isinstance(data, bytes) else str(data))
                        if feed is not None:
                            feed.wake.set()
            except asyncio.CancelledError:
                raise
            except GeneratorExit:  # the coroutine is closed, not run (a task dropped with its loop):
                pubsub = None  # awaiting now (a retry's sleep, the connection's close) is an error
                raise
            except BaseException as exc:  # noqa: BLE001 - retried; feeds poll meanwhile
                self.listening.clear()
                log.warning("commit notifications stopped; watch feeds poll until they resume",
                            error=str(exc), retry_in_s=backoff, poll_s=self.poll_s)
                self._wake_all()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_LISTEN_BACKOFF_S)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):  # closing a broken connection may fail too
                        await pubsub.aclose()

    def cancel_all(self) -> list[asyncio.Task]:
        """Cancel every feed and the listener; returns their tasks. A task waiting on Redis may
        only notice once its connection is closed, so the caller closes the store before
        awaiting them."""
        feeds = list(self._feeds.values())
        self._feeds.clear()
        tasks = [task for feed in feeds for task in feed.cancel()]
        if self._listener is not None:
            self._listener.cancel()
            tasks.append(self._listener)
            self._listener = None
        return tasks
