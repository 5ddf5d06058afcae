"""Canonical Huffman codes for the value symbols of the ``huffman`` stream (the default encoding;
layout in ``cuda/FORMAT.md`` 2.4): code lengths limited to ``MAX_BITS``, encoder codes, decoder
tables, the table's bytes, and the per-tile encoders.

Invariants: codes are canonical (shorter first, then by symbol), so the stream carries only the
lengths; the encoder's table depends only on the symbol counts; a table that is not a complete
code (or one symbol of length 0) is refused. No I/O; every reader is bounds-checked.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from weftboard.cuda.bitops import load_u64le
from weftboard.cuda.entropy import (
    NSYM,
    bytes_put,
    parse_directory,
    read_varint,
    write_varint,
)
from weftboard.cuda.jit import parallel_kernel

MAX_BITS = 12  # 4096-entry decoder table (8 KiB, in L1); 11 bits cost 0.05 bits a change more on the bench
TABLE_BYTES = 1 + 3 * NSYM  # room for any table (the largest takes 261: all NSYM symbols, 128 and nsym in 2 bytes)
# The bytes a tile's value stream may take before it is finished: MAX_BITS bits a symbol and
# the 8-byte word the writer stores from its last full byte (``entropy.bytes_put``).
SLACK = 8


@nb.njit(inline="always", cache=True)
def tile_bound(n: int) -> int:
    """Scratch bytes for the value stream of a tile of ``n`` changes."""
    return (n * MAX_BITS + 7) // 8 + SLACK


@nb.njit(cache=True, nogil=True)
def code_lengths(counts):
    """Code length per symbol (0 where the count is 0) of a Huffman code for ``counts``,
    limited to MAX_BITS. Deterministic: ties are broken by symbol, so the encoder's table
    depends only on the counts.

    Huffman lengths from the two-queue construction over the counts sorted ascending; if
    the longest exceeds MAX_BITS, the lengths are limited as miniz and zlib's ``gen_bitlen``
    do (overlong codes cut to MAX_BITS, then codes moved one level deeper until the Kraft sum
    is 1 again), and in every case assigned anew, shortest to the most frequent symbol."""
    lengths = np.zeros(NSYM, np.int64)
    syms = np.flatnonzero(counts > 0)
    w = counts[syms]
    n = syms.size
    if n < 2:
        return lengths  # no symbol, or one: length 0
    order = np.argsort(w, kind="mergesort")  # ascending counts, ties by symbol
    # nodes 0..n-1: leaves in ascending order; n..2n-2: internal nodes in creation order
    weight = np.zeros(2 * n - 1, np.int64)
    parent = np.zeros(2 * n - 1, np.int64)
    for i in range(n):
        weight[i] = w[order[i]]
    leaf = 0
    inner = n
    for made in range(n, 2 * n - 1):
        for _ in range(2):  # the two lightest of the leaves' and the inner nodes' queue fronts
            if leaf < n and (inner >= made or weight[leaf] <= weight[inner]):
                child = leaf
                leaf += 1
            else:
                child = inner
                inner += 1
            weight[made] += weight[child]
            parent[child] = made
    depth = np.zeros(2 * n - 1, np.int64)
    for i in range(2 * n - 3, -1, -1):  # parents come after their children
        depth[i] = depth[parent[i]] + 1
    per_len = np.zeros(64, np.int64)
    for i in range(n):
        per_len[depth[i]] += 1
    longest = 0
    for d in range(64):
        if per_len[d]:
            longest = d
    if longest > MAX_BITS:
        for d in range(MAX_BITS + 1, 64):
            per_len[MAX_BITS] += per_len[d]
            per_len[d] = 0
        total = 0
        for d in range(1, MAX_BITS + 1):
            total += per_len[d] << (MAX_BITS - d)
        while total > (1 << MAX_BITS):
            per_len[MAX_BITS] -= 1
            for d in range(MAX_BITS - 1, 0, -1):
                if per_len[d]:
                    per_len[d] -= 1
                    per_len[d + 1] += 2
                    break
            total -= 1
    # shortest lengths to the most frequent symbols (descending counts, ties by symbol)
    desc = np.argsort(-w, kind="mergesort")
    i = 0
    for d in range(1, MAX_BITS + 1):
        for _ in range(per_len[d]):
            lengths[syms[desc[i]]] = d
            i += 1
    return lengths


@nb.njit(inline="always", cache=True)
def _reverse(code, length):
    r = 0
    for _ in range(length):
        r = (r << 1) | (code & 1)
        code >>= 1
    return r


@nb.njit(cache=True, nogil=True)
def encoder_codes(lengths):
    """Per symbol ``reversed_code | length << 32`` (0 for absent symbols): what the
    encoder appends, first bit lowest."""
    per_len = np.zeros(MAX_BITS + 2, np.int64)
    for s in range(NSYM):
        per_len[lengths[s]] += 1
    per_len[0] = 0
    next_code = np.zeros(MAX_BITS + 2, np.int64)
    code = 0
    for d in range(1, MAX_BITS + 1):
        code = (code + per_len[d - 1]) << 1
        next_code[d] = code
    codes = np.zeros(NSYM, np.int64)
    for s in range(NSYM):
        d = lengths[s]
        if d > 0:
            codes[s] = _reverse(next_code[d], d) | (d << 32)
            next_code[d] += 1
    return codes


@nb.njit(cache=True, nogil=True)
def decoder_table(lengths, present):
    """The ``2**MAX_BITS`` entries ``symbol << 4 | length`` indexed by the next MAX_BITS
    stream bits, for a checked table (``read_table``)."""
    table = np.zeros(1 << MAX_BITS, np.uint16)
    codes = encoder_codes(lengths)
    for s in range(NSYM):
        d = lengths[s]
        if d > 0:
            entry = np.uint16((s << 4) | d)
            for j in range(codes[s] & 0xFFFFFFFF, 1 << MAX_BITS, 1 << d):
                table[j] = entry
        elif present[s]:  # the one symbol of a one-symbol code: every lookup, no bits
            table[:] = np.uint16(s << 4)
    return table


@nb.njit(cache=True, nogil=True)
def write_table(out, p, lengths, present):
    """Write the table of ``lengths`` (``present[s]``: the symbol occurs) at ``out[p]``;
    returns the end."""
    nsym = 0
    for s in range(NSYM):
        if present[s]:
            nsym += 1
    p = write_varint(out, p, nsym)
    for s in range(NSYM):
        if present[s]:
            p = write_varint(out, p, s)
            out[p] = lengths[s]
            p += 1
    return p


@nb.njit(cache=True, nogil=True)
def read_table(buf, p, end, lengths, present):
    """Parse a table at ``buf[p]`` into ``lengths`` and ``present``; (error code or 0, end,
    nsym). Error 1: truncated or malformed; 2: symbols out of order or unknown, a length out
    of range, or not a complete code."""
    nsym, p = read_varint(buf, p, end)
    if nsym < 0 or nsym > NSYM:
        return 1, p, 0
    last = -1
    kraft = 0
    for _ in range(nsym):
        s, p = read_varint(buf, p, end)
        if s < 0 or p >= end:
            return 1, p, 0
        d = np.int64(buf[p])
        p += 1
        if s <= last or s >= NSYM or d > MAX_BITS or (d == 0) != (nsym == 1):
            return 2, p, 0
        lengths[s] = d
        present[s] = True
        if d > 0:
            kraft += 1 << (MAX_BITS - d)
        last = s
    if nsym > 1 and kraft != (1 << MAX_BITS):
        return 2, p, 0
    return 0, p, nsym


@nb.njit(cache=True, nogil=True)
def parse_stream(buf, numel, tile, width, changed):
    """The table and tile directory of a ``huffman`` stream and its decoder table, in one
    compiled call: (err, ns, ks, rice, value bytes, escapes, offsets, table), per-tile arrays
    flat; ``err`` as ``entropy.DIR_ERRORS``."""
    lengths = np.zeros(NSYM, np.int64)
    present = np.zeros(NSYM, np.bool_)
    err, p, nsym = read_table(buf, 0, buf.size, lengths, present)
    nsyms = np.full(1, nsym, np.int64)
    if err:
        p = buf.size
        nsyms[0] = 1
    derr, ns, ks, rice, values, esc, offs = parse_directory(buf, p, 1, numel, tile, width, changed, nsyms)
    if err == 0:
        err = derr
    table = decoder_table(lengths, present) if err == 0 else np.zeros(1 << MAX_BITS, np.uint16)
    return err, ns[:, 0].copy(), ks[:, 0].copy(), rice[:, 0].copy(), values, esc, offs, table


@nb.njit(inline="always", cache=True)
def _code_group(codes, s0, s1, s2, s3):
    """(bits, length) of four symbols' codes one after the other: at most 4 * MAX_BITS = 48
    bits, which ``entropy.bytes_put`` takes in one append."""
    low = np.uint64(0xFFFFFFFF)
    c0 = np.uint64(codes[s0])
    c1 = np.uint64(codes[s1])
    c2 = np.uint64(codes[s2])
    c3 = np.uint64(codes[s3])
    at1 = c0 >> np.uint64(32)
    at2 = at1 + (c1 >> np.uint64(32))
    at3 = at2 + (c2 >> np.uint64(32))
    bits = (c0 & low) | ((c1 & low) << at1) | ((c2 & low) << at2) | ((c3 & low) << at3)
    return bits, at3 + (c3 >> np.uint64(32))


@nb.njit(inline="always", cache=True)
def _encode_tile(sym_buf, j, n, codes, out, q):
    """The ``n`` symbols ``sym_buf[j:]`` coded at ``out[q:]``; returns the byte after them.

    Four codes go in one append (``entropy.bytes_put``: fewer than 8 pending bits, 8 bytes
    stored, moved by the whole bytes completed): no branch on whether a byte is due, which
    the predictor could not learn, and the writer's dependency chain paid once per four
    symbols (about a quarter less time than one append per symbol on the codec bench:
    6.6 -> 5.1 and 5.8 -> 4.2 ms over its tensors)."""
    acc = np.uint64(0)
    nbits = np.uint64(0)
    j = np.uint64(j)
    end = j + np.uint64(n)
    while j + np.uint64(4) <= end:
        bits, ln = _code_group(codes, sym_buf[j], sym_buf[j + np.uint64(1)], sym_buf[j + np.uint64(2)],
                               sym_buf[j + np.uint64(3)])
        q, acc, nbits = bytes_put(out, q, acc, nbits, bits, ln)
        j += np.uint64(4)
    while j < end:
        c = np.uint64(codes[sym_buf[j]])
        q, acc, nbits = bytes_put(out, q, acc, nbits, c & np.uint64(0xFFFFFFFF), c >> np.uint64(32))
        j += np.uint64(1)
    if nbits:
        out[q] = np.uint8(acc & np.uint64(0xFF))
        q += 1
    return q


@parallel_kernel
def encode_tiles(sym_buf, sym_off, ns, codes, out, out_off):
    """Each tile's symbols ``sym_buf[sym_off[t]:][:ns[t]]`` coded at ``out[out_off[t]:]``
    (``tile_bound(ns[t])`` bytes of room); returns each tile's byte length."""
    ntiles = ns.size
    lens = np.zeros(ntiles, np.int64)
    for t in nb.prange(ntiles):
        if ns[t]:
            lens[t] = _encode_tile(sym_buf, sym_off[t], ns[t], codes, out, out_off[t]) - out_off[t]
    return lens


