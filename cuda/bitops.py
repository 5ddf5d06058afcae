"""Bit intrinsics for the numba kernels, emitted as LLVM IR: count trailing/leading zeros,
population count, 64-element change masks (``ne_mask64``, ``cast_ne_mask64``, ``mag_ge_mask64``),
symbol compress/lane stores, unaligned little-endian loads and stores, a prefetch hint and byte
copies. Results are the same on every CPU; only the instruction count differs.

Invariants: ``cttz64(0)`` and ``ctlz64(0)`` are undefined (callers pass non-zero masks);
``prefetch64`` changes no result. Mask, load, store and ``move_bytes`` do no bounds check: the
caller proves the range lies inside each 1-d C-contiguous array (``range_fits`` before a
``prange`` loop, whose body must not raise); ``copy_bytes`` checks its ranges.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import llvmlite.binding as llvm_binding
import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils, errors
from numba.extending import intrinsic

# Imported before ``copy_bytes`` is defined: it registers the cache locator that stamps a kernel
# with every numba source of the package (``jit``'s docstring).
import weftboard.cuda.jit  # noqa: F401, E402


def _uint64_intrinsic(emit: Callable[[Any, Any], Any], doc: str) -> Any:
    """A numba intrinsic ``uint64 -> uint64`` whose body is ``emit(builder, value)``."""

    def typer(_typingctx, x):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            return emit(builder, args[0])

        return types.uint64(types.uint64), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


_ZERO_IS_POISON = ir.Constant(ir.IntType(1), 1)  # the argument is never 0 (see the invariant)

cttz64 = _uint64_intrinsic(lambda b, v: b.cttz(v, _ZERO_IS_POISON), "Index of the lowest set bit of a non-zero uint64.")
ctlz64 = _uint64_intrinsic(lambda b, v: b.ctlz(v, _ZERO_IS_POISON), "Number of leading zero bits of a non-zero uint64.")
ctpop64 = _uint64_intrinsic(lambda b, v: b.ctpop(v), "Number of set bits of a uint64.")
cttz64z = _uint64_intrinsic(lambda b, v: b.cttz(v, ir.Constant(ir.IntType(1), 0)),
                            "Index of the lowest set bit of a uint64, 64 for 0 (one ``tzcnt`` with BMI1).")


@intrinsic
def ne_mask64(_typingctx, a, a_start, b, _b_start):  # type: ignore[no-untyped-def]
    """Bit j set iff ``a[a_start + j] != b[b_start + j]`` (j < 64), compared as integers."""
    for ary in (a, b):
        if not isinstance(ary, types.Array) or ary.ndim != 1 or ary.layout != "C" or not isinstance(ary.dtype, types.Integer):
            raise errors.TypingError(f"ne_mask64 needs 1-d C-contiguous integer arrays, got {ary}")
    if a.dtype.bitwidth != b.dtype.bitwidth:
        raise errors.TypingError(f"ne_mask64 needs one element width, got {a.dtype} and {b.dtype}")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        vec = ir.VectorType(ir.IntType(signature.args[0].dtype.bitwidth), 64)
        loaded = []
        for ty, value, start in ((signature.args[0], args[0], args[1]), (signature.args[2], args[2], args[3])):
            data = context.make_array(ty)(context, builder, value).data
            ptr = builder.bitcast(builder.gep(data, [start]), vec.as_pointer())
            loaded.append(builder.load(ptr, align=1))
        return builder.bitcast(builder.icmp_unsigned("!=", *loaded), ir.IntType(64))

    return types.uint64(a, types.int64, b, types.int64), codegen


def _check_flat(ary: Any, dtype: Any, what: str) -> None:
    if not isinstance(ary, types.Array) or ary.ndim != 1 or ary.layout != "C" or ary.dtype != dtype:
        raise errors.TypingError(f"{what} needs a 1-d C-contiguous {dtype} array, got {ary}")


def _load64(context: Any, builder: Any, aryty: Any, ary: Any, start: Any, bits: int) -> Any:
    vec = ir.VectorType(ir.IntType(bits), 64)
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.load(builder.bitcast(builder.gep(data, [start]), vec.as_pointer()), align=1)


def _splat(bits: int, value: int) -> Any:
    return ir.Constant(ir.VectorType(ir.IntType(bits), 64), [value] * 64)


@intrinsic
def cast_ne_mask64(_typingctx, a, a_start, src, _src_start):  # type: ignore[no-untyped-def]
    """Bit j set iff the bf16 bits ``a[a_start + j]`` differ from the round-to-nearest-even
    bf16 of the fp32 bits ``src[src_start + j]`` (j < 64); NaN and subnormal inputs are
    ``cast_special64``'s business (torch's own casts disagree on them)."""
    # ``a`` may be any unsigned width so that a kernel generic over widths type-checks; its
    # elements are compared with the bf16 bits zero-extended (only uint16 is meaningful).
    if not isinstance(a, types.Array) or not isinstance(a.dtype, types.Integer):
        raise errors.TypingError(f"cast_ne_mask64 needs an integer array, got {a}")
    _check_flat(a, a.dtype, "cast_ne_mask64")
    _check_flat(src, types.uint32, "cast_ne_mask64")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        width = signature.args[0].dtype.bitwidth
        old = _load64(context, builder, signature.args[0], args[0], args[1], width)
        u = _load64(context, builder, signature.args[2], args[2], args[3], 32)
        lsb = builder.and_(builder.lshr(u, _splat(32, 16)), _splat(32, 1))
        rounded = builder.lshr(builder.add(builder.add(u, _splat(32, 0x7FFF)), lsb), _splat(32, 16))
        new = builder.trunc(rounded, ir.VectorType(ir.IntType(16), 64))
        if width != 16:
            new = builder.zext(new, old.type) if width > 16 else builder.trunc(new, old.type)
        return builder.bitcast(builder.icmp_unsigned("!=", old, new), ir.IntType(64))

    return types.uint64(a, types.int64, src, types.int64), codegen


@intrinsic
def cast_special64(_typingctx, src, _src_start):  # type: ignore[no-untyped-def]
    """Non-zero iff one of the 64 fp32 bits from ``src[src_start]`` is a NaN or a non-zero
    subnormal."""
    _check_flat(src, types.uint32, "cast_special64")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        u = _load64(context, builder, signature.args[0], args[0], args[1], 32)
        mag = builder.and_(u, _splat(32, 0x7FFFFFFF))
        nan = builder.icmp_unsigned(">", mag, _splat(32, 0x7F800000))
        sub = builder.icmp_unsigned("<", builder.sub(mag, _splat(32, 1)), _splat(32, 0x007FFFFF))
        return builder.bitcast(builder.or_(nan, sub), ir.IntType(64))

    return types.uint64(src, types.int64), codegen


@intrinsic
def mag_ge_mask64(_typingctx, a, a_start, threshold):  # type: ignore[no-untyped-def]
    """Bit j set iff the magnitude bits of the 16-bit float ``a[a_start + j]`` (sign cleared)
    are >= ``threshold``: for bf16 and fp16 that is ``|value| >=`` the value with those bits
    (NaNs count as the largest), the class boundary of the context-coded patch streams."""
    _check_flat(a, types.uint16, "mag_ge_mask64")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        x = _load64(context, builder, signature.args[0], args[0], args[1], 16)
        mag = builder.and_(x, _splat(16, 0x7FFF))
        t = builder.trunc(context.cast(builder, args[2], signature.args[2], types.int64), ir.IntType(16))
        tv = builder.insert_element(ir.Constant(ir.VectorType(ir.IntType(16), 64), ir.Undefined), t,
                                    ir.Constant(ir.IntType(32), 0))
        splat = builder.shuffle_vector(tv, tv, ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64))
        return builder.bitcast(builder.icmp_unsigned(">=", mag, splat), ir.IntType(64))

    return types.uint64(a, types.int64, threshold), codegen


if sys.byteorder != "little":  # the streams are little-endian; these move native words
    raise ImportError("weftboard's CPU codec kernels need a little-endian machine")


@intrinsic
def load_u64le(_typingctx, buf, pos):  # type: ignore[no-untyped-def]
    """The 8 bytes ``buf[pos : pos + 8]`` as a little-endian uint64, in one unaligned load
    (byte loads that numba wraps in negative-index checks do not merge). No bounds check."""
    _check_flat(buf, types.uint8, "load_u64le")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        return builder.load(ptr, align=1)

    return types.uint64(buf, types.int64), codegen


@intrinsic
def _pointer_like(_typingctx, address, like):  # type: ignore[no-untyped-def]
    """``address`` as a pointer to elements of ``like``'s dtype (``array_at``)."""
    if not isinstance(address, types.Integer) or not isinstance(like, types.Array):
        raise errors.TypingError(f"_pointer_like needs an integer address and an array, got {address}, {like}")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return types.CPointer(like.dtype)(address, like), codegen


