"""The two-step coder of the tiled streams (stream layout: ``cuda/FORMAT.md`` 2.2-2.5): value
symbols, Rice-coded position gaps, rANS-coded symbols, tables and tile directories, and the
parsers the fused kernels share (``parse_table_and_directory``).

Invariants: decoders never trust a length: every read is bounds-checked and every violation
returns an error code (``ERRORS``, ``DIR_ERRORS``) that the caller turns into ``CorruptData``.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from weftboard.cuda.bitops import store_u32le, store_u64le
from weftboard.cuda.jit import parallel_kernel

SCALE_BITS = 14
SCALE = 1 << SCALE_BITS
RANS_L = 1 << 23
MAX_DELTA = 64
ESC = 2 * MAX_DELTA
NSYM = ESC + 1
MAX_K = 24

ERRORS = {
    1: "a tile's Rice bits run past its recorded length",
    2: "a decoded position falls outside its tile",
    3: "a tile's Rice stream has leftover bytes or non-zero padding",
    4: "a tile's rANS stream is shorter than its initial state",
    5: "a tile's rANS state is out of range",
    6: "a tile's value stream (rANS or Huffman) runs past its recorded length",
    7: "a tile's value stream does not end as recorded (rANS: not in the initial state; Huffman: leftover "
       "bytes or non-zero padding)",
    8: "a tile's number of escapes differs from its directory entry",
    9: "a tile's Rice parameter is out of range",
}

DIR_ERRORS = {
    1: "the symbol table is truncated or malformed",
    2: "the symbol table is invalid (rANS frequencies not summing to 2**14, a Huffman code that is not "
       "complete, or an unknown symbol)",
    3: "the tile directory is truncated or malformed",
    4: "a tile claims more changes than it has elements",
    5: "the tile payloads do not add up to the stream length",
    6: "the per-tile change counts do not add up to the declared number of changes",
}


# ---------------------------------------------------------------------------
# symbols
# ---------------------------------------------------------------------------


@nb.njit(inline="always", cache=True)
def _udiff(old, new, mask):
    return (np.uint64(new) - np.uint64(old)) & mask


@nb.njit(inline="always", cache=True)
def symbol(d, mask, wbits):
    """The symbol of difference ``d`` (``wbits`` = element bits - 1): 2*(|d|-1) + sign for
    1 <= |d| <= MAX_DELTA, else ESC. Without branches: the sign of a change is a coin flip,
    which a branch predictor cannot learn."""
    neg = (d >> wbits) & np.uint64(1)
    mag = ((d ^ (np.uint64(0) - neg)) + neg) & mask
    code = np.int64(((mag - np.uint64(1)) << np.uint64(1)) | neg)
    return code if mag - np.uint64(1) < np.uint64(MAX_DELTA) else np.int64(ESC)


@nb.njit(inline="always", cache=True)
def diff16(s):
    """The 16-bit difference of symbol ``s`` (not ESC): the inverse of ``symbol`` for 16-bit
    elements, ``s // 2 + 1`` with the sign in the low bit."""
    mag = s // 2 + 1
    return (65536 - mag) if s & 1 else mag


