"""Context-coded streams (mode ``context``, ``cuda/FORMAT.md`` 2.6) for 16-bit floats: change
positions and value symbols coded per class of the old value's magnitude.

Invariants:
- A class is a function of the old bits alone, and a tile's classes are computed before any
  change of the tile is written, so decoding writes in place even when a change moves an element
  to another class. Taking a patch out needs the (position, difference) pairs (``ContextUndo``).
- Decoded positions are unique and grouped by class inside a tile, not ascending.
- Every read is bounds-checked; errors are ``entropy.ERRORS`` codes per tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np
import torch

from weftboard.cuda import (
    entropy,
    tile_assembly,
    tile_blocks,
    tile_decode,
    tile_encode,
    tile_scan,
)
from weftboard.cuda.bit_deposit import pdep64
from weftboard.cuda.bitops import ctpop64, cttz64, mag_ge_mask64
from weftboard.cuda.entropy import ESC, MAX_DELTA, MAX_K, NSYM, RANS_L, diff16
from weftboard.cuda.jit import parallel_kernel
from weftboard.cuda.scratch import fresh_scratch

MAX_THRESHOLDS = 7
CLASSES = 5  # the encoder's choice: 4.31 position bits per change on the bench model (4.42 with 4, 4.27 with 6)
_EXPONENT = {torch.bfloat16: (7, 0xFF), torch.float16: (10, 0x1F)}  # shift and mask of the exponent field
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
# Scan scratch per tile: symbols (1 byte per element) then escapes (2 bytes per element), so no
# tile can run out of room for them; only the pages a tile writes are ever touched.
_SYM_STRIDE = 3


def supports(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can be context coded (16-bit floats: magnitude is monotone
    in the bits below the sign)."""
    return dtype in _EXPONENT


def choose_thresholds(old: np.ndarray, dtype: torch.dtype, classes: int = CLASSES) -> np.ndarray:
    """Class bounds from a sample of the old bits (all up to 4,096 elements, else 64 runs of 64
    spread from the first to the last: 128 cache lines): ``classes - 1`` binades ending one
    below the median exponent, so the top class holds the large weights that rarely change.
    Empty when the tensor has no spread to use (all zeros, subnormals)."""
    shift, emask = _EXPONENT[dtype]
    if old.size == 0:
        return np.empty(0, np.int64)
    whole = old.size <= 4096
    starts = np.zeros(1, np.int64) if whole else np.arange(64) * (old.size - 64) // 63
    run = old.size if whole else 64
    med = _median_exponent(old, starts, run, shift, emask)
    exps = [e for e in range(med - classes + 1, med) if e >= 1]
    return np.array([e << shift for e in exps], np.int64)


@nb.njit(cache=True, nogil=True)
def _median_exponent(old, starts, run, shift, emask):
    """The median exponent of the sample ``old[s:s + run]`` for each ``s`` in ``starts``: the
    mean of its two middle order statistics (one when the sample is odd), truncated."""
    counts = np.zeros(emask + 1, np.int64)
    n = 0
    for s in starts:
        for j in range(s, s + run):
            counts[(np.int64(old[j]) >> shift) & emask] += 1
            n += 1
    lo = hi = -1
    below = 0
    for e in range(emask + 1):  # the first exponent whose cumulative count passes each rank
        below += counts[e]
        if lo < 0 and below > (n - 1) // 2:
            lo = e
        if hi < 0 and below > n // 2:
            hi = e
    return (lo + hi) // 2


@nb.njit(inline="always", cache=True)
def ge_elems(a, bs, e, t):
    m = np.uint64(0)
    for j in range(e - bs):
        if (np.int64(a[bs + j]) & 0x7FFF) >= t:
            m |= np.uint64(1) << np.uint64(j)
    return m


