"""The ``huffman`` stream (``cuda/FORMAT.md`` 2.2-2.4) decoded and applied on the device by a
Triton kernel, one program per tile, byte-identical to ``tile_decode.apply_tiles``.

Invariants:
- The host parses and checks the table and directory first (``decode.parse_tile_stream``, the
  CPU path's parser and errors); only a stream that passed is uploaded and applied.
- Each program checks its tile as the CPU decoder does (same ``entropy.ERRORS`` codes) and
  reports how many changes it wrote before an error; on any error the host takes exactly
  those back out (``sign`` reversed, ``limit`` = the count), so a tensor is never left
  half-patched.
- Differences wrap at the element width (1, 2, 4 or 8 bytes); tiles are disjoint, so programs
  never write the same element.

Without a GPU, set ``TRITON_INTERPRET=1`` before importing this module and pass CPU tensors:
the kernel then runs in Triton's interpreter (the tests do this).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from weftboard.cuda import entropy, huffman
from weftboard.cuda.decode import (
    TileStream,
    _raise_tile_errors,
    parse_tile_stream,
    stream_array,
)
from weftboard.cuda.tensor_bits import bits_view, launching_on

_ESC = tl.constexpr(entropy.ESC)
_MAX_K = tl.constexpr(entropy.MAX_K)
_CODE_MASK = tl.constexpr((1 << huffman.MAX_BITS) - 1)
_META = tl.constexpr(8)  # int64 columns of a tile's row in ``meta`` (``_tile_meta``)
PAD = 16  # zero bytes after the stream on the device: a reader's 8-byte loads never leave the buffer
WARPS = 1  # the decode is serial within a tile: one warp a program, programs side by side


@triton.jit
def _load64(buf_ptr, at):
    """The 8 bytes at ``buf_ptr[at:]`` as a little-endian uint64 (byte loads: ``at`` has any alignment)."""
    w = tl.load(buf_ptr + at).to(tl.uint64)
    for i in tl.static_range(1, 8):
        w |= tl.load(buf_ptr + at + i).to(tl.uint64) << (8 * i)
    return w


@triton.jit
def _bits_at(buf_ptr, bit):
    """At least 57 stream bits from bit position ``bit`` (LSB-first), in the low bits of a uint64."""
    return _load64(buf_ptr, bit >> 3) >> (bit & 7).to(tl.uint64)


@triton.jit
def huffman_apply_kernel(t_ptr, buf_ptr, meta_ptr, table_ptr, limit_ptr, out_ptr, n_tiles, tile,
                         SIGN: tl.constexpr, WIDTH: tl.constexpr):
    """Program ``pid``: the tile of row ``pid`` of ``meta``; its first ``limit[pid]`` changes
    added (SIGN 1) or subtracted (-1) into ``t_ptr``'s integer elements. Writes its error code
    to ``out[pid]`` and its count of changes written to ``out[n_tiles + pid]``. The checks and
    their order per change are ``tile_decode._decode_tiles``': value code (6), escape (8),
    Rice gap (1, 2), position (2); at the tile's end (when every change was asked for) the
    Rice bits (3), value bits (7) and escape count (8)."""
    pid = tl.program_id(0)
    row = meta_ptr + pid.to(tl.int64) * _META
    tile_start = tl.load(row)
    tile_end = tl.load(row + 1)
    n = tl.load(row + 2)
    k = tl.load(row + 3)
    rend_bits = tl.load(row + 5) * 8  # the Rice bits end where the value bytes begin
    vend = tl.load(row + 6)  # the value bytes end where the escapes begin
    eend = tl.load(row + 7)
    lim = tl.load(limit_ptr + pid)
    vend_bits = vend * 8
    rp = tl.load(row + 4) * 8  # Rice reader: bit position
    hp = rend_bits  # value reader: bit position
    e = vend  # next escape byte
    prev = tile_start - 1
    applied = lim * 0  # changes stored
    # One change is held back: its old bits load as soon as its position is decoded and are
    # used only after the next change is decoded, so the load's latency overlaps the decoding.
    held = tl.zeros((), tl.int32)
    held_at = prev
    held_old = tl.zeros((), t_ptr.dtype.element_ty)
    held_d = held_old
    err = tl.where((k > _MAX_K) & (lim > 0), 9, 0).to(tl.int32)
    ku = tl.minimum(k, _MAX_K).to(tl.uint64)
    lowmask = (tl.full((), 1, tl.uint64) << ku) - 1
    while (applied + held < lim) & (err == 0):
        # the value code: one table load gives its symbol and length
        entry = tl.load(table_ptr + (_bits_at(buf_ptr, hp) & _CODE_MASK).to(tl.int32))
        hp += (entry & 15).to(tl.int64)
        if hp > vend_bits:
            err = 6
        s = entry >> 4
        mag = ((s >> 1) + 1).to(tl.uint64)
        d = tl.where((s & 1) == 1, 0 - mag, mag)  # 2*(m-1) + (s < 0), as a wrapping difference
        if (s == _ESC) & (err == 0):
            if e + WIDTH > eend:
                err = 8
            else:
                d = tl.load(buf_ptr + e).to(tl.uint64)
                for i in tl.static_range(1, WIDTH):
                    d |= tl.load(buf_ptr + e + i).to(tl.uint64) << (8 * i)
                e += WIDTH
        if SIGN < 0:
            d = 0 - d
        # the Rice gap: ones (56 at a time at most), a zero, k low bits
        q = rp * 0
        low = tl.zeros((), tl.uint64)
        scanning = err == 0
        while scanning:
            w = _bits_at(buf_ptr, rp)
            u = q * 0
            while (((w >> u.to(tl.uint64)) & 1) == 1) & (u < 56):
                u += 1
            q += u
            rp += u
            if u < 56:
                rp += 1
                if u + 1 + k <= 57:
                    low = (w >> (u + 1).to(tl.uint64)) & lowmask
                else:
                    low = _bits_at(buf_ptr, rp) & lowmask
                rp += k
                if rp > rend_bits:
                    err = 1
                scanning = False
            elif rp >= rend_bits:
                err = 1
                scanning = False
            elif q > tile:
                err = 2
                scanning = False
        if err == 0:
            cur = prev + 1 + ((q << k) | low.to(tl.int64))
            if cur >= tile_end:
                err = 2
            else:
                old = tl.load(t_ptr + cur)
                if held == 1:
                    tl.store(t_ptr + held_at, held_old + held_d)  # integer add: wraps at the element width
                    applied += 1
                held = 1
                held_at = cur
                held_old = old
                held_d = d.to(old.dtype)
                prev = cur
    if held == 1:  # the change decoded last, before an error too (the CPU decoder wrote it)
        tl.store(t_ptr + held_at, held_old + held_d)
        applied += 1
    if (err == 0) & (lim == n) & (n > 0):
        rice_left = rend_bits - rp  # what is left must be the zero padding of the last byte
        rice_pad = tl.load(buf_ptr + (rp >> 3)).to(tl.int32) >> (rp & 7).to(tl.int32)
        value_pad = tl.load(buf_ptr + (hp >> 3)).to(tl.int32) >> (hp & 7).to(tl.int32)
        if (rice_left > 7) | ((rice_left > 0) & (rice_pad != 0)):
            err = 3
        elif (((hp + 7) >> 3) != vend) | (((hp & 7) != 0) & (value_pad != 0)):  # huffman.ends_cleanly
            err = 7
        elif e != eend:
            err = 8
    tl.store(out_ptr + pid, err.to(tl.int64))
    tl.store(out_ptr + n_tiles + pid, applied)


class DeviceTiles:
    """A parsed ``huffman`` stream on the target's device: the stream bytes (zero-padded), one
    row per tile with changes (``_tile_meta``) and the 4096-entry decoder table. Built once per
    apply; ``launch`` runs the kernel with any sign and per-tile limit."""

    def __init__(self, sp: TileStream, device: torch.device) -> None:
        if sp.freq is not None:
            raise ValueError("the device decoder reads huffman streams only (sparse streams carry rANS tables)")
        self.tiles = np.flatnonzero(sp.ns)  # the tile index of each row
        self.ns = sp.ns[self.tiles].astype(np.int64)
        self.ntiles = int(sp.ns.size)
        self.tile = int(sp.tile)
        self.width = int(sp.width)
        buf = np.zeros(sp.buf.size + PAD, np.uint8)
        buf[:sp.buf.size] = sp.buf
        self.buf = torch.from_numpy(buf).to(device)
        self.meta = torch.from_numpy(_tile_meta(sp, self.tiles)).to(device)
        self.table = torch.from_numpy(sp.slot2sym.astype(np.int32)).to(device)

    def launch(self, target_bits: torch.Tensor, sign: int, limit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Apply the first ``limit[r]`` changes of each row's tile; (error code, changes
        written) per tile of the stream, as numpy int64 arrays (one host sync)."""
        errs = np.zeros(self.ntiles, np.int64)
        done = np.zeros(self.ntiles, np.int64)
        rows = self.tiles.size
        if rows == 0:
            return errs, done
        dev = target_bits.device
        out = torch.empty(2 * rows, dtype=torch.int64, device=dev)
        lim = torch.from_numpy(np.ascontiguousarray(limit, np.int64)).to(dev)
        with launching_on(dev):
            huffman_apply_kernel[(rows,)](target_bits, self.buf, self.meta, self.table, lim, out, rows, self.tile,
                                          SIGN=1 if sign > 0 else -1, WIDTH=self.width, num_warps=WARPS)
        res = out.cpu().numpy()
        errs[self.tiles] = res[:rows]
        done[self.tiles] = res[rows:]
        return errs, done