@numba.njit(inline="always", cache=True)
def array_at(address, n, like):  # type: ignore[no-untyped-def]
    """The ``n`` elements of ``like``'s dtype at ``address`` as a 1-d C-contiguous array, the
    same numba type as ``like`` when ``like`` is one (so kernels typed for it compile nothing
    new). For one kernel call over many arrays (``tile_encode.encode_huffman_batch``): a list of
    arrays would be boxed element by element. No reference is held and nothing is checked:
    the caller passes addresses and sizes of arrays it keeps alive for the call."""
    return numba.carray(_pointer_like(address, like), n)


@intrinsic
def prefetch64(_typingctx, ary, start):  # type: ignore[no-untyped-def]
    """Ask the CPU to start loading the cache lines of the 64 elements ``ary[start:]`` (1, 2,
    4 or 8 lines of 64 bytes, by the element width) into every cache level: ``prefetcht0``
    on x86-64. A hint, never a fault, so ``start`` may run past the end of the array.

    Why: the scans read two arrays once, front to back, and between two blocks' loads do
    enough work (packing, counting) that the hardware prefetcher alone leaves them waiting
    on memory, most of all on a busy shared host (see ``tile_blocks.PREFETCH_AHEAD``)."""
    if not isinstance(ary, types.Array) or ary.ndim != 1 or ary.layout != "C" or not isinstance(ary.dtype, types.Integer):
        raise errors.TypingError(f"prefetch64 needs a 1-d C-contiguous integer array, got {ary}")
    lines = ary.dtype.bitwidth // 8  # 64 elements of w bytes fill w lines of 64 bytes

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        first = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        for line in range(lines):
            # (address, read, keep in all levels, data cache)
            at = builder.gep(first, [ir.Constant(ir.IntType(64), 64 * line)])
            builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(ary, types.int64), codegen