@nb.njit(inline="always", cache=True)
def class_masks(a, bs, e, thr, cls, bi):
    """``cls[c, bi]``: which of elements ``bs .. min(bs + 64, e) - 1`` are in class ``c``."""
    full = bs + 64 <= e
    upper = _ALL if full else (np.uint64(1) << np.uint64(e - bs)) - np.uint64(1)  # classes >= c
    for c in range(thr.size):
        ge = mag_ge_mask64(a, bs, thr[c]) if full else ge_elems(a, bs, e, thr[c])
        cls[c, bi] = upper & ~ge
        upper = ge
    cls[thr.size, bi] = upper


@nb.njit(inline="always", cache=True)
def class_of(x, thr):
    c = 0
    for j in range(thr.size):
        c += np.int64((np.int64(x) & 0x7FFF) >= thr[j])
    return c


@parallel_kernel
def _scan_encode(a, b, thr, tile, rice_buf, rstride, sym_buf, update, src, cast, fix_buf, fstride):
    """Per tile: change and class masks, then one walk over the changes in position order,
    each coded into its class's Rice piece, symbol run and escape run (per tile: Rice pieces at
    ``rice_off``, then ``_SYM_STRIDE * tile`` bytes of symbols and escapes; ``update`` and
    ``cast`` as in ``tile_scan.scan_encode_tiles``).

    Every piece's size is bounded before the walk (Rice bits at most ``sum(gap >> k) + n *
    (k + 1)`` per class, and the gaps of a class add up to at most its members), so a tile
    either fits and is coded and folded in one walk, or is left exactly as it was and set in
    ``over`` (as is, under ``cast``, a tile holding a NaN or subnormal master value).

    ``update`` also records each folded change whose class the fold changed (its offset in the
    tile and old bits, at ``fix_buf[2 * t * fstride:]``): with those put back, the folded view
    has the old classes again, which is what decoding the stream needs (``decode_folded``)."""
    numel = a.size
    nclasses = thr.size + 1
    ntiles = (numel + tile - 1) // tile
    ns = np.zeros((ntiles, nclasses), np.int64)
    ks = np.zeros((ntiles, nclasses), np.int64)
    rice_off = np.zeros((ntiles, nclasses), np.int64)
    rice_len = np.zeros((ntiles, nclasses), np.int64)
    n_esc = np.zeros((ntiles, nclasses), np.int64)
    nfix = np.zeros(ntiles, np.int64)
    over = np.zeros(ntiles, np.int64)
    hist = np.zeros((ntiles, nclasses, NSYM), np.int64)
    mask = np.uint64(0xFFFF)
    wbits = np.uint64(15)
    for t in nb.prange(ntiles):
        s = t * tile
        e = min(s + tile, numel)
        nblocks = (e - s + 63) // 64
        masks = np.empty(nblocks, np.uint64)
        cls = np.empty((nclasses, nblocks), np.uint64)
        planes = np.zeros((3, nblocks), np.uint64)  # bit j of each element's class, per block
        total = 0
        special = np.uint64(0)
        for bi in range(nblocks):
            bs = s + 64 * bi
            m, sp = tile_blocks.scan_block(a, b, src, bs, e, cast)
            special |= sp
            masks[bi] = m
            class_masks(a, bs, e, thr, cls, bi)
            for c in range(1, nclasses):
                for j in range(3):
                    if (c >> j) & 1:
                        planes[j, bi] |= cls[c, bi]
            total += np.int64(ctpop64(m))
        if special or total == 0:
            over[t] = np.int64(special != 0)
            ns[t, :] = 0
            continue
        p0 = t * rstride
        need = 0
        members = np.zeros(nclasses, np.int64)
        for c in range(nclasses):  # class by class: the sums stay in registers
            n = 0
            mc = 0
            for bi in range(nblocks):
                cm = cls[c, bi]
                n += np.int64(ctpop64(masks[bi] & cm))
                mc += np.int64(ctpop64(cm))
            ns[t, c] = n
            members[c] = mc
            if n:
                k = tile_blocks.rice_k(members[c] - n, n)
                ks[t, c] = k
                rice_off[t, c] = p0 + need
                need += ((((members[c] - n) >> k) + n * (k + 1)) >> 3) + 16  # + slack for rice_put's stores
        if need > rstride or (update and total > fstride):
            over[t] = 1
            ns[t, :] = 0
            continue
        gaps = np.empty(total, np.int64)  # Rice-coded class by class after the walk
        last = np.full(nclasses, -1, np.int64)
        count = np.zeros(nclasses, np.int64)
        sp = np.empty(nclasses, np.int64)  # each class's next symbol, then escape, slot
        ep = np.empty(nclasses, np.int64)
        sb = _SYM_STRIDE * t * tile
        run = 0
        for c in range(nclasses):
            sp[c] = sb + run
            ep[c] = sb + tile + 2 * run
            run += ns[t, c]
        fb = 2 * t * fstride
        nf = 0
        for bi in range(nblocks):
            m = masks[bi]
            while m != 0:
                bit = cttz64(m)
                m &= m - np.uint64(1)
                i = s + 64 * bi + np.int64(bit)
                ov = np.uint64(a[i])
                c = np.int64(((planes[0, bi] >> bit) & np.uint64(1)) | (((planes[1, bi] >> bit) & np.uint64(1)) << np.uint64(1))
                             | (((planes[2, bi] >> bit) & np.uint64(1)) << np.uint64(2)))
                idx = count[c] + np.int64(ctpop64(cls[c, bi] & ((np.uint64(1) << bit) - np.uint64(1))))
                gaps[sp[c] - sb] = idx - last[c] - 1
                last[c] = idx
                nv = tile_blocks.new_element_bits(b, src, i, cast)
                d = (nv - ov) & mask
                if update:
                    # Classes change only with the exponent bits (thresholds are binade bounds).
                    if (nv ^ ov) & np.uint64(0x7F80) and class_of(nv, thr) != c:
                        fix_buf[fb + 2 * nf] = i - s
                        fix_buf[fb + 2 * nf + 1] = ov
                        nf += 1
                    a[i] = nv
                sym = entropy.symbol(d, mask, wbits)
                sym_buf[sp[c]] = sym
                sp[c] += 1
                hist[t, c, sym] += 1
                if sym == ESC:
                    q = ep[c]
                    sym_buf[q] = np.uint8(d & np.uint64(0xFF))
                    sym_buf[q + 1] = np.uint8(d >> np.uint64(8))
                    ep[c] = q + 2
            for c in range(nclasses):
                count[c] += np.int64(ctpop64(cls[c, bi]))
        run = 0
        for c in range(nclasses):
            p = rice_off[t, c]
            acc = 0
            nbits = 0
            k = ks[t, c]
            lowmask = (1 << k) - 1
            for j in range(run, run + ns[t, c]):
                p, acc, nbits = entropy.rice_put(rice_buf, p, acc, nbits, gaps[j], k, lowmask)
            rice_len[t, c] = entropy.rice_flush(rice_buf, p, acc, nbits) - rice_off[t, c]
            n_esc[t, c] = (ep[c] - (sb + tile + 2 * run)) // 2
            run += ns[t, c]
        nfix[t] = nf
    return ns, ks, rice_off, rice_len, n_esc, nfix, hist.sum(axis=0), over


