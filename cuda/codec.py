"""The patch container: one version transition, per-tensor streams, in a safetensors file.

Layout (format ``weftboard-patch``, format_version 2). The file is a valid safetensors file:

    u64 little-endian header length | JSON header (space padded to a multiple of 8) | data

The safetensors header maps each tensor that changed to a uint8 ("U8") 1-D stream and holds
``__metadata__ = {"weftboard": <JSON text>, "weftboard_xxh3_64": <hex of that text>}``; the
JSON text is the patch header::

    {"format": "weftboard-patch", "format_version": 2, "encoding": "default" | "baseline" | "context",
     "base_version": int, "target_version": int, "target_root": "xxh3-128:<hex>",
     "tensors": [{"name", "dtype" (torch name, e.g. "bfloat16"), "numel", "changed", "mode",
                  "stream_bytes", "xxh3_64" (hex of the stream), "tile", "index_bytes"}, ...]}

``tensors`` lists every tensor passed to the encoder, in the order given; a tensor with
``changed == 0`` has mode ``empty`` and no stream.

A version's patch may come in **parts**: containers over disjoint sets of tensors with the
same header fields, applied together (``apply_patch_arriving_`` takes them all, ``join_patches``
makes them one container). A part the publisher uploads before the version's root digest is
known carries ``"target_root": ""``; the version record names the root either way, and it is
the record, never the header, that an island verifies against. Modes and their streams:

- ``huffman`` (default encoding, from format_version 2): Rice-coded position gaps +
  canonical-Huffman-coded integer differences of the raw bits, per tile of ``tile`` elements:
  the ``sparse`` layout with the code's lengths (``weftboard.cuda.huffman``) in place of the
  frequency table and each tile's Huffman bytes in place of its rANS bytes. About 2% larger
  than ``sparse`` on an optimizer step, and its fused apply takes about a fifth less time.
- ``sparse`` (format_version 1's default; still read): Rice-coded position gaps + rANS-coded
  integer differences, per tile; byte layout in ``weftboard.cuda.entropy``.
- ``bitmap`` (default encoding, dense fallback): ``ceil(numel/8)`` bytes of change bits
  (LSB first) followed by the new bits of the changed elements, in order.
- ``all`` (default encoding, every element changed): the new bits of every element.
- ``context`` (context encoding, bf16 and fp16 tensors): like ``sparse``, but positions and values
  are coded per class of the old value's magnitude (``weftboard.cuda.context_codec``), so the
  decoder needs the bits the patch applies to. About a quarter smaller than ``huffman`` on
  optimizer steps; other tensors in a context patch take the default encoding's modes.
- ``baseline``: ``changed`` positions as little-endian int32 (int64 if ``index_bytes`` is 8,
  for tensors of 2**31 elements or more), then the raw new bits; what other tools exchange.

The encoder picks, per tensor, the smaller of huffman and bitmap (``all`` when every element
changed). A format_version 1 patch (no ``huffman`` streams) reads and applies as before. Every stream carries the xxh3-64 of its bytes, so corruption is caught before
decoding, and every decoder is bounds-checked as well, so a stream that hashes correctly but
was written wrongly still fails cleanly. Inspect a patch with ordinary tools::

    python -c "from safetensors import safe_open; f = safe_open('p.safetensors', 'np'); \\
               print(f.metadata()['weftboard']); print(list(f.keys()))"

Apply checks every header, checksum and directory first, then writes in place;
``AppliedPatch.revert`` restores the exact previous bytes. On the CPU the default encoding is
fused (``weftboard.cuda.tile_codec``): encoding reads each (old, new) pair once with no position
arrays, and a huffman or sparse stream is decoded straight into the tensor, undone in full if the entropy
decoder finds damage mid-way. Entropy coding runs on CPU threads (numba) for every device; for
CUDA tensors the decoded (position, bits) arrays travel to the GPU, where Triton kernels write
them in place.
"""

from __future__ import annotations

import functools
import json
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numba as nb
import numpy as np
import torch
import xxhash

from weftboard.cuda import context_codec, entropy, huffman, tile_codec
from weftboard.cuda.diff import (
    TensorDelta,
    bits_view,
    check_pair,
    cpu_bits,
    diff_tensor,
    int_view_dtype,
    scatter_bits_,
    unsigned_np,
)
from weftboard.cuda.digest import dtype_name
from weftboard.proto.errors import CorruptData, InvalidArgument, Unavailable

FORMAT = "weftboard-patch"
FORMAT_VERSION = 2  # 2 added the ``huffman`` mode, the default encoding's since
READ_VERSIONS = (1, 2)  # a version 1 patch is a version 2 patch without ``huffman`` streams
ENCODINGS = ("default", "baseline", "context")
CODEC_TILE = 1 << 16  # elements per independent stream: ~650 changes per tile at 1% density,
# so per-tile overhead (directory, rANS flush, Rice padding: ~12 bytes) stays near 1%, while a
# 7B model still has ~100k tiles to spread over CPU threads or GPU blocks.
_MODES = ("empty", "huffman", "sparse", "bitmap", "all", "baseline", "context")
_MAX_HEADER = 256 << 20
_NP_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class EncodedPatch:
    data: bytes
    changed: dict[str, int]
    numel: dict[str, int]


@dataclass(frozen=True)
class TensorPatchInfo:
    name: str
    dtype: str
    numel: int
    changed: int
    mode: str
    stream_bytes: int
    tile: int


@dataclass(frozen=True)
class PatchInfo:
    format_version: int
    encoding: str
    base_version: int
    target_version: int
    target_root: str
    tensors: list[TensorPatchInfo]

    @property
    def total_changed(self) -> int:
        return sum(t.changed for t in self.tensors)


# ---------------------------------------------------------------------------
# encoding
# ---------------------------------------------------------------------------


def _delta_arrays(delta: TensorDelta) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pos = delta.positions.detach().to("cpu", torch.int64).contiguous().numpy()
    want = int_view_dtype(delta.dtype)
    old = delta.old_bits.detach().cpu().contiguous()
    new = delta.new_bits.detach().cpu().contiguous()
    if old.dtype != want or new.dtype != want:
        raise InvalidArgument(f"delta bits must be {want} views for {delta.dtype}, got {old.dtype}/{new.dtype}")
    if not (pos.size == old.numel() == new.numel()):
        raise InvalidArgument("delta has different numbers of positions, old bits and new bits")
    if pos.size and not _ascending_below(pos, delta.numel):
        raise InvalidArgument("delta positions must be strictly ascending element indices below numel")
    return pos, unsigned_np(old), unsigned_np(new)