def _store_intrinsic(bits: int, big_endian: bool = False) -> Any:
    """A numba intrinsic ``(buf, pos, value)`` storing the low ``bits`` of ``value`` at
    ``buf[pos : pos + bits // 8]``, little-endian (or big-endian: one byte-swapping store,
    ``movbe`` where the CPU has it), in one unaligned store. No bounds check."""
    name = f"store_u{bits}{'be' if big_endian else 'le'}"

    def typer(_typingctx, buf, pos, value):  # type: ignore[no-untyped-def]
        _check_flat(buf, types.uint8, name)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(bits).as_pointer())
            value = builder.trunc(context.cast(builder, args[2], signature.args[2], types.int64), ir.IntType(bits))
            if big_endian:
                value = builder.bswap(value)
            builder.store(value, ptr, align=1)
            return context.get_dummy_value()

        return types.none(buf, types.int64, value), codegen

    typer.__name__ = name
    return intrinsic(typer)


store_u32le = _store_intrinsic(32)
store_u64le = _store_intrinsic(64)
store_u16be = _store_intrinsic(16, big_endian=True)


@intrinsic
def _move_bytes(_typingctx, dst, d0, src, s0, n):  # type: ignore[no-untyped-def]
    """``dst[d0:d0 + n] = src[s0:s0 + n]`` as one ``llvm.memmove``; no bounds check."""
    _check_flat(dst, types.uint8, "copy_bytes")
    _check_flat(src, types.uint8, "copy_bytes")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        to = builder.gep(context.make_array(signature.args[0])(context, builder, args[0]).data, [args[1]])
        at = builder.gep(context.make_array(signature.args[2])(context, builder, args[2]).data, [args[3]])
        cgutils.raw_memmove(builder, to, at, args[4], 1)
        return context.get_dummy_value()

    return types.none(dst, types.int64, src, types.int64, types.int64), codegen


@numba.njit(inline="always", cache=True)
def range_fits(ary, start, n):  # type: ignore[no-untyped-def]
    """Whether ``ary[start:start + n]`` is ``n >= 0`` elements inside ``ary``."""
    return n >= 0 and start >= 0 and start + n <= ary.size


