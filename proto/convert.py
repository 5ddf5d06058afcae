"""Protobuf <-> domain: the one place the wire messages (``proto/v1``) meet the domain types.

Used at the RPC boundary only (the board's handlers and validation); the domain modules
never see a protobuf message. Enum values the domain does not know (a newer client's) map
to a name that no check accepts, never to an exception here: the checks name the field.
"""

from __future__ import annotations

from weftboard.proto.layout import Layout, ServedFormat, TensorSpec
from weftboard.proto.plans import StepKind
from weftboard.proto.records import (
    Artifact,
    ArtifactKind,
    BlobRef,
    TensorDigest,
    TensorStats,
    VersionRecord,
)
from weftboard.proto.v1 import board_pb2 as pb

_ARTIFACT_KIND = {pb.ARTIFACT_KIND_PATCH: ArtifactKind.PATCH, pb.ARTIFACT_KIND_ANCHOR: ArtifactKind.ANCHOR}
_STEP_ARTIFACT = {StepKind.PATCH: pb.ARTIFACT_KIND_PATCH, StepKind.ANCHOR: pb.ARTIFACT_KIND_ANCHOR}


def _enum_name(enum, value: int, prefix: str) -> str:
    """``FORMAT_KIND_BF16`` -> "bf16"; "" for 0 (unset); "unknown(<n>)" for a value not in ``enum``."""
    if value == 0:
        return ""
    known = enum.DESCRIPTOR.values_by_number.get(value)
    return known.name.removeprefix(prefix).lower() if known is not None else f"unknown({value})"


def layout_from_pb(run: pb.Run) -> Layout:
    fmt = run.served_format
    return Layout(
        tensors=tuple(TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in run.layout.tensors),
        served_format=ServedFormat(
            kind=_enum_name(pb.FormatKind, fmt.kind, "FORMAT_KIND_"),
            scale_granularity=_enum_name(pb.ScaleGranularity, fmt.scale_granularity, "SCALE_GRANULARITY_"),
            scale_policy=_enum_name(pb.ScalePolicy, fmt.scale_policy, "SCALE_POLICY_"),
            keep_bf16_patterns=tuple(fmt.keep_bf16_patterns),
        ),
    )


def blob_from_pb(blob: pb.BlobRef) -> BlobRef:
    return BlobRef(blob.key, blob.digest, blob.size, blob.url, blob.name)


def model_files_from_pb(run: pb.Run) -> tuple[BlobRef, ...]:
    """A run's model files (``proto.model_files``) as domain blob references."""
    return tuple(blob_from_pb(f) for f in run.model_files)


def artifact_from_pb(artifact: pb.Artifact) -> Artifact:
    return Artifact(
        _ARTIFACT_KIND.get(artifact.kind, ArtifactKind.UNSPECIFIED),
        artifact.base_version,
        tuple(blob_from_pb(b) for b in artifact.blobs),
    )


def record_from_pb(record: pb.VersionRecord) -> VersionRecord:
    return VersionRecord(
        run=record.run,
        version=record.version,
        parent=record.parent,
        root_digest=record.root_digest,
        artifacts=tuple(artifact_from_pb(a) for a in record.artifacts),
        tensor_digests=tuple(TensorDigest(t.name, t.digest) for t in record.tensor_digests),
        tensor_stats=tuple(TensorStats(t.name, t.changed, t.numel) for t in record.stats.tensors),
    )


def step_artifact_kind(kind: StepKind) -> int:
    """The ``ArtifactKind`` wire value of a plan step's kind."""
    return _STEP_ARTIFACT[kind]