def check_thresholds(thr: np.ndarray) -> None:
    if (not 1 <= thr.size <= MAX_THRESHOLDS or thr[0] < 1 or thr[-1] > 0x7FFF or np.any(thr[1:] <= thr[:-1])
            or np.any(thr % 0x80)):
        raise ValueError(f"context thresholds must be 1 to {MAX_THRESHOLDS} strictly ascending multiples of 0x80 "
                         f"below 0x8000, got {thr.tolist()}")


def _check_pair(old: np.ndarray, new: np.ndarray, cast: bool, tile: int) -> None:
    tile_scan.check_scan_pair(old, new, tile, cast)
    if old.dtype != np.uint16:
        raise ValueError(f"context coding needs 16-bit float bits (uint16), got {old.dtype}")
    if tile > 1 << 16:
        raise ValueError(f"context tiles are at most 65536 elements (offsets are uint16), got {tile}")


def class_prefix(thr: np.ndarray) -> np.ndarray:
    out = np.empty(10 * (thr.size + 1), np.uint8)
    p = entropy.write_varint(out, 0, thr.size)
    for t in thr:
        p = entropy.write_varint(out, p, int(t))
    return out[:p]


def _run_scan(old: np.ndarray, new: np.ndarray, thr: np.ndarray, tile: int, update: bool, cast: bool,
              scratch: dict | None) -> tuple:
    check_thresholds(thr)
    _check_pair(old, new, cast, tile)
    ntiles = (old.size + tile - 1) // tile
    rstride, fstride = tile + tile_blocks.RICE_SLACK, tile
    need = (ntiles * rstride, ntiles * _SYM_STRIDE * tile, ntiles * 2 * fstride)
    bufs = None if scratch is None else scratch.get("context_scan")
    if bufs is None or any(buf.size < n for buf, n in zip(bufs, need, strict=True)):
        bufs = (fresh_scratch(need[0]), fresh_scratch(need[1]),
                torch.empty(max(need[2], 1), dtype=torch.int16).numpy().view(np.uint16))
        if scratch is not None:
            scratch["context_scan"] = bufs
    rice_buf, sym_buf, fix_buf = bufs
    b, src = (old[:0], new) if cast else (new, np.empty(0, np.uint32))
    out = _scan_encode(old, b, thr, tile, rice_buf, rstride, sym_buf, update, src, cast, fix_buf, fstride)
    return out, rice_buf, sym_buf, fix_buf, fstride


