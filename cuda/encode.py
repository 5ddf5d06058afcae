"""Encoding: version transitions (tensor pairs, deltas or tile scans) into per-tensor streams
and patch containers. Per tensor the default encoding writes the smaller of ``huffman`` and
``bitmap`` (``all`` when every element changed). The compact encoding writes, for a 16-bit
float pair (or a delta with its target), ``context_huffman`` or ``huffman``, whichever measured
smaller, and otherwise the default's modes. Tile scans (the publisher's piece-by-piece read)
give ``huffman`` or ``context`` streams as scanned. ``context`` and ``baseline`` as their
encodings say.

Invariants: a tensor's stream depends only on its (old, new) bits, not on batching, piece
boundaries, thread count or scratch reuse.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numba as nb
import numpy as np
import torch
import xxhash

from weftboard.cuda import context_codec, context_huffman, entropy
from weftboard.cuda.container import (
    CODEC_TILE,
    ENCODINGS,
    FORMAT,
    format_version_for,
    write_container,
)
from weftboard.cuda.decode import DecodedTensor, decode_stream, parse_context_stream
from weftboard.cuda.diff import check_pair, diff_tensor
from weftboard.cuda.digest import dtype_name
from weftboard.cuda.jit import serial_kernels
from weftboard.cuda.scratch import kept_scratch, trim_scratch
from weftboard.cuda.tensor_bits import (
    TensorDelta,
    bits_view,
    cpu_bits,
    int_view_dtype,
    unsigned_np,
)
from weftboard.cuda.tile_encode import (
    TileScan,
    batchable,
    encode_huffman,
    encode_huffman_batch,
    finish_huffman,
    finish_scanned_tiles,
)
from weftboard.proto.errors import InvalidArgument


@dataclass
class EncodedPatch:
    data: bytes
    changed: dict[str, int]
    numel: dict[str, int]


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


def _encode_huffman(pos: np.ndarray, old: np.ndarray, new: np.ndarray, numel: int, tile: int) -> np.ndarray:
    """The ``huffman`` stream of a delta, in two steps: the plan, then each tile's Rice bits |
    escapes in its own scratch region, then the values Huffman-coded and the stream assembled
    by the fused encoder's finish, so both encoders give the same bytes."""
    width = old.itemsize
    ntiles = (numel + tile - 1) // tile
    tile_ptr = np.searchsorted(pos, np.arange(ntiles + 1, dtype=np.int64) * tile).astype(np.int64)
    syms, counts, ks, rice_bytes, n_esc = entropy.plan_tiles(pos, old, new, width, tile_ptr, tile)
    ns = np.diff(tile_ptr)
    bounds = np.where(ns > 0, rice_bytes + 4 + n_esc * width, 0)  # 4 of slack: rice_put's stores
    scratch_off = np.zeros(ntiles + 1, np.int64)
    np.cumsum(bounds, out=scratch_off[1:])
    scratch = np.empty(int(scratch_off[-1]), np.uint8)
    entropy.encode_tiles(pos, syms, old, new, width, tile_ptr, tile, ks, n_esc, scratch_off, scratch)
    starts = scratch_off[:-1]
    return finish_scanned_tiles(ns, ks, rice_bytes, n_esc, counts, width, scratch, starts, syms, tile_ptr[:-1],
                                scratch, starts + rice_bytes)


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
    # A publisher's compact stream: the fold's tile scans of the same transition, from which a
    # merge recovers the delta (a ``context_huffman`` stream decodes only against its old bits).
    scans: Any = field(default=None, repr=False)


def _encode_delta(name: str, delta: TensorDelta, encoding: str, target: torch.Tensor | None = None) -> EncodedTensor:
    if (encoding in ("compact", "context") and target is not None and delta.positions.numel()
            and context_codec.supports(delta.dtype)):
        old_t, new_t = _old_and_target(delta, target)
        pair = _encode_pair_context if encoding == "context" else _encode_pair_context_huffman
        fused = pair(name, old_t, new_t)
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


