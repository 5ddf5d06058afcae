"""The decoder of ``context_huffman`` streams (``cuda/FORMAT.md`` 2.7): any number of tensors'
streams in one compiled call, one parallel loop over all their tiles (``decode_batch``).

How it is fast: a tile's classes come from vector compares of its old bits (a class whose
every member changed, with no Rice piece, deposits its class mask whole; a piece with k 0 is
the class's member bitmap inverted, read 64 members a load), each other class's Rice gaps are
read from a 64-bit register topped up with one 8-byte load, four gaps a round with no check
between them (a byte at a time only near the end of the piece, or for a code longer than the
register holds), the tile's changed offsets are packed in order a block at a time
(compress-stores), and the values are read from a register four at a time, one load of the
class's 512-entry table giving each code's length and difference (one change at a time, with
the full 4096-entry table, for a code longer than ``FAST_BITS`` or an escape). One parallel
region for a whole patch: a region per tensor ended at a barrier that waited, on a shared
host, for a descheduled thread (``jit.serial_kernels``).

Invariants: every tile's changes are decoded in ascending position order and written to
``out_off``/``out_diff`` at the prefix sums of the tiles' change counts before (or as) they are
added to the old bits, so a tile found damaged part way lists exactly the writes it made;
errors are ``entropy.ERRORS`` codes, the same per tile as the bit-position decoder gave. The
streams, tables and targets are passed by address: the caller keeps them alive for the call.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from weftboard.cuda import huffman, tile_decode
from weftboard.cuda.bit_deposit import pdep64
from weftboard.cuda.bitops import array_at, ctpop64, cttz64, load_u64le
from weftboard.cuda.context_codec import class_masks
from weftboard.cuda.entropy import ESC, MAX_K, NSYM, diff16
from weftboard.cuda.jit import parallel_kernel
from weftboard.cuda.tile_blocks import pack_word

FAST_BITS = 9  # the first lookup: 2**9 entries a class (2 KiB), every class's table in L1
LONG = np.uint32(15)  # a first-lookup entry of a code longer than FAST_BITS (no code has length 15)
_FAST_MASK = np.int64((1 << FAST_BITS) - 1)
_FULL_MASK = np.int64((1 << huffman.MAX_BITS) - 1)


@nb.njit(cache=True, nogil=True)
def value_tables(lengths, present):
    """(the ``2**MAX_BITS`` entries, the first ``2**FAST_BITS``) of one class's code (a table
    ``huffman.read_table`` checked: complete, or one symbol of length 0) as ``diff << 16 |
    escape << 4 | length`` (uint32). The first lookup holds every code of at most FAST_BITS bits,
    and ``LONG`` where a longer code begins; the full table holds only the longer codes' entries,
    the only ones a decoder looks up there (each of its indices whose first FAST_BITS bits
    begin a longer code), so the tables take a few hundred stores, not ``2**MAX_BITS``."""
    full = np.zeros(1 << huffman.MAX_BITS, np.uint32)
    fast = np.zeros(1 << FAST_BITS, np.uint32)
    codes = huffman.encoder_codes(lengths)
    for s in range(NSYM):
        d = lengths[s]
        if d == 0 and not present[s]:
            continue
        entry = tile_decode.value_entry(s, d, diff16(s) if s != ESC else 0)
        if d == 0:  # the one symbol of a one-symbol code: every lookup, no bits
            fast[:] = entry
            full[:] = entry
            continue
        code = codes[s] & 0xFFFFFFFF  # its bits in stream order from the lowest
        if d <= FAST_BITS:
            for j in range(code, 1 << FAST_BITS, 1 << d):
                fast[j] = entry
        else:
            fast[code & _FAST_MASK] = LONG
            for j in range(code, 1 << huffman.MAX_BITS, 1 << d):
                full[j] = entry
    return full, fast


@nb.njit(inline="always", cache=True)
def _rice_piece(buf, p, rend, k, n, members, mb, base, tile):
    """Read ``n`` Rice(k) gaps of one class from ``buf[p:rend]`` and set the members they name
    in ``mb[base:]``; returns the error code (0, or ``entropy.ERRORS``' 1, 2 or 3). Four gaps
    a round, unchecked between them, when the register holds all four and the last names a
    member (as ``tile_decode._apply_huffman_tile``); otherwise one gap with every check, so
    the bits set and the verdicts are those of the one-gap loop."""
    lowmask = (1 << k) - 1
    acc = 0
    nbits = 0
    j = -1
    i = 0
    while i < n:
        if i + 4 <= n:  # four gaps from one top-up, when all four are in the register and the class
            if p + 8 <= rend:
                take, acc, nbits = tile_decode._top_up(acc, nbits, np.int64(load_u64le(buf, p)))
                p += take
            g1, u1 = tile_decode._rice_gap_unchecked(acc, k, lowmask)
            x = acc >> (u1 & 63)
            g2, u2 = tile_decode._rice_gap_unchecked(x, k, lowmask)
            x >>= u2 & 63
            g3, u3 = tile_decode._rice_gap_unchecked(x, k, lowmask)
            x >>= u3 & 63
            g4, u4 = tile_decode._rice_gap_unchecked(x, k, lowmask)
            x >>= u4 & 63
            used = u1 + u2 + u3 + u4  # each >= 1: a sum within nbits (<= 63) had no shift wrap
            j1 = j + 1 + g1
            j2 = j1 + 1 + g2
            j3 = j2 + 1 + g3
            j4 = j3 + 1 + g4  # gaps are >= 0: j4 inside the class puts all four there
            if used <= nbits and j4 < members:
                mb[np.uint64(base + (j1 >> 6))] |= np.uint64(1) << np.uint64(j1 & 63)
                mb[np.uint64(base + (j2 >> 6))] |= np.uint64(1) << np.uint64(j2 & 63)
                mb[np.uint64(base + (j3 >> 6))] |= np.uint64(1) << np.uint64(j3 & 63)
                mb[np.uint64(base + (j4 >> 6))] |= np.uint64(1) << np.uint64(j4 & 63)
                acc = x
                nbits -= used
                j = j4
                i += 4
                continue
        # one gap with every check: the last few, a long code, the piece's end or an error
        if nbits < 32 and p + 8 <= rend:
            take, acc, nbits = tile_decode._top_up(acc, nbits, np.int64(load_u64le(buf, p)))
            p += take
        g, used = tile_decode._rice_gap_unchecked(acc, k, lowmask)
        if used <= nbits:
            acc >>= used
            nbits -= used
        else:  # near the end of the piece, or a code longer than the register holds
            g, p, acc, nbits, err = tile_decode.rice_gap(buf, p, rend, acc, nbits, k, lowmask, tile)
            if err:
                return err
        j += g + 1
        if j >= members:
            return 2
        mb[np.uint64(base + (j >> 6))] |= np.uint64(1) << np.uint64(j & 63)
        i += 1
    while nbits <= 55 and p < rend:  # the bytes the lazy top-up left: all padding in a valid piece
        acc |= np.int64(buf[p]) << nbits
        p += 1
        nbits += 8
    if p != rend or nbits >= 8 or acc != 0:
        return 3
    return 0


@nb.njit(cache=True, nogil=True)
def _unary_piece(buf, p, rend, n, members, mb, base):
    """``_rice_piece`` for k 0, 64 members a step: a gap of g is g one-bits and a zero-bit, so
    the piece is the class's member bitmap inverted, up to its last change, then zero bits to
    the byte. The same members set, and a piece refused where the gap by gap reader refuses
    it: fewer than ``n`` changes (1), a change past the class (2), or more than the last
    change's byte, or padding that is not zero (3)."""
    nbits = 8 * (rend - p)
    seen = 0
    for w in range((rend - p + 7) >> 3):
        at = p + 8 * w
        if at + 8 <= rend:
            word = load_u64le(buf, at)
        else:
            word = np.uint64(0)
            for b in range(rend - at):
                word |= np.uint64(buf[at + b]) << np.uint64(8 * b)
        valid = min(64, nbits - 64 * w)
        x = ~word & (np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - valid))
        c = np.int64(ctpop64(x))
        if seen + c >= n:  # the n-th change is in this word: only zero padding may follow it
            top = np.int64(cttz64(pdep64(np.uint64(1) << np.uint64(n - seen - 1), x)))
            pad = valid - top - 1  # the word's bits after the change: ones in x (zero padding)
            if nbits - 64 * w - top - 1 >= 8 or (x >> np.uint64(top)) >> np.uint64(1) != (
                    np.uint64(1) << np.uint64(pad)) - np.uint64(1) or (at + 8 < rend and buf[at + 8] != 0):
                return 3
            if 64 * w + top >= members:
                return 2
            mb[np.uint64(base + w)] = x & (np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(63 - top))
            return 0
        if c and 64 * w >= members:
            return 2
        if 64 * w < members:
            mb[np.uint64(base + w)] = x
        seen += c
    return 1


