"""``board.aio.within``: asyncio.wait_for's limit without its lost cancellation (gh-86296: on
Python < 3.12 a cancellation that arrives in the same turn as the awaited result is dropped,
and a feed or health loop told to stop went on)."""

from __future__ import annotations

import asyncio

import pytest

from weftboard.board.aio import within


async def test_the_result_comes_back_within_the_limit() -> None:
    async def answer() -> int:
        await asyncio.sleep(0.01)
        return 42

    assert await within(answer(), 5) == 42


async def test_past_the_limit_the_work_is_cancelled_and_ended_before_the_timeout() -> None:
    ended = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    with pytest.raises(asyncio.TimeoutError):
        await within(slow(), 0.05)
    assert ended.is_set()


async def test_an_error_of_the_work_is_raised_as_it_is() -> None:
    async def broken() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        await within(broken(), 5)


async def test_a_cancellation_arriving_with_the_result_is_not_dropped() -> None:
    """The loop's shape of the board's feeds: wait for a wake-up, go round again. The wake-up
    and the stop come in the same turn; the loop must stop."""
    wake = asyncio.Event()
    rounds = 0

    async def feed() -> None:
        nonlocal rounds
        while True:
            wake.clear()
            await within(wake.wait(), 30)
            rounds += 1

    task = asyncio.create_task(feed())
    await asyncio.sleep(0.01)  # the feed waits
    wake.set()
    task.cancel()  # same turn as the wake-up
    done, _ = await asyncio.wait({task}, timeout=2)
    assert done == {task} and task.cancelled()
    assert rounds == 0


async def test_the_caller_cancelled_cancels_the_work_and_waits_for_its_end() -> None:
    cleaned = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # an end that takes a while
            cleaned.set()

    task = asyncio.create_task(within(work(), 30))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set()