@nb.njit(cache=True, nogil=True)
def _ascending_below(pos: np.ndarray, numel: int) -> bool:
    """Whether ``pos`` is strictly ascending within ``[0, numel)`` (one pass, no temporaries)."""
    prev = -1
    for p in pos:
        if p <= prev:
            return False
        prev = p
    return prev < numel


def _code_tiles(pos: np.ndarray, old: np.ndarray, new: np.ndarray, numel: int, tile: int, rans: bool) -> tuple:
    """The two-step encoder's passes shared by both streams: the plan, then each tile's Rice
    bits | rANS bytes (``rans``; none for ``huffman``) | escapes in its own scratch region.
    Returns (tile_ptr, syms, counts, freq or None, ks, rice_bytes, n_esc, rans_len,
    scratch_off, scratch)."""
    width = old.itemsize
    ntiles = (numel + tile - 1) // tile
    tile_ptr = np.searchsorted(pos, np.arange(ntiles + 1, dtype=np.int64) * tile).astype(np.int64)
    syms, counts, ks, rice_bytes, n_esc = entropy.plan_tiles(pos, old, new, width, tile_ptr, tile)
    ns = np.diff(tile_ptr)
    freq = entropy.quantize_freqs(counts) if rans else None
    value_room = 2 * ns + 4 if rans else 0  # rANS: at most 2 bytes a symbol, and the final state
    bounds = np.where(ns > 0, rice_bytes + value_room + 4 + n_esc * width, 0)  # 4 of slack: rice_put's stores
    scratch_off = np.zeros(ntiles + 1, np.int64)
    np.cumsum(bounds, out=scratch_off[1:])
    scratch = np.empty(int(scratch_off[-1]), np.uint8)
    rtab = entropy.rans_encoder_tables(freq) if rans else np.zeros((0, 5), np.int64)
    rans_len = entropy.encode_tiles(pos, syms, old, new, width, tile_ptr, tile, ks, n_esc, scratch_off, rtab, scratch)
    return tile_ptr, syms, counts, freq, ks, rice_bytes, n_esc, rans_len, scratch_off, scratch


def _encode_sparse(pos: np.ndarray, old: np.ndarray, new: np.ndarray, numel: int, tile: int) -> np.ndarray:
    tile_ptr, _, _, freq, ks, rice_bytes, n_esc, rans_len, scratch_off, scratch = _code_tiles(pos, old, new, numel,
                                                                                            tile, True)
    return entropy.assemble(freq, np.diff(tile_ptr), ks, rice_bytes, rans_len, n_esc, old.itemsize, scratch,
                            scratch_off)


def _encode_huffman(pos: np.ndarray, old: np.ndarray, new: np.ndarray, numel: int, tile: int) -> np.ndarray:
    """The ``huffman`` stream of a delta: the same plan and Rice bits as ``_encode_sparse``,
    then the values Huffman-coded and the stream assembled by the fused encoder's finish, so
    both encoders give the same bytes."""
    tile_ptr, syms, counts, _, ks, rice_bytes, n_esc, _, scratch_off, scratch = _code_tiles(pos, old, new, numel,
                                                                                          tile, False)
    starts = scratch_off[:-1]
    return tile_codec._rans_and_assemble(np.diff(tile_ptr), ks, rice_bytes, n_esc, counts, old.itemsize, scratch,
                                         starts, syms, tile_ptr[:-1], scratch, starts + rice_bytes, huff=True)


def _encode_default(pos: np.ndarray, old: np.ndarray, new: np.ndarray, numel: int) -> tuple[str, np.ndarray]:
    n = pos.size
    if n == 0:
        return "empty", np.empty(0, np.uint8)
    width = new.itemsize
    if n == numel:
        return "all", new.view(np.uint8)
    stream = _encode_huffman(pos, old, new, numel, CODEC_TILE)
    if stream.size <= _bitmap_bytes(numel, n, width):
        return "huffman", stream
    mask = np.zeros(numel, np.bool_)
    mask[pos] = True
    return "bitmap", np.concatenate([np.packbits(mask, bitorder="little"), new.view(np.uint8)])


def _bitmap_bytes(numel: int, changed: int, width: int) -> int:
    """Size of the ``bitmap`` stream: the default encoding takes ``huffman`` unless it is larger."""
    return (numel + 7) // 8 + changed * width


def _encode_baseline(pos: np.ndarray, new: np.ndarray, numel: int) -> tuple[str, np.ndarray, int]:
    if pos.size == 0:
        return "empty", np.empty(0, np.uint8), 4
    index_bytes = 4 if numel <= 2**31 else 8
    idx = pos.astype("<i4" if index_bytes == 4 else "<i8")
    return "baseline", np.concatenate([idx.view(np.uint8), new.astype(new.dtype.newbyteorder("<")).view(np.uint8)]), index_bytes


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor's stream and the header entry fields that describe it (``encode_streams``),
    waiting to be put in a container (``assemble_patch``)."""

    name: str
    dtype: torch.dtype
    numel: int
    changed: int
    mode: str
    stream: np.ndarray  # uint8
    index_bytes: int = 4
    # ``context`` streams made while folding (the publisher's scan): the changes whose class
    # the fold changed, as (positions, old bits), which decoding against the folded view needs.
    fixups: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)


def _encode_delta(name: str, delta: TensorDelta, encoding: str, target: torch.Tensor | None = None) -> EncodedTensor:
    if encoding == "context" and target is not None and delta.positions.numel() and context_codec.supports(delta.dtype):
        old_t, new_t = _old_and_target(delta, target)
        fused = _encode_pair_context(name, old_t, new_t)
        if fused is not None:
            return fused
    pos, old, new = _delta_arrays(delta)
    if encoding != "baseline":
        mode, stream = _encode_default(pos, old, new, delta.numel)
        return EncodedTensor(name, delta.dtype, int(delta.numel), int(pos.size), mode, stream)
    mode, stream, index_bytes = _encode_baseline(pos, new, delta.numel)
    return EncodedTensor(name, delta.dtype, int(delta.numel), int(pos.size), mode, stream, index_bytes)


def _old_and_target(delta: TensorDelta, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) CPU tensors of a delta whose whole new tensor is ``target``."""
    new = target.detach().cpu().contiguous()
    if new.dtype != delta.dtype or new.numel() != delta.numel:
        raise InvalidArgument(f"target of {new.numel()} {new.dtype} does not fit a delta of {delta.numel} {delta.dtype}")
    old = new.clone()
    bits_view(old).view(-1)[delta.positions.cpu()] = delta.old_bits.cpu()
    return old, new


