"""Compile the GPU path's Triton kernels for NVIDIA targets on a machine without a GPU.

``python -m weftboard.cuda.bench.triton_compile [--arch 80,90] [--warps 4,8,16] [--json]``

Why: the tests run the Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1``), which
checks what they compute but not that they lower to a GPU: a type the PTX backend rejects, a
layout conversion that fails, or a kernel that spills registers to local memory passes the
interpreter and fails or slows down only on the device, where a session has minutes. Triton
compiles ahead of time with no driver: its own LLVM makes PTX and the ``ptxas`` bundled in the
wheel makes the cubin. This module does that for every kernel of ``triton_kernels``, for every
element width the diff handles and each ``UPDATE`` variant, at the launch's warps, and reads
each cubin's resources (registers, stack, local and shared memory) with the bundled
``cuobjdump``.

Invariants:
- The arguments are typed as a launch types them: pointers to the element width's integer
  view (``diff.int_view_dtype``), 16-byte aligned as torch allocates them (the runtime
  specializes on that too), positions int64, staged in-block positions int32, ``n`` int32
  (Triton passes an int below 2**31 as i32). ``n`` comes in both forms the runtime compiles:
  a multiple of 16 (almost every weight tensor; the masked loads then vectorize, 16 bytes a
  load) and any other size. The constexprs are the module's launch constants. A kernel argument with no known role is an error, so a new kernel or argument
  cannot go unchecked.
- It refuses to run once ``triton_kernels`` was imported under the interpreter (its kernels
  are then interpreter functions, which do not lower).
- The occupancy printed is the register-limited estimate only (CUDA's occupancy rules for the
  register file; the kernels' shared memory is a few KiB and never the limit here).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

ELEMENTS = ("u8", "i16", "i32", "i64")  # the integer views of 1-, 2-, 4- and 8-byte elements

# how each kernel argument is typed; "element" is the element width's integer view
_ROLES = {
    "a_ptr": "element", "b_ptr": "element", "st_old_ptr": "element", "st_new_ptr": "element",
    "old_ptr": "element", "new_ptr": "element", "t_ptr": "element", "d_ptr": "element", "v_ptr": "element",
    "counts_ptr": "*i64", "starts_ptr": "*i64", "pos_ptr": "*i64", "st_pos_ptr": "*i32", "n": "i32",
}


@dataclass(frozen=True)
class ArchLimits:
    """What bounds resident warps on one SM (CUDA occupancy rules, per compute capability)."""

    registers: int = 65536
    max_warps: int = 64
    max_blocks: int = 32
    register_unit: int = 256  # registers are allocated per warp in units of this many


ARCHS = {80: ArchLimits(), 86: ArchLimits(max_warps=48, max_blocks=16), 89: ArchLimits(max_warps=48, max_blocks=24),
         90: ArchLimits()}


def register_limited_occupancy(registers: int, warps: int, limits: ArchLimits) -> float:
    """Resident warps over the SM's maximum when registers are the only limit."""
    per_warp = math.ceil(registers * 32 / limits.register_unit) * limits.register_unit
    warps_by_registers = min(limits.registers // max(per_warp, 1), limits.max_warps)
    blocks = min(warps_by_registers // warps, limits.max_blocks)
    return blocks * warps / limits.max_warps


@dataclass(frozen=True)
class CompiledKernel:
    kernel: str
    element: str
    variant: str  # the constexprs that vary between launches, e.g. "UPDATE=True"
    n_multiple_of_16: bool  # the runtime's specialization of the element count
    arch: int
    warps: int
    registers: int
    stack_bytes: int
    local_bytes: int
    shared_bytes: int
    cubin_bytes: int
    occupancy: float

    @property
    def spills(self) -> bool:
        return self.stack_bytes > 0 or self.local_bytes > 0


class CompileCheckError(RuntimeError):
    """The kernels cannot be compiled or inspected here (what and why in the message)."""


def _kernels() -> dict[str, tuple[Any, dict[str, Any], tuple[dict[str, Any], ...], int]]:
    """Each kernel: its function, fixed constexprs, the variants launched, and its warps."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise CompileCheckError("TRITON_INTERPRET=1 is set: the kernels would be interpreter functions; "
                                "run this in an environment without it")
    from triton.runtime.jit import JITFunction  # optional dependency: triton

    from weftboard.cuda import triton_kernels as tk  # optional dependency: triton

    kernels = {
        "diff_stage_kernel": (tk.diff_stage_kernel, {"BLOCK": tk.BLOCK, "STAGE": tk.STAGE},
                        ({"UPDATE": False}, {"UPDATE": True}), tk.DIFF_WARPS),
        "diff_place_kernel": (tk.diff_place_kernel, {"BLOCK": tk.BLOCK, "STAGE": tk.STAGE},
                        ({"UPDATE": False}, {"UPDATE": True}), tk.DIFF_WARPS),
        "apply_diff_kernel": (tk.apply_diff_kernel, {"BLOCK": tk.APPLY_BLOCK}, ({},), tk.APPLY_WARPS),
        "scatter_kernel": (tk.scatter_kernel, {"BLOCK": tk.APPLY_BLOCK}, ({},), tk.APPLY_WARPS),
    }
    for name, (fn, *_rest) in kernels.items():
        if not isinstance(fn, JITFunction):
            raise CompileCheckError(f"{name} is a {type(fn).__name__}, not a JITFunction: triton_kernels was "
                                    "imported under TRITON_INTERPRET=1 in this process")
    defined = {n for n, v in vars(tk).items() if isinstance(v, JITFunction)}
    if defined != set(kernels):
        raise CompileCheckError(f"triton_kernels defines kernels {sorted(defined)}; this check knows {sorted(kernels)}")
    return kernels


def _signature(fn: Any, element: str, n_multiple_of_16: bool = True) -> tuple[dict[str, str], dict[tuple[int, ...], list]]:
    """``fn``'s argument types and the runtime's alignment hints for one launch form: what
    ``triton.compile`` needs to build the cubin the runtime would build for that launch."""
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, param in enumerate(fn.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            continue
        try:
            role = _ROLES[param.name]
        except KeyError:
            raise CompileCheckError(f"{fn.__name__}: argument {param.name!r} has no known type; add it to _ROLES") from None
        signature[param.name] = f"*{element}" if role == "element" else role
        if signature[param.name].startswith("*") or (param.name == "n" and n_multiple_of_16):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _tool(name: str) -> str:
    from triton import knobs  # optional dependency: triton

    path = getattr(knobs.nvidia, name).path
    if not path or not os.path.exists(path):
        raise CompileCheckError(f"Triton's bundled {name} was not found (looked at {path!r})")
    return path


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK, LOCAL and SHARED of the one function in ``cubin``, as cuobjdump reports them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise CompileCheckError(f"cuobjdump -res-usage failed ({proc.returncode}): {proc.stderr.strip()}")
    for line in proc.stdout.splitlines():
        if line.strip().startswith("REG:"):
            fields = dict(item.split(":", 1) for item in line.split())
            return {key: int(fields[key]) for key in ("REG", "STACK", "LOCAL", "SHARED")}
    raise CompileCheckError(f"cuobjdump printed no resource line:\n{proc.stdout}")


def compile_kernels(archs: tuple[int, ...] = (80, 90), warps: tuple[int, ...] | None = None,
                    elements: tuple[str, ...] = ELEMENTS) -> Iterator[CompiledKernel]:
    """Compile every kernel for each arch (and each of ``warps``; default: the launch's)."""
    import triton  # optional dependency: triton
    from triton.backends.compiler import GPUTarget  # optional dependency: triton
    from triton.compiler import ASTSource, make_backend  # optional dependency: triton

    for arch in archs:
        if arch not in ARCHS:
            raise CompileCheckError(f"arch {arch}: choose from {sorted(ARCHS)}")
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        for name, (fn, fixed, variants, launch_warps) in _kernels().items():
            for element, n16 in itertools.product(elements, (True, False)):
                signature, attrs = _signature(fn, element, n16)
                for variant in variants:
                    for w in warps or (launch_warps,):
                        options = backend.parse_options({"num_warps": w}).__dict__
                        src = ASTSource(fn=fn, signature=signature, constexprs={**fixed, **variant}, attrs=attrs)
                        try:
                            compiled = triton.compile(src, target=target, options=options)
                        except Exception as exc:
                            raise CompileCheckError(f"{name} ({element}, {variant or 'one variant'}, "
                                                    f"n{' % 16 == 0' if n16 else ' any'}, sm_{arch}, {w} warps) "
                                                    f"does not compile: {exc}") from exc
                        res = cubin_resources(compiled.asm["cubin"])
                        yield CompiledKernel(
                            kernel=name, element=element,
                            variant=",".join(f"{k}={v}" for k, v in variant.items()) or "-",
                            n_multiple_of_16=n16, arch=arch, warps=w, registers=res["REG"], stack_bytes=res["STACK"],
                            local_bytes=res["LOCAL"], shared_bytes=res["SHARED"],
                            cubin_bytes=len(compiled.asm["cubin"]),
                            occupancy=register_limited_occupancy(res["REG"], w, ARCHS[arch]),
                        )


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers") from None


def warps_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated warps per program, each a power of two from 1 to 32
    (a program is at most 1024 threads). Shared with ``gpu_bench --diff-warps``."""
    warps = _ints(text)
    if any(w < 1 or w & (w - 1) or w > 32 for w in warps):
        raise argparse.ArgumentTypeError(f"{text!r}: each must be a power of two from 1 to 32")
    return warps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=_ints, default=(80, 90), help="compute capabilities, e.g. 80,90 (A100, H100/H200)")
    ap.add_argument("--warps", type=warps_list, default=None, help="warps per program to try (default: the launch's)")
    ap.add_argument("--element", action="append", choices=ELEMENTS, help="element views (default: all)")
    ap.add_argument("--json", action="store_true", help="one JSON object per compiled kernel instead of a table")
    args = ap.parse_args(argv)
    try:
        rows = []
        if not args.json:
            print(f"{'kernel':12s} {'elem':4s} {'variant':12s} {'n%16':>4s} {'arch':>5s} {'warps':>5s} {'regs':>5s} "
                  f"{'stack':>5s} {'local':>5s} {'shared':>6s} {'occup.':>6s}")
        for row in compile_kernels(args.arch, args.warps, tuple(args.element or ELEMENTS)):
            rows.append(row)
            if args.json:
                print(json.dumps({**asdict(row), "spills": row.spills}), flush=True)
            else:
                print(f"{row.kernel:12s} {row.element:4s} {row.variant:12s} {'0' if row.n_multiple_of_16 else 'any':>4s} "
                      f"{'sm_' + str(row.arch):>5s} {row.warps:5d} "
                      f"{row.registers:5d} {row.stack_bytes:5d} {row.local_bytes:5d} {row.shared_bytes:6d} "
                      f"{row.occupancy:6.0%}", flush=True)
    except CompileCheckError as exc:
        print(f"triton_compile: {exc}", file=sys.stderr)
        return 1
    if not args.json:
        spilled = [r for r in rows if r.spills]
        print(f"{len(rows)} kernels compiled; {len(spilled)} use stack or local memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
