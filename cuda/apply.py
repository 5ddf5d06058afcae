"""Applying patches in place: whole containers (``apply_patch_``) or parts as they arrive
(``apply_patch_arriving_``), with ``AppliedPatch.revert`` to restore the previous bytes.

Invariants: every header, checksum and directory is checked before the first write; targets keep
their storage (CUDA tensors are written by Triton kernels), so captured addresses stay valid.
A huffman stream into a CUDA tensor is decoded on the device (``triton_huffman``) only where
``WEFTBOARD_DEVICE_DECODE=1``: that kernel has not yet run on a GPU (``cuda/device_check.sh``
measures both paths); otherwise it is decoded on CPU threads and scattered by Triton.
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch
import xxhash

from weftboard.cuda import context_huffman, entropy
from weftboard.cuda.container import (
    check_same_transition,
    header_length,
    parse_container_header,
    read_container,
    torch_dtype,
)
from weftboard.cuda.decode import (
    ContextStreams,
    DecodedTensor,
    TileStream,
    apply_tile_stream_,
    decode_stream,
    parse_context_stream,
    parse_tile_stream,
    stream_array,
    tile_stream_error,
)
from weftboard.cuda.diff import gpu_kernels, scatter_bits_
from weftboard.cuda.digest import dtype_name
from weftboard.cuda.tensor_bits import bits_view, unsigned_np
from weftboard.proto.errors import CorruptData, InvalidArgument, Unavailable


@dataclass
class AppliedPatch:
    changed: dict[str, int]
    base_version: int
    target_version: int
    target_root: str
    encoding: str = ""  # the patch's (every part of one patch has the same)
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
    into CPU tensors are then decoded and applied in one pass (``tile_decode``), and huffman
    streams into CUDA tensors on the device where ``WEFTBOARD_DEVICE_DECODE=1``
    (``triton_huffman``); the rare
    damage only the entropy decoder can see (a stream that was written wrong yet hashes
    right) is found during that pass, and then every write of this call is undone before
    ``CorruptData`` is raised, so the tensors are never left half-patched.
    """
    c = read_container(data)
    targets = [(_checked_target(tensors, e), e) for e in c.entries]
    once = _SharedMemory()
    steps = [(t, e, _parsed_step(t, e, c.streams[e["name"]])) for t, e in targets
             if e["mode"] != "empty" and once.writer(t, e["name"]) == e["name"]]
    applied = _applied_patch(c.header, c.entries)
    batched = [(t, e, s) for t, e, s in steps if isinstance(s, context_huffman.ContextHuffmanStream)]
    try:
        _write_context_batch(applied, batched)  # one parallel loop over all their tiles
        for target, entry, step in steps:
            if not isinstance(step, context_huffman.ContextHuffmanStream):
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
    ``on_tensor(name)`` is called after each changed tensor is written (also for a name sharing
    its memory, written once with the first). Any failure (a
    damaged stream, a download that gave up) undoes every write of this call, in every part,
    before it is raised. The caller still owes each part's digest check before trusting the
    result.
    """
    if not parts:
        raise InvalidArgument("a patch has at least one part")
    applied: AppliedPatch | None = None
    once = _SharedMemory()
    aliases: dict[str, list[str]] = {}  # a written name -> the names sharing its memory, told with it
    done_names: set[str] = set()
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
                    done_names.add(entry["name"])
                    if on_tensor is not None:
                        for name in (entry["name"], *aliases.pop(entry["name"], ())):
                            on_tensor(name)
                elif i not in header_len:
                    header_len[i] = header_length(blob.wait(*span), blob.size)
                    heads[i] = (8, 8 + header_len[i])
                else:
                    header, entries, spans = parse_container_header(blob.wait(*span), blob.size)
                    targets = [(_checked_target(tensors, e), e) for e in entries]
                    applied = _applied_patch(header, entries) if applied is None else _with_part(applied, header, entries)
                    for t, e in targets:
                        owner = once.writer(t, e["name"]) if e["mode"] != "empty" else None
                        if owner == e["name"]:
                            streams.append((i, spans[e["name"]], t, e))
                        elif owner is not None and owner in done_names:  # its memory is written already
                            if on_tensor is not None:
                                on_tensor(e["name"])
                        elif owner is not None:  # written with its owner's stream: told then
                            aliases.setdefault(owner, []).append(e["name"])
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
    check_same_transition(applied.base_version, applied.target_version, header)
    if header["encoding"] != applied.encoding:  # as ``container.join_patches`` refuses them
        raise CorruptData(f"patch parts disagree on the encoding: {applied.encoding!r} and {header['encoding']!r}")
    twice = sorted(set(applied.changed) & {e["name"] for e in entries})
    if twice:
        raise CorruptData(f"patch parts both hold tensor {twice[0]!r}")
    applied.changed.update((e["name"], e["changed"]) for e in entries)
    applied.target_root = applied.target_root or header["target_root"]
    return applied


class _SharedMemory:
    """Destination tensors of one apply that share memory. A tensor under two names (tied
    weights handed over as ``model.state_dict()``) is written once, by the first entry naming
    it: a stream of differences written twice would add them twice. The record's digests of
    every name are still checked after the apply, so two entries that disagree are caught
    there. Tensors that overlap without being the same memory cannot hold both entries' bytes:
    refused before any write."""

    def __init__(self) -> None:
        self._spans: dict[tuple[str, int], list[tuple[int, int, str]]] = {}  # per storage, sorted, disjoint

    def writer(self, target: torch.Tensor, name: str) -> str:
        """The entry whose stream writes ``target``'s memory: ``name`` itself, or the earlier entry
        that writes the same memory; ``InvalidArgument`` for memory that overlaps one in part."""
        size = target.element_size()
        start = target.untyped_storage().data_ptr() + target.storage_offset() * size
        span = (start, start + target.numel() * size, name)
        spans = self._spans.setdefault((str(target.device), target.untyped_storage().data_ptr()), [])
        at = bisect.bisect_left(spans, span)
        for s, e, other in spans[max(at - 1, 0):at + 1]:  # the spans are disjoint: only neighbours can meet it
            if (s, e) == span[:2]:
                return other
            if s < span[1] and span[0] < e:
                raise InvalidArgument(f"destination tensors {other!r} and {name!r} overlap in memory without "
                                      "being the same tensor; a patch cannot write both")
        spans.insert(at, span)
        return name


def _checked_target(tensors: Mapping[str, torch.Tensor], entry: Mapping[str, Any]) -> torch.Tensor:
    """The destination tensor a patch entry is for, refused unless it fits exactly."""
    name = entry["name"]
    target = tensors.get(name)
    if target is None:
        raise CorruptData(f"patch changes tensor {name!r}, which the destination does not have")
    dtype = torch_dtype(entry["dtype"], name)
    if target.dtype != dtype or target.numel() != entry["numel"]:
        raise CorruptData(
            f"patch is for {name!r} as {entry['numel']} elements of {entry['dtype']}, "
            f"the destination holds {target.numel()} of {dtype_name(target.dtype)}"
        )
    if not target.is_contiguous():
        raise InvalidArgument(f"destination tensor {name!r} is not contiguous; patches apply to stored bytes")
    return target


def _parsed_step(target: torch.Tensor, entry: Mapping[str, Any],
                 stream: memoryview) -> TileStream | ContextStreams | DecodedTensor:
    """A checked stream, parsed (huffman or sparse into a CPU tensor: decoded while applied) or decoded.

    A stream in a buffer that can change (a part still arriving, whose range a retried
    download writes again; a caller's bytearray) is copied first: the bytes hashed are then
    the bytes decoded, and the bytes a later ``revert`` decodes again."""
    if not isinstance(memoryview(stream).obj, bytes):
        stream = memoryview(bytes(stream))
    if xxhash.xxh3_64_hexdigest(stream) != entry["xxh3_64"]:
        raise CorruptData(f"patch stream for tensor {entry['name']!r} fails its xxh3-64 check: corrupted in storage or transit")
    if entry["mode"] in ("huffman", "sparse") and target.device.type == "cpu":
        return parse_tile_stream(entry, stream_array(stream), target.element_size())
    if entry["mode"] == "huffman" and target.device.type == "cuda" and device_decoder() is not None:
        return parse_tile_stream(entry, stream_array(stream), target.element_size())  # decoded on the device
    if entry["mode"] in ("context", "context_huffman") and target.device.type == "cpu":
        return parse_context_stream(entry, stream_array(stream))
    if entry["mode"] in ("context", "context_huffman"):  # decoded against the target's bits, copied off the GPU
        return decode_stream(entry, stream, unsigned_np(bits_view(target.detach()).cpu()))
    return decode_stream(entry, stream)


#: set to 1 to decode huffman streams into CUDA tensors on the device
DEVICE_DECODE_ENV = "WEFTBOARD_DEVICE_DECODE"


def device_decoder() -> ModuleType | None:
    """The device decoder of huffman streams where ``WEFTBOARD_DEVICE_DECODE=1`` and Triton
    imports, else None (a CUDA destination then gets CPU-decoded positions and differences,
    ``_apply_decoded``). Read at each call, so a host can switch it between patches."""
    if os.environ.get(DEVICE_DECODE_ENV, "0") != "1":
        return None
    return _triton_huffman()


@functools.cache
def _triton_huffman() -> ModuleType | None:
    try:
        from weftboard.cuda import triton_huffman  # optional dependency (triton)
    except ImportError:
        return None
    return triton_huffman


def _applied_patch(header: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> AppliedPatch:
    return AppliedPatch(
        changed={e["name"]: e["changed"] for e in entries},
        base_version=header["base_version"],
        target_version=header["target_version"],
        target_root=header["target_root"],
        encoding=header["encoding"],
    )


def _write_step(applied: AppliedPatch, target: torch.Tensor, entry: Mapping[str, Any],
                step: TileStream | ContextStreams | DecodedTensor) -> None:
    """Write one tensor's step and record how to undo it."""
    if isinstance(step, TileStream):
        # a TileStream for a CUDA tensor exists only where _parsed_step chose the device decoder
        apply = apply_tile_stream_ if target.device.type == "cpu" else _triton_huffman().apply_tile_stream_cuda_
        apply(target, entry, step, 1)
        applied._undo.append(functools.partial(apply, target, entry, step, -1))
    elif isinstance(step, ContextStreams):
        try:
            applied._undo.append(step.apply_(unsigned_np(bits_view(target))))
        except ValueError as exc:
            raise tile_stream_error(entry, str(exc)) from None
    else:
        target_, pos, old = _apply_decoded(target, step)
        applied._undo.append(functools.partial(scatter_bits_, target_, pos, old))


def _write_context_batch(applied: AppliedPatch, steps: Sequence[tuple[torch.Tensor, Mapping[str, Any],
                                                                    context_huffman.ContextHuffmanStream]]) -> None:
    """Write several tensors' ``context_huffman`` streams, one call per tile size among them (a
    patch may join parts coded with other tiles), and record how to undo each; on a damaged
    stream that call's writes are undone and ``CorruptData`` names it (the earlier calls' writes
    are recorded in ``applied`` by then, for its revert)."""
    by_tile: dict[int, list] = {}
    for step in steps:
        by_tile.setdefault(step[2].tile, []).append(step)
    for group in by_tile.values():
        try:
            undos = context_huffman.apply_batch_([s for *_, s in group], [unsigned_np(bits_view(t)) for t, *_ in group])
        except context_huffman.BadStream as exc:
            raise tile_stream_error(group[exc.index][1], str(exc)) from None
        applied._undo.extend(undos)


def _apply_decoded(target: torch.Tensor, dec: DecodedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tb = bits_view(target)
    view = tb.dtype
    if target.device.type == "cuda":
        triton_kernels = gpu_kernels()
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
