"""Context-Huffman streams (mode ``context_huffman``, ``cuda/FORMAT.md`` 2.7) for 16-bit floats:
change positions coded per class of the old value's magnitude (as mode ``context``), value
symbols Huffman-coded in position order, each with its class's code.

How it is fast: per block of 64 elements, one vector compare gives the change mask and one per
threshold the class masks; ``pext`` packs each class's change bits into that class's member
bitmap (``pdep`` puts them back when decoding), so no change needs a rank or a select. The
Rice gaps are walked off those bitmaps (a class whose every member in a tile changed has no
piece: format 4; a piece with k 0 is the bitmap itself, inverted, stored 64 members at a
time), and the values are coded and decoded in one pass in position order with a table
lookup per symbol (the class's table, ``huffman``), never a branch per bit. Tiles are
independent: one ``prange`` over the tiles of a whole batch of tensors
(``encode_context_huffman_batch``; ``context_apply.decode_batch`` to decode) gives the same
bytes for any number of threads and any batching.

Invariants:
- A class is a function of the old bits alone; a tile's class masks are computed before any
  change of the tile is written, so decoding writes in place (each element once, in position
  order). Taking a patch out needs the (offset, difference) pairs the apply kept
  (``context_codec.ContextUndo``).
- Decoded positions ascend. Every read is bounds-checked; errors are ``entropy.ERRORS`` codes
  per tile, and a tile found damaged has its writes so far listed so they can be undone; a
  batch with a damaged stream undoes every write of the batch before ``BadStream`` is raised.
- A stream is a function of its tensor's (old, new) bits and thresholds alone, not of the
  batch it was coded in (tests hold batched and one-by-one streams to the same bytes).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from weftboard.cuda import entropy, huffman
from weftboard.cuda.bit_deposit import pext64
from weftboard.cuda.bitops import array_at, ctlz64, ctpop64, store_u64le
from weftboard.cuda.context_apply import FAST_BITS, decode_batch, value_tables
from weftboard.cuda.context_codec import (
    MAX_THRESHOLDS,
    ContextUndo,
    check_thresholds,
    class_masks,
    class_prefix,
    unapply,
)
from weftboard.cuda.entropy import ESC, MAX_DELTA, NSYM
from weftboard.cuda.huffman import MAX_BITS
from weftboard.cuda.jit import parallel_kernel, serial_kernels
from weftboard.cuda.scratch import LeasePool, pooled
from weftboard.cuda.tile_assembly import assembly_bound, assembly_head, move_pieces
from weftboard.cuda.tile_blocks import (
    VECTOR_COMPRESS,
    block_mask,
    pack_word,
    rice_k,
    rice_tile_grouped,
)

_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


def rice_stride(tile: int, nclasses: int) -> int:
    """Rice scratch per tile: every class's pieces fit (checked per tile before writing)."""
    return tile // 2 + 64 * nclasses


MAX_CLASSES = MAX_THRESHOLDS + 1