def _classed_pair(old: torch.Tensor, new: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(old bits, new bits, class thresholds) of a CPU pair of a 16-bit float tensor, or None
    when the context modes do not apply (another dtype, or old values without a spread)."""
    if not context_codec.supports(old.dtype):
        return None
    check_pair(old, new)
    a = cpu_bits(old)
    thresholds = context_codec.choose_thresholds(a, old.dtype)
    return (a, cpu_bits(new), thresholds) if thresholds.size else None


def _encode_pair_context(name: str, old: torch.Tensor, new: torch.Tensor) -> EncodedTensor | None:
    """The ``context`` stream of a CPU pair of a 16-bit float tensor, or None when that mode
    does not apply or is not smaller than a bitmap (the caller takes the default modes)."""
    classed = _classed_pair(old, new)
    if classed is None:
        return None
    a, b, thresholds = classed
    changed, stream = context_codec.encode_context(a, b, thresholds, CODEC_TILE)
    if changed == 0:
        return EncodedTensor(name, old.dtype, a.size, 0, "empty", np.empty(0, np.uint8))
    if stream is None or changed == a.size or stream.size > _bitmap_bytes(a.size, changed, 2):
        return None
    return EncodedTensor(name, old.dtype, a.size, changed, "context", stream)


def _encode_pair_context_huffman(name: str, old: torch.Tensor, new: torch.Tensor,
                                 scratch: dict | None = None) -> EncodedTensor | None:
    """The compact encoding's choice for a CPU pair of a 16-bit float tensor: its
    ``context_huffman`` stream, or its ``huffman`` stream where that measured smaller (encoded
    only when the context scan's estimate of it says it may be), or None when neither applies
    or a bitmap is smaller (the caller takes the other default modes)."""
    classed = _classed_pair(old, new)
    if classed is None:
        return None
    a, b, thresholds = classed
    changed, stream, huffman_guess = context_huffman.encode_context_huffman(a, b, thresholds, CODEC_TILE, scratch)
    return _context_huffman_entry(name, old, a, b, changed, stream, huffman_guess, scratch)


def _fused_result(name: str, dtype: torch.dtype, b: np.ndarray, changed: int, stream: np.ndarray | None) -> EncodedTensor | None:
    """The entry of a CPU pair from the fused encoder's (changes, ``huffman`` stream) over its
    new bits ``b`` (``tile_encode``: one read of both tensors): ``empty``, ``all`` (the new
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


Scans = Sequence[TileScan] | context_codec.ContextScans


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
    return EncodedTensor(name, dtype, numel, changed, "huffman", finish_huffman(scans, width))


def encoded_from_scans(name: str, dtype: torch.dtype, numel: int, scans: Scans) -> EncodedTensor | None:
    """The stream of a tensor that was scanned piece by piece as it was read (``scan_tiles``,
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
    into the next one. A stream that carries its fold's ``scans`` is recovered from them."""
    if encoded.scans is not None:
        return delta_from_scans(encoded.scans, target)
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
        pos, diff = context_codec.decode_folded(parse_context_stream(entry, encoded.stream), folded, *encoded.fixups)
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
    if not 0 <= base_version < target_version < 1 << 63:
        raise InvalidArgument(f"a patch goes from a version to a later one (0 <= base < target < 2**63), "
                              f"got base_version {base_version} and target_version {target_version}")
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
        "format_version": format_version_for(e["mode"] for e in entries),
        "encoding": encoding,
        "base_version": int(base_version),
        "target_version": int(target_version),
        "target_root": str(target_root),
        "tensors": entries,
    }
    return EncodedPatch(data=write_container(header, streams), changed=changed, numel=numel)


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
    return assemble_patch(
        encode_pairs(pairs, encoding), base_version=base_version, target_version=target_version,
        target_root=target_root, encoding=encoding
    )


def encode_pairs(pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]], encoding: str = "default") -> Iterator[EncodedTensor]:
    """Each (name, old, new) pair's stream, in the pairs' order, as ``encode_patch`` encodes
    them (batched where it batches: a stream comes out once its batch closes)."""
    _check_encoding(encoding)
    scratch = kept_scratch()  # one pool for all pairs, and for the next patch
    batch = _FusedBatch(scratch, encoding)
    ctx = _ContextBatch(scratch)
    try:
        for name, old, new in pairs:
            on_cpu = old.is_cpu and new.is_cpu
            if encoding == "compact" and on_cpu and context_codec.supports(old.dtype):
                yield from batch.flush()
                yield from ctx.add(name, old, new)
                continue
            yield from ctx.flush()
            if encoding == "context" and on_cpu and context_codec.supports(old.dtype):
                yield from batch.flush()
                fused = _encode_pair_context(name, old, new)
                if fused is not None:
                    yield fused
                    continue
            if encoding != "baseline" and on_cpu:
                yield from batch.add(name, old, new)
                continue
            yield from batch.flush()
            # the new bits as the target: compact and context code a device pair as a CPU pair
            yield _encode_delta(name, diff_tensor(old, new), encoding, new)
        yield from ctx.flush()
        yield from batch.flush()
    finally:
        trim_scratch(scratch)


# A batch of ``encode_patch`` closes once it holds this many tiles: about the bench's embedding
# (250 tiles of 65536), so its scratch pool (about 84 MB of address space for 16-bit elements)
# is no larger than one such tensor needs alone and stays under ``KEPT_SCRATCH_BYTES``
# (with 1024 tiles the pool outgrew it, was released after every patch and page-faulted anew:
# the bench's encode ran 8% slower), and the pairs it holds (the caller's tensors, not copies)
# stay a small part of a large model.
BATCH_TILES = 256


