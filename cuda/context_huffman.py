"""Context-Huffman streams (mode ``context_huffman``, ``cuda/FORMAT.md`` 2.7) for 16-bit floats:
change positions coded per class of the old value's magnitude (as mode ``context``), value
symbols Huffman-coded in position order, each with its class's code.

How it is fast: per block of 64 elements, one vector compare gives the change mask and one per
threshold the class masks; ``pext`` packs each class's change bits into that class's member
bitmap (``pdep`` puts them back when decoding), so no change needs a rank or a select. The
Rice gaps are walked off those bitmaps, and the values are coded and decoded in one pass in
position order with a table lookup per symbol (the class's table, ``huffman``), never a
branch per bit. Tiles are independent: ``prange`` over tiles gives the same bytes for any
number of threads.

Invariants:
- A class is a function of the old bits alone; a tile's class masks are computed before any
  change of the tile is written, so decoding writes in place (each element once, in position
  order). Taking a patch out needs the (offset, difference) pairs the apply kept
  (``context_codec.ContextUndo``).
- Decoded positions ascend. Every read is bounds-checked; errors are ``entropy.ERRORS`` codes
  per tile, and a tile found damaged has its writes so far listed so they can be undone.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from weftboard.cuda import entropy, huffman, tile_decode
from weftboard.cuda.bit_deposit import pdep64, pext64
from weftboard.cuda.bitops import ctpop64, cttz64, load_u64le, mag_ge_mask64
from weftboard.cuda.context_codec import (
    MAX_THRESHOLDS,
    ContextUndo,
    check_thresholds,
    class_masks,
    class_of,
    class_prefix,
    ge_elems,
    unapply,
)
from weftboard.cuda.entropy import ESC, MAX_DELTA, MAX_K, NSYM
from weftboard.cuda.huffman import MAX_BITS
from weftboard.cuda.jit import parallel_kernel, serial_kernels
from weftboard.cuda.scratch import pooled
from weftboard.cuda.tile_assembly import assemble_tiles
from weftboard.cuda.tile_blocks import block_mask, rice_k

_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
FAST_BITS = 9  # the decoder's first lookup: 2**9 entries a class, all classes' tables in L1
_LONG = np.uint16(15)  # a first-lookup entry of a code longer than FAST_BITS (no code has length 15)


def rice_stride(tile: int, nclasses: int) -> int:
    """Rice scratch per tile: every class's pieces fit (checked per tile before writing)."""
    return tile // 2 + 64 * nclasses