@parallel_kernel
def _scan_batch(addr_a, addr_b, numels, like, first, thr, nthr, tile, rice_buf, rstride, sym_buf, esc_buf, pos_rows,
                code_rows, len_rows, lanes_like):
    """Per tile of every tensor (tensor ``i``: the ``numels[i]`` uint16 at ``addr_a[i]`` (old)
    and ``addr_b[i]`` (new), its thresholds ``thr[i, :nthr[i]]``, global tiles
    ``first[i]:first[i + 1]``), in one parallel loop: change and class masks, each class's
    changes packed into its member bitmap and Rice-coded at ``rice_buf[g * rstride:]``, then the
    changes in position order: symbol ``class * NSYM + symbol`` (uint16) at
    ``sym_buf[g * tile:]``, escapes at ``esc_buf[2 * g * tile:]``. A tile whose Rice pieces
    might not fit is set in ``over``. ``pos_rows`` (``tile + 64`` per thread), ``code_rows``,
    ``len_rows`` (``tile``): scratch per thread for the Rice coder
    (``tile_blocks.rice_tile_grouped``, which makes the same bits as ``entropy.rice_put``, a
    group of codes per append); a class's changed members go to ``pos_rows`` a bitmap word at
    a time with compress-stores when ``lanes_like`` is None, else walked bit by bit (the
    same numbers), and so do the tile's changed offsets for the symbols. Per global tile and class (``MAX_CLASSES`` columns): ns, ks, rice_off,
    rice_len; per tile n_esc, over and the histogram."""
    ntensors = numels.size
    ntiles_all = first[ntensors]
    owner = np.empty(ntiles_all, np.int64)
    for i in range(ntensors):
        owner[first[i]:first[i + 1]] = i
    ns = np.zeros((ntiles_all, MAX_CLASSES), np.int64)
    ks = np.zeros((ntiles_all, MAX_CLASSES), np.int64)
    rice_off = np.zeros((ntiles_all, MAX_CLASSES), np.int64)
    rice_len = np.zeros((ntiles_all, MAX_CLASSES), np.int64)
    n_esc = np.zeros(ntiles_all, np.int64)
    over = np.zeros(ntiles_all, np.int64)
    hist = np.zeros((ntiles_all, MAX_CLASSES * NSYM), np.int32)
    mask = np.uint64(0xFFFF)
    wbits = np.uint64(15)
    for g in nb.prange(ntiles_all):
        i = owner[g]
        t = g - first[i]
        numel = numels[i]
        a = array_at(addr_a[i], numel, like)
        b = array_at(addr_b[i], numel, like)
        th = thr[i, :nthr[i]]
        ncls = nthr[i] + 1
        s = t * tile
        e = min(s + tile, numel)
        nblocks = (e - s + 63) // 64
        stride = nblocks + 1
        masks = np.empty(nblocks, np.uint64)
        cls = np.empty((ncls, nblocks), np.uint64)
        total = 0
        for bi in range(nblocks):
            bs = s + 64 * bi
            m = block_mask(a, b, bs, e)
            masks[bi] = m
            total += np.int64(ctpop64(m))
            class_masks(a, bs, e, th, cls, bi)
        if total == 0:
            continue
        mb = np.empty(ncls * stride, np.uint64)
        members = np.zeros(ncls, np.int64)
        nchg = np.zeros(ncls, np.int64)
        for c in range(ncls):  # class by class: the packing state stays in registers
            acc = np.uint64(0)
            cnt_all = 0
            n = 0
            row = c * stride
            for bi in range(nblocks):
                cm = cls[c, bi]
                x = pext64(masks[bi], cm)
                cnt = np.int64(ctpop64(cm))
                n += np.int64(ctpop64(x))
                sh = cnt_all & 63
                acc |= x << np.uint64(sh)
                if sh + cnt >= 64:
                    mb[np.uint64(row + (cnt_all >> 6))] = acc
                    acc = (x >> np.uint64(1)) >> np.uint64(63 - sh)
                cnt_all += cnt
            if cnt_all & 63:
                mb[np.uint64(row + (cnt_all >> 6))] = acc
            members[c] = cnt_all
            nchg[c] = n
        need = 0
        for c in range(ncls):
            n = nchg[c]
            if n and n < members[c]:  # a class whose every member changed has no piece (k 0)
                k = rice_k(members[c] - n, n)
                ks[g, c] = k
                need += ((((members[c] - n) >> k) + n * (k + 1)) >> 3) + 16  # + rice_put's slack
        if need > rstride:
            over[g] = 1
            continue
        p = g * rstride
        me = nb.get_thread_id()
        pos, codes, lens = pos_rows[me], code_rows[me], len_rows[me]
        for c in range(ncls):
            n = nchg[c]
            ns[g, c] = n
            rice_off[g, c] = p
            if n == 0 or n == members[c]:
                continue
            if ks[g, c] == 0:
                p = _unary_put(mb, c * stride, members[c], rice_buf, p)
            else:
                j = 0
                for w in range((members[c] + 63) >> 6):  # the changed members' numbers, then their codes
                    j = pack_word(pos, j, 64 * w, mb[np.uint64(c * stride + w)], lanes_like)
                p = rice_tile_grouped(pos, n, ks[g, c], rice_buf, p, codes, lens)
            rice_len[g, c] = p - rice_off[g, c]
        lut = np.zeros(256, np.int64)  # class * NSYM by the old bits' (x & 0x7FFF) >> 7
        for j in range(th.size):
            for v in range(th[j] >> 7, 256):
                lut[v] += NSYM
        h = np.zeros(ncls * NSYM, np.int32)
        q = g * tile
        qe = 2 * g * tile
        cnt = 0
        for bi in range(nblocks):  # the tile's changed offsets in order, a block at a time
            cnt = pack_word(pos, cnt, 64 * bi, masks[bi], lanes_like)
        for j in range(cnt):  # one counted loop: no loop exit per block to mispredict
            at = np.uint64(s) + np.uint64(pos[j])  # unsigned: no negative-index fix-ups
            ov = a[at]
            d = (np.uint64(b[at]) - np.uint64(ov)) & mask
            sym = entropy.symbol(d, mask, wbits)
            v = lut[np.uint64(ov >> np.uint16(7)) & np.uint64(0xFF)] + sym
            sym_buf[np.uint64(q)] = v
            q += 1
            h[np.uint64(v)] += 1
            if sym == ESC:
                esc_buf[np.uint64(qe)] = np.uint8(d & np.uint64(0xFF))
                esc_buf[np.uint64(qe + 1)] = np.uint8(d >> np.uint64(8))
                qe += 2
        hist[g, :ncls * NSYM] = h
        n_esc[g] = (qe - 2 * g * tile) >> 1
    return ns, ks, rice_off, rice_len, n_esc, over, hist


