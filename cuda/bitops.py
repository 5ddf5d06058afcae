"""Bit intrinsics for the numba kernels: count trailing/leading zeros, population count.

numba exposes neither, and the portable fallbacks (de Bruijn tables, byte loops) cost several
instructions where the CPU has one (``tzcnt``, ``popcnt``). These emit the LLVM intrinsics
directly, so LLVM picks the instruction the build machine has.

Invariant: ``cttz64(0)`` and ``ctlz64(0)`` are undefined (callers only ask about the lowest or
highest set bit of a non-zero mask).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def cttz64(typingctx, x):  # type: ignore[no-untyped-def]
    """Index of the lowest set bit of a non-zero uint64."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return sig, codegen


@intrinsic
def ctpop64(typingctx, x):  # type: ignore[no-untyped-def]
    """Number of set bits of a uint64."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.ctpop(args[0])

    return sig, codegen


@intrinsic
def ctlz64(typingctx, x):  # type: ignore[no-untyped-def]
    """Number of leading zero bits of a non-zero uint64."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 1))

    return sig, codegen
