"""``cancel_and_wait``: every task ends, even one that dropped a cancellation."""

from __future__ import annotations

import asyncio

from weftboard.subscriber.cancel import cancel_and_wait


async def test_a_task_that_drops_a_cancellation_is_cancelled_again():
    cancels = 0

    async def stubborn() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels == 1:
                    continue  # what Python < 3.12's wait_for can do with a cancellation
                raise

    async def failing() -> None:
        raise RuntimeError("reported where it happened")

    tasks = [asyncio.create_task(stubborn()), asyncio.create_task(failing()), asyncio.create_task(asyncio.sleep(3600))]
    await asyncio.sleep(0.01)
    await asyncio.wait_for(cancel_and_wait(tasks, retry_s=0.05), 5)
    assert all(t.done() for t in tasks) and cancels == 2
    assert tasks[0].cancelled() and tasks[2].cancelled()
    assert isinstance(tasks[1].exception(), RuntimeError)