def _escape_offsets(ns: np.ndarray, tile: int) -> np.ndarray:
    """Where each (tile, class) escape run starts in the scan's scratch (see ``_scan_encode``)."""
    before = np.cumsum(ns, axis=1) - ns
    return _SYM_STRIDE * tile * np.arange(ns.shape[0], dtype=np.int64)[:, None] + tile + 2 * before


def encode_context(old: np.ndarray, new: np.ndarray, thresholds: np.ndarray, tile: int) -> tuple[int, np.ndarray | None]:
    """(number of changed elements, the ``context`` stream) of two uint16 views of one 16-bit
    float tensor, in one read of both. The stream is None when nothing changed or a tile did
    not fit its scratch (a pathologically dense tile): the caller picks another mode."""
    thr = np.ascontiguousarray(thresholds, dtype=np.int64)
    (ns, ks, rice_off, rice_len, n_esc, _, counts, over), rice_buf, sym_buf, _, _ = _run_scan(
        old, new, thr, tile, False, False, None)
    total = int(ns.sum())
    if over.any():
        return int((old != new).sum()), None
    if total == 0:
        return 0, None
    return total, tile_encode.finish_scanned_tiles(ns, ks, rice_len, n_esc, counts, 2, rice_buf, rice_off, sym_buf,
                                                _SYM_STRIDE * tile * np.arange(ns.shape[0], dtype=np.int64), sym_buf,
                                                _escape_offsets(ns, tile), class_prefix(thr))


@dataclass(frozen=True)
class ContextScan:
    """Pass 1 of a ``context`` stream over a piece of a tensor (whole tiles), compacted: the
    context counterpart of ``tile_encode.TileScan``, for a caller that reads a tensor piece by
    piece and folds it as it goes (the publisher). ``fix_pos``/``fix_old``: the folded
    changes whose class the fold changed (positions in the piece, old bits); ``overflowed``:
    tiles left alone (too dense, or a NaN or subnormal master value under ``cast``)."""

    numel: int
    ns: np.ndarray  # (tiles, classes), as are the next three
    ks: np.ndarray
    rice_len: np.ndarray
    n_esc: np.ndarray
    rice: np.ndarray
    syms: np.ndarray
    escs: np.ndarray
    counts: np.ndarray  # (classes, NSYM)
    fix_pos: np.ndarray
    fix_old: np.ndarray
    overflowed: np.ndarray

    @property
    def changed(self) -> int:
        return int(self.ns.sum())