@numba.njit(inline="always", cache=True)
def move_bytes(dst, d0, src, s0, n):  # type: ignore[no-untyped-def]
    """``copy_bytes`` without its bounds check, for a ``prange`` loop's body: numba does not
    parallelise a loop that can raise, so the caller checks each range with ``range_fits``
    before the loop."""
    if n > 0:
        _move_bytes(dst, d0, src, s0, n)


@numba.njit(inline="always", cache=True)
def copy_bytes(dst, d0, src, s0, n):  # type: ignore[no-untyped-def]
    """``dst[d0:d0 + n] = src[s0:s0 + n]`` for 1-d uint8 arrays, as one ``memmove`` (the ranges
    may overlap). Raises IndexError when a range is not inside its array.

    Why not the slice assignment: numba compiles it to a loop over the elements behind an
    overlap check, about 2 GB/s on one thread where the C library's copy runs at 13 GB/s:
    the assembly of a stream's tile pieces took 0.8 ms instead of 0.11 ms for the codec bench's
    largest tensor (1.45 MB of stream)."""
    if not (range_fits(dst, d0, n) and range_fits(src, s0, n)):
        raise IndexError("copy_bytes: a range lies outside its array")
    move_bytes(dst, d0, src, s0, n)


def _host_has_vector_compress() -> bool:
    """Whether the kernels are compiled for a CPU with byte and word compress-stores."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:  # a chosen target (e.g. a portable cache)
        return False
    try:
        features = llvm_binding.get_host_cpu_features()
    except RuntimeError:  # LLVM cannot tell on this host
        return False
    return bool(features.get("avx512vbmi2")) and bool(features.get("avx512bw"))


HAS_VECTOR_COMPRESS = _host_has_vector_compress()

# Largest |difference| a symbol codes and the escape symbol (weftboard.cuda.entropy's
# MAX_DELTA and ESC; repeated here because entropy imports these intrinsics' module family
# and the stream format fixes both).
_MAX_DELTA = 64
_ESC = 2 * _MAX_DELTA


def _compress_into(builder: Any, vec: Any, ptr: Any, mask: Any) -> None:
    """The lanes of ``vec`` whose bit is set in the integer ``mask`` (as wide as ``vec`` has
    lanes), packed in lane order into a register (``llvm.experimental.vector.compress``:
    ``vpcompressb``/``vpcompressw`` to a register with VBMI2), then one plain store of the
    whole vector at ``ptr``: the lanes past the packed ones are scratch the next block
    overwrites, so ``ptr`` needs room for every lane. Not ``llvm.masked.compressstore``: its
    memory form of ``vpcompress`` is microcoded on AMD Zen 4 (the codec bench's encode ran at
    1.1-1.4 GB/s with it on such a host, against 5-6 GB/s for the lane walk)."""
    n = vec.type.count
    bits = ir.VectorType(ir.IntType(1), n)
    fnty = ir.FunctionType(vec.type, [vec.type, bits, vec.type])
    fn = cgutils.get_or_insert_function(builder.module, fnty,
                                        f"llvm.experimental.vector.compress.v{n}i{vec.type.element.width}")
    packed = builder.call(fn, [vec, builder.bitcast(mask, bits), ir.Constant(vec.type, ir.Undefined)])
    builder.store(packed, builder.bitcast(ptr, vec.type.as_pointer()), align=1)


def _compress_store(builder: Any, vec: Any, ptr: Any, mask: Any) -> None:
    """The 64 lanes of ``vec`` whose bit is set in the uint64 ``mask``, packed in lane order
    at ``ptr``, which has room for 64 lanes. A vector wider than 512 bits (64 words) goes in
    two halves, the second stored after the first's packed lanes: LLVM would otherwise split
    one compress of an illegal width through a stack slot, lane by lane."""
    if vec.type.element.width == 8:
        _compress_into(builder, vec, ptr, mask)
        return
    half = ir.IntType(32)
    low_mask = builder.trunc(mask, half)
    high_mask = builder.trunc(builder.lshr(mask, ir.Constant(mask.type, 32)), half)
    lanes = ir.VectorType(ir.IntType(32), 32)
    undef = ir.Constant(vec.type, ir.Undefined)
    low = builder.shuffle_vector(vec, undef, ir.Constant(lanes, list(range(32))))
    high = builder.shuffle_vector(vec, undef, ir.Constant(lanes, list(range(32, 64))))
    _compress_into(builder, low, ptr, low_mask)
    _compress_into(builder, high, builder.gep(ptr, [builder.zext(builder.ctpop(low_mask), ir.IntType(64))]), high_mask)


def _vsplat(builder: Any, value: Any, bits: int) -> Any:
    vty = ir.VectorType(ir.IntType(bits), 64)
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64))


def _array_ptr(context: Any, builder: Any, aryty: Any, ary: Any, start: Any) -> Any:
    return builder.gep(context.make_array(aryty)(context, builder, ary).data, [start])


def _plain_new_bits(context: Any, builder: Any, sig: Any, args: Any, bits: int) -> Any:
    """The 64 new elements of a plain block: ``args[2][args[3]:]``, at their own width."""
    return _load64(context, builder, sig.args[2], args[2], args[3], bits)


def _cast_new_bits(context: Any, builder: Any, sig: Any, args: Any, bits: int) -> Any:
    """The 64 new elements of a cast block: the round-to-nearest-even bf16 of the fp32 bits
    ``args[2][args[3]:]`` (as ``cast_ne_mask64``), at the old elements' width."""
    u = _load64(context, builder, sig.args[2], args[2], args[3], 32)
    lsb = builder.and_(builder.lshr(u, _splat(32, 16)), _splat(32, 1))
    rounded = builder.lshr(builder.add(builder.add(u, _splat(32, 0x7FFF)), lsb), _splat(32, 16))
    new = builder.trunc(rounded, ir.VectorType(ir.IntType(16), 64))
    if bits > 16:
        return builder.zext(new, ir.VectorType(ir.IntType(bits), 64))
    return builder.trunc(new, ir.VectorType(ir.IntType(bits), 64)) if bits < 16 else new