@parallel_kernel
def _scan_encode(a, b, thr, tile, rice_buf, rstride, sym_buf, esc_buf):
    """Per tile: change and class masks, each class's changes packed into its member bitmap
    and Rice-coded at ``rice_buf[t * rstride:]``, then the changes in position order: symbol
    ``class * NSYM + symbol`` (uint16) at ``sym_buf[t * tile:]``, escapes at
    ``esc_buf[2 * t * tile:]``. A tile whose Rice pieces might not fit is set in ``over``."""
    numel = a.size
    nthr = thr.size
    ncls = nthr + 1
    ntiles = (numel + tile - 1) // tile
    ns = np.zeros((ntiles, ncls), np.int64)
    ks = np.zeros((ntiles, ncls), np.int64)
    rice_off = np.zeros((ntiles, ncls), np.int64)
    rice_len = np.zeros((ntiles, ncls), np.int64)
    n_esc = np.zeros(ntiles, np.int64)
    over = np.zeros(ntiles, np.int64)
    hist = np.zeros((ntiles, ncls * NSYM), np.int32)
    mask = np.uint64(0xFFFF)
    wbits = np.uint64(15)
    for t in nb.prange(ntiles):
        s = t * tile
        e = min(s + tile, numel)
        nblocks = (e - s + 63) // 64
        stride = nblocks + 1
        masks = np.empty(nblocks, np.uint64)
        mb = np.empty(ncls * stride, np.uint64)
        cur = np.zeros(ncls, np.uint64)
        members = np.zeros(ncls, np.int64)
        nchg = np.zeros(ncls, np.int64)
        for bi in range(nblocks):
            bs = s + 64 * bi
            m = block_mask(a, b, bs, e)
            masks[bi] = m
            full = bs + 64 <= e
            upper = _ALL if full else (np.uint64(1) << np.uint64(e - bs)) - np.uint64(1)
            for c in range(ncls):
                if c < nthr:
                    ge = mag_ge_mask64(a, bs, thr[c]) if full else ge_elems(a, bs, e, thr[c])
                    cm = upper & ~ge
                    upper = ge
                else:
                    cm = upper
                x = pext64(m, cm)
                cnt = np.int64(ctpop64(cm))
                nchg[c] += np.int64(ctpop64(x))
                sh = members[c] & 63
                acc = cur[c] | (x << np.uint64(sh))
                if sh + cnt >= 64:
                    mb[c * stride + (members[c] >> 6)] = acc
                    acc = (x >> np.uint64(1)) >> np.uint64(63 - sh)
                cur[c] = acc
                members[c] += cnt
        total = 0
        need = 0
        for c in range(ncls):
            if members[c] & 63:
                mb[c * stride + (members[c] >> 6)] = cur[c]
            n = nchg[c]
            total += n
            if n:
                k = rice_k(members[c] - n, n)
                ks[t, c] = k
                need += ((((members[c] - n) >> k) + n * (k + 1)) >> 3) + 16  # + rice_put's slack
        if total == 0:
            continue
        if need > rstride:
            over[t] = 1
            continue
        p = t * rstride
        for c in range(ncls):
            n = nchg[c]
            ns[t, c] = n
            rice_off[t, c] = p
            if n == 0:
                continue
            k = ks[t, c]
            lowmask = (1 << k) - 1
            acc = 0
            nbits = 0
            last = -1
            for w in range((members[c] + 63) >> 6):
                x = mb[c * stride + w]
                while x:
                    idx = 64 * w + np.int64(cttz64(x))
                    x &= x - np.uint64(1)
                    p, acc, nbits = entropy.rice_put(rice_buf, p, acc, nbits, idx - last - 1, k, lowmask)
                    last = idx
            p = entropy.rice_flush(rice_buf, p, acc, nbits)
            rice_len[t, c] = p - rice_off[t, c]
        q = t * tile
        qe = 2 * t * tile
        for bi in range(nblocks):
            m = masks[bi]
            while m:
                i = s + 64 * bi + np.int64(cttz64(m))
                m &= m - np.uint64(1)
                ov = np.uint64(a[i])
                d = (np.uint64(b[i]) - ov) & mask
                sym = entropy.symbol(d, mask, wbits)
                v = class_of(ov, thr) * NSYM + sym
                sym_buf[q] = v
                q += 1
                hist[t, v] += 1
                if sym == ESC:
                    esc_buf[qe] = np.uint8(d & np.uint64(0xFF))
                    esc_buf[qe + 1] = np.uint8(d >> np.uint64(8))
                    qe += 2
        n_esc[t] = (qe - 2 * t * tile) >> 1
    counts = np.zeros(ncls * NSYM, np.int64)
    for t in range(ntiles):
        for v in range(ncls * NSYM):
            counts[v] += hist[t, v]
    return ns, ks, rice_off, rice_len, n_esc, counts, over


@nb.njit(cache=True, nogil=True)
def _finish(prefix, ns, ks, rice_off, rice_len, n_esc, counts, tile, rice_buf, sym_buf, esc_buf, value_buf):
    """The stream from a scan: each class's code from its histogram (tables after ``prefix``),
    each tile's symbols coded at ``huffman.tile_bound`` strides in ``value_buf``, then the
    assembly (``tile_assembly.assemble_tiles``: directory, then per tile Rice pieces | values |
    escapes)."""
    ntiles, ncls = ns.shape
    head = np.empty(prefix.size + ncls * huffman.TABLE_BYTES, np.uint8)
    head[: prefix.size] = prefix
    p = prefix.size
    codes = np.zeros(ncls * NSYM, np.uint64)
    for c in range(ncls):
        cnt = counts[c * NSYM:(c + 1) * NSYM]
        if cnt.sum() == 0:
            p = entropy.write_varint(head, p, 0)
            continue
        lengths = huffman.code_lengths(cnt)
        p = huffman.write_table(head, p, lengths, cnt > 0)
        codes[c * NSYM:(c + 1) * NSYM] = huffman.encoder_codes(lengths)
    tot = ns.sum(axis=1)
    starts = np.zeros(ntiles, np.int64)
    q = 0
    for t in range(ntiles):
        starts[t] = q
        if tot[t]:
            q += huffman.tile_bound(tot[t])
    if q > value_buf.size:
        raise IndexError("context_huffman: the value scratch is too small")
    lens = huffman.encode_tiles(sym_buf, np.arange(ntiles) * tile, tot, codes, value_buf, starts)
    ends = np.zeros(ntiles + 1, np.int64)
    for t in range(ntiles):
        ends[t + 1] = starts[t] + lens[t]
    esc2 = np.zeros((ntiles, ncls), np.int64)
    esc_off = np.zeros((ntiles, ncls), np.int64)
    for t in range(ntiles):
        esc2[t, 0] = n_esc[t]
        esc_off[t, :] = 2 * t * tile
    return assemble_tiles(head[:p], np.zeros((0, NSYM), np.int64), ns, ks, rice_len, starts, ends, esc2, 2,
                          rice_buf, rice_off, esc_buf, esc_off, value_buf)