@nb.njit(inline="always", cache=True)
def _unary_put(mb, row, members, out, p):
    """The Rice(0) piece of a class whose member bitmap is ``mb[row:]`` (some member changed),
    at ``out[p:]``, 64 members a store: each gap's one-bits and zero-bit are the bitmap
    inverted, up to the last change, then zero bits to the byte (``entropy.rice_put``'s bytes;
    ``context_apply._unary_piece`` reads them). Up to 7 bytes past the piece are written (the
    scan's ``need`` leaves 16). Returns the byte after the piece."""
    w = (members - 1) >> 6
    while mb[np.uint64(row + w)] == 0:
        w -= 1
    last = mb[np.uint64(row + w)]
    top = 63 - np.int64(ctlz64(last))
    for v in range(w):
        store_u64le(out, p + 8 * v, ~mb[np.uint64(row + v)])
    store_u64le(out, p + 8 * w, ~last & (np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(63 - top)))
    return p + ((64 * w + top + 8) >> 3)


@nb.njit(cache=True, nogil=True)
def _finish_batch(prefixes, prefix_at, first, nthr, numels, ns_all, ks_all, roff_all, rlen_all, esc_all, over_all,
                  hist_all, tile, rice_buf, sym_buf, esc_buf, value_buf):
    """The streams of a batch from its scan (``_scan_batch``), in one compiled call: each
    tensor's class codes from its histograms (serial; tables after its prefix, ``prefixes``
    from ``prefix_at[i]``), every tile's symbols coded in one parallel loop
    (``huffman.encode_tiles_by_row``), each tensor's directory (serial, ``assembly_head``) and
    every tile's pieces moved in one parallel loop (``move_pieces``): the bytes
    ``tile_assembly.assemble_tiles`` gives one tensor. Returns (changes per tensor, -1 where a
    tile overflowed; the ``huffman_estimate`` per tensor; (start, length) of each stream in
    the returned buffer, length 0 where there is none; the buffer)."""
    n = numels.size
    G = first[n]
    changes = np.zeros(n, np.int64)
    estimate = np.zeros(n, np.int64)
    codes = np.zeros((n, MAX_CLASSES * NSYM), np.int64)
    heads = np.zeros((n, 64 + MAX_CLASSES * huffman.TABLE_BYTES), np.uint8)
    head_len = np.zeros(n, np.int64)
    coded = np.zeros(G, np.int64)  # changes per tile of the tensors that get a stream
    row = np.zeros(G, np.int64)
    for i in range(n):
        g0, g1 = first[i], first[i + 1]
        ncls = nthr[i] + 1
        row[g0:g1] = i
        total = 0
        overflow = False
        for g in range(g0, g1):
            overflow |= over_all[g] != 0
            for c in range(ncls):
                total += ns_all[g, c]
        if overflow:
            changes[i] = -1
            continue
        changes[i] = total
        if total == 0:
            continue
        for g in range(g0, g1):
            for c in range(ncls):
                coded[g] += ns_all[g, c]
        counts = np.zeros(ncls * NSYM, np.int64)
        for g in range(g0, g1):
            for v in range(ncls * NSYM):
                counts[v] += hist_all[g, v]
        plen = prefix_at[i + 1] - prefix_at[i]
        heads[i, :plen] = prefixes[prefix_at[i]:prefix_at[i + 1]]
        p = plen
        for c in range(ncls):
            cnt = counts[c * NSYM:(c + 1) * NSYM]
            if cnt.sum() == 0:
                p = entropy.write_varint(heads[i], p, 0)
                continue
            lengths = huffman.code_lengths(cnt)
            p = huffman.write_table(heads[i], p, lengths, cnt > 0)
            codes[i, c * NSYM:(c + 1) * NSYM] = huffman.encoder_codes(lengths)
        head_len[i] = p
        estimate[i] = _huffman_estimate(coded[g0:g1], counts, numels[i], tile)
    starts = np.zeros(G, np.int64)
    q = 0
    for g in range(G):
        starts[g] = q
        if coded[g]:
            q += huffman.tile_bound(coded[g])
    if q > value_buf.size:
        raise IndexError("context_huffman: the value scratch is too small")
    lens = huffman.encode_tiles_by_row(sym_buf, np.arange(G) * tile, coded, codes, row, value_buf, starts)
    ends = np.zeros(G + n, np.int64)  # tensor i's value ends (``assemble_tiles``' rans_off) at first[i] + i
    esc_cnt = np.zeros((G, MAX_CLASSES), np.int64)  # a tile's escapes are one run (class 0's column)
    esc_len = np.zeros((G, MAX_CLASSES), np.int64)
    esc_off = np.zeros((G, MAX_CLASSES), np.int64)
    for g in range(G):
        esc_cnt[g, 0] = esc_all[g]
        esc_len[g, 0] = 2 * esc_all[g]
        esc_off[g, :] = 2 * g * tile
    bound = 0
    for i in range(n):
        g0, g1 = first[i], first[i + 1]
        if changes[i] > 0:
            for g in range(g0, g1):
                ends[g + i + 1] = starts[g] + lens[g]
            ncls = nthr[i] + 1
            bound += assembly_bound(heads[i, :head_len[i]], ns_all[g0:g1, :ncls], rlen_all[g0:g1, :ncls],
                                    starts[g0:g1], ends[g0 + i:g1 + i + 1], esc_cnt[g0:g1, :ncls], 2,
                                    rice_buf, roff_all[g0:g1, :ncls], esc_buf, esc_off[g0:g1, :ncls], value_buf)
    out = np.empty(bound, np.uint8)
    spans = np.zeros((n, 2), np.int64)
    dest = np.zeros(G, np.int64)
    tot = np.zeros(G, np.int64)
    p = 0
    no_freq = np.zeros((0, NSYM), np.int64)
    for i in range(n):
        g0, g1 = first[i], first[i + 1]
        if changes[i] > 0:
            ncls = nthr[i] + 1
            dest[g0:g1], tot[g0:g1], end = assembly_head(
                out, p, heads[i, :head_len[i]], no_freq, ns_all[g0:g1, :ncls], ks_all[g0:g1, :ncls],
                rlen_all[g0:g1, :ncls], starts[g0:g1], ends[g0 + i:g1 + i + 1], esc_cnt[g0:g1, :ncls], 2,
                rice_buf, roff_all[g0:g1, :ncls], esc_buf, esc_off[g0:g1, :ncls], value_buf)
            spans[i, 0] = p
            spans[i, 1] = end - p
            p = end
    move_pieces(out, dest, tot, rice_buf, roff_all, rlen_all, value_buf, starts, lens, esc_buf, esc_off, esc_len)
    return changes, estimate, spans, out