def _fold_codegen(new_vector: Callable[[Any, Any, Any, Any, int], Any]) -> Callable[..., Any]:
    """Codegen of the two ``*fold64``: ``llvm.masked.store`` of the block's new bits (the
    name's pointer suffix is the opaque-pointer one; LLVM remangles it for typed pointers)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        a_ty = sig.args[0]
        bits = a_ty.dtype.bitwidth
        vty = ir.VectorType(ir.IntType(bits), 64)
        lanes = ir.VectorType(ir.IntType(1), 64)
        ptr = builder.bitcast(_array_ptr(context, builder, a_ty, args[0], args[1]), vty.as_pointer())
        fnty = ir.FunctionType(ir.VoidType(), [vty, ptr.type, ir.IntType(32), lanes])
        fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.masked.store.v64i{bits}.p0")
        builder.call(fn, [new_vector(context, builder, sig, args, bits), ptr, ir.Constant(ir.IntType(32), 1),
                          builder.bitcast(args[4], lanes)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def lanes_compress64(_typingctx, pos, pos_at, base, m):  # type: ignore[no-untyped-def]
    """``base + j`` (uint16) for each set bit ``j`` of ``m``, packed in order at ``pos[pos_at:]``,
    which needs room for 64 lanes (``_compress_store``): a bitmap word's set lanes as numbers."""
    _check_flat(pos, types.uint16, "lanes_compress64")

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        lanes = ir.Constant(ir.VectorType(ir.IntType(16), 64), list(range(64)))
        vec = builder.add(lanes, _vsplat(builder, builder.trunc(args[2], ir.IntType(16)), 16))
        _compress_store(builder, vec, _array_ptr(context, builder, sig.args[0], args[0], args[1]), args[3])
        return context.get_dummy_value()

    return types.none(pos, types.int64, types.int64, types.uint64), codegen


@intrinsic
def fold64(_typingctx, a, a_start, b, _b_start, m):  # type: ignore[no-untyped-def]
    """``a[a_start + j] = b[b_start + j]`` for the lanes j set in ``m``, in one masked store."""
    _check_elements(a, "fold64")
    _check_flat(b, a.dtype, "fold64")
    return types.none(a, types.int64, b, types.int64, types.uint64), _fold_codegen(_plain_new_bits)


