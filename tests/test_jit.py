"""The kernels' compile options: only ``prange`` loops become parallel regions, for every
signature a kernel is compiled for (see ``weftboard.cuda.jit``)."""

from __future__ import annotations

import numba as nb
import numpy as np

from weftboard.cuda import tile_codec
from weftboard.cuda.jit import PRANGE_ONLY, parallel_kernel


def _kernel(a):  # array expressions that parallel=True would each turn into a region
    out = np.zeros(a.size, np.int64)
    total = a[:4].sum()
    for i in nb.prange(a.size):
        out[i] = a[i] + total
    return out


def _parallel_regions(dispatcher, sig) -> int:
    return len(dispatcher.overloads[sig].metadata["parfor_diagnostics"].initial_parfors)


def test_only_the_prange_loop_is_parallel_for_every_signature() -> None:
    kernel = parallel_kernel(_kernel, cache=False)  # compiled here, so the diagnostics exist
    for dtype in (np.int64, np.int32, np.uint16):
        a = np.arange(100, dtype=dtype)
        assert kernel(a).tolist() == (np.arange(100) + 6).tolist()
    assert len(kernel.signatures) == 3
    assert [_parallel_regions(kernel, s) for s in kernel.signatures] == [1, 1, 1]


def test_the_same_function_with_parallel_true_has_more_regions() -> None:
    """The yardstick for the test above: numba's default makes a region of each expression."""
    kernel = nb.njit(parallel=True, cache=False)(_kernel)
    kernel(np.arange(100, dtype=np.int64))
    assert _parallel_regions(kernel, kernel.signatures[0]) > 1


def test_the_codec_kernels_use_those_options() -> None:
    for k in (tile_codec.scan_encode_tiles, tile_codec.rans_encode_tiles, tile_codec.assemble_tiles,
              tile_codec._compact_tiles, tile_codec._decode_tiles):
        assert k.targetoptions["parallel"] is PRANGE_ONLY
    assert not PRANGE_ONLY.numpy and not PRANGE_ONLY.setitem and PRANGE_ONLY.prange
