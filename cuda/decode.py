"""Decoding one stream: parse and check a tiled stream's table and directory (``TileStream``),
apply it in place (``apply_tile_stream_``), or decode any mode into positions and bits
(``decode_stream``).

Invariants: a stream is fully checked before its first write; a tile found damaged mid-way is
undone before ``CorruptData`` is raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from weftboard.cuda import context_codec, context_huffman, entropy, huffman
from weftboard.cuda.container import NP_UNSIGNED, torch_dtype
from weftboard.cuda.jit import serial_kernels
from weftboard.cuda.tensor_bits import cpu_bits
from weftboard.cuda.tile_decode import apply_tiles, decode_tiles
from weftboard.proto.errors import CorruptData, InvalidArgument


@dataclass
class DecodedTensor:
    """One tensor's decoded stream: absolute new bits or wrapping differences at ``positions``."""

    name: str
    positions: np.ndarray  # int64, strictly ascending
    values: np.ndarray  # unsigned ints of the element width
    is_difference: bool


def stream_array(stream: memoryview | bytes | bytearray) -> np.ndarray:
    """A stream's bytes as a read-only uint8 array, whatever holds them: a decoder only reads
    them, and the kernels are compiled once per array type, so a writable buffer (a container
    in a bytearray, the bytes of a part still arriving) would compile every decoder again."""
    return np.frombuffer(memoryview(stream).toreadonly(), dtype=np.uint8)


def decode_stream(entry: Mapping[str, Any], stream: memoryview | bytes, base: np.ndarray | None = None) -> DecodedTensor:
    """Decode and validate one tensor's stream (after its checksum was verified). A
    ``context`` stream decodes against ``base``, the unsigned bits it applies to."""
    name = entry["name"]
    width = torch_dtype(entry["dtype"], name).itemsize
    udt = NP_UNSIGNED[width]
    numel, changed, mode = entry["numel"], entry["changed"], entry["mode"]
    buf = stream_array(stream)

    def bad(msg: str) -> CorruptData:
        return CorruptData(f"patch stream for tensor {name!r} ({mode}): {msg}")

    if mode == "empty":
        return DecodedTensor(name, np.empty(0, np.int64), np.empty(0, udt), False)
    if mode == "all":
        if changed != numel or buf.size != numel * width:
            raise bad(f"{buf.size} bytes for {numel} elements of width {width}")
        return DecodedTensor(name, np.arange(numel, dtype=np.int64), buf.view(udt).copy(), False)
    if mode == "bitmap":
        nmask = (numel + 7) // 8
        if buf.size != nmask + changed * width:
            raise bad(f"{buf.size} bytes, expected {nmask} bitmap bytes + {changed} values of width {width}")
        bits = np.unpackbits(buf[:nmask], bitorder="little")
        if bits[numel:].any():
            raise bad("padding bits after the last element are set")
        pos = np.flatnonzero(bits[:numel]).astype(np.int64)
        if pos.size != changed:
            raise bad(f"bitmap marks {pos.size} elements but the header declares {changed} changes")
        return DecodedTensor(name, pos, buf[nmask:].view(udt).copy(), False)
    if mode == "baseline":
        ib = entry["index_bytes"]
        if buf.size != changed * (ib + width):
            raise bad(f"{buf.size} bytes, expected {changed} x ({ib}-byte index + {width}-byte value)")
        pos = buf[: changed * ib].view("<i4" if ib == 4 else "<i8").astype(np.int64)
        if pos.size and (pos[0] < 0 or pos[-1] >= numel or not bool(np.all(pos[1:] > pos[:-1]))):
            raise bad("positions are not strictly ascending indices below numel")
        return DecodedTensor(name, pos, buf[changed * ib :].view(np.dtype(udt).newbyteorder("<")).astype(udt), False)
    if mode in ("context", "context_huffman"):
        if base is None:
            raise InvalidArgument(f"the context stream of {name!r} decodes only against the bits it applies to")
        try:
            pos, diff = parse_context_stream(entry, buf).decode(base)
        except ValueError as exc:
            raise bad(str(exc)) from None
        return DecodedTensor(name, pos, diff, True)
    sp = parse_tile_stream(entry, buf, width)
    pos = np.empty(changed, np.int64)
    diff = np.empty(changed, udt)
    errs = decode_tiles(sp.buf, numel, sp.tile, width, sp.ns, sp.ks, sp.rice, sp.rans, sp.esc, sp.offs,
                                sp.freq, sp.cum, sp.slot2sym, pos, diff)
    _raise_tile_errors(entry, errs)
    return DecodedTensor(name, pos, diff, True)


