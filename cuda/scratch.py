"""Pooled scratch buffers for the encoders, and leased buffers for results that outlive a call.

Invariants: a pooled buffer is valid only until the next call that uses the same pool (so pools
are per thread); scratch comes from ``torch.empty`` so only the pages a tile writes are touched;
a kept pool above ``KEPT_SCRATCH_BYTES`` is dropped after each encode. A leased buffer
(``LeasePool``) is handed out again only once no array refers to it.
"""

from __future__ import annotations

import sys
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


class LeasePool:
    """Buffers for results that outlive the call that made them (an apply's undo records),
    reused once nothing refers to them.

    Fresh memory is page-faulted on its first touch, and the faults of the 23 MB of undo
    records of the codec bench's compact apply, taken by two decoding threads, made that apply
    34-62 ms instead of 27-29 (``PERFORMANCE.md``). The pool keeps up to ``keep`` base arrays of
    at most ``max_bytes`` together. A base is free when the pool holds the only reference to
    it: every numpy view of a base (slices, ``.view``, views of views) refers to the base
    itself, so a lease lasts exactly as long as any array made from it. Thread-safe."""

    def __init__(self, keep: int = 4, max_bytes: int = KEPT_SCRATCH_BYTES) -> None:
        self.keep, self.max_bytes = keep, max_bytes
        self._bases: list[np.ndarray] = [np.empty(1, np.uint8)]
        # What a base nothing else refers to counts, read the way ``_free`` reads it (Python
        # 3.14 counts fewer references than before where it borrows them).
        self._idle = sys.getrefcount(self._bases[0])
        self._bases.clear()
        self._lock = threading.Lock()

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._bases[i]) <= self._idle

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of uint8 (uninitialised): a free pooled base's first bytes, else a new
        base, pooled when the pool has room for it (a free smaller base makes way)."""
        nbytes = max(int(nbytes), 1)
        with self._lock:
            fits = [i for i in range(len(self._bases)) if self._bases[i].size >= nbytes and self._free(i)]
            if fits:
                return self._bases[min(fits, key=lambda i: self._bases[i].size)][:nbytes]
            base = np.empty(nbytes, np.uint8)
            held = sum(b.size for b in self._bases)
            if held + nbytes > self.max_bytes or len(self._bases) >= self.keep:
                free = [i for i in range(len(self._bases)) if self._free(i)]
                if free:  # the smallest free base makes way
                    held -= self._bases.pop(min(free, key=lambda i: self._bases[i].size)).size
            if held + nbytes <= self.max_bytes and len(self._bases) < self.keep:
                self._bases.append(base)
            return base[:nbytes]

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.size for b in self._bases)
