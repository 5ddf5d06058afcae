"""Fused CPU kernels for the ``huffman`` (default) and ``sparse`` streams of one tensor.

The two streams differ only in how the value symbols are coded (canonical Huffman,
``weftboard.cuda.huffman``, or rANS); everything below is shared, and each function named
for ``sparse`` has a ``huffman`` twin where the coder matters (``encode_huffman``,
``finish_huffman``; ``apply_tiles`` and ``decode_tiles`` take either stream's tables).

``encode_sparse`` turns one read of the old and new stored bits into the finished stream (diff
and encode fused); ``encode_huffman_batch`` does it for several tensors of one element width
in one compiled call, each parallel pass over all their tiles at once (``codec.encode_patch``'s
path: one call's Python and dispatch per batch instead of per tensor);
``scan_tiles`` and ``finish_sparse`` split it for a caller that reads a tensor piece by piece
(the publisher, which also lets the scan fold the new bits into its view: ``update``);
``apply_tiles`` makes one pass over a stream and writes the tensor in place (decode and apply
fused); the same kernel with ``sign=-1`` takes a patch back out, and
``decode_tiles`` (the same kernel again) writes position and difference arrays instead, for
CUDA destinations. The bytes are exactly the layout ``weftboard.cuda.entropy`` documents, so
streams of the two-step encoder there decode here and the other way round (tests cross-check
both directions).

Why fused: the two-step path materialises an int64 position plus the old and new bits of every
change (12 bytes per change for bf16) and reads them back two or three times; at 1-10% density
that memory traffic, not the coding, is what costs. Here a tile is scanned 64 elements at a
time into change masks (one vector compare per block, ``bitops.ne_mask64``), and
``scan_encode_tiles_packed`` packs each block's symbols and positions (all 64 symbols are
computed in vectors; where the CPU has compress-stores, AVX-512 VBMI2, two instructions pack
them, elsewhere an unrolled count-trailing-zeros walk eight lanes a round), then Rice-codes
the packed positions: every code and its length in one vectorised loop, then the appends,
four codes per append (no branch per change, the bit writer's dependency chain paid once per
group); only the symbols (one byte each)
wait until the tensor's frequency table is known. ``scan_encode_tiles`` is the same scan as one walk of the masks
(each change coded on the spot), kept for 64-bit elements and tiles above 65536; tests hold
every path to the same bytes. rANS, whose every symbol waits on the previous one's multiply,
codes a tensor's tiles two at a time (``rans_encode_tile_pairs``) so that a core has two
independent chains to run; Huffman codes each tile in one pass of table lookups and appends.
In the decoder, the Rice reader and the value reader (rANS state, or a Huffman bit position)
are two independent chains per change; the Huffman one is about half as long. The apply of a
Huffman stream of 8- or 16-bit elements (the served formats) holds both readers' bits in
registers instead (``_apply_huffman_tile``), topped up once per group of four changes, so
neither chain waits on a load from the stream; every other form reads at bit positions, and a
test holds the two to the same verdicts.

Invariants:
- Tiles are independent and write only their own regions, so ``prange`` over tiles gives the
  same bytes for any number of threads.
- A scan with ``update`` folds a tile only if its output fit: a tile that overflows its
  scratch is left exactly as it was (and listed in ``TileScan.overflowed``), so the caller can
  still diff it.
- A tile's Rice parameter is the optimum for geometric gaps at the tile's mean gap (Gallager
  and Van Voorhis), a closed form, so choosing it needs no pass over the gaps.
- ``apply_tiles`` validates as it writes: it reports, per tile, how many changes it wrote
  before any error, so the caller can undo exactly those (``sign=-1``, ``limit=done``) and a
  corrupt stream never leaves a tensor half-patched.
- Scratch comes from ``torch.empty``, which (unlike numpy for large arrays) does not ask for
  transparent huge pages, so only the pages a tile actually writes are touched.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numba as nb
import numpy as np
import torch
from numba import types
from numba.extending import overload

from weftboard.cuda import entropy, huffman
from weftboard.cuda.bitops import (
    HAS_VECTOR_COMPRESS,
    array_at,
    block_fold64,
    block_ne_mask64,
    block_special64,
    block_sym_compress64,
    block_sym_lanes64,
    cast_ne_mask64,
    cast_special64,
    ctlz64,
    ctpop64,
    cttz64,
    cttz64z,
    load_u64le,
    move_bytes,
    ne_mask64,
    prefetch64,
    range_fits,
    store_u16be,
)
from weftboard.cuda.entropy import ESC, MAX_K, NSYM, RANS_L, SCALE_BITS
from weftboard.cuda.jit import parallel_kernel

_LOG_PHI_M1 = math.log((math.sqrt(5.0) - 1.0) / 2.0)  # log(golden ratio - 1)
_RICE_SLACK = 64  # bytes per tile beyond one byte per element in the Rice scratch
# Pack a block's changes with compress-stores where the CPU has them, with ``_pack_lanes``
# walks elsewhere (``scan_encode_tiles_packed``; the bytes are the same).
_VECTOR_COMPRESS = HAS_VECTOR_COMPRESS
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
def _last_and_k(masks, last, cnt):
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
def _new_bits(b, src, i, cast):
    """Element ``i`` of the new version: ``b[i]``, or (``cast``) the bf16 of ``src[i]``."""
    if cast:
        return np.uint64(bf16_rne(src[i]))
    return np.uint64(b[i])


@nb.njit(inline="always", cache=True)
def _put_escape(sym_buf, q, d, width):
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
def _scan_results(ntiles):
    """A scan's per-tile results, zeroed: changes, Rice parameters, Rice bytes, escapes,
    overflowed flags and symbol histograms."""
    z = np.zeros(ntiles, np.int64)
    return z, z.copy(), z.copy(), z.copy(), z.copy(), np.zeros((ntiles, NSYM), np.int64)


@parallel_kernel
def scan_encode_tiles(a, b, width, tile, rice_buf, rstride, sym_buf, update, src, cast):
    """Pass 1: per tile, change masks, then Rice-coded gaps, symbols and escapes.

    Tile ``t`` writes Rice bytes at ``rice_buf[t*rstride:]``, its symbols at
    ``sym_buf[2*t*tile:]`` and its escapes (raw differences, little-endian) at
    ``sym_buf[2*t*tile + tile:]``. A tile whose output would not fit sets ``over[t]`` (the
    caller then uses the two-step encoder) and counts none of its symbols; ``ns`` is exact
    either way. ``update``: every tile that does not overflow also writes ``b`` into ``a``
    where they differ (so the caller needs no copy), and an overflowing tile writes nothing.

    ``cast``: the new version is the bf16 cast of the fp32 bits ``src`` (``b`` is unused and
    ``a`` holds bf16 bits), computed as the tile is read, so the publisher never writes the
    cast out to read it back. A tile holding a NaN or a subnormal is left alone and set in
    ``over`` like a tile that did not fit: the caller casts and diffs it with torch.
    """
    numel = a.size
    ntiles = (numel + tile - 1) // tile
    ns, ks, rice_len, n_esc, over, hist = _scan_results(ntiles)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * width)
    wbits = np.uint64(8 * width - 1)
    for t in nb.prange(ntiles):
        s = t * tile
        e = min(s + tile, numel)
        nblocks = (e - s + 63) // 64
        masks = np.empty(nblocks, np.uint64)
        cnt = 0
        last = -1
        special = np.uint64(0)
        for bi in range(nblocks):
            m, sp = scan_block(a, b, src, s + 64 * bi, e, cast)
            special |= sp
            masks[bi] = m
            if m != 0:
                cnt += np.int64(ctpop64(m))
                last = bi
        if special:
            over[t] = 1
            continue
        if cnt == 0:
            continue
        ns[t] = cnt
        lastpos, k = _last_and_k(masks, last, cnt)
        ks[t] = k
        lowmask = (1 << k) - 1
        # Fold while walking when the tile provably fits (total Rice bits are at most
        # sum(gap >> k) + cnt * (k + 1), escapes at most one per change); otherwise only
        # after the walk succeeded, so an overflowing tile is left as it was.
        fold_now = update and cnt * width <= tile and (
            ((((lastpos + 1 - cnt) >> k) + cnt * (k + 1)) >> 3) + 48 <= rstride - 16)
        p0 = t * rstride
        p = p0
        pend = p0 + rstride - 16
        sb = 2 * t * tile
        eb = sb + tile
        eend = sb + 2 * tile
        acc = 0
        nbits = 0
        prev = -1
        j = 0
        ne = 0
        bad = False
        h = hist[t]
        for bi in range(nblocks):
            m = masks[bi]
            while m != 0:
                lp = 64 * bi + np.int64(cttz64(m))
                m &= m - np.uint64(1)
                g = lp - prev - 1
                prev = lp
                u = g >> k
                if p + ((u + k) >> 3) + 8 > pend:
                    bad = True
                    break
                p, acc, nbits = entropy.rice_put(rice_buf, p, acc, nbits, g, k, lowmask)
                i = s + lp
                nv = _new_bits(b, src, i, cast)
                d = (nv - np.uint64(a[i])) & mask
                if fold_now:
                    a[i] = nv
                sym = entropy.symbol(d, mask, wbits)
                sym_buf[sb + j] = sym
                j += 1
                h[sym] += 1
                if sym == ESC:
                    q = eb + ne * width
                    if q + width > eend:
                        bad = True
                        break
                    _put_escape(sym_buf, q, d, width)
                    ne += 1
            if bad:
                break
        if bad:
            over[t] = 1
            h[:] = 0
            continue
        if update and not fold_now:
            for bi in range(nblocks):
                m = masks[bi]
                while m != 0:
                    i = s + 64 * bi + np.int64(cttz64(m))
                    m &= m - np.uint64(1)
                    a[i] = _new_bits(b, src, i, cast)
        rice_len[t] = entropy.rice_flush(rice_buf, p, acc, nbits) - p0
        n_esc[t] = ne
    return ns, ks, rice_len, n_esc, hist.sum(axis=0), over


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
    """Codes ``j .. j+3`` of ``_rice_tile_grouped`` (each at most 28 bits) in one append of
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
    """Code ``j`` of ``_rice_tile_grouped`` alone: from ``codes`` when it is at most 28 bits
    long, else from its gap (``entropy.rice_bytes_put``: ``codes`` holds no long code)."""
    ln = np.uint64(lens[np.uint64(j)])
    if ln <= np.uint64(28):
        return entropy.bytes_put(rice_buf, q, acc, nbits, np.uint64(codes[np.uint64(j)]), ln)
    g = np.uint64(pos[np.uint64(j)])
    if j > 0:
        g -= np.uint64(pos[np.uint64(j - 1)]) + np.uint64(1)
    return entropy.rice_bytes_put(rice_buf, q, acc, nbits, g, np.uint64(k))