@nb.njit(cache=True, nogil=True)
def _huffman_estimate(tot, counts, numel, tile):
    """About the bytes of the ``huffman`` stream of the same changes, from what a context scan
    counted (changes per tile, symbols per class): Huffman-coded symbols of the whole tensor's
    histogram, Rice-coded positions as geometric gaps at each tile's density, escapes and a
    directory entry per tile. For choosing between the coders, not a bound."""
    marginal = np.zeros(NSYM, np.int64)
    for v in range(counts.size):
        marginal[v % NSYM] += counts[v]
    lengths = huffman.code_lengths(marginal)
    bits = 0
    present = 0
    for s in range(NSYM):
        bits += lengths[s] * marginal[s]
        present += marginal[s] > 0
    for t in range(tot.size):
        if tot[t]:
            span = min(tile, numel - t * tile) - tot[t]
            k = rice_k(span, tot[t])
            bits += tot[t] * (k + 1) + (span >> k) + 7
    return bits // 8 + 2 * marginal[ESC] + 6 * tot.size + 1 + 2 * present


def encode_context_huffman(old: np.ndarray, new: np.ndarray, thresholds: np.ndarray, tile: int,
                           scratch: dict | None = None) -> tuple[int, np.ndarray | None, int]:
    """(number of changed elements, the ``context_huffman`` stream, ``huffman_estimate``) of
    two uint16 views of one 16-bit float tensor, in one read of both. The stream is None when
    nothing changed or a tile's positions did not fit their scratch: the caller picks another
    mode."""
    return encode_context_huffman_batch([(old, new, thresholds)], tile, scratch)[0]