class _ContextBatch:
    """CPU pairs of 16-bit floats waiting for one ``context_huffman.encode_context_huffman_batch``
    call (``encode_patch``, compact encoding: one parallel region for the batch's scans, not
    one per tensor). ``add`` and ``flush`` yield finished entries in the pairs' order; a pair
    the context coder leaves (no spread for classes, a tile too dense, a bitmap smaller) takes
    the fused ``huffman`` encoder, then the two-step path."""

    def __init__(self, scratch: dict) -> None:
        self.scratch = scratch
        self._items: list[tuple[str, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray, np.ndarray]] = []
        self._tiles = 0

    def add(self, name: str, old: torch.Tensor, new: torch.Tensor) -> Iterator[EncodedTensor]:
        check_pair(old, new)
        a = cpu_bits(old)
        b = cpu_bits(new)
        tiles = -(-a.size // CODEC_TILE)
        if self._items and self._tiles + tiles > BATCH_TILES:
            yield from self.flush()
        self._items.append((name, old, new, a, b, context_codec.choose_thresholds(a, old.dtype)))
        self._tiles += tiles

    def flush(self) -> Iterator[EncodedTensor]:
        items, self._items, self._tiles = self._items, [], 0
        coded = [it for it in items if it[5].size]
        results = iter(context_huffman.encode_context_huffman_batch([(a, b, thr) for *_, a, b, thr in coded],
                                                                    CODEC_TILE, self.scratch))
        for name, old, new, a, b, thr in items:
            entry = _context_huffman_entry(name, old, a, b, *next(results), self.scratch) if thr.size else None
            if entry is None:
                fused = _fused_result(name, old.dtype, b, *encode_huffman(a, b, CODEC_TILE, self.scratch))
                entry = fused if fused is not None else _encode_delta(name, diff_tensor(old, new), "default")
            yield entry


def _context_huffman_entry(name: str, old: torch.Tensor, a: np.ndarray, b: np.ndarray, changed: int,
                           stream: np.ndarray | None, huffman_guess: int, scratch: dict | None) -> EncodedTensor | None:
    """The compact encoding's choice from a pair's ``context_huffman`` result: that stream, or
    the ``huffman`` stream where it measured smaller (encoded only when the estimate says it
    may be), or None when neither applies or a bitmap is smaller."""
    if changed == 0:
        return EncodedTensor(name, old.dtype, a.size, 0, "empty", np.empty(0, np.uint8))
    if stream is None or changed == a.size or stream.size > _bitmap_bytes(a.size, changed, 2):
        return None
    if huffman_guess < stream.size * 1.15:  # the estimate's error, with room to spare
        with serial_kernels() if a.size <= CODEC_TILE else contextlib.nullcontext():  # one tile: no second thread
            _, other = encode_huffman(a, b, CODEC_TILE, scratch)
        if other is not None and other.size < stream.size:
            return EncodedTensor(name, old.dtype, a.size, changed, "huffman", other)
    return EncodedTensor(name, old.dtype, a.size, changed, "context_huffman", stream)


class _FusedBatch:
    """CPU pairs of one element width waiting for one ``encode_huffman_batch``
    call (``encode_patch``). ``add`` and ``flush`` yield finished entries in the pairs' order."""

    def __init__(self, scratch: dict, encoding: str) -> None:
        self.fresh_scratch = scratch
        self._encoding = encoding  # of the two-step path, for a pair the fused encoder leaves
        self._items: list[tuple[str, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]] = []
        self._tiles = 0

    def add(self, name: str, old: torch.Tensor, new: torch.Tensor) -> Iterator[EncodedTensor]:
        check_pair(old, new)
        a = cpu_bits(old)
        b = cpu_bits(new)
        if not batchable(a, CODEC_TILE):
            yield from self.flush()
            yield self._entry(name, old, new, b, *encode_huffman(a, b, CODEC_TILE, self.fresh_scratch))
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
        results = encode_huffman_batch([(a, b) for *_, a, b in items], CODEC_TILE, self.fresh_scratch)
        for (name, old, new, _, b), (changed, stream) in zip(items, results, strict=True):
            yield self._entry(name, old, new, b, changed, stream)

    def _entry(self, name: str, old: torch.Tensor, new: torch.Tensor, b: np.ndarray, changed: int,
               stream: np.ndarray | None) -> EncodedTensor:
        fused = _fused_result(name, old.dtype, b, changed, stream)
        return fused if fused is not None else _encode_delta(name, diff_tensor(old, new), self._encoding)
