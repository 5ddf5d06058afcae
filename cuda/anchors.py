"""Anchors: full served checkpoints in Hugging Face safetensors layout, written by streaming.

Invariants:
- An anchor is an ordinary safetensors checkpoint: ``model.safetensors``, or above the
  shard size ``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``;
  ``safetensors.torch.load_file`` loads every shard.
- Writing never materialises a second copy of the view: each tensor's raw bytes are
  written straight from its storage (a CPU copy of one chunk at a time for GPU tensors),
  and the file's xxh3-128 digest is computed on the same bytes as they are written, so
  the digest always names exactly the bytes on disk.
- Inside a file, tensors are ordered by element size (widest first) then layout order,
  and the header is padded to 8 bytes, so every tensor's data offset is aligned to its
  element size: readers can map tensors in place (``map_safetensors``).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from weftboard.proto.domain import format_digest
from weftboard.proto.errors import CorruptData

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 1024**3
_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class WrittenFile:
    name: str  # file name inside the checkpoint
    path: Path
    digest: str  # xxh3-128 of the file's bytes
    size: int


def _raw_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's stored bytes as a flat uint8 tensor (no copy for contiguous tensors)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _write_tensor(f, h: xxhash.xxh3_128, t: torch.Tensor) -> None:
    raw = _raw_bytes_view(t)
    n = raw.numel()
    for start in range(0, n, _CHUNK):
        part = raw[start : start + _CHUNK]
        if part.device.type != "cpu":
            part = part.cpu()
        mv = memoryview(part.numpy())
        h.update(mv)
        f.write(mv)


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def plan_shards(tensors: Sequence[tuple[str, torch.Tensor]], shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Greedy split in layout order; a tensor larger than a shard gets its own shard."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    return shards


def write_safetensors(path: Path, tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None = None) -> WrittenFile:
    """Write one safetensors file by streaming each tensor's bytes; fsync before returning."""
    ordered = sorted(enumerate(tensors), key=lambda it: (-it[1][1].element_size(), it[0]))
    header: dict[str, object] = {}
    offset = 0
    for _, (name, t) in ordered:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    h = xxhash.xxh3_128()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        prefix = struct.pack("<Q", len(blob)) + blob
        h.update(prefix)
        f.write(prefix)
        for _, (_, t) in ordered:
            _write_tensor(f, h, t)
        f.flush()
        os.fsync(f.fileno())
    return WrittenFile(path.name, path, format_digest(h.digest()), 8 + len(blob) + offset)


def write_checkpoint(
    directory: Path,
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
) -> list[WrittenFile]:
    """Write an HF-layout checkpoint under ``directory``; returns the shards (not the index)."""
    shards = plan_shards(tensors, shard_bytes)
    names = shard_names(len(shards))
    written = [write_safetensors(directory / n, part, metadata) for n, part in zip(names, shards, strict=True)]
    if len(shards) > 1:
        write_index(directory, [(n, [name for name, _ in part]) for n, part in zip(names, shards, strict=True)],
                    total_size=sum(t.numel() * t.element_size() for _, t in tensors))
    return written


def write_index(directory: Path, files: Sequence[tuple[str, Sequence[str]]], total_size: int) -> Path:
    weight_map = {tensor: fname for fname, names in files for tensor in names}
    path = directory / INDEX_NAME
    path.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))
    return path


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes, streamed (blocking: call through asyncio.to_thread)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return format_digest(h.digest())


def read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """(data start offset, header entries without __metadata__); CorruptData on a bad file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CorruptData(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 1024 * 1024:
                raise CorruptData(f"{path}: safetensors header length {n} is implausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise CorruptData(f"{path}: unreadable safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    return 8 + n, header


def map_safetensors(path: Path, *, writable: bool) -> tuple[dict[str, torch.Tensor], mmap.mmap]:
    """Tensors of a safetensors file mapped in place (writes go to the file when writable).

    The caller keeps the returned mmap alive while it uses the tensors and closes it after.
    """
    start, header = read_header(path)
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    finally:
        os.close(fd)
    if writable:
        base = torch.frombuffer(mm, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we never write through it
            base = torch.frombuffer(mm, dtype=torch.uint8)
    return tensors_in_buffer(path, base, start, header), mm


def load_safetensors_buffer(path: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Read a whole safetensors file into one (writable, aligned) buffer; tensors are views of it."""
    start, header = read_header(path)
    size = os.path.getsize(path)
    base = torch.empty(size, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        view = memoryview(base.numpy())
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise CorruptData(f"{path}: file shrank while reading ({got} of {size} bytes)")
            got += n
    return tensors_in_buffer(path, base, start, header), base


def tensors_in_buffer(path: Path, base: torch.Tensor, start: int, header: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Typed views of each tensor of a safetensors file held in the uint8 tensor ``base``."""
    size = base.numel()
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        dtype = TORCH_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CorruptData(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        a, b = info["data_offsets"]
        if not (0 <= a <= b <= size - start):
            raise CorruptData(f"{path}: tensor {name!r} data offsets {a}..{b} outside the file")
        raw = base[start + a : start + b]
        item = torch.empty((), dtype=dtype).element_size()
        if (start + a) % item:
            raise CorruptData(f"{path}: tensor {name!r} is not aligned to its element size")
        out[name] = raw.view(dtype).reshape(info["shape"])
    return out


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of an HF checkpoint directory, in shard order."""
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / n for n in sorted(set(weight_map.values()))]
    single = directory / SINGLE_NAME
    return [single] if single.exists() else sorted(directory.glob("*.safetensors"))