def encode_context_huffman_batch(items: list[tuple[np.ndarray, np.ndarray, np.ndarray]], tile: int,
                                 scratch: dict | None = None, *,
                                 vector_compress: bool = VECTOR_COMPRESS) -> list[tuple[int, np.ndarray | None, int]]:
    """``encode_context_huffman`` of each (old, new, thresholds), the scans of all in one
    compiled call with one parallel loop over every tile (one parallel region for the batch,
    not one per tensor); the streams are those of one call each, with compress-stores
    (``vector_compress``) or without."""
    if not items:
        return []
    thrs = []
    for old, new, thresholds in items:
        thr = np.ascontiguousarray(thresholds, dtype=np.int64)
        check_thresholds(thr)
        if old.dtype != np.uint16 or new.dtype != np.uint16 or old.shape != new.shape or old.ndim != 1:
            raise ValueError(f"context_huffman coding needs two flat uint16 arrays, got {old.dtype}/{new.dtype}")
        if not old.flags.c_contiguous or not new.flags.c_contiguous or tile > 1 << 16 or tile < 64 or tile % 64:
            raise ValueError("context_huffman coding needs contiguous arrays and tiles of 64 to 65536 elements")
        thrs.append(thr)
    n = len(items)
    numels = np.array([old.size for old, _, _ in items], np.int64)
    first = np.zeros(n + 1, np.int64)
    np.cumsum((numels + tile - 1) // tile, out=first[1:])
    ntiles = int(first[-1])
    thr_rows = np.zeros((n, MAX_THRESHOLDS), np.int64)
    nthr = np.array([t.size for t in thrs], np.int64)
    for i, t in enumerate(thrs):
        thr_rows[i, :t.size] = t
    rstride = rice_stride(tile, MAX_CLASSES)
    rice_buf = pooled(scratch, "context_huffman_rice", ntiles * rstride)
    sym_buf = pooled(scratch, "context_huffman_syms", 2 * ntiles * tile).view(np.uint16)
    esc_buf = pooled(scratch, "context_huffman_escapes", 2 * ntiles * tile)
    addr_a = np.array([old.__array_interface__["data"][0] for old, _, _ in items], np.int64)
    addr_b = np.array([new.__array_interface__["data"][0] for _, new, _ in items], np.int64)
    nthreads = nb.config.NUMBA_NUM_THREADS
    rows = pooled(scratch, "context_huffman_rows", 10 * nthreads * tile + 128 * nthreads)
    pos_at = 2 * nthreads * (tile + 64)
    pos_rows = rows[:pos_at].view(np.uint16).reshape(nthreads, tile + 64)
    code_rows = rows[pos_at:pos_at + 4 * nthreads * tile].view(np.uint32).reshape(nthreads, tile)
    len_rows = rows[pos_at + 4 * nthreads * tile:pos_at + 8 * nthreads * tile].view(np.uint32).reshape(nthreads, tile)
    ns_all, ks_all, roff_all, rlen_all, esc_all, over_all, hist_all = _scan_batch(
        addr_a, addr_b, numels, _LIKE_OLD, first, thr_rows, nthr, tile, rice_buf, rstride, sym_buf, esc_buf, pos_rows,
        code_rows, len_rows, None if vector_compress else _LIKE_OLD)
    prefixes = [class_prefix(t) for t in thrs]
    prefix_at = np.zeros(n + 1, np.int64)
    np.cumsum([pr.size for pr in prefixes], out=prefix_at[1:])
    value_buf = pooled(scratch, "context_huffman_values", huffman.tile_bound(1) * ntiles + 2 * int(ns_all.sum()))
    # On the calling thread: a few ms of work a batch, and each parallel region of it waited for
    # a descheduled second thread on a busy host (encode_patch of the codec bench at load 2.3,
    # alternating, best of 7: 124 ms with the two regions, 87 ms without).
    with serial_kernels():
        changes, estimate, spans, out = _finish_batch(np.concatenate(prefixes), prefix_at, first, nthr, numels,
                                                      ns_all, ks_all, roff_all, rlen_all, esc_all, over_all,
                                                      hist_all, tile, rice_buf, sym_buf, esc_buf, value_buf)
    results: list[tuple[int, np.ndarray | None, int]] = []
    for (old, new, _), c, est, (s, m) in zip(items, changes.tolist(), estimate.tolist(), spans.tolist(), strict=True):
        if c < 0:  # a tile's positions did not fit their scratch
            results.append((int(np.count_nonzero(old != new)), None, 0))
        else:
            results.append((c, out[s:s + m] if m else None, est if m else 0))
    return results


@nb.njit(cache=True, nogil=True)
def _parse(buf, numel, tile, changed):
    """(err, thresholds, the directory flat (``decode_batch``'s layout), its ns, the value
    tables (``context_apply.value_tables`` of each class, flat: the full ones, then the first
    lookups)); ``err`` as ``entropy.DIR_ERRORS``, 10 for bad thresholds."""
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
    full = np.zeros(ncls << MAX_BITS, np.uint32)
    fast = np.zeros(ncls << FAST_BITS, np.uint32)
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
                f, q = value_tables(lengths[c], present[c])
                full[c << MAX_BITS:(c + 1) << MAX_BITS] = f
                fast[c << FAST_BITS:(c + 1) << FAST_BITS] = q
    ntiles = ns.shape[0]
    flat = np.empty(ntiles * (3 * ncls + 3) + 1, np.int64)
    flat[:ntiles * ncls] = ns.reshape(-1)
    flat[ntiles * ncls:2 * ntiles * ncls] = ks.reshape(-1)
    flat[2 * ntiles * ncls:3 * ntiles * ncls] = rice.reshape(-1)
    v = 3 * ntiles * ncls
    flat[v:v + ntiles] = vals
    flat[v + ntiles:v + 2 * ntiles] = esc
    flat[v + 2 * ntiles:] = offs[:ntiles + 1]
    return err, thr, flat, ns, full, fast


class ContextHuffmanStream:
    """A ``context_huffman`` stream whose classes, tables and directory were parsed and checked."""

    def __init__(self, buf: np.ndarray, numel: int, tile: int, changed: int) -> None:
        if tile > 1 << 16:
            raise ValueError(f"context_huffman streams need tiles of at most 65536 elements, not {tile}")
        if (numel + tile - 1) // tile > buf.size:  # every tile has at least one directory byte
            raise ValueError(f"{buf.size} bytes cannot hold the directory of {numel} elements in tiles of {tile}")
        err, thr, flat, ns, full, fast = _parse(buf, numel, tile, changed)
        if err == 10:
            raise ValueError("the class thresholds are truncated or malformed")
        if err:
            raise ValueError(entropy.DIR_ERRORS.get(int(err), f"directory error {err}"))
        if buf.size < 8:  # the decoder's value reader loads 8 bytes at a time (zeros past the end)
            buf = np.concatenate([buf, np.zeros(8 - buf.size, np.uint8)])
        self.buf, self.numel, self.tile, self.changed, self.thr = buf, numel, tile, changed, thr
        self.ns, self.flat, self.full, self.fast = ns, flat, full, fast

    def decode(self, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ascending positions, differences as uint16) against ``old``, the uint16 bits the
        stream applies to; raises ValueError naming the first bad tile."""
        (off, diff), = run_batch([self], [old], False)
        tile_starts = np.repeat(np.arange(self.ns.shape[0], dtype=np.int64) * self.tile, self.ns.sum(axis=1))
        return tile_starts + off, diff

    def apply_(self, target: np.ndarray) -> ContextUndo:
        """Patch the uint16 bits ``target`` in place; what it takes to undo it (4 bytes per
        change). On a bad tile every write is undone before ValueError is raised."""
        return apply_batch_([self], [target])[0]


def apply_batch_(streams: list[ContextHuffmanStream], targets: list[np.ndarray]) -> list[ContextUndo]:
    """``apply_`` of each stream to its target (distinct arrays) in one compiled call with one
    parallel loop over all their tiles. On a bad tile every write of the call is undone before
    ValueError (naming the first bad stream's index and tile) is raised."""
    outs = run_batch(streams, targets, True)
    return [ContextUndo(tg, off, diff, s.ns, s.tile) for s, tg, (off, diff) in zip(streams, targets, outs, strict=True)]


class BadStream(ValueError):
    """A ``run_batch`` stream found damaged: ``index`` is its place in the batch."""

    def __init__(self, index: int, msg: str) -> None:
        super().__init__(msg)
        self.index = index


def run_batch(streams: list[ContextHuffmanStream], olds: list[np.ndarray], write: bool, *,
              vector_compress: bool = VECTOR_COMPRESS) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each stream's (offsets in tile, differences) in tile order against its ``olds`` array
    (uint16, the bits it applies to; ``write`` patches them in place), the change offsets
    packed with compress-stores (``vector_compress``) or walked: the same results. On a bad
    tile the call's writes are undone and ``BadStream`` raised for the first bad stream."""
    if not streams:
        return []
    tile = streams[0].tile
    for s, old in zip(streams, olds, strict=True):
        if old.dtype != np.uint16 or old.size != s.numel or not old.flags.c_contiguous or s.tile != tile:
            raise ValueError(f"context_huffman streams decode against the {s.numel} old uint16 bits they apply "
                             f"to, got {old.dtype}/{old.size}")
    def addr(a: np.ndarray) -> int:
        return a.__array_interface__["data"][0]
    n = len(streams)
    ntiles = np.array([s.ns.shape[0] for s in streams], np.int64)
    first = np.zeros(n + 1, np.int64)
    np.cumsum(ntiles, out=first[1:])
    totals = np.concatenate([s.ns.sum(axis=1) for s in streams])
    starts = np.zeros(totals.size + 1, np.int64)
    np.cumsum(totals, out=starts[1:])
    thr = np.zeros((n, MAX_THRESHOLDS), np.int64)
    nthr = np.array([s.thr.size for s in streams], np.int64)
    for i, s in enumerate(streams):
        thr[i, :s.thr.size] = s.thr
    nchanges = int(starts[-1])
    records = _RECORDS.take(4 * nchanges).view(np.uint16)  # reused once no result refers to it
    off, diff = records[:nchanges], records[nchanges:]
    bufs = [s.buf for s in streams]
    errs, done = decode_batch(
        np.array([addr(b) for b in bufs], np.int64), np.array([b.size for b in bufs], np.int64), _LIKE_BUF,
        np.array([addr(o) for o in olds], np.int64), np.array([s.numel for s in streams], np.int64), _LIKE_OLD,
        first, thr, nthr, tile, np.array([addr(s.flat) for s in streams], np.int64), _LIKE_DIR,
        np.array([addr(s.full) for s in streams], np.int64), np.array([addr(s.fast) for s in streams], np.int64),
        _LIKE_TAB, starts, off, diff, write, _thread_rows(tile), None if vector_compress else _LIKE_OLD)
    bad = np.flatnonzero(errs)
    outs = [(off[starts[first[i]]:starts[first[i + 1]]], diff[starts[first[i]]:starts[first[i + 1]]])
            for i in range(n)]
    if bad.size:
        if write:
            for i, s in enumerate(streams):
                g0, g1 = first[i], first[i + 1]
                unapply(olds[i], outs[i][0], outs[i][1], s.ns, done[g0:g1], tile)
        g = int(bad[0])
        i = int(np.searchsorted(first, g, side="right") - 1)
        t = g - int(first[i])
        nbad = int(np.count_nonzero(errs[first[i]:first[i + 1]]))
        raise BadStream(i, f"tile {t} ({nbad} bad tiles): {entropy.ERRORS.get(int(errs[g]), 'unknown error')}")
    return outs


def _thread_rows(tile: int) -> np.ndarray:
    """A row of ``tile + 64`` uint16 per numba thread, for ``decode_batch``."""
    return np.empty((nb.config.NUMBA_NUM_THREADS, tile + 64), np.uint16)


_RECORDS = LeasePool()  # every run's (offset, difference) pairs: an apply's undo records
_LIKE_BUF = np.frombuffer(b"", np.uint8)  # read-only, as the streams are (``decode.stream_array``)
_LIKE_OLD = np.empty(0, np.uint16)
_LIKE_DIR = np.empty(0, np.int64)
_LIKE_TAB = np.empty(0, np.uint32)


assert MAX_DELTA < 0x8000  # sym2diff above writes magnitudes as uint16 two's complement
