"""Diff and apply on the raw stored bits of any dtype (CPU path; CUDA tensors go to Triton).

Invariants:
- Elements are compared as integers of the element width (uint8, int16, int32, int64
  views), never as floats: +0.0 and -0.0 differ, a NaN equal to itself bit for bit is
  unchanged, and every dtype (bf16, fp16, fp32, fp8, packed 4-bit bytes, E8M0 scales)
  goes through the same code.
- A ``TensorDelta`` lists every changed element exactly once, ``positions`` strictly
  ascending (int64 flat indices), with the old and new bits at those positions.
- The CPU path works in fixed tiles of ``DIFF_TILE`` elements in parallel (numba prange),
  64 elements at a time as change masks (one vector compare, ``tile_blocks.block_mask``) walked
  with count-trailing-zeros. One read of both arrays puts each tile's changes in its own
  region of a per-thread staging buffer (batches of ``_STAGE_TILES`` tiles); a prefix sum of
  the counts then gives each tile its place in the compact output. No Python loop over elements, and the result does not
  depend on the number of threads, so it is byte-identical to the Triton path.
- ``diff_and_update_`` fuses the diff with the update of ``prev`` (only changed elements
  are written), so the publisher keeps one served view.
- Apply is in place (``target`` keeps its storage), so CUDA graphs that captured the
  tensor's address stay valid.
"""

from __future__ import annotations

import threading
from types import ModuleType

import numba as nb
import numpy as np
import torch

from weftboard.cuda.bitops import cttz64
from weftboard.cuda.jit import parallel_kernel
from weftboard.cuda.tensor_bits import NP_UNSIGNED, TensorDelta, bits_view, unsigned_np
from weftboard.cuda.tile_blocks import block_mask
from weftboard.proto.errors import InvalidArgument

DIFF_TILE = 1 << 16  # at most 2**16: staged tile-local indices are uint16

# ---------------------------------------------------------------------------
# numba kernels (unsigned views; compiled once per width and cached on disk)
# ---------------------------------------------------------------------------


