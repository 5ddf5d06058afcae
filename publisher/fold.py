"""Folding a new tensor into the served view in one pass that also records the transition.

A fold walks the tensor in pieces of ``CAST_CHUNK`` elements (whole codec tiles). For each
piece it compares the view's bits with the new bits, records what changed and overwrites the
view. On a CPU view with a ``TensorScan`` the comparison *encodes* as it goes (the tile scan
of the default encoding, or the context scan for 16-bit floats in the context encoding), so
the result is the tensor's scans; elsewhere it is a ``TensorDelta`` (``diff_and_update_``).

Invariants:
- After a fold the view holds exactly the new bits, and the result describes exactly the
  transition from the old bits to them (scans, or one delta for the whole tensor).
- Tiles a scan leaves alone (too dense for its scratch, or a value the fused cast does not
  handle) are diffed instead; the tensor's result is then a delta, never a mix.
- An elementwise cast (``chunked_cast_fold_``) goes through one reused chunk buffer, so the
  fold never holds a second full-size copy of the tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from weftboard.cuda import codec, context_codec
from weftboard.cuda.diff import TensorDelta, bits_view, diff_and_update_, unsigned_np

CAST_CHUNK = 1 << 22  # elements; a multiple of torch's parallel grain, so casts are identical to whole-tensor casts
assert CAST_CHUNK % codec.CODEC_TILE == 0  # pieces start on tile boundaries


@dataclasses.dataclass(frozen=True)
class TensorScan:
    """How a fold encodes one CPU tensor: the tile scan, or (context encoding, 16-bit floats)
    the context scan, whose class thresholds come from the view before it is folded."""

    thresholds: np.ndarray | None = None

    @staticmethod
    def for_tensor(encoding: str, prev: torch.Tensor) -> TensorScan:
        if encoding == "context" and context_codec.supports(prev.dtype) and prev.device.type == "cpu":
            thresholds = context_codec.choose_thresholds(unsigned_np(bits_view(prev)).reshape(-1), prev.dtype)
            if thresholds.size:
                return TensorScan(thresholds)
        return TensorScan()

    def piece(self, view: np.ndarray, new: np.ndarray, scratch: dict, cast: bool = False) -> Any:
        """Scan and fold one piece (whole tiles)."""
        if self.thresholds is None:
            return codec.scan_tiles(view, new, codec.CODEC_TILE, scratch, update=True, cast=cast)
        return context_codec.scan_tiles(view, new, self.thresholds, codec.CODEC_TILE, scratch, update=True, cast=cast)

    def tensor(self, pieces: list) -> Any:
        """The scans of a tensor's pieces, as ``codec.encoded_from_scans`` takes them."""
        return pieces if self.thresholds is None else context_codec.ContextScans(self.thresholds, pieces)


def chunked_cast_fold_(prev: torch.Tensor, master: torch.Tensor, scratch: dict, scan: TensorScan | None = None) -> Any:
    """Cast ``master`` to ``prev``'s dtype chunk by chunk, folding each chunk into ``prev``;
    what changed (see ``fold_pieces_``)."""
    flat_m = master.detach().reshape(-1)
    key = (prev.dtype, prev.device)
    buf = scratch.get(key)
    if buf is None:
        buf = scratch[key] = torch.empty(CAST_CHUNK, dtype=prev.dtype, device=prev.device)

    def cast(start: int, end: int) -> torch.Tensor:
        chunk = buf[: end - start]
        chunk.copy_(flat_m[start:end])  # the same cast kernel as .to(), into a reused buffer
        return chunk

    cast_scan = None
    if scan is not None and prev.dtype == torch.bfloat16 and flat_m.dtype == torch.float32 \
            and prev.device.type == "cpu" and flat_m.device.type == "cpu":
        # fp32 master served as bf16 on the CPU: the scan casts as it compares, so the cast
        # is never written out and read back. Tiles the fused cast leaves alone (a NaN or a
        # subnormal) come back as overflowed and go through ``cast``.
        src = flat_m.view(torch.int32).numpy().view(np.uint32)

        def cast_scan(view: np.ndarray, start: int, end: int) -> Any:
            return scan.piece(view, src[start:end], scratch, cast=True)

    # Small tensors too go through the reused buffer: no fresh pages to fault in.
    return fold_pieces_(prev, None, scratch, scan, flat_m.numel(), source=cast, cast_scan=cast_scan)


def fold_pieces_(prev: torch.Tensor, new: torch.Tensor | None, scratch: dict, scan: TensorScan | None, n: int, *,
                 source: Callable[[int, int], torch.Tensor] | None = None,
                 cast_scan: Callable[[np.ndarray, int, int], Any] | None = None) -> Any:
    """Fold ``new`` (or the pieces ``source(start, end)`` gives) into ``prev``; returns the
    TensorDelta, or (``scan`` on a CPU view) the tensor's scans. ``cast_scan(view, start, end)``,
    when given, scans and folds a piece without ``source``; ``source`` then serves only the
    tiles it left."""
    flat_p = prev.reshape(-1)
    flat_n = None if new is None else new.reshape(-1)

    def piece_of(start: int, end: int) -> torch.Tensor:
        return source(start, end) if source is not None else flat_n[start:end]

    scan = scan if prev.device.type == "cpu" else None
    parts: list[tuple[int, Any]] = []
    for start in range(0, max(n, 1), CAST_CHUNK):
        end = min(start + CAST_CHUNK, n)
        view = flat_p[start:end]
        if scan is not None and cast_scan is not None:
            piece = None
            sc = cast_scan(unsigned_np(bits_view(view)), start, end)
        else:
            piece = piece_of(start, end)
            if scan is None:
                parts.append((start, diff_and_update_(view, piece)))
                continue
            sc = scan.piece(unsigned_np(bits_view(view)), unsigned_np(bits_view(piece)), scratch)
        if not sc.overflowed.size:
            parts.append((start, sc))
            continue
        if piece is None:
            piece = piece_of(start, end)
        # The scanned tiles are folded: their delta comes back from the view. The others
        # are untouched: diff them.
        scanned = codec.delta_from_scans(scan.tensor([dataclasses.replace(sc, overflowed=np.empty(0, np.int64))]), view)
        pieces = [(0, scanned)]
        for t in sc.overflowed.tolist():
            lo, hi = t * codec.CODEC_TILE, min((t + 1) * codec.CODEC_TILE, end - start)
            pieces.append((lo, diff_and_update_(view[lo:hi], piece[lo:hi])))
        parts.append((start, join_deltas(pieces, end - start, prev.dtype)))
    if scan is not None and all(not isinstance(item, TensorDelta) for _, item in parts):
        return scan.tensor([item for _, item in parts])
    deltas = [(start, item if isinstance(item, TensorDelta) else
               codec.delta_from_scans(scan.tensor([item]), flat_p[start:start + CAST_CHUNK]))
              for start, item in parts]
    if len(deltas) == 1:
        return deltas[0][1]
    return join_deltas(deltas, n, prev.dtype)


def join_deltas(parts: list[tuple[int, TensorDelta]], numel: int, dtype: torch.dtype) -> TensorDelta:
    """One delta from deltas of disjoint ranges (each ``(offset, delta)``), positions ascending."""
    positions = torch.cat([d.positions + offset for offset, d in parts])
    order = torch.argsort(positions)
    return TensorDelta(
        positions=positions[order],
        old_bits=torch.cat([d.old_bits for _, d in parts])[order],
        new_bits=torch.cat([d.new_bits for _, d in parts])[order],
        numel=numel,
        dtype=dtype,
    )
