"""Merging deltas: the spanning patch when the publisher coalesces skipped versions.

A delta from view A to view B lists, at ascending positions, the old bits (in A) and the
new bits (in B). Given A->B and B->C of the same tensor, ``merge_deltas`` returns A->C:
positions in either, old bits from A (the first delta's old where it has one, else the
second's, which equals A there), new bits from C (the second's new where it has one, else
the first's), and positions whose bits went back to A's dropped. The result is exactly
``diff(A, C)``, so a patch built from it is bitwise correct.
"""

from __future__ import annotations

import torch

from weftboard.cuda.diff import TensorDelta


def merge_deltas(first: TensorDelta, second: TensorDelta) -> TensorDelta:
    if first.numel != second.numel or first.dtype != second.dtype:
        raise ValueError(
            f"cannot merge deltas of different tensors: {first.numel} {first.dtype} vs {second.numel} {second.dtype}"
        )
    if first.positions.numel() == 0:
        return second
    if second.positions.numel() == 0:
        return first
    na = first.positions.numel()
    pos = torch.cat([first.positions, second.positions.to(first.positions.device)])
    uniq, inverse = torch.unique(pos, sorted=True, return_inverse=True)
    ia, ib = inverse[:na], inverse[na:]
    new = torch.empty(uniq.numel(), dtype=first.new_bits.dtype, device=first.new_bits.device)
    old = torch.empty_like(new)
    new[ia] = first.new_bits
    new[ib] = second.new_bits.to(new.device)  # C wins where both changed
    old[ib] = second.old_bits.to(old.device)
    old[ia] = first.old_bits  # A wins where both changed
    keep = new != old  # integer bit patterns: NaN and -0.0 compare exactly
    return TensorDelta(
        positions=uniq[keep].contiguous(),
        old_bits=old[keep].contiguous(),
        new_bits=new[keep].contiguous(),
        numel=first.numel,
        dtype=first.dtype,
    )