def _tile_meta(sp: TileStream, tiles: np.ndarray) -> np.ndarray:
    """Per tile with changes: first element, end element, n, k, and the byte offsets where its
    Rice bits, value bits and escapes begin and where the escapes end (int64, one row each)."""
    start = tiles * sp.tile
    rice_at = sp.offs[tiles]
    value_at = rice_at + sp.rice[tiles]
    esc_at = value_at + sp.rans[tiles]
    cols = [start, np.minimum(start + sp.tile, sp.numel), sp.ns[tiles], sp.ks[tiles], rice_at, value_at, esc_at,
            esc_at + sp.esc[tiles] * sp.width]
    return np.ascontiguousarray(np.stack([np.asarray(c, np.int64) for c in cols], axis=1))


def apply_tile_stream_cuda_(target: torch.Tensor, entry: Mapping[str, Any], sp: TileStream, sign: int) -> None:
    """``decode.apply_tile_stream_`` of a ``huffman`` stream into a tensor on a Triton device:
    decode and add (``sign`` 1) or subtract (-1) in place. On a corrupt tile every write of
    this call is taken back before ``CorruptData`` (the CPU path's message) is raised."""
    tb = bits_view(target)
    dev = DeviceTiles(sp, tb.device)
    errs, done = dev.launch(tb, sign, dev.ns)
    if errs.any():
        dev.launch(tb, -sign, done[dev.tiles])
        _raise_tile_errors(entry, errs)


def apply_huffman_cuda_(target: torch.Tensor, stream: bytes | bytearray | memoryview | np.ndarray, *, changed: int,
                        tile: int, sign: int = 1, name: str = "tensor") -> None:
    """Apply (or with ``sign=-1`` take back) one tensor's ``huffman`` stream, as a patch entry
    of ``changed`` changes in tiles of ``tile`` elements describes it; the stream is checked
    whole (``parse_tile_stream``) before the first write."""
    entry = {"name": name, "mode": "huffman", "numel": target.numel(), "changed": changed, "tile": tile}
    buf = stream if isinstance(stream, np.ndarray) else stream_array(stream)
    apply_tile_stream_cuda_(target, entry, parse_tile_stream(entry, buf, target.element_size()), sign)
