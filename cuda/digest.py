"""Digests of served bytes: one per tensor and one root over the manifest.

Invariants:
- ``tensor_digest`` hashes exactly the stored bytes of the tensor in C (row-major) order,
  whatever its dtype (bfloat16, float8, packed 4-bit as uint8, ...), and gives the same
  string for the same bytes on any device: GPU tensors are streamed to host memory in
  fixed chunks into an incremental hasher, which equals the one-shot hash.
- ``root_digest`` is a pure function of the ordered manifest entries. Its canonical
  encoding is the UTF-8 of the compact JSON array
  ``["weftboard-root-v1", [[name, dtype, [dims...], tensor_digest], ...]]``
  (``json.dumps(..., separators=(",", ":"), ensure_ascii=True)``), hashed with xxh3-128.
  JSON quoting makes the encoding unambiguous for any tensor name, so two different
  manifests can never share an encoding.
- Digests are written ``xxh3-128:<32 lowercase hex>`` (see ``weftboard.proto.domain``).

xxh3 runs at memory speed on one core, so hashing a whole checkpoint costs about one read
of it; there is no Python loop over elements anywhere.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
import xxhash

from weftboard.proto.domain import format_digest

_GPU_CHUNK_BYTES = 64 << 20  # two pinned buffers of this size overlap copy and hash


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The stored bytes of ``t`` as a flat uint8 tensor (a copy only if ``t`` is strided)."""
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-128 of the stored bytes of ``t`` in C order, as ``xxh3-128:<hex>``."""
    data = _byte_view(t.detach())
    if data.device.type == "cpu":
        return format_digest(xxhash.xxh3_128_digest(memoryview(data.numpy())))
    return format_digest(_device_digest(data))


def _device_digest(data: torch.Tensor) -> bytes:
    """Hash device bytes through two pinned host buffers: chunk i+1 copies while chunk i hashes."""
    hasher = xxhash.xxh3_128()
    n = data.numel()
    if n == 0:
        return hasher.digest()
    chunk = min(_GPU_CHUNK_BYTES, n)
    pin = data.device.type == "cuda"
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
    events = []
    starts = list(range(0, n, chunk))
    for i, s in enumerate(starts[:2]):
        e = min(s + chunk, n)
        bufs[i][: e - s].copy_(data[s:e], non_blocking=pin)
        events.append(_record(data.device))
    for i, s in enumerate(starts):
        e = min(s + chunk, n)
        if events[i] is not None:
            events[i].synchronize()
        hasher.update(memoryview(bufs[i % 2][: e - s].numpy()))
        nxt = i + 2
        if nxt < len(starts):
            ns = starts[nxt]
            ne = min(ns + chunk, n)
            bufs[nxt % 2][: ne - ns].copy_(data[ns:ne], non_blocking=pin)
            events.append(_record(data.device))
    return hasher.digest()


def _record(device: torch.device):
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def root_encoding(entries: Sequence[tuple[str, str, Sequence[int], str]]) -> bytes:
    """The canonical bytes that ``root_digest`` hashes (exposed so other languages can check it)."""
    body = [[str(name), str(dtype), [int(d) for d in shape], str(digest)] for name, dtype, shape, digest in entries]
    return json.dumps(["weftboard-root-v1", body], separators=(",", ":"), ensure_ascii=True).encode("ascii")


def root_digest(entries: Sequence[tuple[str, str, Sequence[int], str]]) -> str:
    """One digest over the manifest: (name, dtype name, shape, tensor digest) in layout order."""
    return format_digest(xxhash.xxh3_128_digest(root_encoding(entries)))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the dtype spelling used in manifests and patches."""
    return str(dtype).removeprefix("torch.")