@nb.njit(inline="always", cache=True)
def _rice_tile_grouped(pos, cnt, k, rice_buf, p0, codes, lens):
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


@nb.njit(cache=True, nogil=True)
def _scan_tile(a, new, t, g, tile, width, rice_buf, rstride, sym_buf, update, pos, rare, masks, escs, lanes,
               ns, ks, rice_len, n_esc, over, hist, codes, lens):
    """Tile ``t`` of ``a`` for ``scan_encode_tiles_packed``: its results at index ``g`` of
    ``ns`` ... ``hist``, its scratch in slot ``g`` of ``rice_buf`` and ``sym_buf`` (``g`` is
    ``t`` for one tensor; a batch numbers its tensors' tiles on). ``new`` is the new bits or
    their cast form, ``lanes`` None (pack with compress-stores) or a row of 65 bytes or more
    (``pack_block``): each combination compiles to its own loops (see ``bitops``)."""
    numel = a.size
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * width)
    wbits = np.uint64(8 * width - 1)
    s = t * tile
    e = min(s + tile, numel)
    nfull = (e - s) // 64
    nblocks = (e - s + 63) // 64
    sb = 2 * g * tile
    eb = sb + tile
    eend = sb + 2 * tile
    cnt = 0
    n1 = 0
    nr = 0
    any_esc = np.uint64(0)
    special = np.uint64(0)
    # The hot loop: whole blocks, packing only (escapes wait for the pass below, so the loop
    # carries few values). No branch on m == 0: at 1-2% density about half the blocks have a
    # change, a coin flip for the predictor; packing an empty block stores nothing.
    for bi in range(nfull):
        bs = s + 64 * bi
        prefetch64(a, bs + PREFETCH_AHEAD)
        prefetch64(new, bs + PREFETCH_AHEAD)
        m = block_ne_mask64(a, bs, new, bs)
        special |= block_special64(a, new, bs)
        masks[bi] = m
        esc, one, rr = pack_block(a, bs, new, m, sym_buf, sb + cnt, pos, cnt, 64 * bi, rare, nr, lanes)
        escs[bi] = esc
        any_esc |= esc
        cnt += np.int64(ctpop64(m))
        n1 += np.int64(ctpop64(one))
        nr += np.int64(ctpop64(rr))
    ne = 0
    bad = False
    if any_esc:  # escapes, in position order, each checked against the tile's room
        for bi in range(nfull):
            esc = escs[bi]
            while esc != 0:
                i = s + 64 * bi + np.int64(cttz64(esc))
                esc &= esc - np.uint64(1)
                q = eb + ne * width
                if q + width > eend:
                    bad = True
                    break
                _put_escape(sym_buf, q, (new_element(a, new, i) - np.uint64(a[i])) & mask, width)
                ne += 1
            if bad:
                break
    if nfull < nblocks:  # the tensor's last, partial block, one element at a time
        bs = s + 64 * nfull
        m = np.uint64(0)
        for lane in range(e - bs):
            i = bs + lane
            special |= special_element(a, new, i)
            d = (new_element(a, new, i) - np.uint64(a[i])) & mask
            if d == 0:
                continue
            m |= np.uint64(1) << np.uint64(lane)
            if bad:
                cnt += 1
                continue
            sym = entropy.symbol(d, mask, wbits)
            sym_buf[sb + cnt] = sym
            pos[cnt] = 64 * nfull + lane
            cnt += 1
            if sym == 1:
                n1 += 1
            elif sym >= 2:
                rare[nr] = sym
                nr += 1
            if sym == ESC:
                q = eb + ne * width
                if q + width > eend:
                    bad = True
                    continue
                _put_escape(sym_buf, q, d, width)
                ne += 1
        masks[nfull] = m
    if special:
        over[g] = 1
        return
    if cnt == 0:
        return
    ns[g] = cnt
    last = nblocks - 1
    while masks[last] == 0:
        last -= 1
    lastpos, k = _last_and_k(masks, last, cnt)
    ks[g] = k
    p0 = g * rstride
    # The Rice bits are at most cnt * (k + 1) + (total gap >> k) (a sum of floors is at most
    # the floor of the sum): with ``rice_k``'s parameter at most 1.08 bits an element over a
    # grid of every count and gap total of a 65536-element tile, well inside the tile's 8 bits
    # of scratch. A tile whose bound would not fit (only with a smaller ``rstride``) is left
    # to the caller's two-step encoder like one whose escapes overflowed.
    if bad or ((cnt * (k + 1) + ((lastpos + 1 - cnt) >> k)) >> 3) + 8 > rstride - 16:
        over[g] = 1
        return
    end = _rice_tile_grouped(pos, cnt, k, rice_buf, p0, codes, lens)
    h = hist[g]
    h[0] = cnt - n1 - nr
    h[1] = n1
    for j in range(nr):
        h[rare[j]] += 1
    if update:
        for bi in range(nfull):
            m = masks[bi]
            if m != 0:
                block_fold64(a, s + 64 * bi, new, s + 64 * bi, m)
        if nfull < nblocks:
            for i in range(s + 64 * nfull, e):
                a[i] = new_element(a, new, i)
    rice_len[g] = end - p0
    n_esc[g] = ne


@nb.njit(inline="always", cache=True)
def _thread_rows(nthreads, tile):
    """The packed scan's per-thread rows (``scan_encode_tiles_packed``): packed positions,
    rare symbols, masks, escape masks, Rice codes and their lengths."""
    maxblocks = (tile + 63) // 64
    return (np.empty((nthreads, 64 * maxblocks), np.uint16), np.empty((nthreads, 64 * maxblocks), np.uint8),
            np.empty((nthreads, maxblocks), np.uint64), np.empty((nthreads, maxblocks), np.uint64),
            np.empty((nthreads, 64 * maxblocks), np.uint32), np.empty((nthreads, 64 * maxblocks), np.uint32))


@parallel_kernel
def scan_encode_tiles_packed(a, b, width, tile, rice_buf, rstride, sym_buf, update, src, nthreads, lane_rows):
    """``scan_encode_tiles`` (the same results and bytes) in three passes per tile instead of
    one walk: each 64-element block's symbols and positions are packed (no branch per change,
    no scattered reloads), then the packed positions are Rice-coded (``_rice_tile_grouped``:
    every code first, then four per append), then ``update`` folds the tile. Only the rare symbols (>= 2) are counted one by one; symbol 1
    is a popcount and symbol 0 the rest.

    Two choices are made by the arguments' types, when the kernel is compiled (numba prunes
    the branches on None, so each call compiles only the ``_scan_tile`` it runs): ``src``
    None compares ``b`` with ``a``, an fp32 array compares its bf16 cast (``b`` unused, as
    ``cast`` in ``scan_encode_tiles``); ``lane_rows`` None packs with compress-stores
    (``bitops.HAS_VECTOR_COMPRESS``; elsewhere LLVM lowers them to 64 conditional stores
    each), a (``nthreads``, 128) uint8 array with ``_pack_lanes`` walks.

    Positions within a tile are uint16, so ``tile`` is at most 65536. A thread's packed
    positions, rare symbols, masks, lanes and Rice codes live in per-thread rows allocated once per call
    (a kernel called from two threads at once has two sets); ``nthreads`` is the size of
    numba's thread pool, above every thread id (asked by the caller: the kernel could not be
    cached if it asked)."""
    numel = a.size
    ntiles = (numel + tile - 1) // tile
    ns, ks, rice_len, n_esc, over, hist = _scan_results(ntiles)
    pos_rows, rare_rows, mask_rows, esc_rows, code_rows, len_rows = _thread_rows(nthreads, tile)
    for tile_index in nb.prange(ntiles):
        # One index type for every caller: numba types a prange index int64 in one lowering and
        # uint64 in another, and each type compiled ``_scan_tile``, the largest function, once more.
        t = np.int64(tile_index)
        me = nb.get_thread_id()
        pos, rare, masks, escs = pos_rows[me], rare_rows[me], mask_rows[me], esc_rows[me]
        # Arguments spelled out: passing the rows and results as tuples unpacked with * made
        # the whole scan a third slower on the bench's bf16 tensors.
        if src is None:
            if lane_rows is None:
                _scan_tile(a, b, t, t, tile, width, rice_buf, rstride, sym_buf, update, pos, rare, masks, escs, None,
                           ns, ks, rice_len, n_esc, over, hist, code_rows[me], len_rows[me])
            else:
                _scan_tile(a, b, t, t, tile, width, rice_buf, rstride, sym_buf, update, pos, rare, masks, escs,
                           lane_rows[me], ns, ks, rice_len, n_esc, over, hist, code_rows[me], len_rows[me])
        elif lane_rows is None:
            _scan_tile(a, src, t, t, tile, width, rice_buf, rstride, sym_buf, update, pos, rare, masks, escs, None,
                       ns, ks, rice_len, n_esc, over, hist, code_rows[me], len_rows[me])
        else:
            _scan_tile(a, src, t, t, tile, width, rice_buf, rstride, sym_buf, update, pos, rare, masks, escs,
                       lane_rows[me], ns, ks, rice_len, n_esc, over, hist, code_rows[me], len_rows[me])
    return ns, ks, rice_len, n_esc, hist.sum(axis=0), over


def packed_scan_args(cast_src: np.ndarray | None, vector_compress: bool) -> tuple:
    """The trailing (``src``, ``nthreads``, ``lane_rows``) arguments of
    ``scan_encode_tiles_packed``: ``cast_src`` the fp32 bits of a cast scan (None for plain
    new bits), ``vector_compress`` whether to pack with compress-stores."""
    nthreads = nb.config.NUMBA_NUM_THREADS
    return cast_src, nthreads, None if vector_compress else np.empty((nthreads, 128), np.uint8)


