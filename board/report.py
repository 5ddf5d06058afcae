"""What the board's read commands print: rich tables for people, JSON documents for programs.

``history``, ``status``, ``fleet`` and ``gc`` print a table by default and, with ``--json``,
one JSON document built here. The documents' keys (README "Using it"):

- ``history_document``: ``{"run", "versions": [version record, ...]}``
- ``runs_document``: ``{"runs": [run, ...]}`` (a run's ``layout`` becomes ``tensors``, its count)
- ``fleet_document``: ``{"run", "head", "committed_at_ms", "oldest_available", "islands": [...]}``,
  each island ``{"island_id", "region", "version", "lag", "state", "capacity", "message",
  "last_seen_ms", "lease_expires_at_ms"}``
- ``gc_document``: ``{"run", "dry_run", "deleted_keys", "deleted_blobs", "freed_bytes",
  "oldest_available", "staged_parts_collected", "abandoned_blobs_collected"}``

Invariants:
- A message in a document is ``plain(message)``: every field of the proto under its proto
  name, unset ones with their default (an unset ``optional`` scalar is null), 64-bit
  integers as JSON numbers (not protobuf-JSON strings), enums as their name without the
  enum's prefix in lower case (``ARTIFACT_KIND_PATCH`` is ``"patch"``), bytes as hex.
- Tables and documents are built from the same responses; nothing here calls the board.
"""

from __future__ import annotations

import re
import time
from collections.abc import MutableMapping, MutableSequence
from datetime import datetime, timezone
from typing import Any

from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from rich import box
from rich.table import Table

from weftboard.proto.v1 import board_pb2 as pb

# ---------------------------------------------------------------------------
# JSON documents
# ---------------------------------------------------------------------------


def enum_name(enum: EnumDescriptor, number: int) -> str | int:
    """``ISLAND_STATE_CATCHING_UP`` of ``IslandState`` as ``"catching_up"``; an unknown number as itself."""
    value = enum.values_by_number.get(number)
    if value is None:
        return number
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
    return value.name.removeprefix(prefix).lower()