@dataclass
class TileStream:
    """A ``sparse`` or ``huffman`` stream whose table and directory were parsed and checked
    (``freq`` and ``cum`` None for ``huffman``: ``slot2sym`` is its decoder table and
    ``rans`` its value bytes per tile)."""

    buf: np.ndarray
    numel: int
    tile: int
    width: int
    ns: np.ndarray
    ks: np.ndarray
    rice: np.ndarray
    rans: np.ndarray
    esc: np.ndarray
    offs: np.ndarray
    freq: np.ndarray | None
    cum: np.ndarray | None
    slot2sym: np.ndarray


def tile_stream_error(entry: Mapping[str, Any], msg: str) -> CorruptData:
    if entry["mode"] in ("context", "context_huffman"):  # its classes come from the bits it is applied to
        msg += "; the stream is damaged, or the destination does not hold the patch's base version"
    return CorruptData(f"patch stream for tensor {entry['name']!r} ({entry['mode']}): {msg}")


def parse_tile_stream(entry: Mapping[str, Any], buf: np.ndarray, width: int) -> TileStream:
    numel, changed, tile = entry["numel"], entry["changed"], entry["tile"]
    if (numel + tile - 1) // tile > buf.size:  # every tile has at least one directory byte
        raise tile_stream_error(entry, f"{buf.size} bytes cannot hold the directory of {numel} elements in tiles of {tile}")
    if entry["mode"] == "huffman":
        err, ns, ks, rice, rans, esc, offs, table = huffman.parse_stream(buf, numel, tile, width, changed)
        freq = cum = None
    else:
        err, ns, ks, rice, rans, esc, offs, freq, cum, table = entropy.parse_sparse(buf, numel, tile, width, changed)
    if err:
        raise tile_stream_error(entry, entropy.DIR_ERRORS.get(int(err), f"directory error {err}"))
    return TileStream(buf, numel, tile, width, ns, ks, rice, rans, esc, offs, freq, cum, table)


ContextStreams = context_codec.ContextStream | context_huffman.ContextHuffmanStream


def parse_context_stream(entry: Mapping[str, Any], buf: np.ndarray) -> ContextStreams:
    """A ``context`` or ``context_huffman`` stream, parsed and checked (it decodes against the
    bits it applies to)."""
    kind = context_huffman.ContextHuffmanStream if entry["mode"] == "context_huffman" else context_codec.ContextStream
    try:
        return kind(buf, entry["numel"], entry["tile"], entry["changed"])
    except ValueError as exc:
        raise tile_stream_error(entry, str(exc)) from None


def _raise_tile_errors(entry: Mapping[str, Any], errs: np.ndarray) -> None:
    bad_tiles = np.flatnonzero(errs)
    if bad_tiles.size:
        t = int(bad_tiles[0])
        raise tile_stream_error(entry, f"tile {t} ({bad_tiles.size} bad tiles): {entropy.ERRORS.get(int(errs[t]), 'unknown error')}")


def apply_tile_stream_(target: torch.Tensor, entry: Mapping[str, Any], sp: TileStream, sign: int) -> None:
    """Decode and add (``sign`` 1) or subtract (-1) a huffman or sparse stream in place, on the CPU.

    On a corrupt tile every write this call made is undone before ``CorruptData`` is raised.
    """
    tu = cpu_bits(target)  # contiguous (``_checked_target``), so a view of its memory, not a copy
    args = (sp.buf, tu, sp.numel, sp.tile, sp.width, sp.ns, sp.ks, sp.rice, sp.rans, sp.esc, sp.offs, sp.freq, sp.cum, sp.slot2sym)
    # One tile gives a second thread nothing to do, and waking it (on a busy host, waiting for a
    # core) cost 4-5 ms a call: a norm vector's apply took longer than an embedding's.
    with serial_kernels() if sp.ns.size == 1 else contextlib.nullcontext():
        errs, done = apply_tiles(*args, sign, sp.ns)
        if errs.any():
            apply_tiles(*args, -sign, done)
    if errs.any():
        _raise_tile_errors(entry, errs)