def _encode_pair_context(name: str, old: torch.Tensor, new: torch.Tensor) -> EncodedTensor | None:
    """The ``context`` stream of a CPU pair of a 16-bit float tensor, or None when that mode
    does not apply or is not smaller than a bitmap (the caller takes the default modes)."""
    if not context_codec.supports(old.dtype):
        return None
    check_pair(old, new)
    a = cpu_bits(old)
    b = cpu_bits(new)
    thresholds = context_codec.choose_thresholds(a, old.dtype)
    if thresholds.size == 0:
        return None
    changed, stream = context_codec.encode_context(a, b, thresholds, CODEC_TILE)
    if changed == 0:
        return EncodedTensor(name, old.dtype, a.size, 0, "empty", np.empty(0, np.uint8))
    if stream is None or changed == a.size or stream.size > _bitmap_bytes(a.size, changed, 2):
        return None
    return EncodedTensor(name, old.dtype, a.size, changed, "context", stream)


def _fused_result(name: str, dtype: torch.dtype, b: np.ndarray, changed: int, stream: np.ndarray | None) -> EncodedTensor | None:
    """The entry of a CPU pair from the fused encoder's (changes, ``huffman`` stream) over its
    new bits ``b`` (``tile_codec``: one read of both tensors): ``empty``, ``all`` (the new
    bits), ``huffman``, or None when the bitmap mode is smaller or a tile was pathologically
    dense; the caller then takes the two-step path, which picks the mode itself."""
    numel = b.size
    if changed == 0:
        return EncodedTensor(name, dtype, numel, 0, "empty", np.empty(0, np.uint8))
    if changed == numel:
        # A copy: the stream must not change if the caller's tensor does before assembly.
        return EncodedTensor(name, dtype, numel, changed, "all", b.view(np.uint8).copy())
    if stream is None or stream.size > _bitmap_bytes(numel, changed, b.itemsize):
        return None
    return EncodedTensor(name, dtype, numel, changed, "huffman", stream)


Scans = Sequence[tile_codec.TileScan] | context_codec.ContextScans


def scans_changed(scans: Scans) -> int:
    """Changes a tensor's scans found (tile scans or context scans)."""
    return scans.changed if isinstance(scans, context_codec.ContextScans) else sum(s.changed for s in scans)


def _finish_scans(name: str, dtype: torch.dtype, numel: int, scans: Scans) -> EncodedTensor:
    """The ``huffman`` stream of tile scans, or the ``context`` stream of context scans; at
    least one change."""
    changed = scans_changed(scans)
    if isinstance(scans, context_codec.ContextScans):
        stream, fix_pos, fix_old = context_codec.finish_context(scans)
        return EncodedTensor(name, dtype, numel, changed, "context", stream, fixups=(fix_pos, fix_old))
    width = dtype.itemsize
    return EncodedTensor(name, dtype, numel, changed, "huffman", tile_codec.finish_huffman(scans, width))


def encoded_from_scans(name: str, dtype: torch.dtype, numel: int, scans: Scans) -> EncodedTensor | None:
    """The stream of a tensor that was scanned piece by piece as it was read (``tile_codec.scan_tiles``,
    or ``context_codec.scan_tiles``), or None when that mode does not fit (every element
    changed, or a bitmap is smaller): the caller then recovers the delta
    (``delta_from_scans``) and takes the two-step path, which picks the mode itself."""
    changed = scans_changed(scans)
    if changed == 0:
        return EncodedTensor(name, dtype, numel, 0, "empty", np.empty(0, np.uint8))
    if changed == numel:
        return None
    encoded = _finish_scans(name, dtype, numel, scans)
    if encoded.stream.size > _bitmap_bytes(numel, changed, dtype.itemsize):
        return None
    return encoded


def delta_from_encoded(encoded: EncodedTensor, target: torch.Tensor) -> TensorDelta:
    """The delta of an ``empty``, ``huffman``, ``sparse`` or folded ``context`` stream (one that carries its
    ``fixups``), given the tensor it leads to (its old bits are the target's minus the stream's
    differences): what a publisher that kept streams instead of deltas needs to merge a version
    into the next one."""
    if encoded.mode not in ("empty", "huffman", "sparse", "context") or (encoded.mode == "context" and encoded.fixups is None):
        raise InvalidArgument(f"only empty, huffman, sparse and folded context streams carry their old bits, not {encoded.mode!r}")
    bits = bits_view(target.detach())
    if bits.numel() != encoded.numel or target.dtype != encoded.dtype:
        raise InvalidArgument(f"stream of {encoded.numel} {encoded.dtype} does not fit a tensor of "
                              f"{bits.numel()} {target.dtype}")
    entry = {"name": encoded.name, "dtype": dtype_name(encoded.dtype), "numel": encoded.numel,
             "changed": encoded.changed, "mode": encoded.mode, "tile": CODEC_TILE}
    if encoded.mode == "context":
        assert encoded.fixups is not None
        folded = unsigned_np(bits.cpu()).reshape(-1)
        pos, diff = context_codec.decode_folded(_parse_context(entry, encoded.stream), folded, *encoded.fixups)
        order = np.argsort(pos)  # a delta's positions ascend; a context stream's come class by class
        dec = DecodedTensor(encoded.name, pos[order], diff[order], True)
    else:
        dec = decode_stream(entry, encoded.stream)
    pos = torch.from_numpy(dec.positions)
    new = bits[pos] if bits.device.type == "cpu" else bits[pos.to(bits.device)].cpu()
    new_np = unsigned_np(new)
    old = torch.from_numpy((new_np - dec.values.astype(new_np.dtype)).view(new.numpy().dtype))
    return TensorDelta(positions=pos, old_bits=old.to(bits.device), new_bits=new.to(bits.device),
                       numel=encoded.numel, dtype=encoded.dtype)


def delta_from_scans(scans: Scans, target: torch.Tensor) -> TensorDelta:
    """The delta of a tensor scanned piece by piece, given the tensor it leads to."""
    numel = target.numel()
    if scans_changed(scans) == 0:
        enc = EncodedTensor("scanned", target.dtype, numel, 0, "empty", np.empty(0, np.uint8))
    else:
        enc = _finish_scans("scanned", target.dtype, numel, scans)
    return delta_from_encoded(enc, target)


