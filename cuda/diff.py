"""Diff and apply on the raw stored bits of any dtype (CPU path; CUDA tensors go to Triton).

Invariants:
- Elements are compared as integers of the element width (uint8, int16, int32, int64
  views), never as floats: +0.0 and -0.0 differ, a NaN equal to itself bit for bit is
  unchanged, and every dtype (bf16, fp16, fp32, fp8, packed 4-bit bytes, E8M0 scales)
  goes through the same code.
- A ``TensorDelta`` lists every changed element exactly once, ``positions`` strictly
  ascending (int64 flat indices), with the old and new bits at those positions.
- The CPU path works in fixed tiles of ``DIFF_TILE`` elements in parallel (numba prange):
  pass 1 counts changes per tile, a prefix sum gives each tile its output offset, pass 2
  writes the compacted changes. No Python loop over elements, and the result does not
  depend on the number of threads, so it is byte-identical to the Triton path.
- ``diff_and_update_`` fuses the diff with the update of ``prev`` (only changed elements
  are written), so the publisher keeps one served view.
- Apply is in place (``target`` keeps its storage), so CUDA graphs that captured the
  tensor's address stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np
import torch

from weftboard.proto.errors import InvalidArgument

DIFF_TILE = 1 << 16

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def int_view_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype with the element width of ``dtype`` (uint8 for 1-byte types)."""
    width = torch.empty(0, dtype=dtype).element_size()
    try:
        return _INT_VIEW[width]
    except KeyError:
        raise InvalidArgument(f"dtype {dtype} has element width {width}; supported widths are 1, 2, 4, 8") from None


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """Flat integer view of the stored elements of ``t`` (no copy; ``t`` must be contiguous)."""
    if not t.is_contiguous():
        raise InvalidArgument("diff/apply need contiguous tensors (served views are stored contiguously)")
    flat = t.reshape(-1)
    want = int_view_dtype(t.dtype)
    return flat if flat.dtype == want else flat.view(want)


def unsigned_np(bits: torch.Tensor) -> np.ndarray:
    """A CPU integer tensor as a numpy array of the unsigned type of the same width (no copy)."""
    arr = bits.numpy()
    return arr.view(_NP_UNSIGNED[arr.itemsize])


@dataclass
class TensorDelta:
    """The changed elements of one tensor between two versions of its stored bytes."""

    positions: torch.Tensor  # int64, strictly ascending flat element indices
    old_bits: torch.Tensor  # integer view of the element width, same length as positions
    new_bits: torch.Tensor
    numel: int
    dtype: torch.dtype

    @property
    def changed(self) -> int:
        return int(self.positions.numel())


# ---------------------------------------------------------------------------
# numba kernels (unsigned views; compiled once per width and cached on disk)
# ---------------------------------------------------------------------------


@nb.njit(inline="always", cache=True)
def _lanes_changed(x, width):
    """Number of nonzero ``width``-byte lanes in the 64-bit word ``x`` (branch-free)."""
    if width == 1:
        x |= x >> np.uint64(4)
        x |= x >> np.uint64(2)
        x |= x >> np.uint64(1)
        x &= np.uint64(0x0101010101010101)
        return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)
    if width == 2:
        x |= x >> np.uint64(8)
        x |= x >> np.uint64(4)
        x |= x >> np.uint64(2)
        x |= x >> np.uint64(1)
        x &= np.uint64(0x0001000100010001)
        return (x * np.uint64(0x0001000100010001)) >> np.uint64(48)
    if width == 4:
        x |= x >> np.uint64(16)
        x |= x >> np.uint64(8)
        x |= x >> np.uint64(4)
        x |= x >> np.uint64(2)
        x |= x >> np.uint64(1)
        x &= np.uint64(0x0000000100000001)
        return (x * np.uint64(0x0000000100000001)) >> np.uint64(32)
    return np.uint64(1) if x != 0 else np.uint64(0)


@nb.njit(cache=True)
def _count_words(x, y, width):
    c = np.uint64(0)
    for j in range(x.size):  # 0-based loop over slices: vectorizes (no wraparound checks)
        c += _lanes_changed(x[j] ^ y[j], width)
    return c


@nb.njit(parallel=True, cache=True, nogil=True)
def _count_tiles(aw, bw, a, b, tile, width):
    """Changes per tile; ``aw``/``bw`` are 64-bit word views of the first ``aw.size*8`` bytes."""
    n = a.size
    per = 8 // width
    tilew = tile // per
    covered = aw.size * per
    ntiles = (n + tile - 1) // tile
    counts = np.zeros(ntiles + 1, np.int64)
    for t in nb.prange(ntiles):
        s = t * tile
        e = min(s + tile, n)
        c = 0
        ws = t * tilew
        we = min(ws + tilew, aw.size)
        if we > ws:
            c += np.int64(_count_words(aw[ws:we], bw[ws:we], width))
        for i in range(max(s, covered), e):
            c += 1 if a[i] != b[i] else 0
        counts[t + 1] = c
    return counts