@parallel_kernel
def scan_encode_batch_packed(addr_a, addr_b, numels, like, width, tile, rice_buf, rstride, sym_buf, update, nthreads,
                             lane_rows):
    """``scan_encode_tiles_packed`` (plain new bits) of several tensors in one parallel loop
    over all their tiles: tensor ``i`` is the ``numels[i]`` elements of ``like``'s dtype at
    ``addr_a[i]`` (old) and ``addr_b[i]`` (new), and its tiles take the result and scratch
    slots ``first[i]:first[i + 1]``. Returns ``first`` and the per-slot results, histograms
    per slot (slots, NSYM).

    The scan itself is no faster than one call per tensor (measured: the same within noise on
    the bench's tensors); it is one loop so that ``_encode_huffman_batch`` is one call. The
    caller keeps the tensors alive (``array_at``)."""
    ntensors = numels.size
    first = np.zeros(ntensors + 1, np.int64)
    for i in range(ntensors):
        first[i + 1] = first[i] + (numels[i] + tile - 1) // tile
    ntiles = first[ntensors]
    owner = np.empty(ntiles, np.int64)
    for i in range(ntensors):
        owner[first[i]:first[i + 1]] = i
    ns, ks, rice_len, n_esc, over, hist = _scan_results(ntiles)
    pos_rows, rare_rows, mask_rows, esc_rows, code_rows, len_rows = _thread_rows(nthreads, tile)
    for slot in nb.prange(ntiles):
        g = np.int64(slot)  # one index type (``scan_encode_tiles_packed``)
        i = owner[g]
        me = nb.get_thread_id()
        a = array_at(addr_a[i], numels[i], like)
        b = array_at(addr_b[i], numels[i], like)
        pos, rare, masks, escs = pos_rows[me], rare_rows[me], mask_rows[me], esc_rows[me]
        if lane_rows is None:
            _scan_tile(a, b, g - first[i], g, tile, width, rice_buf, rstride, sym_buf, update, pos, rare, masks, escs,
                       None, ns, ks, rice_len, n_esc, over, hist, code_rows[me], len_rows[me])
        else:
            _scan_tile(a, b, g - first[i], g, tile, width, rice_buf, rstride, sym_buf, update, pos, rare, masks, escs,
                       lane_rows[me], ns, ks, rice_len, n_esc, over, hist, code_rows[me], len_rows[me])
    return first, ns, ks, rice_len, n_esc, hist, over


@nb.njit(inline="always", cache=True)
def _rans_put(rans_buf, q, x, tabf, s):
    """One symbol ``s`` into the rANS state ``x`` whose bytes go down from ``q``; (q, x).
    ``tabf`` is ``entropy.rans_encoder_tables`` flattened (five entries per symbol), indexed
    unsigned so that numba adds no negative-index fix-ups to the hot loop."""
    r = np.uint64(s) * np.uint64(5)
    xmax = tabf[r]
    # Renormalise without branches (how many bytes a symbol pushes out is a coin flip for the
    # predictor): both candidate bytes are stored (one big-endian 16-bit store: x's low byte
    # at q - 1, the next at q - 2; a byte-swapping store costs no more than a plain one, where
    # swapping by hand cost a tenth of the encoder), q moves by the number due, and a byte not
    # due is overwritten next.
    nbytes = (1 if x >= xmax else 0) + (1 if (x >> 8) >= xmax else 0)
    store_u16be(rans_buf, q - 2, x)
    q -= nbytes
    x >>= nbytes << 3
    return q, (x + tabf[r + np.uint64(3)]
               + (((x * tabf[r + np.uint64(1)]) >> 32) >> tabf[r + np.uint64(2)]) * tabf[r + np.uint64(4)])


@nb.njit(inline="always", cache=True)
def _rans_close(rans_buf, q, x):
    """The final state, little-endian, just below ``q``; where the tile's stream starts."""
    q -= 4
    for c in range(4):
        rans_buf[q + c] = (x >> (8 * c)) & 0xFF
    return q


@parallel_kernel
def rans_encode_tiles(sym_buf, sym_off, ns, rtab, rans_off, rans_buf):
    """Pass 2: each tile's symbols (from ``sym_buf[sym_off[t]:]``), rANS-coded backwards so
    that its stream ends at ``rans_off[t+1]``; returns where each tile's stream starts (the
    final state first). ``ns[t, c]`` symbols of class ``c`` come class after class, each
    coded with its class's table ``rtab[c]`` (one class: the ``sparse`` stream)."""
    ntiles, nclasses = ns.shape
    starts = np.zeros(ntiles, np.int64)
    for t in nb.prange(ntiles):
        n = 0
        for c in range(nclasses):
            n += ns[t, c]
        if n == 0:
            continue
        q = rans_off[t + 1]
        x = RANS_L
        j = sym_off[t] + n
        for c in range(nclasses - 1, -1, -1):
            tabf = rtab[c].ravel()
            for _ in range(ns[t, c]):
                j -= 1
                q, x = _rans_put(rans_buf, q, x, tabf, sym_buf[np.uint64(j)])  # q stays >= rans_off[t] + 4
        starts[t] = _rans_close(rans_buf, q, x)
    return starts


