"""``pext`` and ``pdep`` (BMI2 bit extract and deposit) for the numba kernels: one instruction each
where the host has BMI2 (every x86 server CPU since Haswell and Zen; on Zen 1 and 2 they are
microcoded and slow), a loop over the mask's set bits elsewhere. Results are the same on every CPU.
"""

from __future__ import annotations

from typing import Any

import llvmlite.binding as llvm_binding
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# Imported before any kernel is defined: it registers the package's cache locator (``jit``).
import weftboard.cuda.jit  # noqa: F401, E402


def _host_has_bmi2() -> bool:
    """Whether the kernels are compiled for a CPU with ``pext``/``pdep`` (BMI2)."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:  # a chosen target (e.g. a portable cache)
        return False
    try:
        return bool(llvm_binding.get_host_cpu_features().get("bmi2"))
    except RuntimeError:  # LLVM cannot tell on this host
        return False


HAS_BMI2 = _host_has_bmi2()


def _bmi2_intrinsic(name: str, doc: str) -> Any:
    """A numba intrinsic ``(uint64, uint64) -> uint64`` calling ``llvm.x86.bmi.<name>.64``."""

    def typer(_typingctx, x, m):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            i64 = ir.IntType(64)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64, i64]),
                                                f"llvm.x86.bmi.{name}.64")
            return builder.call(fn, [args[0], args[1]])

        return types.uint64(types.uint64, types.uint64), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


@numba.njit(inline="always", cache=True)
def pext_portable(x, m):  # type: ignore[no-untyped-def]
    out = np.uint64(0)
    j = np.uint64(0)
    while m:
        low = m & (~m + np.uint64(1))
        if x & low:
            out |= np.uint64(1) << j
        j += np.uint64(1)
        m &= m - np.uint64(1)
    return out


@numba.njit(inline="always", cache=True)
def pdep_portable(x, m):  # type: ignore[no-untyped-def]
    out = np.uint64(0)
    j = np.uint64(0)
    while m:
        low = m & (~m + np.uint64(1))
        if (x >> j) & np.uint64(1):
            out |= low
        j += np.uint64(1)
        m &= m - np.uint64(1)
    return out


if HAS_BMI2:
    pext64 = _bmi2_intrinsic("pext", "The bits of ``x`` under the mask ``m``, packed to the low end (``pext``).")
    pdep64 = _bmi2_intrinsic("pdep", "The low bits of ``x`` spread to the set bits of ``m`` (``pdep``).")
else:  # the same results, a bit at a time
    pext64 = pext_portable
    pdep64 = pdep_portable