@dataclass(frozen=True)
class ContextScans:
    """A tensor's context scans, piece by piece in order, and the thresholds they all used."""

    thresholds: np.ndarray
    pieces: list[ContextScan]

    @property
    def changed(self) -> int:
        return sum(p.changed for p in self.pieces)


def scan_tiles(old: np.ndarray, new: np.ndarray, thresholds: np.ndarray, tile: int, scratch: dict | None = None, *,
               update: bool = False, cast: bool = False) -> ContextScan:
    """Pass 1 of the ``context`` stream of ``old``/``new`` with the tensor's ``thresholds``
    (every piece of a tensor must use the same); ``update`` folds ``new`` into ``old``; ``cast``:
    ``new`` holds fp32 bits whose bf16 cast is the new version (as ``tile_encode.scan_tiles``)."""
    thr = np.ascontiguousarray(thresholds, dtype=np.int64)
    (ns, ks, rice_off, rice_len, n_esc, nfix, counts, over), rice_buf, sym_buf, fix_buf, fstride = _run_scan(
        old, new, thr, tile, update, cast, scratch)
    rice, syms, escs = tile_assembly.compact_tiles(ns.sum(axis=1), rice_len, n_esc, 2, rice_buf, rice_off, sym_buf,
                                                 _SYM_STRIDE * tile * np.arange(ns.shape[0], dtype=np.int64),
                                                 _escape_offsets(ns, tile))
    fixes = [fix_buf[2 * t * fstride: 2 * (t * fstride + n)].reshape(-1, 2) for t, n in enumerate(nfix.tolist()) if n]
    fix = np.concatenate(fixes) if fixes else np.empty((0, 2), np.uint16)
    tile_of = np.repeat(np.flatnonzero(nfix), nfix[nfix > 0])
    return ContextScan(old.size, ns, ks, rice_len, n_esc, rice, syms, escs, counts,
                       tile_of * tile + fix[:, 0].astype(np.int64), fix[:, 1].copy(), np.flatnonzero(over).astype(np.int64))


def finish_context(tensor: ContextScans) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the ``context`` stream, fixup positions, fixup old bits) of a tensor from the scans of
    its pieces (at least one change in all)."""
    scans = tensor.pieces
    stream = tile_encode.finish_pieces(scans, 2, class_prefix(np.ascontiguousarray(tensor.thresholds, dtype=np.int64)))
    offsets = np.cumsum([0] + [s.numel for s in scans[:-1]])
    fix_pos = np.concatenate([s.fix_pos + off for s, off in zip(scans, offsets, strict=True)])
    return stream, fix_pos, np.concatenate([s.fix_old for s in scans])


def decode_folded(stream: ContextStream, folded: np.ndarray, fix_pos: np.ndarray,
                  fix_old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, differences) of a stream whose changes were already folded into
    ``folded`` (the publisher's view): the recorded fixups give back the old classes."""
    base = folded.copy()
    base[fix_pos] = fix_old
    return stream.decode(base)