@parallel_kernel
def decode_batch(buf_addr, buf_size, like_buf, old_addr, numels, like_old, first, thr, nthr, tile, dir_addr,
                 like_dir, full_addr, fast_addr, like_tab, starts, out_off, out_diff, write, pos_rows, lanes_like):
    """Decode the tiles of several ``context_huffman`` streams: stream ``i`` is the
    ``buf_size[i]`` bytes at ``buf_addr[i]`` (at least 8), its old bits the ``numels[i]``
    uint16 at ``old_addr[i]``, its tiles the global tiles ``first[i]:first[i + 1]``, its
    thresholds ``thr[i, :nthr[i]]``, its directory at ``dir_addr[i]`` (``ncls`` = nthr + 1;
    int64: ns, ks and Rice lengths per (tile, class), then value bytes, escapes and payload
    offsets per tile: ``Directory.flat``), its value tables at ``full_addr[i]`` and
    ``fast_addr[i]`` (``value_tables`` per class, one after the other). Each global tile's
    changes go to ``out_off``/``out_diff`` from ``starts[g]``; ``write`` also adds them to the
    old bits. ``pos_rows``: a row of ``tile + 64`` uint16 of scratch per thread (a tile's change
    offsets, packed with compress-stores when ``lanes_like`` is None, else walked). Returns (an
    ``entropy.ERRORS`` code per global tile, changes written per tile)."""
    ntensors = numels.size
    ntiles_all = first[ntensors]
    owner = np.empty(ntiles_all, np.int64)
    for i in range(ntensors):
        owner[first[i]:first[i + 1]] = i
    errs = np.zeros(ntiles_all, np.int64)
    done = np.zeros(ntiles_all, np.int64)
    for g in nb.prange(ntiles_all):
        i = owner[g]
        t = g - first[i]
        ntiles = first[i + 1] - first[i]
        ncls = nthr[i] + 1
        total = starts[g + 1] - starts[g]
        if total == 0:
            continue
        numel = numels[i]
        d = array_at(dir_addr[i], ntiles * (3 * ncls + 3) + 1, like_dir)
        row = t * ncls
        dk = ntiles * ncls
        dr = 2 * ntiles * ncls
        dv = 3 * ntiles * ncls
        err = 0
        for c in range(ncls):
            if d[row + c] and d[dk + row + c] > MAX_K:
                err = 9
        if err:
            errs[g] = err
            continue
        buf = array_at(buf_addr[i], buf_size[i], like_buf)
        old = array_at(old_addr[i], numel, like_old)
        full = array_at(full_addr[i], ncls << huffman.MAX_BITS, like_tab)
        fast = array_at(fast_addr[i], ncls << FAST_BITS, like_tab)
        th = thr[i, :nthr[i]]
        ts = t * tile
        te = min(ts + tile, numel)
        nblocks = (te - ts + 63) // 64
        cls = np.empty((ncls, nblocks), np.uint64)
        members = np.zeros(ncls, np.int64)
        for bi in range(nblocks):
            class_masks(old, ts + 64 * bi, te, th, cls, bi)
        for c in range(ncls):
            mc = 0
            for bi in range(nblocks):
                mc += np.int64(ctpop64(cls[c, bi]))
            members[c] = mc
        base = np.zeros(ncls + 1, np.int64)
        for c in range(ncls):
            base[c + 1] = base[c] + (members[c] >> 6) + 2
        mb = np.zeros(base[ncls], np.uint64)
        p = d[dv + ntiles + ntiles + t]  # the tile's payload offset
        every = np.zeros(ncls, np.bool_)  # classes whose every member changed (no Rice piece)
        for c in range(ncls):
            rend = p + d[dr + row + c]
            n = d[row + c]
            if n == members[c] and rend == p:
                if d[dk + row + c]:
                    err = 9
                    break
                every[c] = True
            elif n:
                if d[dk + row + c] == 0:
                    err = _unary_piece(buf, p, rend, n, members[c], mb, base[c])
                else:
                    err = _rice_piece(buf, p, rend, d[dk + row + c], n, members[c], mb, base[c], tile)
                if err:
                    break
            p = rend
        if err:
            errs[g] = err
            continue
        chg = np.zeros(nblocks, np.uint64)  # the tile's changes, block by block
        for c in range(ncls):  # class by class: the member offset stays in a register
            if d[row + c] == 0:
                continue
            if every[c]:
                for bi in range(nblocks):
                    chg[bi] |= cls[c, bi]
                continue
            off = 0
            b0 = base[c]
            for bi in range(nblocks):
                cm = cls[c, bi]
                w = b0 + (off >> 6)
                sh = np.uint64(off & 63)
                bits = (mb[np.uint64(w)] >> sh) | ((mb[np.uint64(w + 1)] << np.uint64(1)) << (np.uint64(63) - sh))
                chg[bi] |= pdep64(bits, cm)
                off += np.int64(ctpop64(cm))
        prow = pos_rows[nb.get_thread_id()]  # the tile's change offsets in order
        cnt = 0
        for bi in range(nblocks):
            cnt = pack_word(prow, cnt, 64 * bi, chg[bi], lanes_like)
        lut = np.zeros(256, np.int64)  # class << FAST_BITS by the old bits' (x & 0x7FFF) >> 7
        for j in range(th.size):
            for v in range(th[j] >> 7, 256):
                lut[v] += 1 << FAST_BITS
        vlen = d[dv + t]
        hend = 8 * (p + vlen)
        e = p + vlen
        eend = e + 2 * d[dv + ntiles + t]
        hq = p
        hacc = 0
        hbits = 0
        o = starts[g]
        idx = 0
        while idx < cnt:
            if cnt - idx >= 4:  # four changes from one top-up when none is long or escaped
                hq, hacc, hbits = tile_decode._value_bits(buf, hq, hacc, hbits)
                at1 = np.uint64(ts + np.int64(prow[np.uint64(idx)]))
                at2 = np.uint64(ts + np.int64(prow[np.uint64(idx + 1)]))
                at3 = np.uint64(ts + np.int64(prow[np.uint64(idx + 2)]))
                at4 = np.uint64(ts + np.int64(prow[np.uint64(idx + 3)]))
                ov1, ov2, ov3, ov4 = old[at1], old[at2], old[at3], old[at4]
                e1 = fast[np.uint64(lut[np.uint64(ov1 >> np.uint16(7)) & np.uint64(0xFF)] + (hacc & _FAST_MASK))]
                h = hacc >> np.int64(e1 & np.uint32(15))
                e2 = fast[np.uint64(lut[np.uint64(ov2 >> np.uint16(7)) & np.uint64(0xFF)] + (h & _FAST_MASK))]
                h >>= np.int64(e2 & np.uint32(15))
                e3 = fast[np.uint64(lut[np.uint64(ov3 >> np.uint16(7)) & np.uint64(0xFF)] + (h & _FAST_MASK))]
                h >>= np.int64(e3 & np.uint32(15))
                e4 = fast[np.uint64(lut[np.uint64(ov4 >> np.uint16(7)) & np.uint64(0xFF)] + (h & _FAST_MASK))]
                h >>= np.int64(e4 & np.uint32(15))
                ln = np.int64((e1 & np.uint32(15)) + (e2 & np.uint32(15)) + (e3 & np.uint32(15)) + (e4 & np.uint32(15)))
                plain = ((e1 | e2 | e3 | e4) & np.uint32(16)) == 0
                short = (e1 != LONG) & (e2 != LONG) & (e3 != LONG) & (e4 != LONG)
                if plain and short and (hq << 3) - hbits + ln <= hend:
                    d1 = np.uint16(e1 >> np.uint32(16))
                    d2 = np.uint16(e2 >> np.uint32(16))
                    d3 = np.uint16(e3 >> np.uint32(16))
                    d4 = np.uint16(e4 >> np.uint32(16))
                    out_off[np.uint64(o)] = prow[np.uint64(idx)]
                    out_off[np.uint64(o + 1)] = prow[np.uint64(idx + 1)]
                    out_off[np.uint64(o + 2)] = prow[np.uint64(idx + 2)]
                    out_off[np.uint64(o + 3)] = prow[np.uint64(idx + 3)]
                    out_diff[np.uint64(o)] = d1
                    out_diff[np.uint64(o + 1)] = d2
                    out_diff[np.uint64(o + 2)] = d3
                    out_diff[np.uint64(o + 3)] = d4
                    if write:
                        old[at1] = ov1 + d1
                        old[at2] = ov2 + d2
                        old[at3] = ov3 + d3
                        old[at4] = ov4 + d4
                    hacc = h
                    hbits -= ln
                    o += 4
                    idx += 4
                    continue
            # one change with every check: the last few, a long code, an escape or an error
            at = ts + np.int64(prow[np.uint64(idx)])
            idx += 1
            ov = old[np.uint64(at)]  # unsigned indices: no negative-index fix-ups in the loop
            cb = lut[np.uint64(ov >> np.uint16(7)) & np.uint64(0xFF)]
            if hbits < huffman.MAX_BITS:
                hq, hacc, hbits = tile_decode._value_bits(buf, hq, hacc, hbits)
            entry = fast[np.uint64(cb + (hacc & _FAST_MASK))]
            if entry == LONG:
                entry = full[np.uint64((cb << (huffman.MAX_BITS - FAST_BITS)) + (hacc & _FULL_MASK))]
            ln = np.int64(entry & np.uint32(15))
            hacc >>= ln
            hbits -= ln
            if (hq << 3) - hbits > hend:
                err = 6
                break
            if entry & np.uint32(16):
                if e + 2 > eend:
                    err = 8
                    break
                dv16 = np.uint16(np.int64(buf[e]) | (np.int64(buf[e + 1]) << 8))
                e += 2
            else:
                dv16 = np.uint16(entry >> np.uint32(16))
            out_off[np.uint64(o)] = at - ts
            out_diff[np.uint64(o)] = dv16
            if write:
                old[np.uint64(at)] = ov + dv16
            o += 1
        if err == 0:
            if not huffman.ends_cleanly(buf, (hq << 3) - hbits, hend):
                err = 7
            elif e != eend:
                err = 8
        errs[g] = err
        done[g] = o - starts[g]
    return errs, done