def huffman_estimate(tot: np.ndarray, counts: np.ndarray, numel: int, tile: int) -> int:
    """About the bytes of the ``huffman`` stream of the same changes, from what a context scan
    counted (changes per tile, symbols per class): Huffman-coded symbols of the whole tensor's
    histogram, Rice-coded positions as geometric gaps at each tile's density, escapes and a
    directory entry per tile. For choosing between the coders, not a bound."""
    marginal = np.ascontiguousarray(counts.reshape(-1, NSYM).sum(axis=0), dtype=np.int64)
    value_bits = int((huffman.code_lengths(marginal) * marginal).sum())
    sizes = np.minimum(tile, numel - np.arange(tot.size, dtype=np.int64) * tile)
    rice_bits = 0
    for n, span in zip(tot.tolist(), sizes.tolist(), strict=True):
        if n:
            k = rice_k(span - n, n)
            rice_bits += n * (k + 1) + ((span - n) >> k) + 7
    return (value_bits + rice_bits) // 8 + 2 * int(marginal[ESC]) + 6 * tot.size + 1 + 2 * int((marginal > 0).sum())


def encode_context_huffman(old: np.ndarray, new: np.ndarray, thresholds: np.ndarray, tile: int,
                           scratch: dict | None = None) -> tuple[int, np.ndarray | None, int]:
    """(number of changed elements, the ``context_huffman`` stream, ``huffman_estimate``) of
    two uint16 views of one 16-bit float tensor, in one read of both. The stream is None when
    nothing changed or a tile's positions did not fit their scratch: the caller picks another
    mode."""
    thr = np.ascontiguousarray(thresholds, dtype=np.int64)
    check_thresholds(thr)
    if old.dtype != np.uint16 or new.dtype != np.uint16 or old.shape != new.shape or old.ndim != 1:
        raise ValueError(f"context_huffman coding needs two flat uint16 arrays, got {old.dtype}/{new.dtype}")
    if not old.flags.c_contiguous or not new.flags.c_contiguous or tile > 1 << 16 or tile < 64 or tile % 64:
        raise ValueError("context_huffman coding needs contiguous arrays and tiles of 64 to 65536 elements")
    ntiles = (old.size + tile - 1) // tile
    rstride = rice_stride(tile, thr.size + 1)
    rice_buf = pooled(scratch, "context_huffman_rice", ntiles * rstride)
    sym_buf = pooled(scratch, "context_huffman_syms", 2 * ntiles * tile).view(np.uint16)
    esc_buf = pooled(scratch, "context_huffman_escapes", 2 * ntiles * tile)
    ns, ks, rice_off, rice_len, n_esc, counts, over = _scan_encode(old, new, thr, tile, rice_buf, rstride, sym_buf,
                                                                   esc_buf)
    if over.any():
        return int(np.count_nonzero(old != new)), None, 0
    total = int(ns.sum())
    if total == 0:
        return 0, None, 0
    tot = ns.sum(axis=1)
    value_buf = pooled(scratch, "context_huffman_values", int(sum(huffman.tile_bound(int(n)) for n in tot[tot > 0])))
    with serial_kernels():  # a few ms of work: not worth two more parallel regions (their barriers)
        stream = _finish(class_prefix(thr), ns, ks, rice_off, rice_len, n_esc, counts, tile, rice_buf, sym_buf,
                         esc_buf, value_buf)
    return total, stream, huffman_estimate(tot, counts, old.size, tile)