@intrinsic
def cast_fold64(_typingctx, a, a_start, src, _src_start, m):  # type: ignore[no-untyped-def]
    """``fold64`` of the bf16 cast of the fp32 bits ``src[src_start:]``."""
    _check_elements(a, "cast_fold64")
    _check_flat(src, types.uint32, "cast_fold64")
    return types.none(a, types.int64, src, types.int64, types.uint64), _fold_codegen(_cast_new_bits)


def _block_symbols(context: Any, builder: Any, sig: Any, args: Any,
                   new_vector: Callable[[Any, Any, Any, Any, int], Any]) -> Any:
    """The 64 symbols, as bytes, of the block ``args[0][args[1]:]`` against ``new_vector``'s
    new bits: each lane as ``entropy.symbol`` computes it one at a time."""
    bits = sig.args[0].dtype.bitwidth
    old = _load64(context, builder, sig.args[0], args[0], args[1], bits)
    d = builder.sub(new_vector(context, builder, sig, args, bits), old)
    neg = builder.lshr(d, _splat(bits, bits - 1))
    mag = builder.add(builder.xor(d, builder.sub(_splat(bits, 0), neg)), neg)
    mag1 = builder.sub(mag, _splat(bits, 1))
    coded = builder.icmp_unsigned("<", mag1, _splat(bits, _MAX_DELTA))
    sym = builder.select(coded, builder.or_(builder.shl(mag1, _splat(bits, 1)), neg), _splat(bits, _ESC))
    return builder.trunc(sym, ir.VectorType(ir.IntType(8), 64)) if bits > 8 else sym


def _in_register(builder: Any, value: Any) -> Any:
    """``value`` (an integer) through an empty inline asm, which pins where it is computed: left
    alone, LLVM sinks a mask's vector compare and bitcast to the mask's first use, after the
    caller's packing loop, and a <64 x i1> value live across blocks is lowered on AVX2 as 64
    separate bytes reassembled one ``vpinsrb`` at a time. No instruction is emitted."""
    fnty = ir.FunctionType(value.type, [value.type])
    return builder.asm(fnty, "", "=r,0", [value], side_effect=True)


def _symbol_masks(builder: Any, m: Any, sym8: Any) -> tuple[Any, Any, Any]:
    """The (escaped, symbol 1, symbol >= 2) masks of a block's changed lanes ``m``, from the
    symbols as bytes (a coded symbol is below ESC = 128): on AVX2 one byte compare and one
    ``pmovmskb`` per 32 lanes each."""

    def lanes_where(pred: str, value: int) -> Any:
        bits = builder.bitcast(builder.icmp_unsigned(pred, sym8, _splat(8, value)), ir.IntType(64))
        return builder.and_(_in_register(builder, bits), m)

    return lanes_where("==", _ESC), lanes_where("==", 1), lanes_where(">=", 2)


def _sym_compress_codegen(new_vector: Callable[[Any, Any, Any, Any, int], Any]) -> Callable[..., Any]:
    """Codegen shared by the two ``*sym_compress64``: ``new_vector(context, builder, sig,
    args, bits)`` gives the block's new bits at the old bits' width."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        sym_ty, pos_ty, rare_ty = sig.args[5], sig.args[7], sig.args[10]
        sym8 = _block_symbols(context, builder, sig, args, new_vector)
        m = args[4]
        _compress_store(builder, sym8, _array_ptr(context, builder, sym_ty, args[5], args[6]), m)
        lanes = ir.Constant(ir.VectorType(ir.IntType(16), 64), list(range(64)))
        base = _vsplat(builder, builder.trunc(args[9], ir.IntType(16)), 16)
        _compress_store(builder, builder.add(lanes, base), _array_ptr(context, builder, pos_ty, args[7], args[8]), m)
        esc, one, rare = _symbol_masks(builder, m, sym8)
        _compress_store(builder, sym8, _array_ptr(context, builder, rare_ty, args[10], args[11]), rare)
        return context.make_tuple(builder, sig.return_type, [esc, one, rare])

    return codegen


def _sym_lanes_codegen(new_vector: Callable[[Any, Any, Any, Any, int], Any]) -> Callable[..., Any]:
    """Codegen shared by the two ``*sym_lanes64``: one plain store of all 64 symbols."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        sym8 = _block_symbols(context, builder, sig, args, new_vector)
        ptr = _array_ptr(context, builder, sig.args[5], args[5], ir.Constant(ir.IntType(64), 0))
        builder.store(sym8, builder.bitcast(ptr, sym8.type.as_pointer()), align=1)
        esc, one, rare = _symbol_masks(builder, args[4], sym8)
        return context.make_tuple(builder, sig.return_type, [esc, one, rare])

    return codegen


