"""Bit intrinsics for the numba kernels: count trailing/leading zeros, population count.

numba exposes neither, and the portable fallbacks (de Bruijn tables, byte loops) cost several
instructions where the CPU has one (``tzcnt``, ``popcnt``). These emit the LLVM intrinsics
directly, so LLVM picks the instruction the build machine has.

Invariant: ``cttz64(0)`` and ``ctlz64(0)`` are undefined (callers only ask about the lowest or
highest set bit of a non-zero mask).
"""

from __future__ import annotations

from typing import Any, Callable

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def _uint64_intrinsic(emit: Callable[[Any, Any], Any], doc: str) -> Any:
    """A numba intrinsic ``uint64 -> uint64`` whose body is ``emit(builder, value)``."""

    def typer(typingctx, x):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            return emit(builder, args[0])

        return types.uint64(types.uint64), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


_ZERO_IS_POISON = ir.Constant(ir.IntType(1), 1)  # the argument is never 0 (see the invariant)

cttz64 = _uint64_intrinsic(lambda b, v: b.cttz(v, _ZERO_IS_POISON), "Index of the lowest set bit of a non-zero uint64.")
ctlz64 = _uint64_intrinsic(lambda b, v: b.ctlz(v, _ZERO_IS_POISON), "Number of leading zero bits of a non-zero uint64.")
ctpop64 = _uint64_intrinsic(lambda b, v: b.ctpop(v), "Number of set bits of a uint64.")