def assemble_patch(
    tensors: Iterable[EncodedTensor], *, base_version: int, target_version: int, target_root: str, encoding: str = "default"
) -> EncodedPatch:
    """The container over already encoded streams: cheap, so a caller can encode streams
    while the target's root digest is still being computed, and assemble once it is known."""
    _check_encoding(encoding)
    entries: list[dict[str, Any]] = []
    streams: list[tuple[str, np.ndarray]] = []
    changed: dict[str, int] = {}
    numel: dict[str, int] = {}
    for t in tensors:
        if not isinstance(t.name, str) or not t.name:
            raise InvalidArgument(f"tensor names must be non-empty strings, got {t.name!r}")
        if t.name in changed or t.name == "__metadata__":
            raise InvalidArgument(f"tensor name {t.name!r} appears twice (or is reserved) in one patch")
        # Joined into the container below without a copy of its own.
        raw = np.ascontiguousarray(t.stream).view(np.uint8).reshape(-1)
        entries.append(
            {
                "name": t.name,
                "dtype": dtype_name(t.dtype),
                "numel": t.numel,
                "changed": t.changed,
                "mode": t.mode,
                "stream_bytes": len(raw),
                "xxh3_64": xxhash.xxh3_64_hexdigest(raw),
                "tile": CODEC_TILE,
                "index_bytes": t.index_bytes,
            }
        )
        if raw.size:
            streams.append((t.name, raw))
        changed[t.name] = t.changed
        numel[t.name] = t.numel
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "encoding": encoding,
        "base_version": int(base_version),
        "target_version": int(target_version),
        "target_root": str(target_root),
        "tensors": entries,
    }
    return EncodedPatch(data=_write_container(header, streams), changed=changed, numel=numel)


def _check_encoding(encoding: str) -> None:
    if encoding not in ENCODINGS:
        raise InvalidArgument(f"unknown patch encoding {encoding!r}; expected one of {ENCODINGS}")


def encode_deltas(
    deltas: Iterable[tuple[str, TensorDelta]],
    *,
    base_version: int,
    target_version: int,
    target_root: str,
    encoding: str = "default",
) -> EncodedPatch:
    """Encode per-tensor deltas (consumed one at a time) into one patch container."""
    _check_encoding(encoding)
    return assemble_patch(
        (_encode_delta(name, delta, encoding) for name, delta in deltas),
        base_version=base_version, target_version=target_version, target_root=target_root, encoding=encoding,
    )


def encode_streams(deltas: Iterable[tuple[str, TensorDelta]], encoding: str = "default",
                   targets: Mapping[str, torch.Tensor] | None = None) -> list[EncodedTensor]:
    """Each delta's stream (the costly part of ``encode_deltas``), for ``assemble_patch``.

    The context encoding codes a 16-bit float tensor against its old bits, so it needs the
    whole tensor each delta leads to (``targets``); a delta without one takes the default
    encoding's modes."""
    _check_encoding(encoding)
    targets = targets or {}
    return [_encode_delta(name, delta, encoding, targets.get(name)) for name, delta in deltas]


def encode_patch(
    pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]],
    *,
    base_version: int,
    target_version: int,
    target_root: str,
    encoding: str = "default",
) -> EncodedPatch:
    """Diff each (name, old, new) pair as it comes and encode it into one patch.

    CPU pairs in the default encoding go through the fused kernels (one read of both tensors,
    no position arrays), consecutive ones of one element width in batches of up to
    ``BATCH_TILES`` tiles (one compiled call a batch: a call per tensor cost the bench's 66
    tensors 4-8% more time in Python and dispatch); other pairs are
    diffed first (Triton on CUDA) and then encoded. Both give the same container, decoded by
    the same readers. A pair is read after later pairs have been drawn from ``pairs``, so an
    iterator must not reuse one pair's memory for the next.
    """
    _check_encoding(encoding)
    scratch = tile_codec.kept_scratch()  # one pool for all pairs, and for the next patch
    batch = _FusedBatch(scratch, encoding)

    def encoded() -> Iterable[EncodedTensor]:
        for name, old, new in pairs:
            on_cpu = old.is_cpu and new.is_cpu
            if encoding == "context" and on_cpu:
                yield from batch.flush()
                fused = _encode_pair_context(name, old, new)
                if fused is not None:
                    yield fused
                    continue
            if encoding != "baseline" and on_cpu:
                yield from batch.add(name, old, new)
                continue
            yield from batch.flush()
            yield _encode_delta(name, diff_tensor(old, new), encoding)
        yield from batch.flush()

    try:
        return assemble_patch(
            encoded(), base_version=base_version, target_version=target_version, target_root=target_root,
            encoding=encoding
        )
    finally:
        tile_codec.trim_scratch(scratch)


# A batch of ``encode_patch`` closes once it holds this many tiles: about the bench's embedding
# (250 tiles of 65536), so its scratch pool (about 84 MB of address space for 16-bit elements)
# is no larger than one such tensor needs alone and stays under ``tile_codec.KEPT_SCRATCH_BYTES``
# (with 1024 tiles the pool outgrew it, was released after every patch and page-faulted anew:
# the bench's encode ran 8% slower), and the pairs it holds (the caller's tensors, not copies)
# stay a small part of a large model.
BATCH_TILES = 256