@parallel_kernel
def _decode(buf, old, numel, tile, thr, ns, ks, rice, rans, esc, offs, freq, cum, slot2sym, out_off, out_diff, write):
    """Each tile's changes into ``out_off`` (offsets in the tile, uint16: tiles are at most
    65536 elements) and ``out_diff`` at the prefix sums of its change counts, classes from ``old``, which ``write`` also patches in place (each tile's classes
    are taken before its first write); (an ``entropy.ERRORS`` code per tile, changes written
    per tile)."""
    ntiles, nclasses = ns.shape
    errs = np.zeros(ntiles, np.int64)
    done = np.zeros(ntiles, np.int64)
    totals = ns.sum(axis=1)
    starts = np.zeros(ntiles + 1, np.int64)
    for t in range(ntiles):
        starts[t + 1] = starts[t] + totals[t]
    sym2diff = np.zeros(NSYM, np.uint16)
    for s in range(ESC):
        sym2diff[s] = diff16(s)
    for t in nb.prange(ntiles):
        if totals[t] == 0:
            continue
        err = 0
        for c in range(nclasses):
            if ns[t, c] and ks[t, c] > MAX_K:
                err = 9
        if err:
            errs[t] = err
            continue
        tile_start = t * tile
        tile_end = min(tile_start + tile, numel)
        nblocks = (tile_end - tile_start + 63) // 64
        cls = np.empty((nclasses, nblocks), np.uint64)
        for bi in range(nblocks):
            class_masks(old, tile_start + 64 * bi, tile_end, thr, cls, bi)
        pa = offs[t] + rice[t].sum()
        aend = pa + rans[t]
        x, pa, err = tile_decode.rans_start(buf, pa, aend)
        if err:
            errs[t] = err
            continue
        e = aend
        eend = aend + esc[t] * 2
        n_esc = 0
        o = starts[t]
        rend = offs[t]
        for c in range(nclasses):  # class c's Rice piece follows class c-1's
            p = rend
            rend = p + rice[t, c]
            acc = 0
            nbits = 0
            k = ks[t, c]
            lowmask = (1 << k) - 1
            bi = 0
            cm = cls[c, 0]
            fc, cu, s2s = freq[c], cum[c], slot2sym[c]
            for _ in range(ns[t, c]):
                s, x, pa, err = tile_decode.rans_symbol(buf, x, pa, aend, fc, cu, s2s)
                if err:
                    break
                if s == ESC:
                    n_esc += 1
                    if e + 2 > eend:
                        err = 8
                        break
                    d = np.uint16(np.int64(buf[e]) | (np.int64(buf[e + 1]) << 8))
                    e += 2
                else:
                    d = sym2diff[s]
                g, p, acc, nbits, err = tile_decode.rice_gap(buf, p, rend, acc, nbits, k, lowmask, tile)
                if err:
                    break
                while True:  # skip g class members, then take the next one
                    pc = np.int64(ctpop64(cm))
                    if g < pc:
                        break
                    g -= pc
                    bi += 1
                    if bi >= nblocks:
                        err = 2
                        break
                    cm = cls[c, bi]
                if err:
                    break
                bit = np.int64(cttz64(pdep64(np.uint64(1) << np.uint64(g), cm)))  # cm's set bit with g below it
                cm &= (_ALL << np.uint64(bit)) << np.uint64(1)  # members after this one
                out_off[o] = 64 * bi + bit
                out_diff[o] = d
                i = tile_start + 64 * bi + bit
                if write:
                    old[i] = old[i] + d
                o += 1
            if err == 0 and (p != rend or nbits >= 8 or acc != 0):
                err = 3
            if err:
                break
        if err == 0:
            if pa != aend or x != RANS_L:
                err = 7
            elif n_esc != esc[t]:
                err = 8
        errs[t] = err
        done[t] = o - starts[t]
    return errs, done


@parallel_kernel
def unapply(target, off, diff, ns, done, tile):
    """Subtract the first ``done[t]`` differences of each tile (laid out as ``_decode`` wrote
    them) from ``target``."""
    ntiles = ns.shape[0]
    starts = np.zeros(ntiles + 1, np.int64)
    for t in range(ntiles):
        starts[t + 1] = starts[t] + ns[t].sum()
    for t in nb.prange(ntiles):
        for o in range(starts[t], starts[t] + done[t]):
            i = t * tile + np.int64(off[o])
            target[i] = target[i] - diff[o]


