"""Pure checks of runs and version records, before anything touches Redis or the blob store.

Invariants:
- Malformed input (a field a caller wrote wrong) is INVALID_ARGUMENT and the message
  names the field; a well-formed record that does not fit the run (layout, a first
  version without an anchor) is FAILED_PRECONDITION, as board.proto documents.
- Blob keys must be the content-addressed key of their digest, so a record cannot name
  a blob of another run or an arbitrary object.
"""

from __future__ import annotations

import math
import re

from weftboard.proto.domain import blob_key, check_digest, check_name
from weftboard.proto.errors import FailedPrecondition, InvalidArgument
from weftboard.proto.v1 import board_pb2 as pb

_DTYPE = re.compile(r"[a-z][a-z0-9_]*")  # fullmatch: no trailing newline


def check_run(run: pb.Run) -> None:
    """A run a publisher asks to create: a name, a kind, a served format and a layout."""
    check_name("run.run", run.run)
    if run.kind == pb.RUN_KIND_UNSPECIFIED:
        raise InvalidArgument("run.kind must be RUN_KIND_WEIGHTS or RUN_KIND_LORA_ADAPTER")
    if run.served_format.kind == pb.FORMAT_KIND_UNSPECIFIED:
        raise InvalidArgument("run.served_format.kind must be set (e.g. FORMAT_KIND_BF16)")
    if not run.layout.tensors:
        raise InvalidArgument("run.layout.tensors is empty; a run fixes its tensor layout")
    seen: set[str] = set()
    for i, spec in enumerate(run.layout.tensors):
        if not spec.name:
            raise InvalidArgument(f"run.layout.tensors[{i}].name is empty")
        if spec.name in seen:
            raise InvalidArgument(f"run.layout.tensors[{i}].name {spec.name!r} appears twice")
        seen.add(spec.name)
        if not _DTYPE.fullmatch(spec.dtype):
            raise InvalidArgument(
                f"run.layout.tensors[{i}].dtype {spec.dtype!r} is not a torch dtype name (e.g. 'bfloat16')"
            )
        if any(d < 0 for d in spec.shape):
            raise InvalidArgument(f"run.layout.tensors[{i}].shape {list(spec.shape)} has a negative dimension")


def same_definition(a: pb.Run, b: pb.Run) -> bool:
    """Whether two runs fix the same kind, served format and layout (CreateRun idempotence)."""
    return a.kind == b.kind and a.served_format == b.served_format and a.layout == b.layout


def check_record(record: pb.VersionRecord, run: pb.Run) -> None:
    """A record a publisher commits: well formed, and matching its run's layout."""
    n = record.version
    if n < 1:
        raise InvalidArgument("record.version must be >= 1")
    if record.parent != n - 1:
        raise InvalidArgument(f"record.parent is {record.parent}; version {n} must name parent {n - 1}")
    check_digest("record.root_digest", record.root_digest)
    for i, td in enumerate(record.tensor_digests):
        check_digest(f"record.tensor_digests[{i}].digest ({td.name})", td.digest)
    _check_artifacts(record)
    _check_layout(record, run)


def _check_artifacts(record: pb.VersionRecord) -> None:
    n = record.version
    if not record.artifacts:
        raise InvalidArgument("record.artifacts is empty; a version needs a PATCH from its parent or an ANCHOR")
    kinds = [a.kind for a in record.artifacts]
    for i, artifact in enumerate(record.artifacts):
        where = f"record.artifacts[{i}]"
        if artifact.kind == pb.ARTIFACT_KIND_PATCH:
            if n == 1:
                raise InvalidArgument(f"{where}: version 1 has no parent to patch; give an ANCHOR only")
            if artifact.base_version != n - 1:
                raise InvalidArgument(
                    f"{where}.base_version is {artifact.base_version}; a patch of {n} applies to {n - 1}"
                )
            if not artifact.blobs:
                raise InvalidArgument(f"{where}: a PATCH needs at least one part blob")
            if len({b.digest for b in artifact.blobs}) != len(artifact.blobs):
                raise InvalidArgument(f"{where}: a PATCH names the same part twice")
        elif artifact.kind == pb.ARTIFACT_KIND_ANCHOR:
            if artifact.base_version != 0:
                raise InvalidArgument(f"{where}.base_version must be 0 for an ANCHOR")
            if not artifact.blobs:
                raise InvalidArgument(f"{where}: an ANCHOR needs at least one shard blob")
        else:
            raise InvalidArgument(f"{where}.kind must be ARTIFACT_KIND_PATCH or ARTIFACT_KIND_ANCHOR")
        for j, blob in enumerate(artifact.blobs):
            check_blob_ref(f"{where}.blobs[{j}]", record.run, blob)
    if kinds.count(pb.ARTIFACT_KIND_PATCH) > 1 or kinds.count(pb.ARTIFACT_KIND_ANCHOR) > 1:
        raise InvalidArgument("record.artifacts holds at most one PATCH and one ANCHOR")
    if n == 1 and pb.ARTIFACT_KIND_ANCHOR not in kinds:
        raise FailedPrecondition("the run has no version yet: version 1 must carry an ANCHOR artifact")


def check_blob_ref(where: str, run: str, blob: pb.BlobRef) -> None:
    """A blob reference names a well-formed digest and the content-addressed key of ``run``."""
    check_digest(f"{where}.digest", blob.digest)
    expected = blob_key(run, blob.digest)
    if blob.key != expected:
        raise InvalidArgument(f"{where}.key is {blob.key!r}; the content-addressed key is {expected!r}")


def _check_layout(record: pb.VersionRecord, run: pb.Run) -> None:
    want = [t.name for t in run.layout.tensors]
    got = [t.name for t in record.tensor_digests]
    if got != want:
        missing = [x for x in want if x not in set(got)]
        extra = [x for x in got if x not in set(want)]
        detail = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra else "out of order"
        raise FailedPrecondition(
            f"record.tensor_digests do not match the layout of run {run.run!r} "
            f"({len(got)} vs {len(want)} tensors; {detail})"
        )
    numel = {t.name: math.prod(t.shape) for t in run.layout.tensors}
    for ts in record.stats.tensors:
        if ts.name not in numel:
            raise FailedPrecondition(f"record.stats.tensors names {ts.name!r}, which is not in the run's layout")
        if ts.numel and ts.numel != numel[ts.name]:
            raise FailedPrecondition(
                f"record.stats for {ts.name!r} says numel {ts.numel}; the layout's shape has {numel[ts.name]}"
            )