class _FusedBatch:
    """CPU pairs of one element width waiting for one ``tile_codec.encode_huffman_batch``
    call (``encode_patch``). ``add`` and ``flush`` yield finished entries in the pairs' order."""

    def __init__(self, scratch: dict, encoding: str) -> None:
        self._scratch = scratch
        self._encoding = encoding  # of the two-step path, for a pair the fused encoder leaves
        self._items: list[tuple[str, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]] = []
        self._tiles = 0

    def add(self, name: str, old: torch.Tensor, new: torch.Tensor) -> Iterator[EncodedTensor]:
        check_pair(old, new)
        a = cpu_bits(old)
        b = cpu_bits(new)
        if not tile_codec.batchable(a, CODEC_TILE):
            yield from self.flush()
            yield self._entry(name, old, new, b, *tile_codec.encode_huffman(a, b, CODEC_TILE, self._scratch))
            return
        tiles = -(-a.size // CODEC_TILE)
        if self._items and (self._items[0][3].itemsize != a.itemsize or self._tiles + tiles > BATCH_TILES):
            yield from self.flush()
        self._items.append((name, old, new, a, b))
        self._tiles += tiles

    def flush(self) -> Iterator[EncodedTensor]:
        items, self._items, self._tiles = self._items, [], 0
        if not items:
            return
        results = tile_codec.encode_huffman_batch([(a, b) for *_, a, b in items], CODEC_TILE, self._scratch)
        for (name, old, new, _, b), (changed, stream) in zip(items, results):
            yield self._entry(name, old, new, b, changed, stream)

    def _entry(self, name: str, old: torch.Tensor, new: torch.Tensor, b: np.ndarray, changed: int,
               stream: np.ndarray | None) -> EncodedTensor:
        fused = _fused_result(name, old.dtype, b, changed, stream)
        return fused if fused is not None else _encode_delta(name, diff_tensor(old, new), self._encoding)


def _write_container(header: dict[str, Any], streams: Sequence[tuple[str, bytes | np.ndarray]]) -> bytes:
    text_header = json.dumps(header, separators=(",", ":"))
    st_header: dict[str, Any] = {
        "__metadata__": {"weftboard": text_header, "weftboard_xxh3_64": xxhash.xxh3_64_hexdigest(text_header.encode("utf-8"))}
    }
    offset = 0
    for name, raw in streams:
        st_header[name] = {"dtype": "U8", "shape": [len(raw)], "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(st_header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *(raw for _, raw in streams)])


# ---------------------------------------------------------------------------
# reading and validation
# ---------------------------------------------------------------------------


def _field(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    # A parsed header holds plain dicts; the dict check first skips typing.Mapping's slow
    # isinstance on every field of every tensor entry.
    value = obj.get(key) if isinstance(obj, dict) or isinstance(obj, Mapping) else None
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise CorruptData(f"patch header: {where} field {key!r} is missing or not a {kind.__name__} (got {value!r:.80})")
    return value


_ENTRY_FIELDS = (("name", str), ("dtype", str), ("numel", int), ("changed", int), ("mode", str),
                 ("stream_bytes", int), ("tile", int), ("index_bytes", int), ("xxh3_64", str))
_ENTRY_KEYS = tuple(key for key, _ in _ENTRY_FIELDS)
_ENTRY_TYPES = tuple(kind for _, kind in _ENTRY_FIELDS)


def _entry_fields(entry: Any, i: int) -> tuple[Any, ...]:
    """An entry's fields in ``_ENTRY_FIELDS`` order, each present with its type (an int that
    is not a bool). The exact-type comparison is the common path (a parsed header holds
    plain dicts, strs and ints: about 1 us an entry against 2 us for a ``_field`` call per
    field); anything else goes through ``_field``, which names the first bad field."""
    if type(entry) is dict:
        values = tuple(map(entry.get, _ENTRY_KEYS))
        if tuple(map(type, values)) == _ENTRY_TYPES:
            return values
    where = f"tensor #{i}"
    name = _field(entry, "name", str, where)
    where = f"tensor {name!r}"
    return tuple(_field(entry, key, kind, where) for key, kind in _ENTRY_FIELDS)


def _torch_dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptData(f"patch header: {where} has unknown dtype {name!r}")
    return dtype


@dataclass
class _Container:
    header: dict[str, Any]
    entries: list[dict[str, Any]]
    streams: dict[str, memoryview]


def _header_length(first8: bytes | memoryview, total: int) -> int:
    """The safetensors header's length from the container's first 8 bytes (of ``total``)."""
    if total < 8:
        raise CorruptData(f"patch is {total} bytes: too short to hold the safetensors header length")
    (hlen,) = struct.unpack("<Q", first8[:8])
    if hlen > _MAX_HEADER or 8 + hlen > total:
        raise CorruptData(f"patch header claims {hlen} bytes but the patch has {total - 8} after the length: truncated or not a patch")
    return hlen


def _parse_container_header(header_bytes: bytes | memoryview, total: int) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, tuple[int, int]]]:
    """(header, entries, spans) of a container of ``total`` bytes from its safetensors header
    (the ``hlen`` bytes after the length); spans are each stream's [start, end) in the
    container. Everything the header says is checked here, before any stream is read."""
    hlen = len(header_bytes)
    try:
        st_header = json.loads(bytes(header_bytes).decode("utf-8"))
        meta = st_header["__metadata__"]["weftboard"]
        check = st_header["__metadata__"]["weftboard_xxh3_64"]
        if not isinstance(meta, str) or xxhash.xxh3_64_hexdigest(meta.encode("utf-8")) != check:
            raise CorruptData("patch header fails its xxh3-64 check: corrupted in storage or transit")
        header = json.loads(meta)
    except CorruptData:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        # (RecursionError: JSON nested deeper than the parser's stack, e.g. "[" * 100000)
        raise CorruptData(f"patch header is not a weftboard-patch safetensors header: {type(exc).__name__}: "
                          f"{str(exc)[:200]}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CorruptData(f"patch header has format {header.get('format') if isinstance(header, dict) else None!r}, expected {FORMAT!r}")
    version = _field(header, "format_version", int, "patch")
    if version not in READ_VERSIONS:
        raise CorruptData(f"patch format_version {version} is not supported (this build reads "
                          f"{', '.join(map(str, READ_VERSIONS))})")
    encoding = _field(header, "encoding", str, "patch")
    if encoding not in ENCODINGS:
        raise CorruptData(f"patch encoding {encoding!r} is unknown")
    for key in ("base_version", "target_version"):
        _field(header, key, int, "patch")
    _field(header, "target_root", str, "patch")
    entries = _field(header, "tensors", list, "patch")
    data_start = 8 + hlen
    data_len = total - data_start
    spans: dict[str, tuple[int, int]] = {}
    seen: set[str] = set()
    end_max = 0
    for i, entry in enumerate(entries):
        name, dtype, numel, changed, mode, nbytes, tile, index_bytes, _ = _entry_fields(entry, i)
        where = f"tensor {name!r}"
        if name in seen:
            raise CorruptData(f"patch header names tensor {name!r} twice")
        seen.add(name)
        _torch_dtype(dtype, where)
        if numel < 0 or not 0 <= changed <= numel:
            raise CorruptData(f"patch header: {where} has {changed} changes of {numel} elements")
        if (mode not in _MODES or (mode == "baseline") != (encoding == "baseline" and changed > 0)
                or (mode == "huffman" and version < 2)):
            raise CorruptData(f"patch header: {where} has mode {mode!r}, not valid for encoding {encoding!r}")
        if (mode == "empty") != (changed == 0):
            raise CorruptData(f"patch header: {where} has mode {mode!r} with {changed} changes")
        if mode == "context" and (encoding != "context" or not context_codec.supports(_torch_dtype(entry["dtype"], where))):
            raise CorruptData(f"patch header: {where} has mode 'context', not valid for encoding {encoding!r} "
                              f"and dtype {entry['dtype']}")
        if not (256 <= tile <= 1 << 24 and tile & (tile - 1) == 0) or index_bytes not in (4, 8):
            raise CorruptData(f"patch header: {where} has tile {tile} / index_bytes {index_bytes} out of range")
        if mode == "empty":
            if nbytes != 0 or name in st_header:
                raise CorruptData(f"patch header: {where} has no changes but a stream")
            continue
        spec = st_header.get(name)
        if not isinstance(spec, dict) or spec.get("dtype") != "U8":
            raise CorruptData(f"patch has no uint8 stream for tensor {name!r}")
        offs = spec.get("data_offsets")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1]
            or offs[1] - offs[0] != nbytes
        ):
            raise CorruptData(f"patch stream offsets for tensor {name!r} are malformed: {offs!r:.80}")
        if offs[1] > data_len:
            raise CorruptData(
                f"patch stream for tensor {name!r} ends at byte {offs[1]} of a {data_len}-byte data section: truncated"
            )
        end_max = max(end_max, offs[1])
        spans[name] = (data_start + offs[0], data_start + offs[1])
    extra = set(k for k in st_header if k != "__metadata__") - set(spans)
    if extra:
        raise CorruptData(f"patch holds streams for tensors its header does not list: {sorted(extra)[:5]}")
    if end_max != data_len:
        raise CorruptData(f"patch data section is {data_len} bytes but its streams end at {end_max}: truncated or padded")
    return header, entries, spans


