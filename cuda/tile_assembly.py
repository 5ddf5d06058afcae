"""Passes 2 and 3 of the tiled streams: rANS coding of a tile's symbols, and the assembly of
table, directory and per-tile payloads into one stream (byte layout: ``cuda/FORMAT.md``).

Invariants: pieces are copied in tile (then class) order, so the assembled stream depends only on
the scanned tiles, never on thread count or scratch layout.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from weftboard.cuda import entropy
from weftboard.cuda.bitops import (
    move_bytes,
    range_fits,
    store_u16be,
)
from weftboard.cuda.entropy import NSYM, RANS_L
from weftboard.cuda.jit import parallel_kernel


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
    coded with its class's table ``rtab[c]`` (the ``context`` stream)."""
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
            p = entropy.write_varint(out, p, ns[t, c])
        if tot[t] == 0:
            continue
        for c in range(nclasses):
            if ns[t, c]:
                out[p] = ks[t, c]
                p = entropy.write_varint(out, p + 1, rice_len[t, c])
        p = entropy.write_varint(out, p, rans_off[t + 1] - rans_start[t])
        p = entropy.write_varint(out, p, n_esc[t].sum())
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


def packed_offsets(lengths: np.ndarray) -> np.ndarray:
    """Where each piece starts when pieces of these lengths (any shape, C order) are packed."""
    flat = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    out = np.zeros(flat.size, np.int64)
    np.cumsum(flat[:-1], out=out[1:])
    return out.reshape(lengths.shape)


@parallel_kernel
def compact_tiles(ns, rice_len, n_esc, width, rice_buf, rice_off, sym_buf, sym_off, esc_off):
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
            raise IndexError("compact_tiles: a tile's piece lies outside the scratch")
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
