"""The fused encoders of the tiled streams: ``encode_huffman`` (and its batch form) turn one read of
the old and new bits into a finished ``huffman`` stream; ``scan_tiles`` + ``finish_huffman`` do the
same for a tensor read piece by piece (the publisher's fold). The format-1 ``sparse`` stream is
read (``decode``), no longer written.

Invariants: the bytes equal the two-step encoder's (``entropy``, ``huffman``) for the same changes;
pieces must start on tile boundaries, and their finished stream equals the whole tensor's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numba as nb
import numpy as np

from weftboard.cuda import entropy, huffman
from weftboard.cuda.entropy import NSYM
from weftboard.cuda.scratch import fresh_scratch, pooled
from weftboard.cuda.tile_assembly import (
    assemble_tiles,
    assembly_bound,
    assembly_head,
    compact_tiles,
    move_pieces,
    packed_offsets,
    rans_encode_tiles,
)
from weftboard.cuda.tile_blocks import RICE_SLACK, VECTOR_COMPRESS
from weftboard.cuda.tile_scan import (
    check_scan_pair,
    packed_scan_args,
    packed_scan_fits,
    scan_encode_batch_packed,
    scan_encode_tiles_packed,
    scan_into_scratch,
)


def encode_huffman(old: np.ndarray, new: np.ndarray, tile: int, scratch: dict | None = None) -> tuple[int, np.ndarray | None]:
    """(number of changed elements, the ``huffman`` stream), one read of both arrays.

    ``old`` and ``new`` are unsigned views of one element width. The stream is None when
    nothing changed or when a tile did not fit its scratch (a pathological, very dense tile);
    the caller then picks another mode or the two-step encoder. ``scratch``: a pool kept
    across calls (``pooled``).
    """
    width = old.itemsize
    ntiles = (old.size + tile - 1) // tile
    rstride = tile + RICE_SLACK
    rice_buf = pooled(scratch, "tile_rice", ntiles * rstride)
    sym_buf = pooled(scratch, "tile_sym", ntiles * 2 * tile)
    if packed_scan_fits(tile, width):
        check_scan_pair(old, new, tile, False)  # (``scan_into_scratch`` checks on the other path)
        # Every pass in one compiled call: a tensor's Python and dispatch costs (about 0.1 ms
        # when the passes were called one by one) are paid once per tensor, not per pass.
        value_buf = pooled(scratch, "values", _value_bytes(old.size, ntiles))
        total, stream = _encode_tiles_packed(old, new, width, tile, rice_buf, sym_buf, value_buf, False,
                                              *packed_scan_args(None, VECTOR_COMPRESS))
        return int(total), (stream if stream.size else None)
    ns, ks, rice_len, n_esc, counts, over = scan_into_scratch(old, new, tile, rice_buf, sym_buf)
    total = int(ns.sum())
    if total == 0 or over.any():
        return total, None
    tiles = np.arange(ntiles, dtype=np.int64)  # the scratch layout: fixed strides per tile
    return total, finish_scanned_tiles(ns, ks, rice_len, n_esc, counts, width, rice_buf, rstride * tiles,
                                       sym_buf, 2 * tile * tiles, sym_buf, 2 * tile * tiles + tile, scratch=scratch)


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
    if not packed_scan_fits(tile, width):
        raise ValueError(f"a batch needs tiles of at most 65536 and 1-, 2- or 4-byte elements, got {tile} and {width}")
    for old, new in pairs:
        check_scan_pair(old, new, tile, False)
        if old.itemsize != width:
            raise ValueError(f"a batch has one element width, got {width} and {old.itemsize} bytes")
    numels = np.array([old.size for old, _ in pairs], np.int64)
    addr_a = np.array([old.__array_interface__["data"][0] for old, _ in pairs], np.int64)
    addr_b = np.array([new.__array_interface__["data"][0] for _, new in pairs], np.int64)
    ntiles = int(((numels + tile - 1) // tile).sum())
    rice_buf = pooled(scratch, "tile_rice", ntiles * (tile + RICE_SLACK))
    sym_buf = pooled(scratch, "tile_sym", ntiles * 2 * tile)
    value_buf = pooled(scratch, "values", _value_bytes(int(numels.sum()), ntiles))
    like = pairs[0][0][:0]
    changes, spans, out = _encode_huffman_batch(addr_a, addr_b, numels, like, width, tile, rice_buf, sym_buf,
                                                value_buf, False, *packed_scan_args(None, VECTOR_COMPRESS)[1:])
    return [(int(n), out[s:s + m] if m else None) for n, (s, m) in zip(changes.tolist(), spans.tolist(), strict=True)]


def batchable(old: np.ndarray, tile: int) -> bool:
    """Whether pairs of ``old``'s element width can go through ``encode_huffman_batch``."""
    return packed_scan_fits(tile, old.itemsize)