def _read_container(data: bytes | bytearray | memoryview) -> _Container:
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    hlen = _header_length(view, len(view))
    header, entries, spans = _parse_container_header(view[8 : 8 + hlen], len(view))
    return _Container(header=header, entries=entries, streams={n: view[a:b] for n, (a, b) in spans.items()})


def read_patch_info(data: bytes | bytearray | memoryview) -> PatchInfo:
    """The patch header (validated), without decoding any stream."""
    c = _read_container(data)
    h = c.header
    return PatchInfo(
        format_version=h["format_version"],
        encoding=h["encoding"],
        base_version=h["base_version"],
        target_version=h["target_version"],
        target_root=h["target_root"],
        tensors=[
            TensorPatchInfo(
                name=e["name"],
                dtype=e["dtype"],
                numel=e["numel"],
                changed=e["changed"],
                mode=e["mode"],
                stream_bytes=e["stream_bytes"],
                tile=e["tile"],
            )
            for e in c.entries
        ],
    )


@dataclass
class DecodedTensor:
    """One tensor's decoded stream: absolute new bits or wrapping differences at ``positions``."""

    name: str
    positions: np.ndarray  # int64, strictly ascending
    values: np.ndarray  # unsigned ints of the element width
    is_difference: bool


def _stream_array(stream: memoryview | bytes | bytearray) -> np.ndarray:
    """A stream's bytes as a read-only uint8 array, whatever holds them: a decoder only reads
    them, and the kernels are compiled once per array type, so a writable buffer (a container
    in a bytearray, the bytes of a part still arriving) would compile every decoder again."""
    return np.frombuffer(memoryview(stream).toreadonly(), dtype=np.uint8)


def decode_stream(entry: Mapping[str, Any], stream: memoryview | bytes, base: np.ndarray | None = None) -> DecodedTensor:
    """Decode and validate one tensor's stream (after its checksum was verified). A
    ``context`` stream decodes against ``base``, the unsigned bits it applies to."""
    name = entry["name"]
    width = _torch_dtype(entry["dtype"], name).itemsize
    udt = _NP_UNSIGNED[width]
    numel, changed, mode = entry["numel"], entry["changed"], entry["mode"]
    buf = _stream_array(stream)

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
    if mode == "context":
        if base is None:
            raise InvalidArgument(f"the context stream of {name!r} decodes only against the bits it applies to")
        try:
            pos, diff = _parse_context(entry, buf).decode(base)
        except ValueError as exc:
            raise bad(str(exc)) from None
        return DecodedTensor(name, pos, diff, True)
    sp = _parse_sparse(entry, buf, width)
    pos = np.empty(changed, np.int64)
    diff = np.empty(changed, udt)
    errs = tile_codec.decode_tiles(sp.buf, numel, sp.tile, width, sp.ns, sp.ks, sp.rice, sp.rans, sp.esc, sp.offs,
                                sp.freq, sp.cum, sp.slot2sym, pos, diff)
    _raise_tile_errors(entry, errs)
    return DecodedTensor(name, pos, diff, True)


@dataclass
class SparseStream:
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


def _sparse_error(entry: Mapping[str, Any], msg: str) -> CorruptData:
    return CorruptData(f"patch stream for tensor {entry['name']!r} ({entry['mode']}): {msg}")


def _parse_sparse(entry: Mapping[str, Any], buf: np.ndarray, width: int) -> SparseStream:
    numel, changed, tile = entry["numel"], entry["changed"], entry["tile"]
    if (numel + tile - 1) // tile > buf.size:  # every tile has at least one directory byte
        raise _sparse_error(entry, f"{buf.size} bytes cannot hold the directory of {numel} elements in tiles of {tile}")
    if entry["mode"] == "huffman":
        err, ns, ks, rice, rans, esc, offs, table = huffman.parse_stream(buf, numel, tile, width, changed)
        freq = cum = None
    else:
        err, ns, ks, rice, rans, esc, offs, freq, cum, table = entropy.parse_sparse(buf, numel, tile, width, changed)
    if err:
        raise _sparse_error(entry, entropy.DIR_ERRORS.get(int(err), f"directory error {err}"))
    return SparseStream(buf, numel, tile, width, ns, ks, rice, rans, esc, offs, freq, cum, table)


def _parse_context(entry: Mapping[str, Any], buf: np.ndarray) -> context_codec.ContextStream:
    try:
        return context_codec.ContextStream(buf, entry["numel"], entry["tile"], entry["changed"])
    except ValueError as exc:
        raise _sparse_error(entry, str(exc)) from None


def _raise_tile_errors(entry: Mapping[str, Any], errs: np.ndarray) -> None:
    bad_tiles = np.flatnonzero(errs)
    if bad_tiles.size:
        t = int(bad_tiles[0])
        raise _sparse_error(entry, f"tile {t} ({bad_tiles.size} bad tiles): {entropy.ERRORS.get(int(errs[t]), 'unknown error')}")