class ContextStream:
    """A ``context`` stream whose classes, tables and directory were parsed and checked."""

    def __init__(self, buf: np.ndarray, numel: int, tile: int, changed: int) -> None:
        nthr, p = entropy.read_varint(buf, 0, buf.size)
        if not 1 <= nthr <= MAX_THRESHOLDS:
            raise ValueError("the class thresholds are truncated or malformed")
        thr = np.zeros(nthr, np.int64)
        for j in range(nthr):
            thr[j], p = entropy.read_varint(buf, p, buf.size)
            if p < 0:
                raise ValueError("the class thresholds are truncated or malformed")
        try:
            check_thresholds(thr)
        except ValueError as exc:
            raise ValueError(f"bad class thresholds: {exc}") from None
        if tile > 1 << 16:
            raise ValueError(f"context streams need tiles of at most 65536 elements, not {tile}")
        if (numel + tile - 1) // tile > buf.size - p:  # every tile has at least one directory byte
            raise ValueError(f"{buf.size} bytes cannot hold the directory of {numel} elements in tiles of {tile}")
        err, freq, ns, ks, rice, rans, esc, offs = entropy.parse_table_and_directory(buf, p, nthr + 1, numel, tile, 2,
                                                                                      changed)
        if err:
            raise ValueError(entropy.DIR_ERRORS.get(int(err), f"directory error {err}"))
        tables = [entropy.decoder_tables(f) for f in freq]
        self.buf, self.numel, self.tile, self.changed, self.thr = buf, numel, tile, changed, thr
        self.ns, self.ks, self.rice, self.rans, self.esc, self.offs, self.freq = ns, ks, rice, rans, esc, offs, freq
        self.cum = np.stack([c for c, _ in tables])
        self.slot2sym = np.stack([s for _, s in tables])

    def decode(self, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions, differences as uint16) against ``old``, the uint16 bits the stream
        applies to; raises ValueError naming the first bad tile."""
        off, diff = self._run(old, False)
        tile_starts = np.repeat(np.arange(self.ns.shape[0], dtype=np.int64) * self.tile, self.ns.sum(axis=1))
        return tile_starts + off, diff

    def apply_(self, target: np.ndarray) -> ContextUndo:
        """Patch the uint16 bits ``target`` in place; what it takes to undo it (4 bytes per
        change). On a bad tile every write is undone before ValueError is raised."""
        return ContextUndo(target, *self._run(target, True), self.ns, self.tile)

    def _run(self, old: np.ndarray, write: bool) -> tuple[np.ndarray, np.ndarray]:
        if old.dtype != np.uint16 or old.size != self.numel or not old.flags.c_contiguous:
            raise ValueError(f"context streams decode against the {self.numel} old uint16 bits they apply to, got "
                             f"{old.dtype}/{old.size}")
        off = np.empty(self.changed, np.uint16)
        diff = np.empty(self.changed, np.uint16)
        errs, done = _decode(self.buf, old, self.numel, self.tile, self.thr, self.ns, self.ks, self.rice, self.rans,
                             self.esc, self.offs, self.freq, self.cum, self.slot2sym, off, diff, write)
        bad = np.flatnonzero(errs)
        if bad.size:
            if write:
                unapply(old, off, diff, self.ns, done, self.tile)
            t = int(bad[0])
            raise ValueError(f"tile {t} ({bad.size} bad tiles): {entropy.ERRORS.get(int(errs[t]), 'unknown error')}")
        return off, diff


class ContextUndo:
    """The (offset in tile, difference) pairs one ``apply_`` wrote: the new bits alone do not
    give the old classes back, so this is how a context stream is taken out again."""

    def __init__(self, target: np.ndarray, off: np.ndarray, diff: np.ndarray, ns: np.ndarray, tile: int) -> None:
        self.target, self.off, self.diff, self.ns, self.tile = target, off, diff, ns, tile

    def __call__(self) -> None:
        unapply(self.target, self.off, self.diff, self.ns, self.ns.sum(axis=1), self.tile)


assert MAX_DELTA < 0x8000  # sym2diff above writes magnitudes as uint16 two's complement