@nb.njit(parallel=True, cache=True, nogil=True)
def _compact_tiles(aw, bw, a, b, tile, width, offsets, pos, olds, news, update):
    """Write each tile's changes at its offset.

    Sparse tiles skip equal 64-bit words whole; dense tiles use a branch-free scan (the index
    is always written, the cursor advances only on a change), whose cost does not depend on
    the density, so no tile pays for branch mispredictions.
    """
    n = a.size
    per = 8 // width
    tilew = tile // per
    covered = aw.size * per
    ntiles = offsets.size - 1
    for t in nb.prange(ntiles):
        o = offsets[t]
        cnt = offsets[t + 1] - o
        if cnt == 0:
            continue
        s = t * tile
        e = min(s + tile, n)
        if cnt * 32 > e - s:
            x = a[s:e]
            y = b[s:e]
            idx = np.empty(x.size + 1, np.int32)
            m = 0
            for j in range(x.size):
                idx[m] = j
                m += 1 if x[j] != y[j] else 0
            for q in range(m):
                j = idx[q]
                pos[o + q] = s + j
                olds[o + q] = x[j]
                news[o + q] = y[j]
                if update:
                    x[j] = y[j]
            continue
        ws = t * tilew
        we = min(ws + tilew, aw.size)
        if we > ws:
            xw = aw[ws:we]
            yw = bw[ws:we]
            for j in range(xw.size):
                if xw[j] != yw[j]:
                    base = (ws + j) * per
                    for i in range(base, base + per):
                        av = a[i]
                        bv = b[i]
                        if av != bv:
                            pos[o] = i
                            olds[o] = av
                            news[o] = bv
                            o += 1
                            if update:
                                a[i] = bv
        for i in range(max(s, covered), e):
            av = a[i]
            bv = b[i]
            if av != bv:
                pos[o] = i
                olds[o] = av
                news[o] = bv
                o += 1
                if update:
                    a[i] = bv


@nb.njit(parallel=True, cache=True, nogil=True)
def _scatter(target, pos, bits, chunk):
    n = pos.size
    nchunks = (n + chunk - 1) // chunk
    for c in nb.prange(nchunks):
        for i in range(c * chunk, min((c + 1) * chunk, n)):
            target[pos[i]] = bits[i]


def check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.dtype != new.dtype:
        raise InvalidArgument(f"diff needs equal dtypes, got {old.dtype} and {new.dtype}")
    if old.shape != new.shape:
        raise InvalidArgument(f"diff needs equal shapes, got {tuple(old.shape)} and {tuple(new.shape)}")
    if old.device != new.device:
        raise InvalidArgument(f"diff needs both tensors on one device, got {old.device} and {new.device}")


def _word_view(arr: np.ndarray) -> np.ndarray:
    """64-bit words over the largest 8-byte multiple prefix of ``arr`` (empty if misaligned)."""
    per = 8 // arr.itemsize
    nw = arr.size // per
    if arr.ctypes.data % 8 or nw == 0:
        return np.empty(0, np.uint64)
    return arr[: nw * per].view(np.uint64)


def _diff_cpu(old: torch.Tensor, new: torch.Tensor, update: bool) -> TensorDelta:
    a_bits = bits_view(old)
    b_bits = bits_view(new)
    a = unsigned_np(a_bits)
    b = unsigned_np(b_bits)
    aw, bw = _word_view(a), _word_view(b)
    if aw.size != bw.size:  # one of them is not 8-byte aligned: compare element by element
        aw, bw = aw[:0], bw[:0]
    width = a.itemsize
    offsets = np.cumsum(_count_tiles(aw, bw, a, b, DIFF_TILE, width))
    total = int(offsets[-1])
    pos = np.empty(total, np.int64)
    olds = np.empty(total, a.dtype)
    news = np.empty(total, a.dtype)
    if total:
        _compact_tiles(aw, bw, a, b, DIFF_TILE, width, offsets, pos, olds, news, update)
    view = a_bits.dtype
    return TensorDelta(
        positions=torch.from_numpy(pos),
        old_bits=torch.from_numpy(olds).view(view) if olds.dtype != np.uint8 else torch.from_numpy(olds),
        new_bits=torch.from_numpy(news).view(view) if news.dtype != np.uint8 else torch.from_numpy(news),
        numel=old.numel(),
        dtype=old.dtype,
    )


def diff_tensor(old: torch.Tensor, new: torch.Tensor) -> TensorDelta:
    """Changed positions and bits between two stored versions of one tensor."""
    check_pair(old, new)
    if old.device.type == "cuda":
        from weftboard.cuda import triton_kernels

        return triton_kernels.diff_cuda(old, new, update=False)
    return _diff_cpu(old.detach().contiguous(), new.detach().contiguous(), update=False)


def diff_and_update_(prev: torch.Tensor, new: torch.Tensor) -> TensorDelta:
    """Diff ``prev`` against ``new`` and make ``prev`` equal ``new`` in the same pass."""
    check_pair(prev, new)
    if prev.device.type == "cuda":
        from weftboard.cuda import triton_kernels

        return triton_kernels.diff_cuda(prev, new, update=True)
    return _diff_cpu(prev.detach(), new.detach().contiguous(), update=True)


def check_delta(target: torch.Tensor, delta: TensorDelta) -> None:
    if delta.dtype != target.dtype or delta.numel != target.numel():
        raise InvalidArgument(
            f"delta is for {delta.numel} elements of {delta.dtype}, target has {target.numel()} of {target.dtype}"
        )
    if delta.new_bits.numel() != delta.positions.numel():
        raise InvalidArgument("delta has different numbers of positions and new values")


def scatter_bits_(target: torch.Tensor, positions: torch.Tensor, bits: torch.Tensor) -> None:
    """``target.flat[positions] = bits`` on the raw bits, in place (positions already validated)."""
    tb = bits_view(target)
    if positions.numel() == 0:
        return
    if target.device.type == "cuda":
        from weftboard.cuda import triton_kernels

        triton_kernels.scatter_cuda_(tb, positions.to(target.device), bits.to(target.device).view(tb.dtype))
        return
    _scatter(unsigned_np(tb), positions.numpy(), unsigned_np(bits.view(tb.dtype)), 1 << 16)


def apply_delta_(target: torch.Tensor, delta: TensorDelta) -> None:
    """Write the delta's new bits into ``target`` in place."""
    check_delta(target, delta)
    scatter_bits_(target, delta.positions, delta.new_bits)