def _apply_sparse_(target: torch.Tensor, entry: Mapping[str, Any], sp: SparseStream, sign: int) -> None:
    """Decode and add (``sign`` 1) or subtract (-1) a huffman or sparse stream in place, on the CPU.

    On a corrupt tile every write this call made is undone before ``CorruptData`` is raised.
    """
    tu = cpu_bits(target)  # contiguous (``_checked_target``), so a view of its memory, not a copy
    args = (sp.buf, tu, sp.numel, sp.tile, sp.width, sp.ns, sp.ks, sp.rice, sp.rans, sp.esc, sp.offs, sp.freq, sp.cum, sp.slot2sym)
    errs, done = tile_codec.apply_tiles(*args, sign, sp.ns)
    if errs.any():
        tile_codec.apply_tiles(*args, -sign, done)
        _raise_tile_errors(entry, errs)


# ---------------------------------------------------------------------------
# apply
# ---------------------------------------------------------------------------


@dataclass
class AppliedPatch:
    changed: dict[str, int]
    base_version: int
    target_version: int
    target_root: str
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _reverted: bool = field(default=False, repr=False)

    def revert(self) -> None:
        """Restore the exact bytes the tensors held before the apply (idempotent)."""
        if self._reverted:
            return
        for undo in reversed(self._undo):
            undo()
        self._reverted = True


def apply_patch_(tensors: Mapping[str, torch.Tensor], data: bytes | bytearray | memoryview) -> AppliedPatch:
    """Check the whole patch, then write it into ``tensors`` in place.

    Every header, checksum and directory is checked before the first write. Sparse streams
    into CPU tensors are then decoded and applied in one pass (``tile_codec``); the rare
    damage only the entropy decoder can see (a stream that was written wrong yet hashes
    right) is found during that pass, and then every write of this call is undone before
    ``CorruptData`` is raised, so the tensors are never left half-patched.
    """
    c = _read_container(data)
    targets = [(_checked_target(tensors, e), e) for e in c.entries]
    steps = [(t, e, _parsed_step(t, e, c.streams[e["name"]])) for t, e in targets if e["mode"] != "empty"]
    applied = _applied_patch(c.header, c.entries)
    try:
        for target, entry, step in steps:
            _write_step(applied, target, entry, step)
    except BaseException:
        applied.revert()
        raise
    return applied


def apply_patch_arriving_(tensors: Mapping[str, torch.Tensor], parts: Sequence[Any], *,
                          on_tensor: Callable[[str], None] | None = None, timeout_s: float | None = None) -> AppliedPatch:
    """Write a patch (its parts) into ``tensors`` in place while its bytes are still arriving.

    Each part is an arriving blob (``subscriber.arriving.ArrivingBytes``): its container's
    ``size``; ``wait(start, end)`` for bytes already there; ``ready(start, end)``, which raises
    why bytes never will come; and ``watch``/``unwatch`` of a ``threading.Event`` set whenever
    bytes come. Parts are taken in whatever order their bytes arrive, not in the order given
    (parts download in parallel, and one slow part must not hold back the others). A part's
    header is checked whole, and every target against it, before any write of that part
    (and against the parts read before it: same transition, no tensor twice); then each
    tensor's stream is checked (xxh3-64) and applied as soon as it has arrived, and
    ``on_tensor(name)`` is called after each changed tensor is written. Any failure (a
    damaged stream, a download that gave up) undoes every write of this call, in every part,
    before it is raised. The caller still owes each part's digest check before trusting the
    result.
    """
    if not parts:
        raise InvalidArgument("a patch has at least one part")
    applied: AppliedPatch | None = None
    heads = {i: (0, min(8, blob.size)) for i, blob in enumerate(parts)}  # what a part's header awaits
    header_len: dict[int, int] = {}
    # Awaited tensor streams: (part, span, target, entry).
    streams: list[tuple[int, tuple[int, int], torch.Tensor, Mapping[str, Any]]] = []
    try:
        while heads or streams:
            awaited_heads, awaited_streams = list(heads.items()), streams
            wanted = awaited_heads + [(i, span) for i, span, _, _ in awaited_streams]
            streams = []
            written: set[int] = set()
            for k in _wait_across(parts, wanted, timeout_s):  # headers first, parts in order
                i, span = wanted[k]
                blob = parts[i]
                if k >= len(awaited_heads):
                    _, _, target, entry = awaited_streams[k - len(awaited_heads)]
                    _write_step(applied, target, entry, _parsed_step(target, entry, blob.wait(*span)))
                    written.add(k - len(awaited_heads))
                    if on_tensor is not None:
                        on_tensor(entry["name"])
                elif i not in header_len:
                    header_len[i] = _header_length(blob.wait(*span), blob.size)
                    heads[i] = (8, 8 + header_len[i])
                else:
                    header, entries, spans = _parse_container_header(blob.wait(*span), blob.size)
                    targets = [(_checked_target(tensors, e), e) for e in entries]
                    applied = _applied_patch(header, entries) if applied is None else _with_part(applied, header, entries)
                    streams += [(i, spans[e["name"]], t, e) for t, e in targets if e["mode"] != "empty"]
                    del heads[i]
            streams = [s for j, s in enumerate(awaited_streams) if j not in written] + streams
    except BaseException:
        if applied is not None:
            applied.revert()
        raise
    assert applied is not None
    return applied


def _wait_across(parts: Sequence[Any], wanted: Sequence[tuple[int, tuple[int, int]]], timeout_s: float | None) -> list[int]:
    """Indices of the ``(part, (start, end))`` spans that have arrived; blocks until one has."""
    wake = threading.Event()
    watched = [parts[i] for i in sorted({i for i, _ in wanted})]
    for blob in watched:
        blob.watch(wake)
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wake.clear()  # before looking: bytes that come while we look set it again
            ready = [k for k, (i, span) in enumerate(wanted) if parts[i].ready(*span)]
            if ready:
                return ready
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not wake.wait(left):
                raise Unavailable(f"no awaited byte span of the patch's parts arrived within {timeout_s} s")
    finally:
        for blob in watched:
            blob.unwatch(wake)