@parallel_kernel
def rans_encode_tile_pairs(sym_buf, sym_off, ns, tab, rans_off, rans_buf):
    """``rans_encode_tiles`` for one class (the ``sparse`` stream), the same bytes, two tiles
    at a time in lockstep: one state's update is a chain of dependent multiplies and shifts,
    so a core left with one chain idles most of each step; two independent chains fill it."""
    ntiles = ns.shape[0]
    starts = np.zeros(ntiles, np.int64)
    tabf = tab.ravel()
    for pr in nb.prange((ntiles + 1) // 2):
        t0 = 2 * pr
        t1 = min(t0 + 1, ntiles - 1)
        n0 = ns[t0]
        n1 = ns[t1] if t1 != t0 else 0
        q0 = rans_off[t0 + 1]
        q1 = rans_off[t1 + 1]
        x0 = RANS_L
        x1 = RANS_L
        j0 = sym_off[t0] + n0
        j1 = sym_off[t1] + n1
        both = min(n0, n1)
        for _ in range(both):
            j0 -= 1
            j1 -= 1
            q0, x0 = _rans_put(rans_buf, q0, x0, tabf, sym_buf[np.uint64(j0)])
            q1, x1 = _rans_put(rans_buf, q1, x1, tabf, sym_buf[np.uint64(j1)])
        for _ in range(n0 - both):
            j0 -= 1
            q0, x0 = _rans_put(rans_buf, q0, x0, tabf, sym_buf[np.uint64(j0)])
        for _ in range(n1 - both):
            j1 -= 1
            q1, x1 = _rans_put(rans_buf, q1, x1, tabf, sym_buf[np.uint64(j1)])
        if n0:
            starts[t0] = _rans_close(rans_buf, q0, x0)
        if n1:
            starts[t1] = _rans_close(rans_buf, q1, x1)
    return starts


@nb.njit(inline="always", cache=True)
def _tile_sizes(ns, rice_len, rans_start, rans_off, n_esc, width, rice_buf, rice_off, esc_buf, esc_off, rans_buf):
    """Changes and piece bytes per tile of an assembly (``assemble_tiles``), every piece
    checked to lie inside its buffer (here: a raise in the ``prange`` loop would make it serial)."""
    ntiles, nclasses = ns.shape
    tot = np.zeros(ntiles, np.int64)
    size = np.zeros(ntiles, np.int64)
    for t in range(ntiles):
        for c in range(nclasses):
            tot[t] += ns[t, c]
            size[t] += rice_len[t, c] + n_esc[t, c] * width
        if tot[t] == 0:
            continue
        size[t] += rans_off[t + 1] - rans_start[t]
        fits = range_fits(rans_buf, rans_start[t], rans_off[t + 1] - rans_start[t])
        for c in range(nclasses):
            fits = fits and range_fits(rice_buf, rice_off[t, c], rice_len[t, c])
            fits = fits and range_fits(esc_buf, esc_off[t, c], n_esc[t, c] * width)
        if not fits:
            raise IndexError("assemble_tiles: a tile's piece lies outside its buffer")
    return tot, size


@nb.njit(inline="always", cache=True)
def _assembly_bound(prefix_bytes, nclasses, size):
    """Bytes an assembly may take (prefix, tables, directory, pieces of ``size`` per tile)."""
    return prefix_bytes + nclasses * (10 + NSYM * 20) + size.size * (20 + 20 * nclasses) + size.sum()


@nb.njit(cache=True, nogil=True)
def assembly_bound(prefix, ns, rice_len, rans_start, rans_off, n_esc, width, rice_buf, rice_off, esc_buf, esc_off,
                   rans_buf):
    """What ``assemble_tiles_into`` may write for these arguments (``assemble_tiles``'s, less
    ``freq``, ``ks`` and with ``prefix`` first)."""
    _, size = _tile_sizes(ns, rice_len, rans_start, rans_off, n_esc, width, rice_buf, rice_off, esc_buf, esc_off,
                          rans_buf)
    return _assembly_bound(prefix.size, ns.shape[1], size)


@nb.njit(cache=True, nogil=True)
def assembly_head(out, p, prefix, freq, ns, ks, rice_len, rans_start, rans_off, n_esc, width, rice_buf, rice_off,
                  esc_buf, esc_off, rans_buf):
    """The serial part of ``assemble_tiles_into``: every piece checked, then ``prefix``, one
    table per class and the directory written at ``out[p:]``. Returns where each tile's
    pieces go, each tile's changes (no pieces where 0) and where the assembly ends."""
    ntiles, nclasses = ns.shape
    tot, size = _tile_sizes(ns, rice_len, rans_start, rans_off, n_esc, width, rice_buf, rice_off, esc_buf, esc_off,
                            rans_buf)
    limit = p + _assembly_bound(prefix.size, nclasses, size)
    if p < 0 or limit > out.size:
        raise IndexError("assemble_tiles: the output is smaller than the assembly's bound")
    out[p:p + prefix.size] = prefix
    p += prefix.size
    for c in range(freq.shape[0]):  # none for a ``huffman`` stream: its table is the prefix
        p = entropy.write_table(out, p, freq[c])
    for t in range(ntiles):
        for c in range(nclasses):
            p = entropy._write_varint(out, p, ns[t, c])
        if tot[t] == 0:
            continue
        for c in range(nclasses):
            if ns[t, c]:
                out[p] = ks[t, c]
                p = entropy._write_varint(out, p + 1, rice_len[t, c])
        p = entropy._write_varint(out, p, rans_off[t + 1] - rans_start[t])
        p = entropy._write_varint(out, p, n_esc[t].sum())
    dest = np.zeros(ntiles, np.int64)
    for t in range(ntiles):
        dest[t] = p
        p += size[t]
    if p > limit:
        raise IndexError("assemble_tiles: the directory outgrew its bound")
    return dest, tot, p


@parallel_kernel
def move_pieces(out, dest, tot, rice_buf, rice_off, rice_len, value_buf, value_start, value_len, esc_buf, esc_off,
                esc_len):
    """The parallel part of ``assemble_tiles_into``: each tile with changes (``tot``) gets its
    Rice pieces (tiles, classes), its coded values and its escape pieces (tiles, classes)
    one after the other at ``out[dest[t]:]``. Every range was checked (``assembly_head``)."""
    for t in nb.prange(dest.size):
        if tot[t] == 0:
            continue
        o = dest[t]
        for c in range(rice_len.shape[1]):
            move_bytes(out, o, rice_buf, rice_off[t, c], rice_len[t, c])
            o += rice_len[t, c]
        move_bytes(out, o, value_buf, value_start[t], value_len[t])
        o += value_len[t]
        for c in range(esc_len.shape[1]):
            move_bytes(out, o, esc_buf, esc_off[t, c], esc_len[t, c])
            o += esc_len[t, c]


@nb.njit(cache=True, nogil=True)
def assemble_tiles_into(out, p, prefix, freq, ns, ks, rice_len, rans_start, rans_off, n_esc, width, rice_buf, rice_off,
                        esc_buf, esc_off, rans_buf):
    """Pass 3 into ``out`` from ``p`` on (``assembly_bound`` bytes of room); returns where it
    ended. ``prefix``, one table per class and the directory (serial), then every tile's
    Rice pieces | rANS | escape pieces (parallel). ``freq`` is (classes, NSYM); ``ns``, ``ks``
    and each class's Rice and escape pieces (lengths and where they lie in ``rice_buf`` and
    ``esc_buf``) are (tiles, classes). With one class this is the ``sparse`` layout."""
    dest, tot, end = assembly_head(out, p, prefix, freq, ns, ks, rice_len, rans_start, rans_off, n_esc, width,
                                   rice_buf, rice_off, esc_buf, esc_off, rans_buf)
    move_pieces(out, dest, tot, rice_buf, rice_off, rice_len, rans_buf, rans_start, rans_off[1:] - rans_start, esc_buf,
                esc_off, n_esc * width)
    return end


@nb.njit(cache=True, nogil=True)
def assemble_tiles(prefix, freq, ns, ks, rice_len, rans_start, rans_off, n_esc, width, rice_buf, rice_off, esc_buf,
                   esc_off, rans_buf):
    """``assemble_tiles_into`` a new array of the assembly's length."""
    out = np.empty(assembly_bound(prefix, ns, rice_len, rans_start, rans_off, n_esc, width, rice_buf, rice_off, esc_buf,
                                  esc_off, rans_buf), np.uint8)
    end = assemble_tiles_into(out, 0, prefix, freq, ns, ks, rice_len, rans_start, rans_off, n_esc, width, rice_buf,
                              rice_off, esc_buf, esc_off, rans_buf)
    return out[:end]


def _scratch(nbytes: int) -> np.ndarray:
    return torch.empty(max(nbytes, 1), dtype=torch.uint8).numpy()


def pooled(scratch: dict | None, key: str, nbytes: int) -> np.ndarray:
    """``nbytes`` of scratch under ``key`` in ``scratch`` (grown when too small), or fresh
    scratch when there is no pool. An encode that keeps one pool across its tensors touches
    each scratch page once instead of once per tensor: first touches are page faults (fresh
    scratch for each of the bench's 66 bf16 tensors cost about 8 ms of a 50 ms scan). A
    pooled buffer is only valid until the next call that uses the pool."""
    if scratch is None:
        return _scratch(nbytes)
    buf = scratch.get(key)
    if buf is None or buf.size < nbytes:
        buf = scratch[key] = _scratch(nbytes)
    return buf


# A thread's pool outlives one encode when its buffers total at most this: page-faulting
# fresh scratch on every ``encode_patch`` cost 1-4 ms of the bench's 35-50 ms (bf16, 55M
# parameters: a pool of 82 MB of address space, of which the 7 MB that a step's changes
# touch stay resident). The publisher's read keeps its own, smaller pool per version.
KEPT_SCRATCH_BYTES = 256 << 20
_kept = threading.local()


def kept_scratch() -> dict:
    """This thread's scratch pool for ``pooled``, kept from one encode to the next (release
    it with ``trim_scratch`` after each): a trainer that calls ``encode_patch`` every step
    would otherwise page-fault its first touch of every scratch page each time. Per thread, because a pooled
    buffer is only valid until the next call that uses the pool."""
    pool = getattr(_kept, "pool", None)
    if pool is None:
        pool = _kept.pool = {}
    return pool


def trim_scratch(scratch: dict) -> None:
    """Drop the pool's buffers if they total more than ``KEPT_SCRATCH_BYTES`` (one huge
    tensor should not pin its scratch for the life of the process)."""
    held = 0
    for value in scratch.values():  # arrays, or tuples of them (``scan_tiles``)
        for buf in value if isinstance(value, tuple) else (value,):
            held += getattr(buf, "nbytes", 0)
    if held > KEPT_SCRATCH_BYTES:
        scratch.clear()


def encode_sparse(old: np.ndarray, new: np.ndarray, tile: int, scratch: dict | None = None) -> tuple[int, np.ndarray | None]:
    """(number of changed elements, the ``sparse`` stream), one read of both arrays.

    ``old`` and ``new`` are unsigned views of one element width. The stream is None when
    nothing changed or when a tile did not fit its scratch (a pathological, very dense tile);
    the caller then picks another mode or the two-step encoder. ``scratch``: a pool kept
    across calls (``pooled``).
    """
    return _encode(old, new, tile, scratch, False)


def encode_huffman(old: np.ndarray, new: np.ndarray, tile: int, scratch: dict | None = None) -> tuple[int, np.ndarray | None]:
    """``encode_sparse`` with the values Huffman-coded: the ``huffman`` stream."""
    return _encode(old, new, tile, scratch, True)


def encode_huffman_batch(pairs: Sequence[tuple[np.ndarray, np.ndarray]], tile: int,
                         scratch: dict | None = None) -> list[tuple[int, np.ndarray | None]]:
    """``encode_huffman`` of each (old, new) pair, in one compiled call with one parallel
    scan over every pair's tiles: the same changes and streams, and one call's dispatch
    instead of one per tensor (the bench's 66 bf16 tensors, most of them a few tiles each).

    The pairs share one element width of 1, 2 or 4 bytes, and ``tile`` is at most 65536
    (``batchable``). The streams are views of one new buffer."""
    if not pairs:
        return []
    width = pairs[0][0].itemsize
    if not _packs(tile, width):
        raise ValueError(f"a batch needs tiles of at most 65536 and 1-, 2- or 4-byte elements, got {tile} and {width}")
    for old, new in pairs:
        check_scan_pair(old, new, tile, False)
        if old.itemsize != width:
            raise ValueError(f"a batch has one element width, got {width} and {old.itemsize} bytes")
    numels = np.array([old.size for old, _ in pairs], np.int64)
    addr_a = np.array([old.__array_interface__["data"][0] for old, _ in pairs], np.int64)
    addr_b = np.array([new.__array_interface__["data"][0] for _, new in pairs], np.int64)
    ntiles = int(((numels + tile - 1) // tile).sum())
    rice_buf = pooled(scratch, "sparse_rice", ntiles * (tile + _RICE_SLACK))
    sym_buf = pooled(scratch, "sparse_sym", ntiles * 2 * tile)
    value_buf = pooled(scratch, "values", _value_bytes(int(numels.sum()), ntiles))
    like = pairs[0][0][:0]
    changes, spans, out = _encode_huffman_batch(addr_a, addr_b, numels, like, width, tile, rice_buf, sym_buf,
                                                value_buf, False, *packed_scan_args(None, _VECTOR_COMPRESS)[1:])
    return [(int(n), out[s:s + m] if m else None) for n, (s, m) in zip(changes.tolist(), spans.tolist())]


def batchable(old: np.ndarray, tile: int) -> bool:
    """Whether pairs of ``old``'s element width can go through ``encode_huffman_batch``."""
    return _packs(tile, old.itemsize)


def _encode(old: np.ndarray, new: np.ndarray, tile: int, scratch: dict | None, huff: bool) -> tuple[int, np.ndarray | None]:
    width = old.itemsize
    ntiles = (old.size + tile - 1) // tile
    rstride = tile + _RICE_SLACK
    rice_buf = pooled(scratch, "sparse_rice", ntiles * rstride)
    sym_buf = pooled(scratch, "sparse_sym", ntiles * 2 * tile)
    if _packs(tile, width):
        check_scan_pair(old, new, tile, False)  # (``_scan`` checks on the other path)
        # Every pass in one compiled call: a tensor's Python and dispatch costs (about 0.1 ms
        # when the passes were called one by one) are paid once per tensor, not per pass.
        value_buf = pooled(scratch, "values", _value_bytes(old.size, ntiles))
        total, stream = _encode_sparse_packed(old, new, width, tile, rice_buf, sym_buf, value_buf, huff, False,
                                              *packed_scan_args(None, _VECTOR_COMPRESS))
        return int(total), (stream if stream.size else None)
    ns, ks, rice_len, n_esc, counts, over = _scan(old, new, tile, rice_buf, sym_buf)
    total = int(ns.sum())
    if total == 0 or over.any():
        return total, None
    tiles = np.arange(ntiles, dtype=np.int64)  # the scratch layout: fixed strides per tile
    return total, _rans_and_assemble(ns, ks, rice_len, n_esc, counts, width, rice_buf, rstride * tiles,
                                     sym_buf, 2 * tile * tiles, sym_buf, 2 * tile * tiles + tile, scratch=scratch,
                                     huff=huff)


def _value_bytes(changes: int, ntiles: int) -> int:
    """Scratch for the coded values of ``changes`` symbols in ``ntiles`` tiles, either coder:
    rANS pushes at most 2 bytes a symbol and 4 a tile, Huffman ``huffman.MAX_BITS`` bits a
    symbol and ``huffman.SLACK`` + 1 bytes a tile."""
    return 2 * changes + (4 + huffman.SLACK + 1) * ntiles


@nb.njit(cache=True, nogil=True)
def _encode_sparse_packed(a, b, width, tile, rice_buf, sym_buf, value_buf, huff, update, src, nthreads, lane_rows):
    """``encode_sparse`` (``huff`` False) or ``encode_huffman`` of a packed-scan pair
    (``_packs``): the scan, then ``_finish_sparse`` or ``_finish_huffman``. Returns (changes,
    stream), the stream empty when there is none (nothing changed or a tile overflowed).
    ``value_buf``: ``_value_bytes`` of scratch. ``update`` (False from every caller) comes
    from Python, typed a plain bool: a ``False`` written here is typed as a literal, and the
    scan was compiled once more for it beside the publisher's form (``scan_tiles``)."""
    rstride = tile + _RICE_SLACK
    ns, ks, rice_len, n_esc, counts, over = scan_encode_tiles_packed(a, b, width, tile, rice_buf, rstride, sym_buf,
                                                                     update, src, nthreads, lane_rows)
    ntiles = ns.size
    total = 0
    overflow = False
    for t in range(ntiles):
        total += ns[t]
        overflow |= over[t]
    if total == 0 or overflow:
        return total, np.empty(0, np.uint8)
    tiles = np.arange(ntiles)  # the scratch layout: fixed strides per tile
    if huff:
        return total, _finish_huffman(ns, ks, rice_len, n_esc, counts, width, rice_buf, rstride * tiles, sym_buf,
                                      2 * tile * tiles, sym_buf, 2 * tile * tiles + tile, value_buf)
    return total, _finish_sparse(ns, ks, rice_len, n_esc, counts, width, rice_buf, rstride * tiles, sym_buf,
                                 2 * tile * tiles, sym_buf, 2 * tile * tiles + tile, value_buf)


@nb.njit(cache=True, nogil=True)
def _finish_sparse(ns, ks, rice_len, n_esc, counts, width, rice_buf, rice_off, sym_buf, sym_off, esc_buf, esc_off,
                   rans_buf):
    """Passes 2 and 3 of a ``sparse`` stream (one class) over scanned tiles wherever their
    pieces lie (every argument per tile, ``counts`` the tensor's histogram): the table, rANS
    and assembly in one compiled call. ``rans_buf`` holds at least 2 bytes per change and 4
    per tile (a symbol pushes at most 2 bytes out of the state; the final state takes 4)."""
    ntiles = ns.size
    freq = entropy._quantize_freqs(counts)
    rans_off = np.zeros(ntiles + 1, np.int64)
    for t in range(ntiles):
        rans_off[t + 1] = rans_off[t] + (2 * ns[t] + 4 if ns[t] else 0)
    starts = rans_encode_tile_pairs(sym_buf, sym_off, ns, entropy._rans_encoder_tables(freq), rans_off, rans_buf)
    return assemble_tiles(np.empty(0, np.uint8), freq.reshape(1, NSYM), ns.reshape(ntiles, 1), ks.reshape(ntiles, 1),
                          rice_len.reshape(ntiles, 1), starts, rans_off, n_esc.reshape(ntiles, 1), width, rice_buf,
                          rice_off.reshape(ntiles, 1), esc_buf, esc_off.reshape(ntiles, 1), rans_buf)


@nb.njit(cache=True, nogil=True)
def _finish_huffman(ns, ks, rice_len, n_esc, counts, width, rice_buf, rice_off, sym_buf, sym_off, esc_buf, esc_off,
                    value_buf):
    """``_finish_sparse`` for the ``huffman`` stream: the code from the tensor's histogram,
    each tile's values coded at a fixed stride in ``value_buf`` (``huffman.tile_bound``),
    then the same assembly with the code's table in front instead of a frequency table."""
    ntiles = ns.size
    table = np.empty(huffman.TABLE_BYTES, np.uint8)
    table_len, codes = _huffman_table(counts, table)
    starts = np.zeros(ntiles, np.int64)
    _value_starts(ns, starts)
    ends = _value_ends(starts, huffman.encode_tiles(sym_buf, sym_off, ns, codes, value_buf, starts))
    return assemble_tiles(table[:table_len], np.zeros((0, NSYM), np.int64), ns.reshape(ntiles, 1),
                          ks.reshape(ntiles, 1), rice_len.reshape(ntiles, 1), starts, ends,
                          n_esc.reshape(ntiles, 1), width, rice_buf, rice_off.reshape(ntiles, 1), esc_buf,
                          esc_off.reshape(ntiles, 1), value_buf)


@nb.njit(cache=True, nogil=True)
def _huffman_table(counts, table):
    """The Huffman code of a tensor's histogram ``counts``: its table written into ``table``
    (returns the bytes written) and its encoder codes (``huffman.encoder_codes``)."""
    lengths = huffman.code_lengths(counts)
    return huffman.write_table(table, 0, lengths, counts > 0), huffman.encoder_codes(lengths)


@nb.njit(inline="always", cache=True)
def _value_starts(ns, starts):
    """Where each tile's coded values go, at ``huffman.tile_bound`` strides from byte 0
    (written into ``starts``)."""
    q = 0
    for t in range(ns.size):
        starts[t] = q
        if ns[t]:
            q += huffman.tile_bound(ns[t])


@nb.njit(inline="always", cache=True)
def _value_ends(starts, lens):
    """``assemble_tiles``' ``rans_off`` of coded values: tile ``t``'s end at ``t + 1``."""
    ends = np.zeros(starts.size + 1, np.int64)
    for t in range(starts.size):
        ends[t + 1] = starts[t] + lens[t]
    return ends


@nb.njit(cache=True, nogil=True)
def _encode_huffman_batch(addr_a, addr_b, numels, like, width, tile, rice_buf, sym_buf, value_buf, update, nthreads,
                          lane_rows):
    """``encode_huffman_batch``'s compiled part: the batch scan, each tensor's code (serial),
    every tile's values in one parallel loop, each tensor's directory (serial) and every
    tile's pieces in one parallel loop. Returns (changes per tensor, (start, length) of each
    tensor's stream in the returned buffer, length 0 where ``encode_huffman`` gives None,
    the buffer).

    Why one call: the kernels take about as long either way, but a call per tensor paid its
    wrapper's pools, checks and dispatch (about 20 us on a 512-element tensor whose scan takes
    13) and ran that Python on caches the kernel before had emptied; on the bench's 66
    tensors ``encode_patch`` took 4-8% less time batched (``cuda/PERFORMANCE.md``)."""
    rstride = tile + _RICE_SLACK
    first, ns, ks, rice_len, n_esc, hist, over = scan_encode_batch_packed(addr_a, addr_b, numels, like, width, tile,
                                                                          rice_buf, rstride, sym_buf, update,
                                                                          nthreads, lane_rows)
    ntensors = numels.size
    nslots = first[ntensors]
    slots = np.arange(nslots)
    rice_off = (rstride * slots).reshape(-1, 1)
    sym_off = 2 * tile * slots
    esc_off = (sym_off + tile).reshape(-1, 1)
    changes = np.zeros(ntensors, np.int64)
    coded_ns = np.zeros(nslots, np.int64)  # a tensor left to the caller codes no values
    row = np.empty(nslots, np.int64)
    tables = np.empty((ntensors, huffman.TABLE_BYTES), np.uint8)
    table_len = np.zeros(ntensors, np.int64)
    codes = np.zeros((ntensors, NSYM), np.int64)
    for i in range(ntensors):
        g0, g1 = first[i], first[i + 1]
        row[g0:g1] = i
        overflow = False
        for g in range(g0, g1):
            changes[i] += ns[g]
            overflow |= over[g] != 0
        if changes[i] and not overflow:
            coded_ns[g0:g1] = ns[g0:g1]
            table_len[i], codes[i] = _huffman_table(hist[g0:g1].sum(axis=0), tables[i])
    starts = np.zeros(nslots, np.int64)
    _value_starts(coded_ns, starts)
    lens = huffman.encode_tiles_by_row(sym_buf, sym_off, coded_ns, codes, row, value_buf, starts)
    ns2, ks2, rice_len2, esc_len = ns.reshape(-1, 1), ks.reshape(-1, 1), rice_len.reshape(-1, 1), n_esc.reshape(-1, 1)
    no_freq = np.zeros((0, NSYM), np.int64)
    ends = np.zeros(nslots + ntensors, np.int64)  # tensor i's ``_value_ends`` at first[i] + i
    bound = 0
    for i in range(ntensors):
        g0, g1 = first[i], first[i + 1]
        if table_len[i]:
            ends[g0 + i:g1 + i + 1] = _value_ends(starts[g0:g1], lens[g0:g1])
            bound += assembly_bound(tables[i, :table_len[i]], ns2[g0:g1], rice_len2[g0:g1], starts[g0:g1],
                                    ends[g0 + i:g1 + i + 1], esc_len[g0:g1], width, rice_buf, rice_off[g0:g1],
                                    sym_buf, esc_off[g0:g1], value_buf)
    out = np.empty(bound, np.uint8)
    spans = np.zeros((ntensors, 2), np.int64)
    dest = np.zeros(nslots, np.int64)
    tot = np.zeros(nslots, np.int64)
    p = 0
    for i in range(ntensors):
        g0, g1 = first[i], first[i + 1]
        if table_len[i]:
            dest[g0:g1], tot[g0:g1], end = assembly_head(out, p, tables[i, :table_len[i]], no_freq, ns2[g0:g1],
                                                         ks2[g0:g1], rice_len2[g0:g1], starts[g0:g1],
                                                         ends[g0 + i:g1 + i + 1], esc_len[g0:g1], width, rice_buf,
                                                         rice_off[g0:g1], sym_buf, esc_off[g0:g1], value_buf)
            spans[i, 0] = p
            spans[i, 1] = end - p
            p = end
    move_pieces(out, dest, tot, rice_buf, rice_off, rice_len2, value_buf, starts, lens, sym_buf, esc_off, esc_len * width)
    return changes, spans, out


def check_scan_pair(old: np.ndarray, new: np.ndarray, tile: int, cast: bool) -> None:
    """What every scan needs of its inputs (this one's and ``context_codec``'s)."""
    if tile % 64:
        raise ValueError("tile must be a multiple of 64")
    if cast:
        if old.dtype != np.uint16 or new.dtype != np.uint32 or old.size != new.size:
            raise ValueError(f"a cast scan needs bf16 bits (uint16) and fp32 bits (uint32) of one size, got "
                             f"{old.dtype}/{old.size} and {new.dtype}/{new.size}")
    elif old.dtype != new.dtype or old.size != new.size:
        raise ValueError(f"old and new must have one dtype and size, got {old.dtype}/{old.size} and {new.dtype}/{new.size}")
    if not (old.flags.c_contiguous and new.flags.c_contiguous):
        raise ValueError("old and new must be C-contiguous (flat views of contiguous tensors)")


def _packs(tile: int, width: int) -> bool:
    """Whether ``scan_encode_tiles_packed`` scans these tiles: uint16 positions within a tile,
    8-, 16- or 32-bit lanes."""
    return tile <= 65536 and width in (1, 2, 4)


def _scan(old: np.ndarray, new: np.ndarray, tile: int, rice_buf: np.ndarray, sym_buf: np.ndarray,
          update: bool = False, cast: bool = False) -> tuple:
    check_scan_pair(old, new, tile, cast)
    args = ((old, old[:0], 2, tile, rice_buf, tile + _RICE_SLACK, sym_buf, update, new, True) if cast else
            (old, new, old.itemsize, tile, rice_buf, tile + _RICE_SLACK, sym_buf, update, np.empty(0, np.uint32), False))
    if _packs(tile, old.itemsize):
        return scan_encode_tiles_packed(*args[:8], *packed_scan_args(new if cast else None, _VECTOR_COMPRESS))
    return scan_encode_tiles(*args)


def _rans_and_assemble(ns, ks, rice_len, n_esc, counts, width, rice_buf, rice_off, sym_buf, sym_off, esc_buf, esc_off,
                       prefix=None, scratch=None, huff=False):
    """Passes 2 and 3 over scanned tiles wherever their bytes lie. One class (the ``sparse``
    stream, no ``prefix``): every argument per tile and one histogram ``counts``, coded by
    ``_finish_sparse``; several (``context``): ``ns``, ``ks`` and the Rice and escape pieces
    per (tile, class), ``counts`` (classes, NSYM), and the stream's ``prefix``; ``sym_off``
    is per tile either way. ``scratch``: a pool for the coded values (``pooled``). ``huff``
    (one class only): code the values with ``_finish_huffman``, the ``huffman`` stream."""
    ntiles = ns.shape[0]
    counts = counts.reshape(-1, NSYM)
    if counts.shape[0] == 1 and prefix is None:
        flat = [np.ascontiguousarray(x, dtype=np.int64).reshape(-1) for x in (ns, ks, rice_len, n_esc, rice_off, esc_off)]
        value_buf = pooled(scratch, "values", _value_bytes(int(flat[0].sum()), ntiles))
        finish = _finish_huffman if huff else _finish_sparse
        return finish(*flat[:4], np.ascontiguousarray(counts[0], dtype=np.int64), width, rice_buf, flat[4],
                      sym_buf, np.ascontiguousarray(sym_off, dtype=np.int64), esc_buf, flat[5], value_buf)
    if huff:
        raise ValueError("the huffman stream has one class")
    ns, ks, rice_len, n_esc, rice_off, esc_off = (x.reshape(ntiles, -1)
                                                  for x in (ns, ks, rice_len, n_esc, rice_off, esc_off))
    freq = np.stack([entropy.quantize_freqs(c) for c in counts])
    rtab = np.stack([entropy.rans_encoder_tables(f) for f in freq])
    total = ns.sum(axis=1)
    rans_off = np.zeros(total.size + 1, np.int64)
    np.cumsum(np.where(total > 0, 2 * total + 4, 0), out=rans_off[1:])
    rans_buf = pooled(scratch, "rans", int(rans_off[-1]))
    starts = rans_encode_tiles(sym_buf, sym_off, ns, rtab, rans_off, rans_buf)
    return assemble_tiles(np.empty(0, np.uint8) if prefix is None else prefix, freq, ns, ks, rice_len, starts,
                          rans_off, n_esc, width, rice_buf, rice_off, esc_buf, esc_off, rans_buf)


def packed_offsets(lengths: np.ndarray) -> np.ndarray:
    """Where each piece starts when pieces of these lengths (any shape, C order) are packed."""
    flat = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    out = np.zeros(flat.size, np.int64)
    np.cumsum(flat[:-1], out=out[1:])
    return out.reshape(lengths.shape)


@dataclass(frozen=True)
class TileScan:
    """Pass 1 over whole tiles of a tensor, compacted: everything its ``sparse`` stream needs
    except the rANS coding of the symbols, which waits for the whole tensor's frequency table.

    This is how a caller that reads a tensor piece by piece (the publisher folds a large
    tensor into its view in chunks, and the old bits are gone once a chunk is folded in)
    encodes it in the same read: ``scan_tiles`` per piece, then ``finish_sparse`` once.
    Pieces must start on tile boundaries; the bytes equal ``encode_sparse`` of the whole.
    """

    ns: np.ndarray  # changes per tile
    ks: np.ndarray  # Rice parameter per tile
    rice_len: np.ndarray  # Rice bytes per tile
    n_esc: np.ndarray  # escapes per tile
    rice: np.ndarray  # uint8: every tile's Rice bytes, in tile order
    syms: np.ndarray  # uint8: every change's symbol, in order
    escs: np.ndarray  # uint8: every escape's raw difference (little-endian, width bytes each)
    counts: np.ndarray  # symbol histogram
    # Tiles that did not fit the scan's scratch (pathologically dense): not scanned (ns 0 here)
    # and, under ``update``, not folded either; the caller diffs them.
    overflowed: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    @property
    def changed(self) -> int:
        return int(self.ns.sum())


def scan_tiles(old: np.ndarray, new: np.ndarray, tile: int, scratch: dict | None = None, *,
               update: bool = False, cast: bool = False) -> TileScan:
    """Pass 1 of ``encode_sparse`` over ``old``/``new`` (unsigned views, a whole number of
    tiles except at a tensor's end); ``update`` also folds ``new`` into ``old`` (see
    ``scan_encode_tiles``). Tiles that did not fit their scratch are listed in
    ``overflowed``. ``scratch`` keeps the scan's buffers between calls.

    ``cast``: ``old`` holds bf16 bits and ``new`` the fp32 bits whose bf16 cast is the new
    version; tiles with a NaN or a subnormal are left for the caller in ``overflowed``."""
    ntiles = (old.size + tile - 1) // tile
    need_rice, need_sym = ntiles * (tile + _RICE_SLACK), ntiles * 2 * tile
    bufs = None if scratch is None else scratch.get("tile_scan")
    if bufs is None or bufs[0].size < need_rice or bufs[1].size < need_sym:
        bufs = (_scratch(need_rice), _scratch(need_sym))
        if scratch is not None:
            scratch["tile_scan"] = bufs
    rice_buf, sym_buf = bufs
    ns, ks, rice_len, n_esc, counts, over = _scan(old, new, tile, rice_buf, sym_buf, update, cast)
    overflowed = np.flatnonzero(over).astype(np.int64)
    ns[overflowed] = 0  # their Rice lengths and escapes are 0 already, their symbols uncounted
    tiles = np.arange(ns.size, dtype=np.int64)[:, None]
    rice, syms, escs = _compact_tiles(ns, rice_len[:, None], n_esc[:, None], old.itemsize, rice_buf,
                                      (tile + _RICE_SLACK) * tiles, sym_buf, 2 * tile * tiles[:, 0], 2 * tile * tiles + tile)
    return TileScan(ns, ks, rice_len, n_esc, rice, syms, escs, counts, overflowed)


def finish_sparse(scans: Sequence[TileScan], width: int) -> np.ndarray:
    """The ``sparse`` stream of a tensor from the scans of its pieces, in order (at least one
    change in all)."""
    return finish_pieces(scans, width)


def finish_huffman(scans: Sequence[TileScan], width: int) -> np.ndarray:
    """The ``huffman`` stream of a tensor from the scans of its pieces, in order (at least one
    change in all)."""
    return finish_pieces(scans, width, huff=True)


def finish_pieces(scans: Sequence, width: int, prefix: np.ndarray | None = None, huff: bool = False) -> np.ndarray:
    """Passes 2 and 3 over the scans of a tensor's pieces, in order: ``TileScan`` (the
    ``sparse`` stream, or with ``huff`` the ``huffman`` one) or ``context_codec.ContextScan``
    with the stream's ``prefix``."""
    if any(s.overflowed.size for s in scans):
        raise ValueError("a scan with overflowed tiles does not describe its piece; diff those tiles")
    ns = np.concatenate([s.ns for s in scans])
    if not ns.any():
        raise ValueError("a stream needs at least one change")
    rice_len = np.concatenate([s.rice_len for s in scans])
    n_esc = np.concatenate([s.n_esc for s in scans])
    return _rans_and_assemble(
        ns, np.concatenate([s.ks for s in scans]), rice_len, n_esc, sum(s.counts for s in scans), width,
        np.concatenate([s.rice for s in scans]), packed_offsets(rice_len),
        np.concatenate([s.syms for s in scans]), packed_offsets(ns.reshape(ns.shape[0], -1).sum(axis=1)),
        np.concatenate([s.escs for s in scans]), packed_offsets(n_esc * width), prefix, huff=huff,
    )


@parallel_kernel
def _compact_tiles(ns, rice_len, n_esc, width, rice_buf, rice_off, sym_buf, sym_off, esc_off):
    """Copy each tile's Rice pieces, symbols and escape pieces out of the scratch, packed in
    (tile, class) order. ``ns`` is per tile; ``rice_len``, ``n_esc`` and the pieces' offsets
    are (tiles, classes)."""
    ntiles, nclasses = rice_len.shape
    ro = np.zeros(ntiles + 1, np.int64)
    so = np.zeros(ntiles + 1, np.int64)
    eo = np.zeros(ntiles + 1, np.int64)
    for t in range(ntiles):
        ro[t + 1] = ro[t] + rice_len[t].sum()
        so[t + 1] = so[t] + ns[t]
        eo[t + 1] = eo[t] + n_esc[t].sum() * width
        fits = range_fits(sym_buf, sym_off[t], ns[t])
        for c in range(nclasses):  # checked here: a raise in the prange loop would make it serial
            fits = fits and range_fits(rice_buf, rice_off[t, c], rice_len[t, c])
            fits = fits and range_fits(sym_buf, esc_off[t, c], n_esc[t, c] * width)
        if not fits:
            raise IndexError("_compact_tiles: a tile's piece lies outside the scratch")
    rice = np.empty(ro[ntiles], np.uint8)
    syms = np.empty(so[ntiles], np.uint8)
    escs = np.empty(eo[ntiles], np.uint8)
    for t in nb.prange(ntiles):
        r = ro[t]
        e = eo[t]
        for c in range(nclasses):
            move_bytes(rice, r, rice_buf, rice_off[t, c], rice_len[t, c])
            r += rice_len[t, c]
            move_bytes(escs, e, sym_buf, esc_off[t, c], n_esc[t, c] * width)
            e += n_esc[t, c] * width
        move_bytes(syms, so[t], sym_buf, sym_off[t], ns[t])
    return rice, syms, escs


@nb.njit(inline="always", cache=True)
def rans_start(buf, pa, aend):
    """The initial rANS state of a tile's stream ``buf[pa:aend]`` (its first 4 bytes): returns
    ``(x, pa, err)``, ``err`` 4 when the stream is shorter than that and 5 when the state is
    out of range."""
    if aend - pa < 4:
        return 0, pa, 4
    x = np.int64(buf[pa]) | (np.int64(buf[pa + 1]) << 8) | (np.int64(buf[pa + 2]) << 16) | (np.int64(buf[pa + 3]) << 24)
    if x < RANS_L or x >= (RANS_L << 8):
        return x, pa + 4, 5
    return x, pa + 4, 0


@nb.njit(inline="always", cache=True)
def rans_symbol(buf, x, pa, aend, freq, cum, slot2sym):
    """Decode one symbol from the rANS state ``x`` reading at ``buf[pa:aend]``: returns
    ``(symbol, x, pa, err)``, ``err`` 6 when the stream runs out.

    Renormalising takes at most two bytes (a state >= RANS_L falls to at least
    RANS_L >> SCALE_BITS, which two bytes bring back above RANS_L), and how many is a coin
    flip for the branch predictor, so both candidate bytes are read and the state chosen
    without a branch: a loop here cost a sixth of the decoder in mispredictions."""
    slot = x & ((1 << SCALE_BITS) - 1)
    s = slot2sym[np.uint64(slot)]  # unsigned indices: no negative-index fix-ups in the loop
    x = freq[s] * (x >> SCALE_BITS) + slot - cum[s]
    one = x < RANS_L
    two = (x << 8) < RANS_L  # after one byte b, (x << 8) | b < RANS_L exactly when this holds
    if pa + 2 <= buf.size:  # always but at the very end of the buffer
        b0 = np.int64(buf[np.uint64(pa)])
        b1 = np.int64(buf[np.uint64(pa + 1)])
    else:
        b0 = np.int64(buf[pa]) if pa < buf.size else 0
        b1 = 0
    x1 = (x << 8) | b0
    x = ((x1 << 8) | b1) if two else (x1 if one else x)
    pa += np.int64(one) + np.int64(two)
    if pa > aend:  # a byte this symbol needed lies past the tile's rANS bytes
        return s, x, pa, 6
    return s, x, pa, 0


@nb.njit(inline="always", cache=True)
def _top_up(acc, nbits, word):
    """Add to an LSB-first reader's register ``acc`` (``nbits`` <= 63 held, zero above them)
    the low whole bytes of ``word`` that fit: returns ``(bytes taken, acc, nbits)``, at
    least 56 bits held after it, none taken at 56 or more."""
    take = (63 - nbits) >> 3
    acc |= (word & ((1 << (take << 3)) - 1)) << nbits
    return take, acc, nbits + (take << 3)


@nb.njit(inline="always", cache=True)
def rice_gap(buf, p, rend, acc, nbits, k, lowmask, tile):
    """Read one Rice(k) gap from the LSB-first reader ``(buf, p, rend, acc, nbits)``: returns
    ``(gap, p, acc, nbits, err)``, ``err`` 1 when the bits run past ``rend`` and 2 for a
    unary part longer than a tile. ``acc`` holds ``nbits`` <= 63 unread bits, the rest of it
    is zero.

    Away from the end of the bits the reader tops up on every call, from one 8-byte
    little-endian read and without a branch (whether a refill was due is a coin flip for the
    predictor); near the end it reads byte by byte."""
    if p + 8 <= rend:  # whole bytes up to 63 bits (none when nbits > 55)
        take, acc, nbits = _top_up(acc, nbits, np.int64(load_u64le(buf, p)))
        p += take
    elif nbits < 32:
        while nbits <= 55 and p < rend:
            acc |= np.int64(buf[p]) << nbits
            p += 1
            nbits += 8
    q = 0
    while True:
        ones = np.int64(cttz64(np.uint64(~acc)))  # <= nbits: acc is zero above nbits
        if ones < nbits:
            q += ones
            acc >>= ones + 1
            nbits -= ones + 1
            break
        q += nbits
        acc = 0
        nbits = 0
        if p >= rend:
            return 0, p, acc, nbits, 1
        if q > tile:
            return 0, p, acc, nbits, 2
        while nbits <= 55 and p < rend:
            acc |= np.int64(buf[p]) << nbits
            p += 1
            nbits += 8
    if nbits < k:
        while nbits <= 55 and p < rend:
            acc |= np.int64(buf[p]) << nbits
            p += 1
            nbits += 8
        if nbits < k:
            return 0, p, acc, nbits, 1
    return (q << k) | (acc & lowmask), p, acc >> k, nbits - k, 0


def apply_tiles(buf, target, numel, tile, width, ns, ks, rice, rans, esc, offs, freq, cum, slot2sym, sign, limit):
    """Decode each tile and add (``sign`` 1) or subtract (-1) its differences in ``target``.

    Only the first ``limit[t]`` changes of tile ``t`` are applied (decoding stops there when
    ``limit[t] < ns[t]``, which is how an apply is undone). Returns ``(errs, done)``: an
    ``entropy.ERRORS`` code per tile (0 when valid) and how many changes each tile wrote.
    A position is written only after it was decoded and checked to lie inside its tile.

    A ``sparse`` stream passes its rANS tables (``freq``, ``cum``, ``slot2sym``); a
    ``huffman`` stream passes None, None and ``huffman.decoder_table`` (``rans`` then holds
    each tile's value bytes), and numba compiles that form apart, with no rANS in it.
    """
    return _decode_tiles(buf, target, None, None, numel, tile, width, ns, ks, rice, rans, esc, offs, freq, cum,
                         slot2sym, sign, limit)


def decode_tiles(buf, numel, tile, width, ns, ks, rice, rans, esc, offs, freq, cum, slot2sym, out_pos, out_diff):
    """Decode every tile into positions and differences (at prefix-sum offsets of ``ns``);
    the per-tile error codes. The same kernel as ``apply_tiles``, so both accept exactly the
    same streams."""
    errs, _ = _decode_tiles(buf, out_diff[:0], out_pos, out_diff, numel, tile, width, ns, ks, rice, rans, esc, offs,
                            freq, cum, slot2sym, 1, ns)
    return errs


@nb.njit(inline="always", cache=True)
def _value_bits(buf, q, acc, nbits):
    """Top the Huffman reader ``(q, acc, nbits)`` of ``_apply_huffman_tile`` (at most 63 bits
    held; at 56 or more it takes nothing) up to at least 56 bits with one 8-byte load: near
    the end of ``buf`` the 8 bytes that end it, shifted down, and zero bytes past its end
    (what ``huffman.symbol`` reads there), ``q`` going on past it. ``buf.size`` >= 8."""
    have = buf.size - q
    if have >= 8:
        word = np.int64(load_u64le(buf, q))
    elif have > 0:
        word = np.int64(load_u64le(buf, buf.size - 8) >> np.uint64((8 - have) << 3))
    else:
        word = np.int64(0)
    take, acc, nbits = _top_up(acc, nbits, word)
    return q + take, acc, nbits


@nb.njit(cache=True, nogil=True)
def value_table(table, sym2diff):
    """``huffman.decoder_table`` with each symbol's difference in its entry, for 8- and
    16-bit elements: ``diff << 16 | escape << 4 | length``, escape set for ESC (whose
    difference is in the escape bytes). One load a change finds both."""
    out = np.empty(table.size, np.uint32)
    for j in range(table.size):
        s = np.int64(table[j] >> np.uint16(4))
        ln = np.uint32(table[j] & np.uint16(15))
        if s == ESC:
            out[j] = ln | np.uint32(16)
        else:
            out[j] = ln | (np.uint32(sym2diff[s]) << np.uint32(16))
    return out


@nb.njit(inline="always", cache=True)
def _rice_gap_unchecked(acc, k, lowmask):
    """``(gap, bits used)`` of the Rice code at the bottom of ``acc``, with no check that the
    register holds all of it (the caller checks the bits used against the bits held). Shifts
    are taken mod 64, so a code longer than the register gives a wrong gap, never undefined
    behaviour, and then uses more bits than it holds."""
    ones = np.int64(cttz64(np.uint64(~acc)))
    return (ones << k) | ((acc >> ((ones + 1) & 63)) & lowmask), ones + 1 + k


@nb.njit(inline="always", cache=True)
def _huffman_change(buf, target, p, rend, hq, hacc, hbits, aend_bits, e, eend, width, k, lowmask, tile, prev, tile_end,
                    vtab, sign, mask, acc, nbits):
    """Apply one change of ``_apply_huffman_tile`` with every check made, from the readers'
    state (value bits ``hq, hacc, hbits`` holding at least ``MAX_BITS``, Rice bits ``p, acc,
    nbits``): returns ``(p, hq, hacc, hbits, e, prev, acc, nbits, err)``, the change written
    only when ``err`` is 0."""
    hmask = np.int64((1 << huffman.MAX_BITS) - 1)
    entry = vtab[np.uint64(hacc & hmask)]
    ln = np.int64(entry & np.uint32(15))
    hacc >>= ln
    hbits -= ln
    if (hq << 3) - hbits > aend_bits:
        return p, hq, hacc, hbits, e, prev, acc, nbits, 6
    d = np.uint64(entry >> np.uint32(16))
    if entry & np.uint32(16):
        if e + width > eend:
            return p, hq, hacc, hbits, e, prev, acc, nbits, 8
        d = np.uint64(buf[np.uint64(e)])
        if width == 2:
            d |= np.uint64(buf[np.uint64(e + 1)]) << np.uint64(8)
        e += width
        if sign < 0:
            d = (np.uint64(0) - d) & mask
    g, used = _rice_gap_unchecked(acc, k, lowmask)
    if used <= nbits:
        acc >>= used
        nbits -= used
    else:
        g, p, acc, nbits, err = rice_gap(buf, p, rend, acc, nbits, k, lowmask, tile)
        if err:
            return p, hq, hacc, hbits, e, prev, acc, nbits, err
    cur = prev + 1 + g
    if cur >= tile_end:
        return p, hq, hacc, hbits, e, prev, acc, nbits, 2
    at = np.uint64(cur)
    target[at] = np.uint64(target[at]) + d
    return p, hq, hacc, hbits, e, cur, acc, nbits, 0


@nb.njit(inline="always", cache=True)
def _apply_huffman_tile(buf, target, p, rend, pa, aend_bits, e, eend, width, k, lowmask, tile, prev, tile_end, lim,
                        vtab, sign, mask):
    """Apply the first ``lim`` changes of a Huffman tile of 8- or 16-bit elements, the value
    and Rice bits held in registers: returns ``(applied, p, acc, nbits, pa, e, n_esc, err)``,
    the state the loop of ``_decode_tiles`` ends with, for its end-of-tile checks.

    Why a loop of its own: ``huffman.symbol`` reads each symbol at a bit position, which puts
    an 8-byte load on every change's dependency chain (position, load, shift, table load,
    position), and ``rice_gap`` tops its reader up on every call, another load on the other
    chain. Here both readers are topped up to at least 56 bits once per group of four
    changes, which then holds four value codes (``MAX_BITS`` each at most) and, nearly
    always, four Rice codes, so the group is decoded with no check in between: symbol and
    difference in one load of ``value_table`` each, four gaps from the register. The group
    is written only if every check the one-change path makes would have passed (no escape,
    its value bits inside the tile's, its Rice codes inside the bits held, its last position
    inside the tile); otherwise ``_huffman_change`` applies the next up to four changes one
    by one, with every check. So the writes, error codes and ending state are those of the
    bit-position loop, which still reads every other form (a test holds the two to the same
    verdicts on damaged streams). The group saves the checks and the hard-to-predict
    refill branches of one change at a time: ``bench codec`` on a 2-vCPU Intel host, 6 runs
    alternating with the one-change loop, median decode+apply 3.19 -> 4.08 GB/s (see
    PERFORMANCE.md). ``rend`` >= 8."""
    hq = pa >> 3
    hacc = 0
    hbits = 0
    acc = 0
    nbits = 0
    e0 = e
    err = 0
    applied = 0
    hmask = np.int64((1 << huffman.MAX_BITS) - 1)
    vmask = np.uint32(15)
    while applied < lim:
        hq, hacc, hbits = _value_bits(buf, hq, hacc, hbits)
        if p + 8 <= rend:  # the Rice reader's top-up of rice_gap, once a group
            take, acc, nbits = _top_up(acc, nbits, np.int64(load_u64le(buf, p)))
            p += take
        if lim - applied >= 4 and (hq << 3) - hbits + 4 * huffman.MAX_BITS <= aend_bits:
            v1 = vtab[np.uint64(hacc & hmask)]
            h = hacc >> np.int64(v1 & vmask)
            v2 = vtab[np.uint64(h & hmask)]
            h >>= np.int64(v2 & vmask)
            v3 = vtab[np.uint64(h & hmask)]
            h >>= np.int64(v3 & vmask)
            v4 = vtab[np.uint64(h & hmask)]
            h >>= np.int64(v4 & vmask)
            g1, u1 = _rice_gap_unchecked(acc, k, lowmask)
            a = acc >> (u1 & 63)
            g2, u2 = _rice_gap_unchecked(a, k, lowmask)
            a >>= u2 & 63
            g3, u3 = _rice_gap_unchecked(a, k, lowmask)
            a >>= u3 & 63
            g4, u4 = _rice_gap_unchecked(a, k, lowmask)
            a >>= u4 & 63
            c1 = prev + 1 + g1
            c2 = c1 + 1 + g2
            c3 = c2 + 1 + g3
            c4 = c3 + 1 + g4  # gaps are >= 0: c4 inside the tile puts all four there
            used = u1 + u2 + u3 + u4  # each >= 1: a sum within nbits (<= 63) had no shift wrap
            if ((v1 | v2 | v3 | v4) & np.uint32(16)) == 0 and used <= nbits and c4 < tile_end:
                target[np.uint64(c1)] = np.uint64(target[np.uint64(c1)]) + np.uint64(v1 >> np.uint32(16))
                target[np.uint64(c2)] = np.uint64(target[np.uint64(c2)]) + np.uint64(v2 >> np.uint32(16))
                target[np.uint64(c3)] = np.uint64(target[np.uint64(c3)]) + np.uint64(v3 >> np.uint32(16))
                target[np.uint64(c4)] = np.uint64(target[np.uint64(c4)]) + np.uint64(v4 >> np.uint32(16))
                hacc = h
                hbits -= np.int64((v1 & vmask) + (v2 & vmask) + (v3 & vmask) + (v4 & vmask))
                acc = a
                nbits -= used
                prev = c4
                applied += 4
                continue
        for _ in range(min(4, lim - applied)):
            if hbits < huffman.MAX_BITS:
                hq, hacc, hbits = _value_bits(buf, hq, hacc, hbits)
            p, hq, hacc, hbits, e, prev, acc, nbits, err = _huffman_change(
                buf, target, p, rend, hq, hacc, hbits, aend_bits, e, eend, width, k, lowmask, tile, prev, tile_end,
                vtab, sign, mask, acc, nbits)
            if err:
                break
            applied += 1
        if err:
            break
    return applied, p, acc, nbits, (hq << 3) - hbits, e, (e - e0) // width, err


@parallel_kernel
def _decode_tiles(buf, target, out_pos, out_diff, numel, tile, width, ns, ks, rice, rans, esc, offs, freq, cum, slot2sym,
                  sign, limit):
    """The decoder: each change goes into ``target`` in place (``out_pos`` and ``out_diff``
    None), or into ``out_pos``/``out_diff`` at the tile's prefix-sum offset. The choice is
    made when the kernel is typed (numba prunes the branch on ``None``), so the apply loop
    carries no code of the other."""
    ntiles = ns.size
    errs = np.zeros(ntiles, np.int64)
    done = np.zeros(ntiles, np.int64)
    starts = np.zeros(ntiles + 1, np.int64)
    for t in range(ntiles):
        starts[t + 1] = starts[t] + ns[t]
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * width)
    sym2diff = np.zeros(NSYM, np.uint64)
    for s in range(ESC):
        mag = np.uint64(s // 2 + 1)
        v = (((~mag) + np.uint64(1)) & mask) if s & 1 else mag
        if sign < 0:
            v = (np.uint64(0) - v) & mask
        sym2diff[s] = v
    vtab = np.zeros(1, np.uint32)
    if freq is None:  # nested ifs on None: numba prunes them where the kernel is typed
        if out_pos is None:
            if width <= 2:  # the form _apply_huffman_tile applies
                vtab = value_table(slot2sym, sym2diff)
    for t in nb.prange(ntiles):
        n = ns[t]
        lim = min(n, limit[t])
        if lim == 0:
            continue
        k = ks[t]
        if k > MAX_K:
            errs[t] = 9
            continue
        tile_start = t * tile
        tile_end = min(tile_start + tile, numel)
        p = offs[t]
        rend = p + rice[t]
        aend = rend + rans[t]
        if freq is None:  # Huffman: pa is a bit position, aend_bits where the value bits end
            x = 0
            pa = rend << 3
        else:
            x, pa, err = rans_start(buf, rend, aend)
            if err:
                errs[t] = err
                continue
        aend_bits = aend << 3
        e = aend
        eend = aend + esc[t] * width
        n_esc = 0
        acc = 0
        nbits = 0
        prev = tile_start - 1
        err = 0
        lowmask = (1 << k) - 1
        applied = 0
        rest = lim
        if freq is None:
            if out_pos is None:
                if width <= 2 and rend >= 8:
                    applied, p, acc, nbits, pa, e, n_esc, err = _apply_huffman_tile(
                        buf, target, p, rend, pa, aend_bits, e, eend, width, k, lowmask, tile, prev, tile_end, lim,
                        vtab, sign, mask)
                    rest = 0
        for i in range(rest):
            if freq is None:
                s, pa, err = huffman.symbol(buf, pa, aend_bits, slot2sym)
            else:
                s, x, pa, err = rans_symbol(buf, x, pa, aend, freq, cum, slot2sym)
            if err:
                break
            if s == ESC:
                n_esc += 1
                if e + width > eend:
                    err = 8
                    break
                d = np.uint64(0)
                for c in range(width):
                    d |= np.uint64(buf[e]) << np.uint64(8 * c)
                    e += 1
                if sign < 0:
                    d = (np.uint64(0) - d) & mask
            else:
                d = sym2diff[np.uint64(s)]
            g, p, acc, nbits, err = rice_gap(buf, p, rend, acc, nbits, k, lowmask, tile)
            if err:
                break
            cur = prev + 1 + g
            if cur >= tile_end:
                err = 2
                break
            if out_pos is not None:
                out_pos[starts[t] + i] = cur
                out_diff[starts[t] + i] = d
            else:
                target[np.uint64(cur)] = np.uint64(target[np.uint64(cur)]) + d
            applied += 1
            prev = cur
        done[t] = applied
        if err == 0 and lim == n:
            if p != rend or nbits >= 8 or acc != 0:
                err = 3
            elif (not huffman.ends_cleanly(buf, pa, aend_bits)) if freq is None else (pa != aend or x != RANS_L):
                err = 7
            elif n_esc != esc[t]:
                err = 8
        errs[t] = err
    return errs, done
