"""Pass 1 of the tiled streams (``huffman`` and ``sparse``): scan (old, new) tiles into Rice-coded
positions, value symbols and escapes in per-tile scratch, optionally folding ``new`` into ``old``.

Invariants:
- Tiles are independent and write only their own scratch regions, so ``prange`` over tiles gives
  the same bytes for any number of threads; the packed and the plain scan give the same bytes.
- With ``update`` a tile is folded only if its output fit its scratch: a tile that overflows is
  left exactly as it was and flagged, so the caller can still diff it.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from weftboard.cuda import entropy
from weftboard.cuda.bitops import array_at, ctpop64, cttz64, prefetch64
from weftboard.cuda.block_ops import block_fold64, block_ne_mask64, block_special64
from weftboard.cuda.entropy import ESC
from weftboard.cuda.jit import parallel_kernel
from weftboard.cuda.tile_blocks import (
    PREFETCH_AHEAD,
    RICE_SLACK,
    VECTOR_COMPRESS,
    last_and_k,
    new_element,
    new_element_bits,
    pack_block,
    put_escape,
    rice_tile_grouped,
    scan_block,
    scan_results,
    special_element,
)


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
    ns, ks, rice_len, n_esc, over, hist = scan_results(ntiles)
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
        lastpos, k = last_and_k(masks, last, cnt)
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
                nv = new_element_bits(b, src, i, cast)
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
                    put_escape(sym_buf, q, d, width)
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
                    a[i] = new_element_bits(b, src, i, cast)
        rice_len[t] = entropy.rice_flush(rice_buf, p, acc, nbits) - p0
        n_esc[t] = ne
    return ns, ks, rice_len, n_esc, hist.sum(axis=0), over


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
                put_escape(sym_buf, q, (new_element(a, new, i) - np.uint64(a[i])) & mask, width)
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
                put_escape(sym_buf, q, d, width)
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
    lastpos, k = last_and_k(masks, last, cnt)
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
    end = rice_tile_grouped(pos, cnt, k, rice_buf, p0, codes, lens)
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
    no scattered reloads), then the packed positions are Rice-coded (``rice_tile_grouped``:
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
    ns, ks, rice_len, n_esc, over, hist = scan_results(ntiles)
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
    ns, ks, rice_len, n_esc, over, hist = scan_results(ntiles)
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


def packed_scan_fits(tile: int, width: int) -> bool:
    """Whether ``scan_encode_tiles_packed`` scans these tiles: uint16 positions within a tile,
    8-, 16- or 32-bit lanes."""
    return tile <= 65536 and width in (1, 2, 4)


def scan_into_scratch(old: np.ndarray, new: np.ndarray, tile: int, rice_buf: np.ndarray, sym_buf: np.ndarray,
          update: bool = False, cast: bool = False) -> tuple:
    check_scan_pair(old, new, tile, cast)
    args = ((old, old[:0], 2, tile, rice_buf, tile + RICE_SLACK, sym_buf, update, new, True) if cast else
            (old, new, old.itemsize, tile, rice_buf, tile + RICE_SLACK, sym_buf, update, np.empty(0, np.uint32), False))
    if packed_scan_fits(tile, old.itemsize):
        return scan_encode_tiles_packed(*args[:8], *packed_scan_args(new if cast else None, VECTOR_COMPRESS))
    return scan_encode_tiles(*args)
