"""Pooled scratch buffers for the encoders.

Invariants: a pooled buffer is valid only until the next call that uses the same pool (so pools
are per thread); scratch comes from ``torch.empty`` so only the pages a tile writes are touched;
a kept pool above ``KEPT_SCRATCH_BYTES`` is dropped after each encode.
"""

from __future__ import annotations

import threading

import numpy as np
import torch


def fresh_scratch(nbytes: int) -> np.ndarray:
    return torch.empty(max(nbytes, 1), dtype=torch.uint8).numpy()


def pooled(scratch: dict | None, key: str, nbytes: int) -> np.ndarray:
    """``nbytes`` of scratch under ``key`` in ``scratch`` (grown when too small), or fresh
    scratch when there is no pool. An encode that keeps one pool across its tensors touches
    each scratch page once instead of once per tensor: first touches are page faults (fresh
    scratch for each of the bench's 66 bf16 tensors cost about 8 ms of a 50 ms scan). A
    pooled buffer is only valid until the next call that uses the pool."""
    if scratch is None:
        return fresh_scratch(nbytes)
    buf = scratch.get(key)
    if buf is None or buf.size < nbytes:
        buf = scratch[key] = fresh_scratch(nbytes)
    return buf


# A thread's pool outlives one encode when its buffers total at most this: page-faulting
# fresh scratch on every ``encode_patch`` cost 1-4 ms of the bench's 35-50 ms (bf16, 55M
# parameters: a pool of 82 MB of address space, of which the 7 MB that a step's changes
# touch stay resident). The publisher's read keeps its own, smaller pool per version.
KEPT_SCRATCH_BYTES = 256 << 20
_kept = threading.local()


def kept_scratch() -> dict:
    """This thread's scratch pool for ``pooled``, kept from one encode to the next (release
    it with ``trim_scratch`` after each): a trainer that calls ``encode_patch`` every step
    would otherwise page-fault its first touch of every scratch page each time. Per thread, because a pooled
    buffer is only valid until the next call that uses the pool."""
    pool = getattr(_kept, "pool", None)
    if pool is None:
        pool = _kept.pool = {}
    return pool


def trim_scratch(scratch: dict) -> None:
    """Drop the pool's buffers if they total more than ``KEPT_SCRATCH_BYTES`` (one huge
    tensor should not pin its scratch for the life of the process)."""
    held = 0
    for value in scratch.values():  # arrays, or tuples of them (``scan_tiles``)
        for buf in value if isinstance(value, tuple) else (value,):
            held += getattr(buf, "nbytes", 0)
    if held > KEPT_SCRATCH_BYTES:
        scratch.clear()
