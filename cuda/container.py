"""The patch container: safetensors framing, the JSON patch header with its tensor entries,
reading and validating it, writing it, and joining parts (specified in ``cuda/FORMAT.md``).

Invariants: ``read_container`` checks everything the header says (hash, fields, modes against
encoding and version, stream offsets) before any stream is read; only ``READ_VERSIONS`` decode.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from weftboard.cuda import context_codec
from weftboard.proto.errors import CorruptData, InvalidArgument

FORMAT = "weftboard-patch"
FORMAT_VERSION = 4  # 2 added the ``huffman`` mode, 3 the ``context_huffman`` mode, 4 its empty pieces
READ_VERSIONS = (1, 2, 3, 4)  # each version's patches are valid patches of the next
# A writer stamps the lowest version that holds its modes (``format_version_for``), so a patch
# without ``context_huffman`` streams stays readable by a version 2 island.
ENCODINGS = ("default", "baseline", "context", "compact")
CODEC_TILE = 1 << 16  # elements per independent stream: ~650 changes per tile at 1% density,
# so per-tile overhead (directory, rANS flush, Rice padding: ~12 bytes) stays near 1%, while a
# 7B model still has ~100k tiles to spread over CPU threads or GPU blocks.
_MODES = ("empty", "huffman", "sparse", "bitmap", "all", "baseline", "context", "context_huffman")
_MAX_HEADER = 256 << 20
NP_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


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
# writing
# ---------------------------------------------------------------------------


def write_container(header: dict[str, Any], streams: Sequence[tuple[str, bytes | np.ndarray]]) -> bytes:
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
    value = obj.get(key) if isinstance(obj, (dict, Mapping)) else None
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


def torch_dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptData(f"patch header: {where} has unknown dtype {name!r}")
    if dtype.itemsize not in (1, 2, 4, 8):  # the element widths the streams code
        raise CorruptData(f"patch header: {where} has dtype {name!r} of {dtype.itemsize} bytes an element; "
                          "patches hold elements of 1, 2, 4 or 8 bytes")
    return dtype


@dataclass
class _Container:
    header: dict[str, Any]
    entries: list[dict[str, Any]]
    streams: dict[str, memoryview]


def header_length(first8: bytes | memoryview, total: int) -> int:
    """The safetensors header's length from the container's first 8 bytes (of ``total``)."""
    if total < 8:
        raise CorruptData(f"patch is {total} bytes: too short to hold the safetensors header length")
    (hlen,) = struct.unpack("<Q", first8[:8])
    if hlen > _MAX_HEADER or 8 + hlen > total:
        raise CorruptData(f"patch header claims {hlen} bytes but the patch has {total - 8} after the length: truncated or not a patch")
    return hlen


def parse_container_header(header_bytes: bytes | memoryview, total: int) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, tuple[int, int]]]:
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
    base, target = (_field(header, key, int, "patch") for key in ("base_version", "target_version"))
    if not 0 <= base < target < 1 << 63:
        raise CorruptData(f"patch header: base_version {base} and target_version {target} are not "
                          "0 <= base < target < 2**63")
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
        torch_dtype(dtype, where)
        if numel < 0 or not 0 <= changed <= numel:
            raise CorruptData(f"patch header: {where} has {changed} changes of {numel} elements")
        if (mode not in _MODES or (mode == "baseline") != (encoding == "baseline" and changed > 0)
                or (mode == "huffman" and version < 2) or (mode == "context_huffman" and version < 3)):
            raise CorruptData(f"patch header: {where} has mode {mode!r}, not valid for encoding {encoding!r}")
        if (mode == "empty") != (changed == 0):
            raise CorruptData(f"patch header: {where} has mode {mode!r} with {changed} changes")
        if mode == "context" and (encoding != "context" or not context_codec.supports(torch_dtype(entry["dtype"], where))):
            raise CorruptData(f"patch header: {where} has mode 'context', not valid for encoding {encoding!r} "
                              f"and dtype {entry['dtype']}")
        if mode == "context_huffman" and (encoding != "compact"
                                          or not context_codec.supports(torch_dtype(entry["dtype"], where))):
            raise CorruptData(f"patch header: {where} has mode 'context_huffman', not valid for encoding "
                              f"{encoding!r} and dtype {entry['dtype']}")
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


def read_container(data: bytes | bytearray | memoryview) -> _Container:
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    hlen = header_length(view, len(view))
    header, entries, spans = parse_container_header(view[8 : 8 + hlen], len(view))
    return _Container(header=header, entries=entries, streams={n: view[a:b] for n, (a, b) in spans.items()})


def read_patch_info(data: bytes | bytearray | memoryview) -> PatchInfo:
    """The patch header (validated), without decoding any stream."""
    c = read_container(data)
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


def format_version_for(modes: Iterable[str]) -> int:
    """The lowest format version whose readers know every one of ``modes`` as this build writes
    them (``context_huffman`` streams may hold version 4's empty pieces)."""
    return FORMAT_VERSION if "context_huffman" in set(modes) else 2


def check_same_transition(base_version: int, target_version: int, header: Mapping[str, Any]) -> None:
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
    containers = [read_container(p) for p in parts]
    first = containers[0].header
    header = {k: first[k] for k in ("format", "format_version", "encoding", "base_version", "target_version")}
    header["format_version"] = max(c.header["format_version"] for c in containers)
    header["target_root"] = next((c.header["target_root"] for c in containers if c.header["target_root"]), "")
    seen: set[str] = set()
    entries: list[dict[str, Any]] = []
    streams: list[tuple[str, bytes]] = []
    for c in containers:
        check_same_transition(first["base_version"], first["target_version"], c.header)
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
    return write_container(header, streams)
