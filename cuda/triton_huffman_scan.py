"""Pass 1 of the ``huffman`` stream (``cuda/FORMAT.md`` 2.2-2.4) on the device: Triton kernels scan
(old, new) tensors tile by tile into what ``tile_scan``'s CPU scan produces (changes, Rice
parameter, Rice bytes, symbols and escapes per tile); the host's ``tile_encode`` finish codes
the symbols and assembles the stream, so the bytes are ``tile_encode.encode_huffman``'s.

Invariants:
- Three launches, one program per tile: ``huffman_count_kernel`` (changes, last position, escapes),
  then, after the host chose each tile's Rice parameter with the CPU's own ``rice_k`` and
  refused what the CPU scan refuses (an overflowing tile: the stream is None), ``huffman_place_kernel``
  (symbols, escapes and positions at exclusive offsets) and ``huffman_rice_kernel`` (each tile's Rice
  bits, serially, in a region of the CPU's bound). Tiles write disjoint regions.
- Two device-to-host copies of compact arrays (per-tile counts; then one buffer of symbols,
  escapes, Rice bytes and Rice lengths), never the tensor.
- Not wired into the publisher or ``encode.py``: a measured, tested kernel until a GPU run
  validates it. Without a GPU, set ``TRITON_INTERPRET=1`` before importing and pass CPU tensors.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import torch
import triton
import triton.language as tl

from weftboard.cuda import entropy
from weftboard.cuda.tensor_bits import bits_view, launching_on
from weftboard.cuda.tile_assembly import packed_offsets
from weftboard.cuda.tile_blocks import RICE_SLACK, rice_k
from weftboard.cuda.tile_encode import finish_scanned_tiles

_MAX_DELTA = tl.constexpr(entropy.ESC // 2)
_ESC = tl.constexpr(entropy.ESC)
_META = tl.constexpr(6)  # int64 columns of a tile's row in ``meta``: tile, symbol, escape and Rice offsets, n, k
SCAN_WARPS = 4  # the count and place passes are vector loops over a tile's blocks
RICE_WARPS = 1  # the Rice pass is serial within a tile


@triton.jit
def _symbols(o_ptr, n_ptr, idx, live, WIDTH: tl.constexpr):
    """(changed, escaped, symbol, difference as uint64) of the elements ``idx`` (where ``live``)."""
    top: tl.constexpr = 1 << (8 * WIDTH)
    mask: tl.constexpr = top - 1
    old = tl.load(o_ptr + idx, mask=live, other=0).to(tl.int64) & mask
    new = tl.load(n_ptr + idx, mask=live, other=0).to(tl.int64) & mask
    d = (new - old) & mask
    s = tl.where(d >= (top >> 1), d - top, d)  # the difference read as a signed WIDTH-byte integer
    m = tl.abs(s)
    changed = live & (d != 0)
    small = (m >= 1) & (m <= _MAX_DELTA)
    sym = tl.where(small, 2 * (m - 1) + (s < 0).to(tl.int64), _ESC)
    return changed, changed & (sym == _ESC), sym, d


@triton.jit
def huffman_count_kernel(o_ptr, n_ptr, out_ptr, numel, tile, n_tiles, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``t``: tile ``t``'s changes, last changed position (-1: none) and escapes at
    ``out[t]``, ``out[n_tiles + t]`` and ``out[2 * n_tiles + t]``."""
    t = tl.program_id(0)
    start = t.to(tl.int64) * tile
    lane = tl.arange(0, BLOCK)
    cnt = tl.zeros((), tl.int64)
    nesc = tl.zeros((), tl.int64)
    last = tl.full((), -1, tl.int64)
    for off in range(0, tile, BLOCK):
        idx = start + off + lane
        changed, escaped, _, _ = _symbols(o_ptr, n_ptr, idx, idx < numel, WIDTH)
        cnt += tl.sum(changed.to(tl.int64), axis=0)
        nesc += tl.sum(escaped.to(tl.int64), axis=0)
        last = tl.maximum(last, tl.max(tl.where(changed, off + lane, -1).to(tl.int64), axis=0))
    tl.store(out_ptr + t, cnt)
    tl.store(out_ptr + n_tiles + t, last)
    tl.store(out_ptr + 2 * n_tiles + t, nesc)