@nb.njit(cache=True, nogil=True)
def _quantize_freqs(counts):
    freqs = np.zeros(NSYM, np.int64)
    total = 0
    for s in range(NSYM):
        total += counts[s]
    if total == 0:
        return freqs
    fsum = 0
    for s in range(NSYM):
        if counts[s] > 0:
            freqs[s] = max(1, (counts[s] * SCALE) // total)
            fsum += freqs[s]
    diff = SCALE - fsum
    order = np.argsort(-counts, kind="mergesort")  # stable: ties keep symbol order
    if diff > 0:  # rounding down left a remainder: the most frequent symbol takes it (cheapest)
        freqs[order[0]] += diff
    else:  # forced minimum frequencies overshot: take back from the most frequent symbols
        for s in order:
            if diff == 0:
                break
            take = min(freqs[s] - 1, -diff)
            freqs[s] -= take
            diff += take
    return freqs


def quantize_freqs(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to SCALE, >= 1 wherever a count is > 0, close to proportional."""
    return _quantize_freqs(np.ascontiguousarray(counts, dtype=np.int64))


# ---------------------------------------------------------------------------
# encoder
# ---------------------------------------------------------------------------


@parallel_kernel
def plan_tiles(pos, old, new, width, tile_ptr, tile):
    """Pass 1 of the encoder, one read of the changes: symbols, per-tile symbol histograms,
    Rice parameter and exact Rice bytes, escape counts.

    k is chosen among the three values around log2(mean gap) by exact cost (the optimum for
    geometric gaps is log2(mean * ln 2), i.e. one of them); the mean comes from the tile's
    span in O(1).
    """
    ntiles = tile_ptr.size - 1
    n_all = pos.size
    syms = np.empty(n_all, np.uint8)
    hist = np.zeros((ntiles, NSYM), np.int64)
    ks = np.zeros(ntiles, np.int64)
    rice_bytes = np.zeros(ntiles, np.int64)
    n_esc = np.zeros(ntiles, np.int64)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * width)
    wbits = np.uint64(8 * width - 1)
    for t in nb.prange(ntiles):
        lo = tile_ptr[t]
        hi = tile_ptr[t + 1]
        if hi == lo:
            continue
        n = hi - lo
        tile_start = t * tile
        total_gap = (pos[hi - 1] - tile_start + 1) - n
        mean = total_gap // n
        k0 = 0
        while (2 << k0) <= mean:
            k0 += 1
        k1 = max(0, k0 - 1)
        k2 = min(MAX_K, k0 + 1)
        c0 = 0
        c1 = 0
        c2 = 0
        e = 0
        prev = tile_start - 1
        h = hist[t]
        for i in range(lo, hi):
            g = pos[i] - prev - 1
            prev = pos[i]
            c0 += g >> k0
            c1 += g >> k1
            c2 += g >> k2
            sym = symbol(_udiff(old[i], new[i], mask), mask, wbits)
            syms[i] = sym
            h[sym] += 1
            e += 1 if sym == ESC else 0
        c0 += n * (k0 + 1)
        c1 += n * (k1 + 1)
        c2 += n * (k2 + 1)
        best_k = k0
        best = c0
        if c1 < best:
            best_k = k1
            best = c1
        if c2 < best:
            best_k = k2
            best = c2
        ks[t] = best_k
        rice_bytes[t] = (best + 7) // 8
        n_esc[t] = e
    return syms, hist.sum(axis=0), ks, rice_bytes, n_esc


def rans_encoder_tables(freq: np.ndarray) -> np.ndarray:
    """Per symbol (x_max, rcp, shift, bias, cmpl): division-free rANS encoding.

    ``x // f`` becomes ``((x * rcp) >> 32) >> shift`` with an exact 32-bit reciprocal
    (x < 2**31), as in F. Giesen's rans_byte; frequency 1 uses rcp = 2**32 - 1, shift 0 and a
    bias of start + SCALE - 1, which gives the same state.
    """
    return _rans_encoder_tables(np.ascontiguousarray(freq, dtype=np.int64))


@nb.njit(cache=True, nogil=True)
def _rans_encoder_tables(freq):
    tab = np.zeros((NSYM, 5), np.int64)
    cum = 0
    for s in range(NSYM):
        f = freq[s]
        if f > 0:
            shift = 0
            while (1 << shift) < f:  # ceil(log2(f)), exact for f <= 2**14
                shift += 1
            tab[s, 0] = ((RANS_L >> SCALE_BITS) << 8) * f
            if f < 2:
                tab[s, 1] = (1 << 32) - 1
                tab[s, 2] = 0
                tab[s, 3] = cum + SCALE - 1
            else:
                tab[s, 1] = ((1 << (shift + 31)) + f - 1) // f
                tab[s, 2] = shift - 1
                tab[s, 3] = cum
            tab[s, 4] = SCALE - f
        cum += f
    return tab


@nb.njit(inline="always", cache=True)
def rice_put(buf, p, acc, nbits, g, k, lowmask):
    """Append Rice(k) of gap ``g`` (``g >> k`` one-bits, a zero-bit, the k low bits) to the
    LSB-first bit writer ``(buf, p, acc, nbits)``; returns the new ``(p, acc, nbits)``.

    ``acc`` holds < 32 pending bits between codes (62 at most inside one). Whole 32-bit words
    leave without a branch (whether one is due is a coin flip for the predictor): four bytes
    are always stored at ``p`` and ``p`` moves only when they are due, so the caller must leave
    3 bytes of slack after the last Rice byte that nothing else has written yet.
    """
    u = g >> k
    while u >= 24:
        acc |= ((1 << 24) - 1) << nbits
        nbits += 24
        while nbits >= 8:
            buf[p] = acc & 0xFF
            p += 1
            acc >>= 8
            nbits -= 8
        u -= 24
    ln = u + 1 + k
    if nbits + ln > 62:  # rare (long codes): make room so acc never reaches the sign bit
        while nbits >= 8:
            buf[p] = acc & 0xFF
            p += 1
            acc >>= 8
            nbits -= 8
    acc |= (((1 << u) - 1) | ((g & lowmask) << (u + 1))) << nbits
    nbits += ln
    store_u32le(buf, p, acc)
    full = nbits >> 5
    return p + (full << 2), acc >> (full << 5), nbits - (full << 5)


@nb.njit(inline="always", cache=True)
def bytes_put(buf, q, acc, nbits, code, ln):
    """Append the ``ln`` <= 56 bits ``code`` (uint64s, all three) to a byte-granular writer:
    ``acc`` holds the ``nbits`` < 8 bits not yet in a whole byte, the 8 bytes at ``q`` are
    always stored and ``q`` moves by the whole bytes completed, so the caller leaves 7 bytes
    of slack after the last byte. The bits are those ``rice_put`` writes (LSB-first); the
    finished state closes with ``rice_flush``. Groups of codes go in one append: the
    writer's dependency chain is paid once per group."""
    acc |= code << nbits
    nbits += ln
    store_u64le(buf, q, acc)
    whole = nbits >> np.uint64(3)
    return q + np.int64(whole), acc >> (whole << np.uint64(3)), nbits & np.uint64(7)


@nb.njit(inline="always", cache=True)
def rice_bytes_put(buf, q, acc, nbits, g, k):
    """Append Rice(k) of any gap ``g`` (``k`` <= MAX_K; uint64s, like the writer's state) to
    the writer of ``bytes_put``: the unary part 32 one-bits at a time until the rest fits
    one append. The bits ``rice_put`` writes; the caller leaves ``bytes_put``'s slack."""
    u = g >> k
    while u + k > np.uint64(55):  # u + 1 + k bits would not fit one append
        q, acc, nbits = bytes_put(buf, q, acc, nbits, np.uint64(0xFFFFFFFF), np.uint64(32))
        u -= np.uint64(32)
    lowmask = (np.uint64(1) << k) - np.uint64(1)
    code = ((np.uint64(1) << u) - np.uint64(1)) | ((g & lowmask) << (u + np.uint64(1)))
    return bytes_put(buf, q, acc, nbits, code, u + np.uint64(1) + k)


@nb.njit(inline="always", cache=True)
def rice_flush(buf, p, acc, nbits):
    """Write the Rice writer's pending bits (zero-padded to a byte); returns the end."""
    while nbits > 0:
        buf[p] = acc & 0xFF
        p += 1
        acc >>= 8
        nbits -= 8
    return p


@parallel_kernel
def encode_tiles(pos, syms, old, new, width, tile_ptr, tile, ks, n_esc, scratch_off, scratch):
    """Pass 2 of the two-step encoder: write each tile's Rice bits | escapes at
    ``scratch_off[t]`` (the ``huffman`` stream codes its values apart, ``weftboard.cuda.huffman``).
    A region holds the exact Rice bytes, 4 of slack for ``rice_put``'s stores and the escapes."""
    ntiles = tile_ptr.size - 1
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * width)
    for t in nb.prange(ntiles):
        lo = tile_ptr[t]
        hi = tile_ptr[t + 1]
        if hi == lo:
            continue
        k = ks[t]
        p = scratch_off[t]
        acc = 0
        nbits = 0
        lowmask = (1 << k) - 1
        tile_start = t * tile
        for j in range(hi - lo):
            i = lo + j
            g = pos[i] - (pos[i - 1] + 1 if j > 0 else tile_start)
            p, acc, nbits = rice_put(scratch, p, acc, nbits, g, k, lowmask)
        # escapes: raw differences, little-endian, in change order, right after the Rice bytes
        e = rice_flush(scratch, p, acc, nbits)
        if n_esc[t]:
            for i in range(lo, hi):
                if syms[i] == ESC:
                    d = (np.uint64(new[i]) - np.uint64(old[i])) & mask
                    for b in range(width):
                        scratch[e] = np.uint8((d >> np.uint64(8 * b)) & np.uint64(0xFF))
                        e += 1


# ---------------------------------------------------------------------------
# decoder
# ---------------------------------------------------------------------------


@nb.njit(cache=True)
def read_varint(buf, p, end):
    """A LEB128 varint at ``buf[p]``, before ``end``: (value, new position) or (-1, -1) if truncated or longer than 9 bytes."""
    v = 0
    shift = 0
    while True:
        if p >= end or shift > 56:
            return -1, -1
        b = np.int64(buf[p])
        p += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, p
        shift += 7


@nb.njit(cache=True)
def _read_table(buf, p, end, freq):
    """Parse one frequency table at ``buf[p]`` into ``freq``; (error code or 0, end, nsym)."""
    nsym, p = read_varint(buf, p, end)
    if nsym < 0 or nsym > NSYM:
        return 1, p, 0
    last = -1
    total = 0
    for _ in range(nsym):
        s, p = read_varint(buf, p, end)
        if s < 0:
            return 1, p, 0
        f, p = read_varint(buf, p, end)
        if f < 0:
            return 1, p, 0
        if s <= last or s >= NSYM or f < 1 or f > SCALE:
            return 2, p, 0
        freq[s] = f
        total += f
        last = s
    if nsym > 0 and total != SCALE:
        return 2, p, 0
    return 0, p, nsym


@nb.njit(cache=True, nogil=True)
def parse_table_and_directory(buf, p, nclasses, numel, tile, width, changed):
    """Parse the frequency tables (one per class) and the tile directory from ``buf[p]``;
    returns (err, freq, per-tile arrays, payload offsets). With one class this is the
    ``sparse`` layout above; ``weftboard.cuda.context_codec`` documents the other."""
    end = buf.size
    freq = np.zeros((nclasses, NSYM), np.int64)
    nsyms = np.zeros(nclasses, np.int64)
    for c in range(nclasses):
        err, p, nsyms[c] = _read_table(buf, p, end, freq[c])
        if err:
            ntiles = (numel + tile - 1) // tile
            z = np.zeros((ntiles, nclasses), np.int64)
            return err, freq, z, z, z, z[:, 0], z[:, 0], np.zeros(ntiles + 1, np.int64)
    err, ns, ks, rice, rans, esc, offs = parse_directory(buf, p, nclasses, numel, tile, width, changed, nsyms)
    return err, freq, ns, ks, rice, rans, esc, offs


@nb.njit(cache=True, nogil=True)
def parse_directory(buf, p, nclasses, numel, tile, width, changed, nsyms):
    """The tile directory at ``buf[p]`` (after the tables, ``nsyms`` symbols in each class's):
    (err, ns, ks, rice, value bytes, escapes, payload offsets), every length checked against
    the stream's end. Shared by the ``sparse``, ``huffman`` and ``context`` layouts."""
    end = buf.size
    ntiles = (numel + tile - 1) // tile
    ns = np.zeros((ntiles, nclasses), np.int64)
    ks = np.zeros((ntiles, nclasses), np.int64)
    rice = np.zeros((ntiles, nclasses), np.int64)
    rans = np.zeros(ntiles, np.int64)
    esc = np.zeros(ntiles, np.int64)
    offs = np.zeros(ntiles + 1, np.int64)
    count = 0
    per_class = np.zeros(nclasses, np.int64)
    for t in range(ntiles):
        tile_n = min(tile, numel - t * tile)
        n = 0
        for c in range(nclasses):
            v, p = read_varint(buf, p, end)
            if v < 0:
                return 3, ns, ks, rice, rans, esc, offs
            if v > tile_n:  # each count on its own: a sum of huge ones could wrap past the check below
                return 4, ns, ks, rice, rans, esc, offs
            ns[t, c] = v
            per_class[c] += v
            n += v
        if n > tile_n:
            return 4, ns, ks, rice, rans, esc, offs
        count += n
        if n == 0:
            continue
        for c in range(nclasses):
            if ns[t, c]:
                if p >= end:
                    return 3, ns, ks, rice, rans, esc, offs
                ks[t, c] = buf[p]
                r, p = read_varint(buf, p + 1, end)
                if r < 0:
                    return 3, ns, ks, rice, rans, esc, offs
                if r > end:  # a length past the stream (summed unchecked, it could wrap int64)
                    return 5, ns, ks, rice, rans, esc, offs
                rice[t, c] = r
        a, p = read_varint(buf, p, end)
        if a < 0:
            return 3, ns, ks, rice, rans, esc, offs
        if a > end:
            return 5, ns, ks, rice, rans, esc, offs
        e, p = read_varint(buf, p, end)
        if e < 0 or e > n:
            return 3, ns, ks, rice, rans, esc, offs
        rans[t] = a
        esc[t] = e
    if count != changed:
        return 6, ns, ks, rice, rans, esc, offs
    for c in range(nclasses):
        if per_class[c] > 0 and nsyms[c] == 0:
            return 2, ns, ks, rice, rans, esc, offs
    # Every length is at most ``end`` (checked as read) and each partial sum is checked
    # against it in turn, so no sum here can wrap: a wrapped offset would pass the checks
    # negative and send a decoder's reads far outside the stream.
    offs[0] = p
    for t in range(ntiles):
        offs[t + 1] = offs[t] + rice[t].sum() + rans[t] + esc[t] * width
        if offs[t + 1] > end:
            return 5, ns, ks, rice, rans, esc, offs
    if offs[ntiles] != end:
        return 5, ns, ks, rice, rans, esc, offs
    return 0, ns, ks, rice, rans, esc, offs


@nb.njit(cache=True, nogil=True)
def parse_sparse(buf, numel, tile, width, changed):
    """``parse_table_and_directory`` of a ``sparse`` stream (one class) and its decoder
    tables, in one compiled call: (err, ns, ks, rice, rans, esc, offs, freq, cum, slot2sym),
    every per-tile array flat. One call per tensor instead of a parse and a few numpy steps
    matters to a patch of many small tensors (the Python around them cost more than the
    parse)."""
    err, freq2, ns2, ks2, rice2, rans, esc, offs = parse_table_and_directory(buf, 0, 1, numel, tile, width, changed)
    freq = freq2[0].copy()
    cum = np.zeros(NSYM, np.int64)
    slot2sym = np.zeros(SCALE, np.uint8)
    if err == 0:
        _fill_decoder_tables(freq, cum, slot2sym)
    return err, ns2[:, 0].copy(), ks2[:, 0].copy(), rice2[:, 0].copy(), rans, esc, offs, freq, cum, slot2sym


@nb.njit(cache=True, nogil=True)
def _fill_decoder_tables(freq, cum, slot2sym):
    """``cum`` and ``slot2sym`` of a checked table (frequencies >= 0 summing to SCALE)."""
    c = 0
    for s in range(NSYM):
        cum[s] = c
        slot2sym[c:c + freq[s]] = s
        c += freq[s]


def decoder_tables(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cumulative frequencies, symbol of each of the SCALE slots) of a parsed table. An empty
    table (a context class without changes) gets all-zero slots, which nothing decodes."""
    cum = np.zeros(NSYM, np.int64)
    slot2sym = np.zeros(SCALE, np.uint8)
    total = int(freq.sum())
    if total:
        assert total == SCALE, "parse_table_and_directory checks that a table sums to SCALE"
        _fill_decoder_tables(np.ascontiguousarray(freq, dtype=np.int64), cum, slot2sym)
    return cum, slot2sym


@parallel_kernel
def gather(target, pos, out):
    n = pos.size
    chunk = 1 << 16
    for c in nb.prange((n + chunk - 1) // chunk):
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            out[i] = target[pos[i]]


# ---------------------------------------------------------------------------
# writers of the tables and directories (``tile_assembly``, ``huffman``, ``context_codec``)
# ---------------------------------------------------------------------------


@nb.njit(cache=True)
def write_varint(buf, p, v):
    """Write ``v`` >= 0 as a LEB128 varint (7 bits a byte, low first) at ``buf[p]``; returns the end."""
    while v >= 0x80:
        buf[p] = (v & 0x7F) | 0x80
        p += 1
        v >>= 7
    buf[p] = v
    return p + 1


@nb.njit(cache=True)
def write_table(out, p, freq):
    """Write the frequency table of ``freq`` (NSYM entries) at ``out[p]``; returns the end."""
    nsym = 0
    for s in range(NSYM):
        if freq[s] > 0:
            nsym += 1
    p = write_varint(out, p, nsym)
    for s in range(NSYM):
        if freq[s] > 0:
            p = write_varint(out, p, s)
            p = write_varint(out, p, freq[s])
    return p