def _with_part(applied: AppliedPatch, header: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> AppliedPatch:
    """``applied`` extended by one more part of the same patch (refused unless it is one)."""
    _check_same_transition(applied.base_version, applied.target_version, header)
    twice = sorted(set(applied.changed) & {e["name"] for e in entries})
    if twice:
        raise CorruptData(f"patch parts both hold tensor {twice[0]!r}")
    applied.changed.update((e["name"], e["changed"]) for e in entries)
    applied.target_root = applied.target_root or header["target_root"]
    return applied


def _check_same_transition(base_version: int, target_version: int, header: Mapping[str, Any]) -> None:
    if (header["base_version"], header["target_version"]) != (base_version, target_version):
        raise CorruptData(
            f"patch parts disagree: one goes from {base_version} to {target_version}, another from "
            f"{header['base_version']} to {header['target_version']}"
        )


def join_patches(parts: Sequence[bytes | bytearray | memoryview]) -> bytes:
    """The parts of one patch as one container (their tensors in part order): for a reader
    that takes a single container. Every part is checked as ``read_patch_info`` would."""
    if not parts:
        raise InvalidArgument("a patch has at least one part")
    containers = [_read_container(p) for p in parts]
    first = containers[0].header
    header = {k: first[k] for k in ("format", "format_version", "encoding", "base_version", "target_version")}
    header["target_root"] = next((c.header["target_root"] for c in containers if c.header["target_root"]), "")
    seen: set[str] = set()
    entries: list[dict[str, Any]] = []
    streams: list[tuple[str, bytes]] = []
    for c in containers:
        _check_same_transition(first["base_version"], first["target_version"], c.header)
        if c.header["encoding"] != first["encoding"]:
            raise CorruptData(f"patch parts disagree on the encoding: {first['encoding']!r} and {c.header['encoding']!r}")
        for e in c.entries:
            if e["name"] in seen:
                raise CorruptData(f"patch parts both hold tensor {e['name']!r}")
            seen.add(e["name"])
            entries.append(e)
            if e["mode"] != "empty":
                streams.append((e["name"], bytes(c.streams[e["name"]])))
    header["tensors"] = entries
    return _write_container(header, streams)


def _checked_target(tensors: Mapping[str, torch.Tensor], entry: Mapping[str, Any]) -> torch.Tensor:
    """The destination tensor a patch entry is for, refused unless it fits exactly."""
    name = entry["name"]
    target = tensors.get(name)
    if target is None:
        raise CorruptData(f"patch changes tensor {name!r}, which the destination does not have")
    dtype = _torch_dtype(entry["dtype"], name)
    if target.dtype != dtype or target.numel() != entry["numel"]:
        raise CorruptData(
            f"patch is for {name!r} as {entry['numel']} elements of {entry['dtype']}, "
            f"the destination holds {target.numel()} of {dtype_name(target.dtype)}"
        )
    if not target.is_contiguous():
        raise InvalidArgument(f"destination tensor {name!r} is not contiguous; patches apply to stored bytes")
    return target


def _parsed_step(target: torch.Tensor, entry: Mapping[str, Any],
                 stream: memoryview) -> SparseStream | context_codec.ContextStream | DecodedTensor:
    """A checked stream, parsed (huffman or sparse into a CPU tensor: decoded while applied) or decoded.

    A stream in a buffer that can change (a part still arriving, whose range a retried
    download writes again; a caller's bytearray) is copied first: the bytes hashed are then
    the bytes decoded, and the bytes a later ``revert`` decodes again."""
    if not isinstance(memoryview(stream).obj, bytes):
        stream = memoryview(bytes(stream))
    if xxhash.xxh3_64_hexdigest(stream) != entry["xxh3_64"]:
        raise CorruptData(f"patch stream for tensor {entry['name']!r} fails its xxh3-64 check: corrupted in storage or transit")
    if entry["mode"] in ("huffman", "sparse") and target.device.type == "cpu":
        return _parse_sparse(entry, _stream_array(stream), target.element_size())
    if entry["mode"] == "context" and target.device.type == "cpu":
        return _parse_context(entry, _stream_array(stream))
    if entry["mode"] == "context":  # decoded against the target's bits, copied off the GPU
        return decode_stream(entry, stream, unsigned_np(bits_view(target.detach()).cpu()))
    return decode_stream(entry, stream)


def _applied_patch(header: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> AppliedPatch:
    return AppliedPatch(
        changed={e["name"]: e["changed"] for e in entries},
        base_version=header["base_version"],
        target_version=header["target_version"],
        target_root=header["target_root"],
    )


def _write_step(applied: AppliedPatch, target: torch.Tensor, entry: Mapping[str, Any],
                step: SparseStream | context_codec.ContextStream | DecodedTensor) -> None:
    """Write one tensor's step and record how to undo it."""
    if isinstance(step, SparseStream):
        _apply_sparse_(target, entry, step, 1)
        applied._undo.append(functools.partial(_apply_sparse_, target, entry, step, -1))
    elif isinstance(step, context_codec.ContextStream):
        try:
            applied._undo.append(step.apply_(unsigned_np(bits_view(target))))
        except ValueError as exc:
            raise _sparse_error(entry, str(exc)) from None
    else:
        target_, pos, old = _apply_decoded(target, step)
        applied._undo.append(functools.partial(scatter_bits_, target_, pos, old))


def _apply_decoded(target: torch.Tensor, dec: DecodedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tb = bits_view(target)
    view = tb.dtype
    if target.device.type == "cuda":
        from weftboard.cuda import triton_kernels

        pos = torch.from_numpy(dec.positions).to(target.device, non_blocking=True)
        vals = _as_torch(dec.values, view).to(target.device, non_blocking=True)
        old = torch.empty_like(vals)
        if dec.is_difference:
            triton_kernels.apply_diff_cuda_(tb, pos, vals, old)
        else:
            old.copy_(tb[pos])
            triton_kernels.scatter_cuda_(tb, pos, vals)
        return target, pos, old
    tu = unsigned_np(tb)
    old_np = np.empty(dec.positions.size, tu.dtype)
    entropy.gather(tu, dec.positions, old_np)
    new_np = old_np + dec.values if dec.is_difference else dec.values  # unsigned: wraps like the encoder's difference
    scatter_bits_(target, torch.from_numpy(dec.positions), _as_torch(new_np, view))
    return target, torch.from_numpy(dec.positions), _as_torch(old_np, view)


def _as_torch(arr: np.ndarray, view: torch.dtype) -> torch.Tensor:
    arr = np.ascontiguousarray(arr)
    if arr.dtype == np.uint8:
        return torch.from_numpy(arr)
    signed = {2: np.int16, 4: np.int32, 8: np.int64}[arr.itemsize]
    return torch.from_numpy(arr.view(signed)).view(view)
