"""Compile the CPU codec's kernels before they are needed (``weftboard warmup``): every CPU path of
the publisher's read, an island's apply and ``encode_patch``, on tensors of a few tiles, so the
first-compile cost is paid when the caller chooses; with a warm cache it only loads the kernels.

Invariant: the paths and argument types here are those the publisher and the subscriber take
(each type compiles apart); ``tests/test_warmup.py`` checks that afterwards a real publisher and
island compile nothing more.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weftboard.cuda import context_codec, tile_encode
from weftboard.cuda.codec import (
    CODEC_TILE,
    apply_patch_,
    decode_stream,
    delta_from_scans,
    encode_deltas,
    encode_patch,
    encoded_from_scans,
)
from weftboard.cuda.codec import ENCODINGS as ALL_ENCODINGS
from weftboard.cuda.container import read_container
from weftboard.cuda.diff import diff_and_update_, diff_tensor
from weftboard.cuda.digest import tensor_digest
from weftboard.cuda.formats import KINDS as ALL_FORMATS
from weftboard.cuda.formats import Projector, ServedFormatSpec, make_test_master
from weftboard.cuda.jit import kernel_signatures
from weftboard.cuda.tensor_bits import bits_view, unsigned_np
from weftboard.proto.errors import InvalidArgument

# Spread over a few tiles, the last one partial, so every per-tile branch runs.
_ELEMENTS = 2 * (1 << 16) + 777
# One dtype per element width: the kernels see only the unsigned bits of that width.
_WIDTH_DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up did: the element widths and encodings it took, how long it took, and the
    kernel signatures compiled or loaded from the disk cache during it (none when this process
    already had them all)."""

    widths: tuple[int, ...]
    encodings: tuple[str, ...]
    seconds: float
    signatures: frozenset[tuple[str, str]]


def served_widths(formats: Iterable[str]) -> tuple[int, ...]:
    """The element widths the served formats ``formats`` store (scales included)."""
    master = make_test_master(layers=1, hidden=256, intermediate=512, vocab=512)
    widths: set[int] = set()
    for kind in formats:
        served = Projector(ServedFormatSpec(kind)).project(master, anchor=True)
        widths.update(t.element_size() for t in served.values())
    return tuple(sorted(widths))


def warm_up_kernels(formats: Sequence[str] = ALL_FORMATS, encodings: Sequence[str] = ALL_ENCODINGS, *,
                    say: Callable[[str], None] | None = None) -> WarmUp:
    """Run every CPU codec path of the served ``formats`` and patch ``encodings`` once on small
    tensors, checking each result bitwise; see the module docstring. ``say`` gets a line per
    stage."""
    unknown = sorted(set(encodings) - set(ALL_ENCODINGS))
    if unknown or not encodings:
        raise InvalidArgument(f"encodings must be some of {', '.join(ALL_ENCODINGS)}, got {list(encodings)}")
    widths = served_widths(formats)
    encodings = tuple(e for e in ALL_ENCODINGS if e in encodings)
    before = kernel_signatures()
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    for width in widths:
        dtype = _WIDTH_DTYPES[width]
        stages: list[tuple[str, Callable[[], None]]] = []
        if width == 2:
            stages.append(("the read of an fp32 master served as bf16 (cast inside the scan)",
                           lambda: _publisher_cast_scans(gen, encodings)))
        stages += [
            ("the read of a projected view (plain scans)", lambda dtype=dtype: _publisher_plain_scans(gen, dtype, encodings)),
            ("patches of every mode, applied, undone and decoded", lambda dtype=dtype: _streams_applied(gen, dtype, encodings)),
            ("the one-pass encoder and digests", lambda dtype=dtype: _fused_encoder(gen, dtype, encodings)),
        ]
        for what, stage in stages:
            if say is not None:
                say(f"{width}-byte elements: {what}")
            stage()
    return WarmUp(widths, encodings, time.perf_counter() - t0, kernel_signatures() - before)


# ---------------------------------------------------------------------------
# the stages
# ---------------------------------------------------------------------------


def _random(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(_ELEMENTS, generator=gen) * 0.05).to(dtype)


def _stepped(old: torch.Tensor, gen: torch.Generator, density: float = 0.02) -> torch.Tensor:
    """``old`` with a fraction of its elements one unit in the last place up or down, a few far
    off (escaped differences), and every element of the first tile far off: with elements of
    two bytes or more, more escapes than a scan has room for, so that tile is diffed instead."""
    bits = bits_view(old.clone())
    n = bits.numel()
    moved = torch.rand(n, generator=gen) < density
    step = torch.where(torch.rand(n, generator=gen) < 0.5, 1, -1).to(bits.dtype)
    bits[moved] += step[moved]
    bits[::4099] += 100  # beyond the largest coded difference (64): escapes
    bits[:CODEC_TILE] += 100
    return bits.view(old.dtype)


def _scan_encodings(encodings: Sequence[str], dtype: torch.dtype) -> list[str]:
    """The scans a read takes for these encodings: the context scan for 16-bit floats in the
    context encoding, the tile scan otherwise (``baseline`` reads scan too, then re-encode)."""
    scans = ["context"] if "context" in encodings and context_codec.supports(dtype) else []
    if set(encodings) - {"context"} or not context_codec.supports(dtype):
        scans.insert(0, "default")
    return scans


