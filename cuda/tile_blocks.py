"""Inlined building blocks of the tile scan kernels: 64-element change masks, the bf16 cast,
symbol and escape packing, and the Rice parameter and grouped Rice writer of a tile.

Invariants: every function here is ``inline="always"`` (or a numba ``overload``) so the scan
kernels that call them compile into one loop; a tile's Rice parameter is the closed-form
optimum for geometric gaps at the tile's mean gap, so choosing it needs no pass over the gaps.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
from numba import types
from numba.extending import overload

from weftboard.cuda import entropy
from weftboard.cuda.bitops import (
    HAS_VECTOR_COMPRESS,
    cast_ne_mask64,
    cast_special64,
    ctlz64,
    ctpop64,
    cttz64,
    cttz64z,
    lanes_compress64,
    ne_mask64,
)
from weftboard.cuda.block_ops import block_sym_compress64, block_sym_lanes64
from weftboard.cuda.entropy import MAX_K, NSYM

_LOG_PHI_M1 = math.log((math.sqrt(5.0) - 1.0) / 2.0)  # log(golden ratio - 1)
RICE_SLACK = 64  # bytes per tile beyond one byte per element in the Rice scratch
# Pack a block's changes with compress-stores where the CPU has them, with ``_pack_lanes``
# walks elsewhere (``scan_encode_tiles_packed``; the bytes are the same).
VECTOR_COMPRESS = HAS_VECTOR_COMPRESS
# How far ahead of the block it compares the packed scan asks for the old and new elements
# (``bitops.prefetch64``), in elements: 1 KiB of bf16. Alternating in one process on the
# codec bench's bf16 tensors (2 threads, AVX2 host), 256 to 4096 all ran the scan 3-10%
# faster than none (more when the host was busy), 256-512 best; the bytes are the same.
PREFETCH_AHEAD = 512


@nb.njit(inline="always", cache=True)
def _elem_block(a, b, s, e):
    """Change mask of elements ``s .. e-1`` (at most 64), element by element."""
    m = np.uint64(0)
    for j in range(e - s):
        if a[s + j] != b[s + j]:
            m |= np.uint64(1) << np.uint64(j)
    return m


@nb.njit(inline="always", cache=True)
def block_mask(a, b, bs, e):
    """Change mask of elements ``bs .. min(bs + 64, e) - 1`` of two C-contiguous arrays of one
    width (``e`` at most their size): one vector compare for a whole block."""
    if bs + 64 <= e:
        return ne_mask64(a, bs, b, bs)
    return _elem_block(a, b, bs, e)


@nb.njit(inline="always", cache=True)
def rice_k(total_gap, n):
    """Optimal Rice parameter for geometric gaps of mean ``total_gap / n``."""
    if total_gap <= 0:
        return 0
    theta = total_gap / (total_gap + n)  # mean / (mean + 1)
    if theta >= 1.0:
        return MAX_K
    k = 1 + int(math.floor(math.log2(_LOG_PHI_M1 / math.log(theta))))
    return min(MAX_K, max(0, k))


@nb.njit(inline="always", cache=True)
def last_and_k(masks, last, cnt):
    """(position of a tile's last change, its Rice parameter), from its block masks, the
    last block with a change and the number of changes."""
    lastpos = 64 * last + 63 - np.int64(ctlz64(masks[last]))
    return lastpos, rice_k(lastpos + 1 - cnt, cnt)


@nb.njit(inline="always", cache=True)
def bf16_rne(u):
    """The bf16 bits of the fp32 bits ``u`` (uint32), rounded to nearest even: torch's cast
    for every finite and infinite value. NaN and fp32 subnormal inputs are not covered
    (torch's vector and scalar casts differ on NaN, and a cast may flush subnormals):
    ``cast_special`` finds them and callers leave those to torch."""
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@nb.njit(inline="always", cache=True)
def cast_special(u):
    """1 for the fp32 bits of a NaN or a non-zero subnormal, else 0."""
    mag = u & np.uint32(0x7FFFFFFF)
    # mag - 1 wraps for zero (the block path does the same in vectors: cast_special64)
    return np.uint32(mag > np.uint32(0x7F800000)) | np.uint32((mag - np.uint32(1)) < np.uint32(0x007FFFFF))


@nb.njit(inline="always", cache=True)
def new_element_bits(b, src, i, cast):
    """Element ``i`` of the new version: ``b[i]``, or (``cast``) the bf16 of ``src[i]``."""
    if cast:
        return np.uint64(bf16_rne(src[i]))
    return np.uint64(b[i])


@nb.njit(inline="always", cache=True)
def put_escape(sym_buf, q, d, width):
    """The raw difference ``d`` little-endian at ``sym_buf[q:q + width]``."""
    for c in range(width):
        sym_buf[q + c] = np.uint8((d >> np.uint64(8 * c)) & np.uint64(0xFF))


@nb.njit(inline="always", cache=True)
def scan_block(a, b, src, bs, e, cast):
    """(change mask, special) of elements ``bs .. min(bs + 64, e) - 1``: ``b`` against ``a``,
    or (``cast``) the bf16 cast of the fp32 bits ``src``, with ``special`` non-zero when one of
    those is a NaN or subnormal (``cast_special``)."""
    if not cast:
        return block_mask(a, b, bs, e), np.uint64(0)
    if bs + 64 <= e:
        return cast_ne_mask64(a, bs, src, bs), cast_special64(src, bs)
    m = np.uint64(0)
    special = np.uint64(0)
    for j in range(e - bs):
        u = src[bs + j]
        special |= np.uint64(cast_special(u))
        if np.uint64(a[bs + j]) != np.uint64(bf16_rne(u)):
            m |= np.uint64(1) << np.uint64(j)
    return m, special


@nb.njit(inline="always", cache=True)
def _pack_lanes(m, lanes, sym_buf, sym_at, pos, pos_at, base):
    """The symbols ``lanes[lane]`` and positions ``base + lane`` of the set lanes of ``m``,
    packed at ``sym_buf[sym_at:]`` and ``pos[pos_at:]``: eight lanes per round with no branch
    but the round's (a block at 1-10% density takes one or two rounds). A round past the last
    set lane writes lane 64 (``cttz64z(0)``: ``lanes`` holds 65 or more) into slots after the
    packed ones, at most ``pos_at + 64`` (the caller's rows have room; later blocks overwrite
    them)."""
    n = np.int64(ctpop64(m))
    i = 0
    while i < n:
        for _ in range(8):  # unsigned indices: no negative-index fix-ups (three instructions each)
            lane = cttz64z(m)
            sym_buf[np.uint64(sym_at + i)] = lanes[lane]
            pos[np.uint64(pos_at + i)] = base + np.int64(lane)
            m &= m - np.uint64(1)
            i += 1


@nb.njit(inline="always", cache=True)
def _pack_rare(rr, lanes, rare, at):
    """The symbols of the set lanes of ``rr`` (those >= 2: rare) at ``rare[at:]``. The first
    two go without a branch (a block holds none, one or two most of the time, a coin flip for
    a loop's exit); a slot past the last (lane 64's byte) is overwritten by the next block, and
    both lie inside ``rare``: it has 64 slots per block and ``at`` is at most 64 times the
    block's index."""
    rare[np.uint64(at)] = lanes[cttz64z(rr)]
    rr &= rr - np.uint64(1)
    rare[np.uint64(at + 1)] = lanes[cttz64z(rr)]
    rr &= rr - np.uint64(1)
    at += 2
    while rr != 0:
        rare[np.uint64(at)] = lanes[cttz64(rr)]
        rr &= rr - np.uint64(1)
        at += 1


@nb.njit(inline="always", cache=True)
def scan_results(ntiles):
    """A scan's per-tile results, zeroed: changes, Rice parameters, Rice bytes, escapes,
    overflowed flags and symbol histograms."""
    z = np.zeros(ntiles, np.int64)
    return z, z.copy(), z.copy(), z.copy(), z.copy(), np.zeros((ntiles, NSYM), np.int64)


def new_element(a, new, i):
    """Element ``i`` of the new version as uint64: ``new[i]``, or the bf16 cast of the fp32
    bits ``new[i]`` when ``new`` is the cast form (its dtype differs from ``a``'s)."""
    raise NotImplementedError("only callable from numba kernels")


@overload(new_element, inline="always", jit_options={"cache": True})
def _new_element(a, new, i):
    if a.dtype != new.dtype:
        return lambda a, new, i: np.uint64(bf16_rne(new[i]))
    return lambda a, new, i: np.uint64(new[i])


def special_element(a, new, i):
    """``cast_special`` of element ``i`` of a cast form; 0 for plain new bits."""
    raise NotImplementedError("only callable from numba kernels")


@overload(special_element, inline="always", jit_options={"cache": True})
def _special_element(a, new, i):
    if a.dtype != new.dtype:
        return lambda a, new, i: np.uint64(cast_special(new[i]))
    return lambda a, new, i: np.uint64(0)


def pack_block(a, bs, new, m, sym_buf, sym_at, pos, pos_at, base, rare, rare_at, lanes):
    """A block's symbols, positions and rare symbols packed; returns the (escaped, symbol 1,
    symbol >= 2) masks. ``lanes`` None: with compress-stores (``block_sym_compress64``);
    otherwise every lane's symbol goes to ``lanes`` in one vector store and ``_pack_lanes``
    packs the changed ones (CPUs without compress-stores). Chosen when the caller is typed."""
    raise NotImplementedError("only callable from numba kernels")


@overload(pack_block, inline="always", jit_options={"cache": True})
def _pack_block(a, bs, new, m, sym_buf, sym_at, pos, pos_at, base, rare, rare_at, lanes):
    if isinstance(lanes, types.NoneType):
        def compressed(a, bs, new, m, sym_buf, sym_at, pos, pos_at, base, rare, rare_at, lanes):
            return block_sym_compress64(a, bs, new, bs, m, sym_buf, sym_at, pos, pos_at, base, rare, rare_at)
        return compressed

    def walked(a, bs, new, m, sym_buf, sym_at, pos, pos_at, base, rare, rare_at, lanes):
        esc, one, rr = block_sym_lanes64(a, bs, new, bs, m, lanes)
        _pack_lanes(m, lanes, sym_buf, sym_at, pos, pos_at, base)
        _pack_rare(rr, lanes, rare, rare_at)
        return esc, one, rr
    return walked


@nb.njit(inline="always", cache=True)
def _rice_quad(codes, lens, j, rice_buf, q, acc, nbits):
    """Codes ``j .. j+3`` of ``rice_tile_grouped`` (each at most 28 bits) in one append of
    the byte writer, two when together they exceed 56 bits."""
    at1 = np.uint64(lens[np.uint64(j)])
    at2 = at1 + np.uint64(lens[np.uint64(j + 1)])
    at3 = at2 + np.uint64(lens[np.uint64(j + 2)])
    ln = at3 + np.uint64(lens[np.uint64(j + 3)])
    first = np.uint64(codes[np.uint64(j)]) | (np.uint64(codes[np.uint64(j + 1)]) << at1)
    second = np.uint64(codes[np.uint64(j + 2)]) | (np.uint64(codes[np.uint64(j + 3)]) << (at3 - at2))
    if ln > np.uint64(56):
        q, acc, nbits = entropy.bytes_put(rice_buf, q, acc, nbits, first, at2)
        return entropy.bytes_put(rice_buf, q, acc, nbits, second, ln - at2)
    return entropy.bytes_put(rice_buf, q, acc, nbits, first | (second << at2), ln)


@nb.njit(inline="always", cache=True)
def _rice_one(pos, j, k, codes, lens, rice_buf, q, acc, nbits):
    """Code ``j`` of ``rice_tile_grouped`` alone: from ``codes`` when it is at most 28 bits
    long, else from its gap (``entropy.rice_bytes_put``: ``codes`` holds no long code)."""
    ln = np.uint64(lens[np.uint64(j)])
    if ln <= np.uint64(28):
        return entropy.bytes_put(rice_buf, q, acc, nbits, np.uint64(codes[np.uint64(j)]), ln)
    g = np.uint64(pos[np.uint64(j)])
    if j > 0:
        g -= np.uint64(pos[np.uint64(j - 1)]) + np.uint64(1)
    return entropy.rice_bytes_put(rice_buf, q, acc, nbits, g, np.uint64(k))


@nb.njit(inline="always", cache=True)
def rice_tile_grouped(pos, cnt, k, rice_buf, p0, codes, lens):
    """The Rice bits of a tile's ``cnt`` >= 1 packed positions at ``rice_buf[p0:]``, in two
    passes: every code and its length first (a loop with no dependency between changes,
    which LLVM vectorises, in 64-bit lanes), then the appends, four codes at a time (two when
    they exceed 56 bits). Codes longer than 28 bits (gaps of ``(28 - k) << k`` or more: rare
    at random positions, common between the clusters of a clustered update) do not fit the
    groups: a tile with one appends its groups that hold one code by code, the long ones
    from their gaps. Returns the end of the flushed bits. ``codes`` and ``lens`` hold ``cnt``
    uint32 each; the caller guarantees that the bits and 8 bytes of slack fit. The same bits
    as ``entropy.rice_put`` (tests hold the two to the same bytes)."""
    one = np.uint32(1)
    k32 = np.uint32(k)
    lowmask = (one << k32) - one
    codes[0] = np.uint32(pos[0])
    for j in range(1, cnt):
        codes[np.uint64(j)] = np.uint32(pos[np.uint64(j)]) - np.uint32(pos[np.uint64(j - 1)]) - one
    longest = np.uint32(0)
    for j in range(cnt):
        g = codes[np.uint64(j)]
        u = g >> k32
        longest = max(longest, u)
        lens[np.uint64(j)] = u + one + k32
        # the shifts masked to 31 keep a long gap's code defined (and unused: ``_rice_one``)
        codes[np.uint64(j)] = ((one << (u & np.uint32(31))) - one) | ((g & lowmask) << ((u + one) & np.uint32(31)))
    q = p0
    acc = np.uint64(0)
    nbits = np.uint64(0)
    j = 0
    if np.int64(longest) + 1 + k <= 28:
        while j + 3 < cnt:
            q, acc, nbits = _rice_quad(codes, lens, j, rice_buf, q, acc, nbits)
            j += 4
    else:
        while j + 3 < cnt:
            group = max(max(lens[np.uint64(j)], lens[np.uint64(j + 1)]),
                        max(lens[np.uint64(j + 2)], lens[np.uint64(j + 3)]))
            if group <= np.uint32(28):
                q, acc, nbits = _rice_quad(codes, lens, j, rice_buf, q, acc, nbits)
            else:
                for i in range(j, j + 4):
                    q, acc, nbits = _rice_one(pos, i, k, codes, lens, rice_buf, q, acc, nbits)
            j += 4
    while j < cnt:
        q, acc, nbits = _rice_one(pos, j, k, codes, lens, rice_buf, q, acc, nbits)
        j += 1
    return entropy.rice_flush(rice_buf, q, np.int64(acc), np.int64(nbits))


@nb.njit(inline="always", cache=True)
def pack_word(out, at, base, x, lanes_like):
    """``base + j`` for each set bit ``j`` of the bitmap word ``x``, in order at ``out[at:]``
    (uint16): one compress-store when ``lanes_like`` is None (``out`` then needs room for 64
    lanes past ``at``), else a walk of the bits. Returns ``at`` past the packed numbers."""
    if lanes_like is None:
        lanes_compress64(out, at, base, x)
        return at + np.int64(ctpop64(x))
    while x:
        out[np.uint64(at)] = base + np.int64(cttz64(x))
        x &= x - np.uint64(1)
        at += 1
    return at
