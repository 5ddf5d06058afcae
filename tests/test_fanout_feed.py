"""The fan-out's per-subscription mailbox and the feed's ticker pacing (no Redis: the ticker
reads only its subscriptions)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from weftboard.board.fanout import MAX_TICK_S, TICK, Mailbox, RunFeed, Subscription


async def test_mailbox_is_fifo_and_get_waits_for_a_put():
    box = Mailbox()
    box.put_nowait(1)
    box.put_nowait(2)
    assert [await box.get(), await box.get()] == [1, 2]
    waiting = asyncio.create_task(box.get())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    box.put_nowait(3)
    assert await asyncio.wait_for(waiting, 1) == 3
    assert box.qsize() == 0


async def test_a_cancelled_get_loses_nothing():
    box = Mailbox()
    waiting = asyncio.create_task(box.get())
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    box.put_nowait("kept")
    assert box.qsize() == 1 and await box.get() == "kept"


class CountingSubscription(Subscription):
    """Counts how often the ticker looks at this subscription's interval."""

    looks = 0

    @property
    def interval_s(self) -> float:
        CountingSubscription.looks += 1
        return self._interval

    @interval_s.setter
    def interval_s(self, value: float) -> None:
        self._interval = value


async def test_ticker_passes_follow_the_shortest_interval():
    feed = RunFeed(store=None, run="r", poll_s=1.0, tick_s=0.01)  # type: ignore[arg-type]
    slow = CountingSubscription(feed, 5.0)
    slow.wrote()
    feed.subs.add(slow)
    feed.ticker = asyncio.create_task(feed._tick())
    try:
        CountingSubscription.looks = 0
        await asyncio.sleep(1.0)
        passes = CountingSubscription.looks / 2  # each pass reads the interval twice
        # 5 s intervals: passes every MAX_TICK_S, not every tick_s (about 100 in a second)
        assert passes <= 1.0 / MAX_TICK_S + 2, passes

        fast = Subscription(feed, 0.2)
        fast.wrote()
        feed.subs.add(fast)
        start = time.monotonic()
        assert await asyncio.wait_for(fast.queue.get(), 2) is TICK
        assert time.monotonic() - start <= 0.2 + MAX_TICK_S + 0.1  # one long pause at most, then 10 ms
        fast.tick_pending = False
        fast.wrote()
        start = time.monotonic()
        assert await asyncio.wait_for(fast.queue.get(), 2) is TICK
        assert time.monotonic() - start <= 0.2 + 0.05 + 0.1  # now paced by its 200 ms interval
        assert slow.queue.qsize() == 0
    finally:
        feed.ticker.cancel()


def test_serving_process_freezes_its_heap_and_collects_young_objects_less_often():
    """``weftboard serve`` calls this once its modules are loaded (a subprocess: it changes the
    interpreter's collector)."""
    code = (
        "import gc, json; import weftboard.board.commands;"
        "from weftboard.board.process import tune_gc_for_serving, SERVING_GC_THRESHOLDS;"
        "before = gc.get_freeze_count(); tune_gc_for_serving();"
        "print(json.dumps([before, gc.get_freeze_count(), list(gc.get_threshold()), list(SERVING_GC_THRESHOLDS)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after, threshold, expected = json.loads(out)
    assert before == 0 and after > 10_000  # the imported modules' objects are out of the generations
    assert threshold == expected and threshold[0] > 700
