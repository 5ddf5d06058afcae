"""Checks of runs and version records at the RPC boundary, before anything touches Redis or
the blob store: the wire messages are converted (``proto.convert``) and checked by the
domain's rules (``proto.layout``, ``proto.records``).

Invariants:
- Malformed input (a field a caller wrote wrong) is INVALID_ARGUMENT and the message
  names the field; a well-formed record that does not fit the run (layout, a first
  version without an anchor) is FAILED_PRECONDITION, as board.proto documents.
- Blob keys must be the content-addressed key of their digest, so a record cannot name
  a blob of another run or an arbitrary object.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from weftboard.proto import convert
from weftboard.proto.errors import InvalidArgument
from weftboard.proto.layout import check_layout
from weftboard.proto.limits import MAX_TRAJECTORY_BATCH, MAX_TRAJECTORY_RECORD_BYTES
from weftboard.proto.model_files import check_model_files, model_files_difference
from weftboard.proto.names import check_name
from weftboard.proto.records import check_blob_ref as check_domain_blob_ref
from weftboard.proto.records import check_record as check_domain_record
from weftboard.proto.v1 import board_pb2 as pb

MAX_PAGE = 1000
# A Redis stream entry id: two unsigned 64-bit decimals (ASCII digits; the range is checked apart).
_STREAM_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")


def is_stream_id(value: str) -> bool:
    parts = _STREAM_ID.fullmatch(value)
    return parts is not None and all(int(p) < 1 << 64 for p in parts.groups())


def page_size(value: int) -> int:
    """A List call's page size: 0 means 100, more than ``MAX_PAGE`` is refused."""
    if value > MAX_PAGE:
        raise InvalidArgument(f"page_size {value} is too large; at most {MAX_PAGE} (0 means 100)")
    return value or 100


def check_run(run: pb.Run) -> None:
    """A run a publisher asks to create: a name, a kind, a served format, a layout and its
    model files, if any (``proto.model_files``)."""
    check_name("run.run", run.run)
    if run.kind == pb.RUN_KIND_UNSPECIFIED:
        raise InvalidArgument("run.kind must be RUN_KIND_WEIGHTS or RUN_KIND_LORA_ADAPTER")
    check_layout(convert.layout_from_pb(run))
    check_model_files(run.run, convert.model_files_from_pb(run))


def same_definition(a: pb.Run, b: pb.Run) -> bool:
    """Whether two runs fix the same kind, served format and layout (CreateRun idempotence)."""
    return a.kind == b.kind and a.served_format == b.served_format and a.layout == b.layout


def model_files_changed(stored: pb.Run, asked: pb.Run) -> str:
    """How the model files of a CreateRun differ from the existing run's, "" when the same."""
    return model_files_difference(convert.model_files_from_pb(stored), convert.model_files_from_pb(asked))


def check_record(record: pb.VersionRecord, run: pb.Run) -> None:
    """A record a publisher commits: well formed, and matching its run's layout."""
    check_domain_record(convert.record_from_pb(record), run.run, convert.layout_from_pb(run))


def check_blob_ref(where: str, run: str, blob: pb.BlobRef) -> None:
    """A blob reference names a well-formed digest and the content-addressed key of ``run``."""
    check_domain_blob_ref(where, run, convert.blob_from_pb(blob))


def check_trajectories(records: Sequence[pb.TrajectoryRecord]) -> str:
    """The run of a non-empty batch of trajectory records, each of that run, named well and
    within ``MAX_TRAJECTORY_RECORD_BYTES``; INVALID_ARGUMENT naming the first that is not."""
    if len(records) > MAX_TRAJECTORY_BATCH:
        raise InvalidArgument(f"{len(records)} records in one call; at most {MAX_TRAJECTORY_BATCH}")
    run = records[0].run
    check_name("records[0].run", run)
    islands: set[str] = set()
    for i, rec in enumerate(records):
        if rec.run != run:
            raise InvalidArgument(f"records[{i}].run is {rec.run!r}; every record of one call must be of run {run!r}")
        size = rec.ByteSize()
        if size > MAX_TRAJECTORY_RECORD_BYTES:
            raise InvalidArgument(f"records[{i}] is {size} bytes serialized; at most {MAX_TRAJECTORY_RECORD_BYTES} "
                                  "(labels are metadata: point at large data with replay_ref)")
        islands.add(rec.island_id)
    for island in islands:
        check_name("records[].island_id", island)
    return run
