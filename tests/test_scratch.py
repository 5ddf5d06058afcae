"""The leased buffers of ``weftboard.cuda.scratch.LeasePool``: what must hold is that a buffer is
never handed out while any array made from it lives (slices, ``.view``, views of views, a torch
tensor over it), that it is handed out again once none does, and that the pool stays within
its count and byte limits (a request beyond them gets unpooled memory).
"""

from __future__ import annotations

import numpy as np
import torch

from weftboard.cuda.scratch import LeasePool


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_buffer_is_reused_only_once_nothing_refers_to_it() -> None:
    pool = LeasePool(keep=4, max_bytes=1 << 20)
    first = pool.take(4096)
    where = _addr(first)
    held = first.view(np.uint16)[10:20]  # a view of a view keeps the lease
    del first
    second = pool.take(4096)
    assert _addr(second) != where
    as_tensor = torch.from_numpy(held)  # so does a tensor over it
    del held
    assert _addr(pool.take(4096)) not in (where, _addr(second))
    del as_tensor
    assert _addr(pool.take(4096)) == where  # the first buffer, free again
    assert pool.held_bytes == 3 * 4096


def test_the_smallest_free_buffer_that_fits_is_taken_and_a_bigger_one_grows_the_pool() -> None:
    pool = LeasePool(keep=4, max_bytes=1 << 20)
    big, small = pool.take(8192), pool.take(1024)
    big_at, small_at = _addr(big), _addr(small)
    del big, small
    assert _addr(pool.take(512)) == small_at
    assert _addr(pool.take(2048)) == big_at
    larger = pool.take(16384)
    assert _addr(larger) not in (big_at, small_at) and larger.size == 16384


def test_the_pool_keeps_its_limits_and_free_buffers_make_way() -> None:
    pool = LeasePool(keep=2, max_bytes=10_000)
    a, b = pool.take(4000), pool.take(4000)
    c = pool.take(4000)  # over both limits, nothing free: unpooled
    assert pool.held_bytes == 8000
    del c
    assert pool.held_bytes == 8000
    a_at = _addr(a)
    del a
    d = pool.take(5000)  # the free 4000 makes way for it
    assert _addr(d) != a_at and pool.held_bytes == 9000
    huge = pool.take(50_000)  # beyond max_bytes: never pooled
    assert huge.size == 50_000 and pool.held_bytes == 9000
    del b, d, huge
