"""Bit intrinsics for the numba kernels: count trailing/leading zeros, population count, and
the change mask of 64 elements.

numba exposes none of them, and the portable fallbacks (de Bruijn tables, byte loops, word
tricks) cost several instructions where the CPU has one (``tzcnt``, ``popcnt``, a vector
compare into a mask register). These emit LLVM IR directly (intrinsics, or a generic vector
compare that LLVM lowers to whatever the build machine has: one ``vpcmpneqw`` per 32 bf16
elements with AVX-512, a compare and ``pmovmskb`` with AVX2), so the bits are the same
everywhere and only the instruction count differs.

Invariants: ``cttz64(0)`` and ``ctlz64(0)`` are undefined (callers only ask about the lowest or
highest set bit of a non-zero mask). ``ne_mask64`` reads 64 elements from ``start`` without a
bounds check: the caller proves ``start + 64 <= size`` for both arrays, which must be
C-contiguous (the typer refuses any other layout).
"""

from __future__ import annotations

from typing import Any, Callable

from llvmlite import ir
from numba import types
from numba.core import errors
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


@intrinsic
def ne_mask64(typingctx, a, b, start):  # type: ignore[no-untyped-def]
    """Bit j set iff ``a[start + j] != b[start + j]`` (j < 64), compared as integers."""
    for ary in (a, b):
        if not isinstance(ary, types.Array) or ary.ndim != 1 or ary.layout != "C" or not isinstance(ary.dtype, types.Integer):
            raise errors.TypingError(f"ne_mask64 needs 1-d C-contiguous integer arrays, got {ary}")
    if a.dtype.bitwidth != b.dtype.bitwidth:
        raise errors.TypingError(f"ne_mask64 needs one element width, got {a.dtype} and {b.dtype}")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        vec = ir.VectorType(ir.IntType(signature.args[0].dtype.bitwidth), 64)
        loaded = []
        for ty, value in zip(signature.args[:2], args[:2]):
            data = context.make_array(ty)(context, builder, value).data
            ptr = builder.bitcast(builder.gep(data, [args[2]]), vec.as_pointer())
            loaded.append(builder.load(ptr, align=1))
        return builder.bitcast(builder.icmp_unsigned("!=", *loaded), ir.IntType(64))

    return types.uint64(a, b, types.int64), codegen