@parallel_kernel
def encode_tiles_by_row(sym_buf, sym_off, ns, codes, row, out, out_off):
    """``encode_tiles`` of several tensors' tiles in one parallel loop, tile ``t`` coded with
    ``codes[row[t]]`` (``tile_encode.encode_huffman_batch``)."""
    ntiles = ns.size
    lens = np.zeros(ntiles, np.int64)
    for t in nb.prange(ntiles):
        if ns[t]:
            lens[t] = _encode_tile(sym_buf, sym_off[t], ns[t], codes[row[t]], out, out_off[t]) - out_off[t]
    return lens


@nb.njit(inline="always", cache=True)
def symbol(buf, hp, hend, table):
    """Decode one symbol at bit ``hp`` of ``buf`` whose value bits end at bit ``hend``:
    returns ``(symbol, hp, err)``, ``err`` 6 when the code runs past ``hend``."""
    at = hp >> 3
    if at + 8 <= buf.size:  # always but at the very end of the buffer
        word = load_u64le(buf, at)
    else:
        word = np.uint64(0)
        for b in range(min(8, buf.size - at)):
            word |= np.uint64(buf[at + b]) << np.uint64(8 * b)
    entry = table[(word >> np.uint64(hp & 7)) & np.uint64((1 << MAX_BITS) - 1)]
    hp += np.int64(entry & np.uint16(15))
    if hp > hend:
        return np.int64(entry >> np.uint16(4)), hp, 6
    return np.int64(entry >> np.uint16(4)), hp, 0


@nb.njit(inline="always", cache=True)
def ends_cleanly(buf, hp, hend):
    """Whether a tile's value bits, read up to bit ``hp``, end at byte ``hend >> 3`` with zero
    padding (the only way the encoder ends them)."""
    if (hp + 7) >> 3 != hend >> 3:
        return False
    if hp & 7:
        return (np.int64(buf[hp >> 3]) >> (hp & 7)) == 0
    return True