@parallel_kernel
def _stage_tiles(a, b, t0, t1, tile, width, spos, sold, snew, update):
    """Tiles ``t0 .. t1-1``: each tile's changes (tile-local index, old, new) into its own
    staging region ``[(t - t0) * tile, ...)``, in one read of both arrays; the counts."""
    n = a.size
    counts = np.zeros(t1 - t0, np.int64)
    for j in nb.prange(t1 - t0):
        s = (t0 + j) * tile
        e = min(s + tile, n)
        r = j * tile
        c = 0
        for bi in range((e - s + 63) // 64):
            m = block_mask(a, b, s + 64 * bi, e)
            while m != 0:
                li = 64 * bi + np.int64(cttz64(m))
                m &= m - np.uint64(1)
                i = s + li
                av = a[i]
                bv = b[i]
                spos[r + c] = li
                sold[r + c] = av
                snew[r + c] = bv
                c += 1
                if update:
                    a[i] = bv
        counts[j] = c
    return counts


@parallel_kernel
def _unstage(t0, tile, counts, spos, sold, snew, pos, olds, news, o0):
    """Copy each staged tile to the compact output from ``o0`` (positions made absolute)."""
    nt = counts.size
    offsets = np.zeros(nt + 1, np.int64)
    for j in range(nt):
        offsets[j + 1] = offsets[j] + counts[j]
    for j in nb.prange(nt):
        o = o0 + offsets[j]
        r = j * tile
        base = (t0 + j) * tile
        for c in range(counts[j]):
            pos[o + c] = base + np.int64(spos[r + c])
            olds[o + c] = sold[r + c]
            news[o + c] = snew[r + c]


@nb.njit(cache=True, nogil=True)
def _grow(arr, need):
    out = np.empty(max(need, 2 * arr.size), arr.dtype)
    out[: arr.size] = arr
    return out


@nb.njit(cache=True, nogil=True)
def _diff_batches(a, b, tile, width, batch, spos, sold, snew, update, capacity):
    """Every tile, ``batch`` tiles at a time through the staging buffers, into output arrays
    that grow by doubling (no per-batch Python, no final concatenation)."""
    ntiles = (a.size + tile - 1) // tile
    pos = np.empty(capacity, np.int64)
    olds = np.empty(capacity, a.dtype)
    news = np.empty(capacity, a.dtype)
    total = 0
    for t0 in range(0, ntiles, batch):
        t1 = min(ntiles, t0 + batch)
        counts = _stage_tiles(a, b, t0, t1, tile, width, spos, sold, snew, update)
        need = total + counts.sum()
        if need > pos.size:
            pos = _grow(pos[:total], need)
            olds = _grow(olds[:total], need)
            news = _grow(news[:total], need)
        _unstage(t0, tile, counts, spos, sold, snew, pos, olds, news, total)
        total = need
    return pos, olds, news, total


@parallel_kernel
def _scatter(target, pos, bits, chunk):
    n = pos.size
    nchunks = (n + chunk - 1) // chunk
    for c in nb.prange(nchunks):
        for i in range(c * chunk, min((c + 1) * chunk, n)):
            target[pos[i]] = bits[i]


def gpu_kernels() -> ModuleType:
    """The Triton kernels of the GPU path (``triton_kernels``), imported on first use."""
    from weftboard.cuda import triton_kernels  # optional dependency (triton)

    return triton_kernels


def check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.dtype != new.dtype:
        raise InvalidArgument(f"diff needs equal dtypes, got {old.dtype} and {new.dtype}")
    if old.shape != new.shape:
        raise InvalidArgument(f"diff needs equal shapes, got {tuple(old.shape)} and {tuple(new.shape)}")
    if old.device != new.device:
        raise InvalidArgument(f"diff needs both tensors on one device, got {old.device} and {new.device}")


_STAGE_TILES = 16  # tiles per staging batch: 1M elements, 6 MB of staging for 2-byte types
_staging = threading.local()


def _staging_buffers(width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's staging arrays for one batch (kept: fresh ones would page-fault every call)."""
    key = f"w{width}"
    bufs = getattr(_staging, key, None)
    if bufs is None:
        n = _STAGE_TILES * DIFF_TILE
        bufs = (np.empty(n, np.uint16), np.empty(n, NP_UNSIGNED[width]), np.empty(n, NP_UNSIGNED[width]))
        setattr(_staging, key, bufs)
    return bufs


def _diff_cpu(old: torch.Tensor, new: torch.Tensor, update: bool) -> TensorDelta:
    a_bits = bits_view(old)
    b_bits = bits_view(new)
    a = unsigned_np(a_bits)
    b = unsigned_np(b_bits)
    width = a.itemsize
    spos, sold, snew = _staging_buffers(width)
    capacity = a.size // 32 + 1024  # ~3% density; grows by doubling when denser
    pos, olds, news, total = _diff_batches(a, b, DIFF_TILE, width, _STAGE_TILES, spos, sold, snew, update, capacity)
    if pos.size > 2 * total + 4096:  # do not pin a much larger buffer than the delta needs
        pos, olds, news = pos[:total].copy(), olds[:total].copy(), news[:total].copy()
    else:
        pos, olds, news = pos[:total], olds[:total], news[:total]
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
    if old.device.type == "cuda":  # (contiguous as the CPU path takes them: only an update needs ``prev`` as it is)
        return gpu_kernels().diff_cuda(old.detach().contiguous(), new.detach().contiguous(), update=False)
    return _diff_cpu(old.detach().contiguous(), new.detach().contiguous(), update=False)


def diff_and_update_(prev: torch.Tensor, new: torch.Tensor) -> TensorDelta:
    """Diff ``prev`` against ``new`` and make ``prev`` equal ``new`` in the same pass."""
    check_pair(prev, new)
    if prev.device.type == "cuda":
        return gpu_kernels().diff_cuda(prev, new, update=True)
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
        gpu_kernels().scatter_cuda_(tb, positions.to(target.device), bits.to(target.device).view(tb.dtype))
        return
    _scatter(unsigned_np(tb), positions.numpy(), unsigned_np(bits.view(tb.dtype)), 1 << 16)


def apply_delta_(target: torch.Tensor, delta: TensorDelta) -> None:
    """Write the delta's new bits into ``target`` in place."""
    check_delta(target, delta)
    scatter_bits_(target, delta.positions, delta.new_bits)
