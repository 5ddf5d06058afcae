"""The fused decoders of the tiled streams (``huffman`` and ``sparse``): ``apply_tiles`` decodes a
stream straight into the tensor (``sign=-1`` takes it back out), ``decode_tiles`` writes
(position, difference) arrays instead, for CUDA destinations.

Invariants: every read is bounds-checked; each tile reports how many changes it wrote before any
error (``entropy.ERRORS`` codes), so the caller undoes exactly those and a corrupt stream never
leaves a tensor half-patched.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from weftboard.cuda import huffman
from weftboard.cuda.bitops import (
    cttz64,
    load_u64le,
)
from weftboard.cuda.entropy import ESC, MAX_K, NSYM, RANS_L, SCALE_BITS
from weftboard.cuda.jit import parallel_kernel


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


@nb.njit(inline="always", cache=True)
def value_entry(s, length, diff):
    """A value table's entry: ``diff << 16 | escape << 4 | length``, escape set (and no
    difference: it is in the escape bytes) for ESC."""
    if s == ESC:
        return np.uint32(length) | np.uint32(16)
    return np.uint32(length) | (np.uint32(diff) << np.uint32(16))


@nb.njit(cache=True, nogil=True)
def value_table(table, sym2diff):
    """``huffman.decoder_table`` with each symbol's difference in its entry, for 8- and
    16-bit elements: ``diff << 16 | escape << 4 | length``, escape set for ESC (whose
    difference is in the escape bytes). One load a change finds both."""
    out = np.empty(table.size, np.uint32)
    for j in range(table.size):
        s = np.int64(table[j] >> np.uint16(4))
        out[j] = value_entry(s, table[j] & np.uint16(15), sym2diff[s])
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
    if freq is None:  # noqa: SIM102 (nested ifs on None: numba prunes them where the kernel is typed)
        if out_pos is None:  # noqa: SIM102 (see above)
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
        if freq is None:  # noqa: SIM102 (see above)
            if out_pos is None:  # noqa: SIM102 (see above)
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
