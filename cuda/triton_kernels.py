"""Triton kernels for the GPU path: tiled diff with compaction, and in-place apply.

Invariants (shared with the CPU path in ``weftboard.cuda.diff``, which gives byte-identical
results):
- Elements are compared as integers of the element width; positions come out strictly
  ascending as int64, with the old and new bits beside them.
- Diff reads each element of old and new once in the common case. ``diff_stage_kernel`` gives each
  block of ``BLOCK`` elements its change count and, when the count fits ``STAGE`` slots,
  its compacted changes in a per-block staging area (in-block exclusive prefix sum, no
  atomics, so order is preserved). A device-side cumsum of the counts gives every block its
  output offset (no ``torch.nonzero``, whose host sync per tensor stalls the stream), and
  ``diff_place_kernel`` copies staged changes to their offsets; only blocks denser than ``STAGE``
  re-read their elements there. ``prev`` in update mode is written in the same passes, only
  where an element changed, and a block that overflowed its stage is updated only after it
  was compacted, so old bits are never lost.
- Sizing the output needs one host read of the total per call; ``diff_many_cuda`` does one
  for a whole batch of tensors.
- Apply scatters in place (``tensor.data_ptr()`` never changes), so CUDA graphs stay valid;
  ``apply_diff_kernel`` adds the wrapping integer difference and keeps the old bits for revert.
- Entropy coding and decoding run on CPU threads (numba) for the GPU path too: only the
  compact (position, bits) arrays cross PCIe, about 1% of the tensor. With
  ``WEFTBOARD_DEVICE_DECODE=1`` ``huffman`` streams decode on the device instead
  (``triton_huffman``; opt-in until ``cuda/device_check.sh`` has measured it on a GPU).

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before importing this module and pass
CPU tensors: the same kernels then run in Triton's interpreter (the tests do this).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weftboard.cuda.tensor_bits import TensorDelta, bits_view, launching_on

BLOCK = 4096  # elements per program: one coalesced pass, the in-block scan stays in registers
STAGE = 512  # staged changes per block (12.5%); denser blocks are compacted in the second pass
APPLY_BLOCK = 1024
DIFF_WARPS = 16  # warps per diff program: the fewest with no register spills and 8 elements (16 bytes of bf16) a thread; see triton_compile
APPLY_WARPS = 4


@triton.jit
def diff_stage_kernel(a_ptr, b_ptr, counts_ptr, st_pos_ptr, st_old_ptr, st_new_ptr, n,
                UPDATE: tl.constexpr, BLOCK: tl.constexpr, STAGE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    a = tl.load(a_ptr + offs, mask=inb, other=0)
    b = tl.load(b_ptr + offs, mask=inb, other=0)
    ne = (a != b) & inb
    ne_i = ne.to(tl.int32)
    cnt = tl.sum(ne_i, axis=0)
    tl.store(counts_ptr + pid, cnt.to(tl.int64))
    local = tl.cumsum(ne_i, axis=0) - ne_i
    keep = ne & ((ne_i * 0 + cnt) <= STAGE)  # broadcast the block's "fits its stage" flag
    slot = pid.to(tl.int64) * STAGE + local
    tl.store(st_pos_ptr + slot, (offs - pid.to(tl.int64) * BLOCK).to(tl.int32), mask=keep)
    tl.store(st_old_ptr + slot, a, mask=keep)
    tl.store(st_new_ptr + slot, b, mask=keep)
    if UPDATE:
        tl.store(a_ptr + offs, b, mask=keep)


@triton.jit
def diff_place_kernel(a_ptr, b_ptr, counts_ptr, starts_ptr, st_pos_ptr, st_old_ptr, st_new_ptr,
                pos_ptr, old_ptr, new_ptr, n,
                UPDATE: tl.constexpr, BLOCK: tl.constexpr, STAGE: tl.constexpr):
    pid = tl.program_id(0)
    cnt = tl.load(counts_ptr + pid)
    start = tl.load(starts_ptr + pid)
    if cnt <= STAGE:
        j = tl.arange(0, STAGE)
        m = j < cnt
        src = pid.to(tl.int64) * STAGE + j
        p = tl.load(st_pos_ptr + src, mask=m, other=0).to(tl.int64) + pid.to(tl.int64) * BLOCK
        tl.store(pos_ptr + start + j, p, mask=m)
        tl.store(old_ptr + start + j, tl.load(st_old_ptr + src, mask=m, other=0), mask=m)
        tl.store(new_ptr + start + j, tl.load(st_new_ptr + src, mask=m, other=0), mask=m)
    else:
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n
        a = tl.load(a_ptr + offs, mask=inb, other=0)
        b = tl.load(b_ptr + offs, mask=inb, other=0)
        ne = (a != b) & inb
        ne_i = ne.to(tl.int32)
        dst = start + (tl.cumsum(ne_i, axis=0) - ne_i).to(tl.int64)
        tl.store(pos_ptr + dst, offs, mask=ne)
        tl.store(old_ptr + dst, a, mask=ne)
        tl.store(new_ptr + dst, b, mask=ne)
        if UPDATE:
            tl.store(a_ptr + offs, b, mask=ne)


@triton.jit
def apply_diff_kernel(t_ptr, pos_ptr, d_ptr, old_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    p = tl.load(pos_ptr + offs, mask=m, other=0)
    d = tl.load(d_ptr + offs, mask=m, other=0)
    old = tl.load(t_ptr + p, mask=m, other=0)
    tl.store(old_ptr + offs, old, mask=m)
    tl.store(t_ptr + p, (old + d).to(old.dtype), mask=m)  # integer add wraps in the element width


@triton.jit
def scatter_kernel(t_ptr, pos_ptr, v_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    p = tl.load(pos_ptr + offs, mask=m, other=0)
    tl.store(t_ptr + p, tl.load(v_ptr + offs, mask=m, other=0), mask=m)


class _Pending:
    """A diff whose counts are computed but whose outputs are not yet sized."""

    def __init__(self, old: torch.Tensor, new: torch.Tensor, update: bool, warps: int):
        self.old, self.new, self.update, self.warps = old, new, update, warps
        self.a = bits_view(old)
        self.b = bits_view(new.contiguous())
        self.n = self.a.numel()
        self.nblocks = triton.cdiv(self.n, BLOCK)
        dev = self.a.device
        self.counts = torch.empty(self.nblocks, dtype=torch.int64, device=dev)
        self.st_pos = torch.empty(self.nblocks * STAGE, dtype=torch.int32, device=dev)
        self.st_old = torch.empty(self.nblocks * STAGE, dtype=self.a.dtype, device=dev)
        self.st_new = torch.empty(self.nblocks * STAGE, dtype=self.a.dtype, device=dev)
        if self.nblocks:
            with launching_on(dev):
                diff_stage_kernel[(self.nblocks,)](
                    self.a, self.b, self.counts, self.st_pos, self.st_old, self.st_new, self.n,
                    UPDATE=update, BLOCK=BLOCK, STAGE=STAGE, num_warps=warps,
                )
        ends = torch.cumsum(self.counts, 0)
        self.starts = ends - self.counts
        self.total = ends[-1:] if self.nblocks else torch.zeros(1, dtype=torch.int64, device=dev)

    def finish(self, total: int) -> TensorDelta:
        dev = self.a.device
        pos = torch.empty(total, dtype=torch.int64, device=dev)
        olds = torch.empty(total, dtype=self.a.dtype, device=dev)
        news = torch.empty(total, dtype=self.a.dtype, device=dev)
        if self.nblocks:
            with launching_on(dev):
                diff_place_kernel[(self.nblocks,)](
                    self.a, self.b, self.counts, self.starts, self.st_pos, self.st_old, self.st_new,
                    pos, olds, news, self.n, UPDATE=self.update, BLOCK=BLOCK, STAGE=STAGE,
                    num_warps=self.warps,
                )
        return TensorDelta(positions=pos, old_bits=olds, new_bits=news, numel=self.n, dtype=self.old.dtype)


def diff_many_cuda(pairs: list[tuple[torch.Tensor, torch.Tensor]], *, update: bool = False,
                   warps: int = DIFF_WARPS) -> list[TensorDelta]:
    """Diff a batch of (old, new) pairs with a single host synchronization for all of them.

    ``warps`` (warps per program) is for the GPU benchmark's sweep; the result does not depend on it."""
    pending = [_Pending(old, new, update, warps) for old, new in pairs]
    if not pending:
        return []
    totals = torch.cat([p.total for p in pending]).cpu().tolist()  # the one host sync
    return [p.finish(int(t)) for p, t in zip(pending, totals, strict=True)]


def diff_cuda(old: torch.Tensor, new: torch.Tensor, *, update: bool = False) -> TensorDelta:
    """Diff one pair (one host sync to size the output); ``update`` also writes new into old."""
    return diff_many_cuda([(old, new)], update=update)[0]


def apply_diff_cuda_(target_bits: torch.Tensor, positions: torch.Tensor, diffs: torch.Tensor, old_out: torch.Tensor) -> None:
    """target_bits[positions] += diffs (wrapping), old bits saved into old_out; in place."""
    n = positions.numel()
    if n:
        with launching_on(target_bits.device):
            apply_diff_kernel[(triton.cdiv(n, APPLY_BLOCK),)](target_bits, positions, diffs, old_out, n,
                                                            BLOCK=APPLY_BLOCK, num_warps=APPLY_WARPS)


def scatter_cuda_(target_bits: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """target_bits[positions] = values, in place."""
    n = positions.numel()
    if n:
        with launching_on(target_bits.device):
            scatter_kernel[(triton.cdiv(n, APPLY_BLOCK),)](target_bits, positions, values, n, BLOCK=APPLY_BLOCK,
                                                         num_warps=APPLY_WARPS)
