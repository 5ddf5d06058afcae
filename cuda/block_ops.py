"""Block operations of the scan kernels, generic over the new version's form: the plain form
(new bits of the old bits' dtype) or the cast form (fp32 bits whose bf16 cast is the new
version), chosen when a kernel is typed.

Invariants: each overload is inlined and picks one form per compiled kernel, so a kernel body
written once compiles to one loop per form; the same preconditions as ``bitops`` apply.
"""

from __future__ import annotations

from typing import Any

import numba
from numba.extending import overload

from weftboard.cuda.bitops import (
    cast_fold64,
    cast_ne_mask64,
    cast_special64,
    cast_sym_compress64,
    cast_sym_lanes64,
    fold64,
    ne_mask64,
    sym_compress64,
    sym_lanes64,
)

# Block operations generic over the new version's form: ``new`` is either the new bits (the
# old bits' dtype) or fp32 bits whose bf16 cast is the new version (a cast scan: the dtypes
# differ). The choice is made when a kernel is typed, so a kernel body written once compiles
# to one loop per form: no branch on the form in the hot loop, and none of the other form's
# vector code competing for its registers.


def _is_cast(a: Any, new: Any) -> bool:
    return bool(a.dtype != new.dtype)


def block_ne_mask64(a: Any, a_start: int, new: Any, new_start: int) -> int:
    """``ne_mask64`` or ``cast_ne_mask64``, by the form of ``new``."""
    raise NotImplementedError("only callable from numba kernels")


@overload(block_ne_mask64, inline="always", jit_options={"cache": True})
def _block_ne_mask64(a, a_start, new, new_start):  # type: ignore[no-untyped-def]
    if _is_cast(a, new):
        return lambda a, a_start, new, new_start: cast_ne_mask64(a, a_start, new, new_start)
    return lambda a, a_start, new, new_start: ne_mask64(a, a_start, new, new_start)


def block_special64(a: Any, new: Any, new_start: int) -> int:
    """``cast_special64`` of a cast block; 0 (nothing special) for plain new bits."""
    raise NotImplementedError("only callable from numba kernels")


@overload(block_special64, inline="always", jit_options={"cache": True})
def _block_special64(a, new, new_start):  # type: ignore[no-untyped-def]
    if _is_cast(a, new):
        return lambda a, new, new_start: cast_special64(new, new_start)
    return lambda a, new, new_start: numba.uint64(0)


def block_sym_compress64(a: Any, a_start: int, new: Any, new_start: int, m: int, sym: Any, sym_at: int, pos: Any,
                         pos_at: int, base: int, rare: Any, rare_at: int) -> tuple[int, int, int]:
    """``sym_compress64`` or ``cast_sym_compress64``, by the form of ``new``."""
    raise NotImplementedError("only callable from numba kernels")


@overload(block_sym_compress64, inline="always", jit_options={"cache": True})
def _block_sym_compress64(a, a_start, new, new_start, m, sym, sym_at, pos, pos_at, base, rare, rare_at):  # type: ignore[no-untyped-def]
    if _is_cast(a, new):
        return (lambda a, a_start, new, new_start, m, sym, sym_at, pos, pos_at, base, rare, rare_at:
                cast_sym_compress64(a, a_start, new, new_start, m, sym, sym_at, pos, pos_at, base, rare, rare_at))
    return (lambda a, a_start, new, new_start, m, sym, sym_at, pos, pos_at, base, rare, rare_at:
            sym_compress64(a, a_start, new, new_start, m, sym, sym_at, pos, pos_at, base, rare, rare_at))


def block_sym_lanes64(a: Any, a_start: int, new: Any, new_start: int, m: int, lanes: Any) -> tuple[int, int, int]:
    """``sym_lanes64`` or ``cast_sym_lanes64``, by the form of ``new``."""
    raise NotImplementedError("only callable from numba kernels")


@overload(block_sym_lanes64, inline="always", jit_options={"cache": True})
def _block_sym_lanes64(a, a_start, new, new_start, m, lanes):  # type: ignore[no-untyped-def]
    if _is_cast(a, new):
        return lambda a, a_start, new, new_start, m, lanes: cast_sym_lanes64(a, a_start, new, new_start, m, lanes)
    return lambda a, a_start, new, new_start, m, lanes: sym_lanes64(a, a_start, new, new_start, m, lanes)


def block_fold64(a: Any, a_start: int, new: Any, new_start: int, m: int) -> None:
    """``fold64`` or ``cast_fold64``, by the form of ``new``."""
    raise NotImplementedError("only callable from numba kernels")


@overload(block_fold64, inline="always", jit_options={"cache": True})
def _block_fold64(a, a_start, new, new_start, m):  # type: ignore[no-untyped-def]
    if _is_cast(a, new):
        return lambda a, a_start, new, new_start, m: cast_fold64(a, a_start, new, new_start, m)
    return lambda a, a_start, new, new_start, m: fold64(a, a_start, new, new_start, m)