@nb.njit(cache=True, nogil=True)
def _parse(buf, numel, tile, changed):
    """(err, thresholds, ns, ks, rice, value bytes, escapes, offsets, decoder tables (classes,
    2**MAX_BITS), their first 2**FAST_BITS entries with ``_LONG`` where the code is longer);
    ``err`` as ``entropy.DIR_ERRORS``, 10 for bad thresholds."""
    end = buf.size
    nthr, p = entropy.read_varint(buf, 0, end)
    bad = nthr < 1 or nthr > MAX_THRESHOLDS
    thr = np.zeros(max(nthr, 1) if not bad else 1, np.int64)
    if not bad:
        for j in range(nthr):
            thr[j], p = entropy.read_varint(buf, p, end)
            if p < 0 or thr[j] < 1 or thr[j] >= 0x8000 or thr[j] % 0x80 or (j and thr[j] <= thr[j - 1]):
                bad = True
                break
    ncls = thr.size + 1
    lengths = np.zeros((ncls, NSYM), np.int64)
    present = np.zeros((ncls, NSYM), np.bool_)
    nsyms = np.ones(ncls, np.int64)
    tables = np.zeros((ncls, 1 << MAX_BITS), np.uint16)
    fast = np.zeros((ncls, 1 << FAST_BITS), np.uint16)
    err = 10 if bad else 0
    for c in range(ncls):
        if err:
            break
        err, p, nsyms[c] = huffman.read_table(buf, p, end, lengths[c], present[c])
    if err:
        p = end
    derr, ns, ks, rice, vals, esc, offs = entropy.parse_directory(buf, p, ncls, numel, tile, 2, changed, nsyms)
    if err == 0:
        err = derr
    if err == 0:
        for c in range(ncls):
            if nsyms[c]:
                tables[c] = huffman.decoder_table(lengths[c], present[c])
                for j in range(1 << FAST_BITS):  # codes longer than FAST_BITS: look in the whole table
                    fast[c, j] = tables[c, j] if (tables[c, j] & 15) <= FAST_BITS else _LONG
    return err, thr, ns, ks, rice, vals, esc, offs, tables, fast


@nb.njit(inline="always", cache=True)
def _symbol(buf, hp, tables, fast, c):
    """(symbol, next bit) of the code at bit ``hp``, looked up in class ``c``'s small table
    (in L1 for every class), or its whole table for the rare long code."""
    at = hp >> 3
    if at + 8 <= buf.size:
        word = load_u64le(buf, at)
    else:
        word = np.uint64(0)
        for j in range(min(8, buf.size - at)):
            word |= np.uint64(buf[at + j]) << np.uint64(8 * j)
    bits = word >> np.uint64(hp & 7)
    entry = fast[c, bits & np.uint64((1 << FAST_BITS) - 1)]
    if entry == _LONG:
        entry = tables[c, bits & np.uint64((1 << MAX_BITS) - 1)]
    return np.int64(entry >> np.uint16(4)), hp + np.int64(entry & np.uint16(15))


@parallel_kernel
def _decode(buf, old, numel, tile, thr, ns, ks, rice, vals, esc, offs, tables, fast, out_off, out_diff, write):
    """Each tile's changes in position order into ``out_off`` (offset in the tile) and
    ``out_diff`` at the prefix sums of its change counts; ``write`` also adds them to ``old``
    in place. Returns (an ``entropy.ERRORS`` code per tile, changes written per tile)."""
    ntiles, ncls = ns.shape
    nthr = ncls - 1
    errs = np.zeros(ntiles, np.int64)
    done = np.zeros(ntiles, np.int64)
    totals = ns.sum(axis=1)
    starts = np.zeros(ntiles + 1, np.int64)
    for t in range(ntiles):
        starts[t + 1] = starts[t] + totals[t]
    sym2diff = np.zeros(NSYM, np.uint16)
    for s in range(ESC):
        mag = s // 2 + 1
        sym2diff[s] = (65536 - mag) if s & 1 else mag
    for t in nb.prange(ntiles):
        if totals[t] == 0:
            continue
        err = 0
        for c in range(ncls):
            if ns[t, c] and ks[t, c] > MAX_K:
                err = 9
        if err:
            errs[t] = err
            continue
        ts = t * tile
        te = min(ts + tile, numel)
        nblocks = (te - ts + 63) // 64
        cls = np.empty((ncls, nblocks), np.uint64)
        members = np.zeros(ncls, np.int64)
        for bi in range(nblocks):
            class_masks(old, ts + 64 * bi, te, thr, cls, bi)
            for c in range(ncls):
                members[c] += np.int64(ctpop64(cls[c, bi]))
        base = np.zeros(ncls + 1, np.int64)
        for c in range(ncls):
            base[c + 1] = base[c] + (members[c] >> 6) + 2
        mb = np.zeros(base[ncls], np.uint64)
        p = offs[t]
        for c in range(ncls):
            rend = p + rice[t, c]
            acc = 0
            nbits = 0
            k = ks[t, c]
            lowmask = (1 << k) - 1
            j = -1
            for _ in range(ns[t, c]):
                g, p, acc, nbits, err = tile_decode.rice_gap(buf, p, rend, acc, nbits, k, lowmask, tile)
                if err:
                    break
                j += g + 1
                if j >= members[c]:
                    err = 2
                    break
                mb[base[c] + (j >> 6)] |= np.uint64(1) << np.uint64(j & 63)
            if err == 0 and (p != rend or nbits >= 8 or acc != 0):
                err = 3
            if err:
                break
            p = rend
        if err:
            errs[t] = err
            continue
        hp = 8 * p
        hend = 8 * (p + vals[t])
        e = p + vals[t]
        eend = e + 2 * esc[t]
        o = starts[t]
        offc = np.zeros(ncls, np.int64)
        for bi in range(nblocks):
            m = np.uint64(0)
            for c in range(ncls):
                cm = cls[c, bi]
                w = base[c] + (offc[c] >> 6)
                sh = np.uint64(offc[c] & 63)
                bits = (mb[w] >> sh) | ((mb[w + 1] << np.uint64(1)) << (np.uint64(63) - sh))
                m |= pdep64(bits, cm)
                offc[c] += np.int64(ctpop64(cm))
            while m:
                bit = np.int64(cttz64(m))
                m &= m - np.uint64(1)
                i = ts + 64 * bi + bit
                ov = old[i]
                c = 0
                for jj in range(nthr):
                    c += np.int64((np.int64(ov) & 0x7FFF) >= thr[jj])
                s, hp = _symbol(buf, hp, tables, fast, c)
                if hp > hend:
                    err = 6
                    break
                if s == ESC:
                    if e + 2 > eend:
                        err = 8
                        break
                    d = np.uint16(np.int64(buf[e]) | (np.int64(buf[e + 1]) << 8))
                    e += 2
                else:
                    d = sym2diff[s]
                out_off[o] = i - ts
                out_diff[o] = d
                if write:
                    old[i] = ov + d
                o += 1
            if err:
                break
        if err == 0:
            if not huffman.ends_cleanly(buf, hp, hend):
                err = 7
            elif e != eend:
                err = 8
        errs[t] = err
        done[t] = o - starts[t]
    return errs, done