def _value_bytes(changes: int, ntiles: int) -> int:
    """Scratch for the Huffman-coded values of ``changes`` symbols in ``ntiles`` tiles: at most
    ``huffman.MAX_BITS`` (<= 16) bits a symbol and ``huffman.SLACK`` + 1 bytes a tile."""
    return 2 * changes + (4 + huffman.SLACK + 1) * ntiles


@nb.njit(cache=True, nogil=True)
def _encode_tiles_packed(a, b, width, tile, rice_buf, sym_buf, value_buf, update, src, nthreads, lane_rows):
    """``encode_huffman`` of a packed-scan pair (``packed_scan_fits``): the scan, then
    ``_finish_huffman``. Returns (changes, stream), the stream empty when there is none
    (nothing changed or a tile overflowed).
    ``value_buf``: ``_value_bytes`` of scratch. ``update`` (False from every caller) comes
    from Python, typed a plain bool: a ``False`` written here is typed as a literal, and the
    scan was compiled once more for it beside the publisher's form (``scan_tiles``)."""
    rstride = tile + RICE_SLACK
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
    return total, _finish_huffman(ns, ks, rice_len, n_esc, counts, width, rice_buf, rstride * tiles, sym_buf,
                                  2 * tile * tiles, sym_buf, 2 * tile * tiles + tile, value_buf)


@nb.njit(cache=True, nogil=True)
def _finish_huffman(ns, ks, rice_len, n_esc, counts, width, rice_buf, rice_off, sym_buf, sym_off, esc_buf, esc_off,
                    value_buf):
    """Passes 2 and 3 of a ``huffman`` stream over scanned tiles wherever their pieces lie
    (every argument per tile, ``counts`` the tensor's histogram), in one compiled call: the
    code from the histogram, each tile's values coded at a fixed stride in ``value_buf``
    (``huffman.tile_bound``), then the assembly with the code's table in front."""
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
    rstride = tile + RICE_SLACK
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


def finish_scanned_tiles(ns, ks, rice_len, n_esc, counts, width, rice_buf, rice_off, sym_buf, sym_off, esc_buf, esc_off,
                         prefix=None, scratch=None):
    """Passes 2 and 3 over scanned tiles wherever their bytes lie. One class (the ``huffman``
    stream, no ``prefix``): every argument per tile and one histogram ``counts``, coded by
    ``_finish_huffman``; several (``context``, rANS-coded): ``ns``, ``ks`` and the Rice and
    escape pieces per (tile, class), ``counts`` (classes, NSYM), and the stream's ``prefix``;
    ``sym_off`` is per tile either way. ``scratch``: a pool for the coded values (``pooled``)."""
    ntiles = ns.shape[0]
    counts = counts.reshape(-1, NSYM)
    if counts.shape[0] == 1 and prefix is None:
        flat = [np.ascontiguousarray(x, dtype=np.int64).reshape(-1) for x in (ns, ks, rice_len, n_esc, rice_off, esc_off)]
        value_buf = pooled(scratch, "values", _value_bytes(int(flat[0].sum()), ntiles))
        return _finish_huffman(*flat[:4], np.ascontiguousarray(counts[0], dtype=np.int64), width, rice_buf, flat[4],
                               sym_buf, np.ascontiguousarray(sym_off, dtype=np.int64), esc_buf, flat[5], value_buf)
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


