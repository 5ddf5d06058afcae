"""How weftboard's CPU kernels are compiled: ``parallel_kernel`` for every kernel with a ``prange``.

Why not ``parallel=True``: besides ``prange`` loops it turns every array expression of the
kernel (``np.zeros``, ``row.sum()``, a slice assignment) into a parallel region of its own,
and each region wakes the OpenMP team and waits at its barrier. A ``sum`` inside a serial
loop over tiles becomes one region per tile. From a thread other than the first one that
called into numba (the publisher's read thread, an island's apply thread) the team's
workers sleep between regions (libgomp stops them spinning once it manages more threads than
there are cores), so every region pays for waking them: the tile compaction kernel took
2.1 ms a call there instead of 0.57 ms, and a third of the publisher's read went to it.
Only the ``prange`` loops are worth a region; everything else compiles serial.

Reference counts: an ``inline="always"`` helper that takes an array and has loops of its own,
called in one arm of a branch inside a hot loop, makes numba keep a reference count on that
array around the call: an atomic increment and decrement in its runtime on every iteration
(the encoder's Rice groups lost about a tenth of the scan that way). Keep such helpers out of the
arms of hot loops (``tile_codec._scan_tile`` leaves its group loop for the rare long code).
``NUMBA_ENABLE_PROFILING=1`` under ``perf record -e cpu-clock`` shows them as calls to two
tiny functions (``lock incq``/``lock decq``) next to the hot instructions.
"""

from __future__ import annotations

from typing import Any, Callable

import numba as nb
from numba.core.cpu_options import ParallelOptions


# An options object, not the dict it is made of: numba pops the keys out of a dict when it
# compiles, so a kernel's second signature would be compiled with every transformation on.
PRANGE_ONLY = ParallelOptions({"prange": True, "numpy": False, "setitem": False, "reduction": False, "stencil": False,
                               "inplace_binop": False, "comprehension": False, "fusion": False})


def parallel_kernel(fn: Callable[..., Any], *, cache: bool = True) -> Any:
    """``nb.njit`` with only the ``prange`` loops parallel; cached on disk, GIL released."""
    return nb.njit(parallel=PRANGE_ONLY, cache=cache, nogil=True)(fn)
