"""Blocking transfers on their own threads (board/blobs/stoppable.py): they start at once, pass
their outcome back, and a cancelled one has stopped before the cancellation goes on."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from weftboard.board.blobs.stoppable import Stopper, TransferStopped


async def test_transfers_start_at_once_when_the_default_executor_is_full() -> None:
    # A version's parts download at once: each holds its thread for the whole transfer, so
    # they must not queue for the loop's default executor (cpu_count + 4 threads, shared with
    # every to_thread call). Here that executor has one thread, and it is busy.
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(1))
    release = threading.Event()
    busy = asyncio.ensure_future(asyncio.to_thread(release.wait, 30))
    transfers = 6
    all_started = threading.Barrier(transfers, timeout=10)

    def transfer(i: int) -> int:
        all_started.wait()  # breaks (BrokenBarrierError) unless every transfer runs at once
        return i * i

    try:
        results = await asyncio.gather(*(Stopper().run(transfer, i) for i in range(transfers)))
    finally:
        release.set()
        await busy
    assert results == [i * i for i in range(transfers)]


async def test_a_failed_transfer_raises_its_own_error() -> None:
    def transfer() -> None:
        raise ValueError("range 0-10 returned 11 bytes")

    with pytest.raises(ValueError, match="returned 11 bytes"):
        await Stopper().run(transfer)


async def test_a_cancelled_transfer_has_stopped_before_the_cancellation_goes_on() -> None:
    stopper = Stopper()
    started = threading.Event()
    ended = threading.Event()
    reads = 0

    def transfer() -> None:
        nonlocal reads
        started.set()
        try:
            while True:  # a body read chunk by chunk, checking between chunks
                stopper.check()
                reads += 1
                time.sleep(0.005)
        finally:
            ended.set()

    task = asyncio.ensure_future(stopper.run(transfer))
    await asyncio.to_thread(started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended.is_set() and stopper.stopped  # the thread ended first: nothing writes any more
    after = reads
    await asyncio.sleep(0.05)
    assert reads == after
    with pytest.raises(TransferStopped):
        stopper.check()