def _value(field: FieldDescriptor, value: Any) -> Any:
    if isinstance(value, Message):
        return plain(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return enum_name(field.enum_type, value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def plain(message: Message) -> dict[str, Any]:
    """A protobuf message as plain JSON values (see the module's invariants)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if isinstance(value, MutableMapping):
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {key: _value(value_field, item) for key, item in value.items()}
        elif isinstance(value, MutableSequence):
            out[field.name] = [_value(field, item) for item in value]
        elif field.message_type is None and field.has_presence and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _value(field, value)
    return out


def history_document(run: str, records: list[pb.VersionRecord]) -> dict[str, Any]:
    return {"run": run, "versions": [plain(record) for record in records]}


def runs_document(runs: list[pb.Run]) -> dict[str, Any]:
    docs = []
    for run in runs:
        doc = plain(run)
        doc.pop("layout", None)
        doc["tensors"] = len(run.layout.tensors)
        docs.append(doc)
    return {"runs": docs}


def island_document(info: pb.IslandInfo) -> dict[str, Any]:
    s = info.status
    return {
        "island_id": s.island_id, "region": s.region, "version": s.version, "lag": info.lag,
        "state": enum_name(pb.IslandState.DESCRIPTOR, s.state), "capacity": s.capacity, "message": s.message,
        "last_seen_ms": info.last_seen_ms, "lease_expires_at_ms": info.lease_expires_at_ms,
    }


def fleet_document(run: str, head: pb.Head, islands: pb.ListIslandsResponse) -> dict[str, Any]:
    return {
        "run": run, "head": head.version, "committed_at_ms": head.committed_at_ms,
        "oldest_available": head.oldest_available,
        "islands": [island_document(info) for info in sorted(islands.islands, key=lambda i: i.status.island_id)],
    }


def gc_document(run: str, dry_run: bool, response: pb.CollectGarbageResponse) -> dict[str, Any]:
    return {
        "run": run, "dry_run": dry_run, "deleted_keys": list(response.deleted_keys),
        "deleted_blobs": len(response.deleted_keys), "freed_bytes": response.freed_bytes,
        "oldest_available": response.oldest_available,
        "staged_parts_collected": response.staged_parts_collected,
        "abandoned_blobs_collected": response.abandoned_blobs_collected,
    }


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    if n <= 0:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def when(ms: int, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    if ms <= 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime(fmt)


def _table(title: str, columns: tuple[tuple[str, str], ...]) -> Table:
    """A compact table: light borders, cells never wrapped (numbers stay readable)."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    return table


def ago(ms: int, now_ms: int | None = None) -> str:
    if ms <= 0:
        return "-"
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    seconds = (now_ms - ms) / 1000
    if seconds < 0:
        return f"in {-seconds:.0f}s"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def coder_summary(stats: Any) -> str:
    """How many changed tensors each patch coder carried, most used first ("huffman 51, bitmap 3")."""
    counts: dict[str, int] = {}
    for tensor in stats.tensors:
        if tensor.coder:
            counts[tensor.coder] = counts.get(tensor.coder, 0) + 1
    return ", ".join(f"{coder} {n}" for coder, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def version_row(record: Any) -> list[str]:
    """One history table row: version, step, parent, artifacts, bytes, density, coders, committed."""
    kinds = []
    patch_bytes = record.stats.patch_bytes
    anchor_bytes = record.stats.anchor_bytes
    for artifact in record.artifacts:
        size = sum(b.size for b in artifact.blobs)
        if artifact.kind == pb.ARTIFACT_KIND_PATCH:
            kinds.append("patch")
            patch_bytes = patch_bytes or size
        elif artifact.kind == pb.ARTIFACT_KIND_ANCHOR:
            kinds.append(f"anchor({len(artifact.blobs)})" if len(artifact.blobs) > 1 else "anchor")
            anchor_bytes = anchor_bytes or size
    stats = record.stats
    density = f"{stats.density * 100:.3f}%" if stats.total_elements else "-"
    return [
        str(record.version),
        str(record.step),
        str(record.parent) if record.parent else "-",
        "+".join(kinds) or "-",
        human_bytes(patch_bytes),
        human_bytes(anchor_bytes),
        density,
        f"{stats.changed_elements:,}" if stats.total_elements else "-",
        coder_summary(stats),
        when(record.committed_at_ms, "%m-%d %H:%M:%S"),
    ]


def history_table(run: str, records: list[Any]) -> Table:
    table = _table(f"history of {run}", (
        ("version", "right"), ("step", "right"), ("parent", "right"), ("artifacts", "left"),
        ("patch", "right"), ("anchor", "right"), ("density", "right"), ("changed", "right"),
        ("coders", "left"), ("committed UTC", "left"),
    ))
    for record in records:
        table.add_row(*version_row(record))
    return table


def islands_table(run: str, response: Any, now_ms: int | None = None) -> Table:
    table = _table(f"fleet of {run} (head {response.head})", (
        ("island", "left"), ("region", "left"), ("version", "right"), ("lag", "right"), ("state", "left"),
        ("capacity", "right"), ("last seen", "right"), ("lease", "right"), ("message", "left"),
    ))
    for info in sorted(response.islands, key=lambda i: (-i.lag, i.status.island_id)):
        s = info.status
        state = pb.IslandState.Name(s.state).removeprefix("ISLAND_STATE_").lower()
        style = {"ready": "green", "expired": "dim", "error": "red"}.get(state, "yellow")
        table.add_row(
            s.island_id, s.region or "-", str(s.version) if s.version else "-", str(info.lag),
            f"[{style}]{state}[/{style}]", str(s.capacity), ago(info.last_seen_ms, now_ms),
            ago(info.lease_expires_at_ms, now_ms), s.message or "",
        )
    return table


def runs_table(runs: list[Any]) -> Table:
    table = _table("runs", (
        ("run", "left"), ("kind", "left"), ("format", "left"), ("tensors", "right"), ("head", "right"),
        ("oldest", "right"), ("created UTC", "left"),
    ))
    for run in runs:
        table.add_row(
            run.run,
            pb.RunKind.Name(run.kind).removeprefix("RUN_KIND_").lower(),
            pb.FormatKind.Name(run.served_format.kind).removeprefix("FORMAT_KIND_").lower(),
            str(len(run.layout.tensors)),
            str(run.head),
            str(run.oldest_available or "-"),
            when(run.created_at_ms),
        )
    return table