class ContextHuffmanStream:
    """A ``context_huffman`` stream whose classes, tables and directory were parsed and checked."""

    def __init__(self, buf: np.ndarray, numel: int, tile: int, changed: int) -> None:
        if tile > 1 << 16:
            raise ValueError(f"context_huffman streams need tiles of at most 65536 elements, not {tile}")
        if (numel + tile - 1) // tile > buf.size:  # every tile has at least one directory byte
            raise ValueError(f"{buf.size} bytes cannot hold the directory of {numel} elements in tiles of {tile}")
        err, thr, ns, ks, rice, vals, esc, offs, tables, fast = _parse(buf, numel, tile, changed)
        if err == 10:
            raise ValueError("the class thresholds are truncated or malformed")
        if err:
            raise ValueError(entropy.DIR_ERRORS.get(int(err), f"directory error {err}"))
        self.buf, self.numel, self.tile, self.changed, self.thr = buf, numel, tile, changed, thr
        self.ns, self.ks, self.rice, self.vals, self.esc, self.offs = ns, ks, rice, vals, esc, offs
        self.tables, self.fast = tables, fast

    def decode(self, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ascending positions, differences as uint16) against ``old``, the uint16 bits the
        stream applies to; raises ValueError naming the first bad tile."""
        off, diff = self._run(old, False)
        tile_starts = np.repeat(np.arange(self.ns.shape[0], dtype=np.int64) * self.tile, self.ns.sum(axis=1))
        return tile_starts + off, diff

    def apply_(self, target: np.ndarray) -> ContextUndo:
        """Patch the uint16 bits ``target`` in place; what it takes to undo it (4 bytes per
        change). On a bad tile every write is undone before ValueError is raised."""
        return ContextUndo(target, *self._run(target, True), self.ns, self.tile)

    def _run(self, old: np.ndarray, write: bool) -> tuple[np.ndarray, np.ndarray]:
        if old.dtype != np.uint16 or old.size != self.numel or not old.flags.c_contiguous:
            raise ValueError(f"context_huffman streams decode against the {self.numel} old uint16 bits they apply "
                             f"to, got {old.dtype}/{old.size}")
        off = np.empty(self.changed, np.uint16)
        diff = np.empty(self.changed, np.uint16)
        errs, done = _decode(self.buf, old, self.numel, self.tile, self.thr, self.ns, self.ks, self.rice, self.vals,
                             self.esc, self.offs, self.tables, self.fast, off, diff, write)
        bad = np.flatnonzero(errs)
        if bad.size:
            if write:
                unapply(old, off, diff, self.ns, done, self.tile)
            t = int(bad[0])
            raise ValueError(f"tile {t} ({bad.size} bad tiles): {entropy.ERRORS.get(int(errs[t]), 'unknown error')}")
        return off, diff


assert MAX_DELTA < 0x8000  # sym2diff above writes magnitudes as uint16 two's complement