def _check_elements(a: Any, what: str) -> None:
    if not isinstance(a, types.Array) or not isinstance(a.dtype, types.Integer) or a.dtype.bitwidth not in (8, 16, 32):
        raise errors.TypingError(f"{what} needs 8, 16 or 32-bit integer elements, got {a}")
    _check_flat(a, a.dtype, what)


def _check_sym_compress(a: Any, sym: Any, pos: Any, rare: Any) -> None:
    _check_elements(a, "sym_compress64")
    _check_flat(sym, types.uint8, "sym_compress64 (symbols)")
    _check_flat(pos, types.uint16, "sym_compress64 (positions)")
    _check_flat(rare, types.uint8, "sym_compress64 (rare symbols)")


_SYM_COMPRESS_RESULT = types.UniTuple(types.uint64, 3)


@intrinsic
def sym_compress64(_typingctx, a, a_start, b, _b_start, m, sym, sym_at, pos, pos_at, base, rare, rare_at):  # type: ignore[no-untyped-def]
    """For the changed lanes ``m`` of the 64 elements at ``a[a_start]``/``b[b_start]``: the
    symbol of each difference ``b - a`` packed at ``sym[sym_at:]``, its position ``base +
    lane`` (uint16) at ``pos[pos_at:]``, the symbols >= 2 again at ``rare[rare_at:]``;
    returns the masks (escaped, symbol 1, symbol >= 2). Each output needs room for 64."""
    _check_sym_compress(a, sym, pos, rare)
    _check_flat(b, a.dtype, "sym_compress64")

    sig = _SYM_COMPRESS_RESULT(a, types.int64, b, types.int64, types.uint64, sym, types.int64, pos, types.int64,
                               types.int64, rare, types.int64)
    return sig, _sym_compress_codegen(_plain_new_bits)


@intrinsic
def cast_sym_compress64(_typingctx, a, a_start, src, _src_start, m, sym, sym_at, pos, pos_at, base, rare, rare_at):  # type: ignore[no-untyped-def]
    """``sym_compress64`` with the new bits the round-to-nearest-even bf16 of the fp32 bits
    ``src[src_start:]`` (as ``cast_ne_mask64``; ``a`` holds bf16 bits)."""
    _check_sym_compress(a, sym, pos, rare)
    _check_flat(src, types.uint32, "cast_sym_compress64")

    sig = _SYM_COMPRESS_RESULT(a, types.int64, src, types.int64, types.uint64, sym, types.int64, pos, types.int64,
                               types.int64, rare, types.int64)
    return sig, _sym_compress_codegen(_cast_new_bits)


@intrinsic
def sym_lanes64(_typingctx, a, a_start, b, _b_start, m, lanes):  # type: ignore[no-untyped-def]
    """``sym_compress64`` without the packing, for CPUs without compress-stores: the symbol
    of every one of the 64 lanes (changed or not) at ``lanes[0:64]`` in one vector store;
    returns the same masks. The caller packs the changed lanes (``cttz64z`` walks)."""
    _check_elements(a, "sym_lanes64")
    _check_flat(b, a.dtype, "sym_lanes64")
    _check_flat(lanes, types.uint8, "sym_lanes64 (lanes)")
    sig = _SYM_COMPRESS_RESULT(a, types.int64, b, types.int64, types.uint64, lanes)
    return sig, _sym_lanes_codegen(_plain_new_bits)


@intrinsic
def cast_sym_lanes64(_typingctx, a, a_start, src, _src_start, m, lanes):  # type: ignore[no-untyped-def]
    """``sym_lanes64`` with the new bits the round-to-nearest-even bf16 of the fp32 bits
    ``src[src_start:]``."""
    _check_elements(a, "cast_sym_lanes64")
    _check_flat(src, types.uint32, "cast_sym_lanes64")
    _check_flat(lanes, types.uint8, "cast_sym_lanes64 (lanes)")
    sig = _SYM_COMPRESS_RESULT(a, types.int64, src, types.int64, types.uint64, lanes)
    return sig, _sym_lanes_codegen(_cast_new_bits)