@triton.jit
def huffman_place_kernel(o_ptr, n_ptr, meta_ptr, buf_ptr, pos_ptr, numel, tile, WIDTH: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Program ``r``: the tile of ``meta``'s row ``r``, its symbols in position order at
    ``buf[sym_off:]``, its escapes (``WIDTH`` little-endian bytes each) at ``buf[esc_off:]``
    and its change positions within the tile (int32) at ``pos[sym_off:]``."""
    row = meta_ptr + tl.program_id(0).to(tl.int64) * _META
    start = tl.load(row) * tile
    at = tl.load(row + 1)
    e = tl.load(row + 2)
    lane = tl.arange(0, BLOCK)
    for off in range(0, tile, BLOCK):
        idx = start + off + lane
        changed, escaped, sym, d = _symbols(o_ptr, n_ptr, idx, idx < numel, WIDTH)
        slot = at + tl.cumsum(changed.to(tl.int64), axis=0) - 1
        tl.store(buf_ptr + slot, sym.to(tl.uint8), mask=changed)
        tl.store(pos_ptr + slot, (off + lane).to(tl.int32), mask=changed)
        q = e + (tl.cumsum(escaped.to(tl.int64), axis=0) - 1) * WIDTH
        for i in tl.static_range(WIDTH):
            tl.store(buf_ptr + q + i, ((d >> (8 * i)) & 255).to(tl.uint8), mask=escaped)
        at += tl.sum(changed.to(tl.int64), axis=0)
        e += tl.sum(escaped.to(tl.int64), axis=0) * WIDTH


@triton.jit
def _flush(buf_ptr, q, acc, nbits):
    """Store the writer's whole bytes at ``buf[q:]``; returns (q, acc, nbits) with nbits < 8."""
    while nbits >= 8:
        tl.store(buf_ptr + q, (acc & 255).to(tl.uint8))
        q += 1
        acc = acc >> 8
        nbits -= 8
    return q, acc, nbits


@triton.jit
def huffman_rice_kernel(pos_ptr, meta_ptr, buf_ptr, len_ptr):
    """Program ``r``: the Rice(k) bits (FORMAT.md 2.3, LSB-first, zero-padded to a byte) of
    the gaps between the tile's positions at ``pos[sym_off:]``, written at ``buf[rice_off:]``
    (``entropy.rice_bytes_put``'s bits); its byte length at ``len[r]``."""
    r = tl.program_id(0)
    row = meta_ptr + r.to(tl.int64) * _META
    at = tl.load(row + 1)
    q0 = tl.load(row + 3)
    n = tl.load(row + 4)
    k = tl.load(row + 5).to(tl.uint64)
    lowmask = (tl.full((), 1, tl.uint64) << k) - 1
    q = q0
    acc = tl.zeros((), tl.uint64)
    nbits = tl.zeros((), tl.uint64)
    prev = tl.full((), -1, tl.int64)
    for j in range(n):
        p = tl.load(pos_ptr + at + j).to(tl.int64)
        g = (p - prev - 1).to(tl.uint64)
        prev = p
        u = g >> k
        while u + k > 55:  # 32 one-bits at a time until the code fits one append
            acc |= tl.full((), 0xFFFFFFFF, tl.uint64) << nbits
            nbits += 32
            q, acc, nbits = _flush(buf_ptr, q, acc, nbits)
            u -= 32
        acc |= (((tl.full((), 1, tl.uint64) << u) - 1) | ((g & lowmask) << (u + 1))) << nbits
        nbits += u + 1 + k
        q, acc, nbits = _flush(buf_ptr, q, acc, nbits)
    if nbits > 0:
        tl.store(buf_ptr + q, (acc & 255).to(tl.uint8))
        q += 1
    tl.store(len_ptr + r, (q - q0).to(tl.int32))


@nb.njit(cache=True, nogil=True)
def _rice_ks(ns: np.ndarray, lastpos: np.ndarray) -> np.ndarray:
    """Each tile's Rice parameter, by the CPU scan's own ``rice_k`` (0 for a tile with no change)."""
    ks = np.zeros(ns.size, np.int64)
    for t in range(ns.size):
        if ns[t]:
            ks[t] = rice_k(lastpos[t] + 1 - ns[t], ns[t])
    return ks


def _block(tile: int) -> int:
    """The largest power of two up to 1024 that divides ``tile`` (a multiple of 64)."""
    return min(tile & -tile, 1024)


def encode_huffman_cuda(old: torch.Tensor, new: torch.Tensor, tile: int) -> tuple[int, np.ndarray | None]:
    """``tile_encode.encode_huffman`` of two tensors of one dtype and shape on a Triton device:
    (number of changed elements, the ``huffman`` stream), the stream None when nothing changed
    or when a tile overflows the CPU scan's scratch (a pathologically dense tile, as on CPU).
    ``tile``: a multiple of 64, at most 65536; elements of 1, 2 or 4 bytes."""
    if old.dtype != new.dtype or old.shape != new.shape or old.device != new.device:
        raise ValueError(f"old and new must have one dtype, shape and device, got {old.dtype}/{tuple(old.shape)}/"
                         f"{old.device} and {new.dtype}/{tuple(new.shape)}/{new.device}")
    width = old.element_size()
    if width not in (1, 2, 4) or tile % 64 or not 0 < tile <= 65536:
        raise ValueError(f"the device scan takes 1-, 2- or 4-byte elements and tiles a multiple of 64 up to 65536, "
                         f"got {width} bytes and {tile}")
    a, b = bits_view(old.contiguous()), bits_view(new.contiguous())
    numel = a.numel()
    ntiles = (numel + tile - 1) // tile
    if ntiles == 0:
        return 0, None
    dev = a.device
    block = _block(tile)
    with launching_on(dev):
        counts_dev = torch.empty(3 * ntiles, dtype=torch.int64, device=dev)
        huffman_count_kernel[(ntiles,)](a, b, counts_dev, numel, tile, ntiles, WIDTH=width, BLOCK=block,
                                        num_warps=SCAN_WARPS)
        ns, lastpos, n_esc = counts_dev.cpu().numpy().reshape(3, ntiles)
        total = int(ns.sum())
        if total == 0:
            return 0, None
        ks = _rice_ks(ns, lastpos)
        # The CPU scan's refusals (``tile_scan._scan_tile``): escapes past the tile's bytes, or
        # a Rice bound past its scratch. The bound (a sum of floors is at most the floor of the
        # sum) also sizes each tile's Rice region here.
        rice_bits = np.where(ns > 0, ns * (ks + 1) + ((lastpos + 1 - ns) >> ks), 0)
        if (n_esc * width > tile).any() or ((rice_bits >> 3) + 8 > tile + RICE_SLACK - 16).any():
            return total, None
        tiles = np.flatnonzero(ns)
        sym_off = packed_offsets(ns)
        esc_off = total + packed_offsets(n_esc * width)
        esc_end = total + int(n_esc.sum()) * width
        rice_off = esc_end + packed_offsets((rice_bits + 7) >> 3)
        len_at = (int(rice_off[-1] + ((rice_bits[-1] + 7) >> 3)) + 3) // 4 * 4
        meta = np.stack([tiles, sym_off[tiles], esc_off[tiles], rice_off[tiles], ns[tiles], ks[tiles]], axis=1)
        meta_dev = torch.from_numpy(np.ascontiguousarray(meta, np.int64)).to(dev)
        buf = torch.zeros(len_at + 4 * tiles.size, dtype=torch.uint8, device=dev)
        pos = torch.empty(total, dtype=torch.int32, device=dev)
        rows = (tiles.size,)
        huffman_place_kernel[rows](a, b, meta_dev, buf, pos, numel, tile, WIDTH=width, BLOCK=block,
                                   num_warps=SCAN_WARPS)
        huffman_rice_kernel[rows](pos, meta_dev, buf, buf[len_at:].view(torch.int32), num_warps=RICE_WARPS)
        host = buf.cpu().numpy()
    rice_len = np.zeros(ntiles, np.int64)
    rice_len[tiles] = host[len_at:].view(np.int32)
    syms = host[:total]
    counts = np.bincount(syms, minlength=entropy.NSYM).astype(np.int64)
    return total, finish_scanned_tiles(ns, ks, rice_len, n_esc, counts, width, host, rice_off, host, sym_off,
                                       host, esc_off)
