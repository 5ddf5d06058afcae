"""Tensors as their stored bits: integer and numpy views of any dtype, and ``TensorDelta``.

Invariants:
- Views never copy a contiguous tensor; elements are integers of the element width
  (1, 2, 4 or 8 bytes), so every dtype goes through the same diff and codec code.
- A ``TensorDelta`` lists every changed element exactly once, ``positions`` strictly
  ascending (int64 flat indices), with the old and new bits at those positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from weftboard.proto.errors import InvalidArgument

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NP_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def int_view_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype with the element width of ``dtype`` (uint8 for 1-byte types)."""
    width = dtype.itemsize
    try:
        return _INT_VIEW[width]
    except KeyError:
        raise InvalidArgument(f"dtype {dtype} has element width {width}; supported widths are 1, 2, 4, 8") from None


@contextlib.contextmanager
def launching_on(device: torch.device) -> Iterator[None]:
    """Triton launches on the current CUDA device: make it ``device`` for the block (an engine
    may hold several GPUs); nothing to do for CPU tensors under the interpreter."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """Flat integer view of the stored elements of ``t`` (no copy; ``t`` must be contiguous)."""
    if not t.is_contiguous():
        raise InvalidArgument("diff/apply need contiguous tensors (served views are stored contiguously)")
    flat = t.reshape(-1)
    want = int_view_dtype(t.dtype)
    return flat if flat.dtype == want else flat.view(want)


class _TensorMemory:
    """A CPU tensor's memory as numpy's array interface describes it: address, element count
    and the unsigned type of the element width. ``np.asarray`` of one is an array whose
    ``base`` is this object, which holds the tensor, so the memory outlives the caller's
    reference to the tensor as it does for ``Tensor.numpy()``."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor, typestr: str) -> None:
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.numel(),), "typestr": typestr,
                                    "version": 3}


_TYPESTR = {width: np.dtype(kind).str for width, kind in NP_UNSIGNED.items()}


def cpu_bits(t: torch.Tensor) -> np.ndarray:
    """The stored elements of a CPU tensor as a flat numpy array of the unsigned type of their
    width: ``unsigned_np(bits_view(t.detach().contiguous()))`` without a torch operation (the
    address goes to numpy through the array interface). The encoder takes this path for both
    tensors of every pair of a patch, right after a kernel has streamed a large tensor through
    the caches, where torch's dispatch of a dtype view and ``numpy()`` cost about 12 us a call
    (3.6-7 us warm, against 2-4 us this way). No copy unless ``t`` is not contiguous. A
    tensor whose memory does not hold its values as plain elements (not on the CPU,
    quantized, a negative or conjugate view) or an empty one takes the torch path, which
    refuses the first kinds with torch's own error."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    typestr = _TYPESTR.get(t.element_size())
    if typestr is None or not t.is_cpu or t.is_quantized or t.is_neg() or t.is_conj() or t.numel() == 0:
        return t.view(int_view_dtype(t.dtype)).numpy().view(NP_UNSIGNED[t.element_size()]).reshape(-1)
    return np.asarray(_TensorMemory(t, typestr))


def unsigned_np(bits: torch.Tensor) -> np.ndarray:
    """A CPU integer tensor as a numpy array of the unsigned type of the same width (no copy)."""
    arr = bits.numpy()
    return arr.view(NP_UNSIGNED[arr.itemsize])


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