def _scan_fold_finish(view: torch.Tensor, src: np.ndarray, new: torch.Tensor, encoding: str, cast: bool) -> None:
    """What the publisher's read does with one tensor: scan ``src`` (the new bits, or with
    ``cast`` the fp32 master's) into ``view`` (the tile scan, or the context scan), diff the tiles
    the scan left, check the view now holds ``new`` bitwise, then finish: the stream, or (tiles
    the scan left, a mode it does not fit) the delta recovered from the folded view."""
    old_bits = unsigned_np(bits_view(view))
    if encoding == "default":
        thresholds = np.empty(0, np.int64)
        scan = tile_encode.scan_tiles(old_bits, src, CODEC_TILE, {}, update=True, cast=cast)
    else:
        thresholds = context_codec.choose_thresholds(old_bits, view.dtype)
        scan = context_codec.scan_tiles(old_bits, src, thresholds, CODEC_TILE, {}, update=True, cast=cast)
    for t in scan.overflowed.tolist():
        lo, hi = t * CODEC_TILE, min((t + 1) * CODEC_TILE, view.numel())
        diff_and_update_(view[lo:hi], new[lo:hi])
    if not torch.equal(bits_view(view), bits_view(new)):
        raise RuntimeError(f"kernel warm-up: a {'cast ' if cast else ''}{encoding} scan of {view.dtype} did not fold "
                           "the new version in")
    whole = dataclasses.replace(scan, overflowed=np.empty(0, np.int64))
    scans = [whole] if encoding == "default" else context_codec.ContextScans(thresholds, [whole])
    if scan.overflowed.size or encoded_from_scans("w", view.dtype, view.numel(), scans) is None:
        delta_from_scans(scans, view)


def _publisher_cast_scans(gen: torch.Generator, encodings: Sequence[str]) -> None:
    """The publisher's common case: an fp32 master served as bf16 on the CPU, cast inside the
    scan (``scan_tiles(cast=True)``, and the context scan's), the tiles a scan leaves (a NaN
    master) cast by torch and diffed."""
    master = torch.randn(_ELEMENTS, generator=gen) * 0.02
    stepped = master + torch.randn(_ELEMENTS, generator=gen) * 1e-5
    stepped[5] = float("nan")  # the first tile is left to torch's cast
    src = stepped.view(torch.int32).numpy().view(np.uint32)
    for encoding in _scan_encodings(encodings, torch.bfloat16):
        _scan_fold_finish(master.to(torch.bfloat16), src, stepped.to(torch.bfloat16), encoding, cast=True)


def _publisher_plain_scans(gen: torch.Generator, dtype: torch.dtype, encodings: Sequence[str]) -> None:
    """A served view the publisher projects whole and then folds in: a plain scan, once with a
    tile too dense for it (diffed, then the delta recovered) and once with every element changed."""
    old = _random(gen, dtype)
    for new in (_stepped(old, gen), (bits_view(old.clone()) + 1).view(dtype)):
        for encoding in _scan_encodings(encodings, dtype):
            _scan_fold_finish(old.clone(), unsigned_np(bits_view(new)), new, encoding, cast=False)


def _streams_applied(gen: torch.Generator, dtype: torch.dtype, encodings: Sequence[str]) -> None:
    """Patches of every mode, encoded from deltas as the publisher finishes them, applied in
    place as an island does (from bytes and from writable buffers), undone, and decoded into
    arrays as for a GPU destination."""
    old = _random(gen, dtype)
    pairs = {"sparse": _stepped(old, gen), "dense": _stepped(old, gen, density=0.6),  # a bitmap stream
             "every": (bits_view(old.clone()) + 1).view(dtype)}  # an ``all`` stream
    for encoding in encodings:
        data = encode_deltas(((n, diff_tensor(old, new)) for n, new in pairs.items()), base_version=1,
                             target_version=2, target_root="", encoding=encoding).data
        for container in (data, bytearray(data)):
            live = {n: old.clone() for n in pairs}
            applied = apply_patch_(live, container)
            if not all(torch.equal(bits_view(live[n]), bits_view(new)) for n, new in pairs.items()):
                raise RuntimeError(f"kernel warm-up: a {encoding} patch of {dtype} did not apply bitwise")
            applied.revert()
        read = read_container(data)
        for entry in read.entries:
            if entry["mode"] not in ("empty", "context"):  # a context stream decodes against its target
                decode_stream(entry, read.streams[entry["name"]])


def _fused_encoder(gen: torch.Generator, dtype: torch.dtype, encodings: Sequence[str]) -> None:
    """``encode_patch``, the one-pass encoder of a caller that holds both versions (benchmarks,
    tools), and the digest an island verifies with."""
    old = _random(gen, dtype)
    new = _stepped(old, gen)
    tensor_digest(new)
    for encoding in encodings:
        data = encode_patch([("w", old, new)], base_version=1, target_version=2, target_root="",
                            encoding=encoding).data
        live = {"w": old.clone()}
        apply_patch_(live, data)
        if not torch.equal(bits_view(live["w"]), bits_view(new)):
            raise RuntimeError(f"kernel warm-up: encode_patch ({encoding}) of {dtype} did not apply bitwise")
        read = read_container(data)
        for entry in read.entries:  # a context stream decoded into arrays, as for a GPU destination
            if entry["mode"] in ("context", "context_huffman"):
                decode_stream(entry, read.streams[entry["name"]], unsigned_np(bits_view(old)))