@dataclass(frozen=True)
class TileScan:
    """Pass 1 over whole tiles of a tensor, compacted: everything its tiled stream needs except
    the coding of the symbols, which waits for the whole tensor's symbol counts.

    This is how a caller that reads a tensor piece by piece (the publisher folds a large
    tensor into its view in chunks, and the old bits are gone once a chunk is folded in)
    encodes it in the same read: ``scan_tiles`` per piece, then ``finish_huffman`` once.
    Pieces must start on tile boundaries; the bytes equal ``encode_huffman`` of the whole.
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
    """Pass 1 of ``encode_huffman`` over ``old``/``new`` (unsigned views, a whole number of
    tiles except at a tensor's end); ``update`` also folds ``new`` into ``old`` (see
    ``scan_encode_tiles``). Tiles that did not fit their scratch are listed in
    ``overflowed``. ``scratch`` keeps the scan's buffers between calls.

    ``cast``: ``old`` holds bf16 bits and ``new`` the fp32 bits whose bf16 cast is the new
    version; tiles with a NaN or a subnormal are left for the caller in ``overflowed``."""
    ntiles = (old.size + tile - 1) // tile
    need_rice, need_sym = ntiles * (tile + RICE_SLACK), ntiles * 2 * tile
    bufs = None if scratch is None else scratch.get("tile_scan")
    if bufs is None or bufs[0].size < need_rice or bufs[1].size < need_sym:
        bufs = (fresh_scratch(need_rice), fresh_scratch(need_sym))
        if scratch is not None:
            scratch["tile_scan"] = bufs
    rice_buf, sym_buf = bufs
    ns, ks, rice_len, n_esc, counts, over = scan_into_scratch(old, new, tile, rice_buf, sym_buf, update, cast)
    overflowed = np.flatnonzero(over).astype(np.int64)
    ns[overflowed] = 0  # their Rice lengths and escapes are 0 already, their symbols uncounted
    tiles = np.arange(ns.size, dtype=np.int64)[:, None]
    rice, syms, escs = compact_tiles(ns, rice_len[:, None], n_esc[:, None], old.itemsize, rice_buf,
                                      (tile + RICE_SLACK) * tiles, sym_buf, 2 * tile * tiles[:, 0], 2 * tile * tiles + tile)
    return TileScan(ns, ks, rice_len, n_esc, rice, syms, escs, counts, overflowed)


def finish_huffman(scans: Sequence[TileScan], width: int) -> np.ndarray:
    """The ``huffman`` stream of a tensor from the scans of its pieces, in order (at least one
    change in all)."""
    return finish_pieces(scans, width)


def finish_pieces(scans: Sequence, width: int, prefix: np.ndarray | None = None) -> np.ndarray:
    """Passes 2 and 3 over the scans of a tensor's pieces, in order: ``TileScan`` (the
    ``huffman`` stream) or ``context_codec.ContextScan`` with the stream's ``prefix``."""
    if any(s.overflowed.size for s in scans):
        raise ValueError("a scan with overflowed tiles does not describe its piece; diff those tiles")
    ns = np.concatenate([s.ns for s in scans])
    if not ns.any():
        raise ValueError("a stream needs at least one change")
    rice_len = np.concatenate([s.rice_len for s in scans])
    n_esc = np.concatenate([s.n_esc for s in scans])
    return finish_scanned_tiles(
        ns, np.concatenate([s.ks for s in scans]), rice_len, n_esc, sum(s.counts for s in scans), width,
        np.concatenate([s.rice for s in scans]), packed_offsets(rice_len),
        np.concatenate([s.syms for s in scans]), packed_offsets(ns.reshape(ns.shape[0], -1).sum(axis=1)),
        np.concatenate([s.escs for s in scans]), packed_offsets(n_esc * width), prefix,
    )
