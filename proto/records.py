"""Version records and their artifacts: what a publisher commits for version n of a run.

Invariants (``check_record``):
- Version n names parent n - 1, every tensor of the run's layout in layout order, and a
  root digest; it carries at most one PATCH (applying to n - 1, one or more distinct parts)
  and at most one ANCHOR (base 0, one or more shards). Version 1 carries an ANCHOR.
- Every blob is named by the content-addressed key of its digest in its run, so a record
  cannot name a blob of another run or an arbitrary object.
- Malformed input is INVALID_ARGUMENT naming the field; a well-formed record that does not
  fit its run (layout, a first version without an anchor) is FAILED_PRECONDITION.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from weftboard.proto.errors import FailedPrecondition, InvalidArgument
from weftboard.proto.layout import Layout
from weftboard.proto.names import blob_key, check_digest
from weftboard.proto.plans import VersionArtifacts


class ArtifactKind(str, Enum):
    UNSPECIFIED = "unspecified"
    PATCH = "patch"
    ANCHOR = "anchor"


@dataclass(frozen=True)
class BlobRef:
    key: str
    digest: str
    size: int
    url: str = ""  # a presigned GET URL when one was asked for
    name: str = ""  # file name inside an anchor checkpoint; "" for patch parts


@dataclass(frozen=True)
class Artifact:
    kind: ArtifactKind
    base_version: int  # PATCH: the version it applies to (n - 1); ANCHOR: 0
    blobs: tuple[BlobRef, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.blobs)


@dataclass(frozen=True)
class TensorDigest:
    name: str
    digest: str


@dataclass(frozen=True)
class TensorStats:
    name: str
    changed: int
    numel: int


@dataclass(frozen=True)
class VersionRecord:
    """The parts of a record the board checks and plans with (stats beyond per-tensor numel,
    labels and clocks stay in the wire message)."""

    run: str
    version: int
    parent: int
    root_digest: str
    artifacts: tuple[Artifact, ...]
    tensor_digests: tuple[TensorDigest, ...] = ()
    tensor_stats: tuple[TensorStats, ...] = ()

    def blobs(self) -> list[BlobRef]:
        return [b for a in self.artifacts for b in a.blobs]

    def sizes(self) -> VersionArtifacts:
        """The planner's view: the byte sizes of this version's patch and anchor, if any."""
        patch = anchor = None
        for a in self.artifacts:
            if a.kind is ArtifactKind.PATCH:
                patch = a.nbytes
            else:
                anchor = a.nbytes
        return VersionArtifacts(self.version, patch, anchor)


def check_blob_ref(where: str, run: str, blob: BlobRef) -> None:
    """A blob reference names a well-formed digest and the content-addressed key of ``run``."""
    check_digest(f"{where}.digest", blob.digest)
    expected = blob_key(run, blob.digest)
    if blob.key != expected:
        raise InvalidArgument(f"{where}.key is {blob.key!r}; the content-addressed key is {expected!r}")


def check_record(record: VersionRecord, run: str, layout: Layout) -> None:
    """A record a publisher commits: well formed, and matching the layout of ``run``."""
    n = record.version
    if n < 1:
        raise InvalidArgument("record.version must be >= 1")
    if record.parent != n - 1:
        raise InvalidArgument(f"record.parent is {record.parent}; version {n} must name parent {n - 1}")
    check_digest("record.root_digest", record.root_digest)
    for i, td in enumerate(record.tensor_digests):
        check_digest(f"record.tensor_digests[{i}].digest ({td.name})", td.digest)
    check_artifacts(record)
    check_fits_layout(record, run, layout)


def check_artifacts(record: VersionRecord) -> None:
    n = record.version
    if not record.artifacts:
        raise InvalidArgument("record.artifacts is empty; a version needs a PATCH from its parent or an ANCHOR")
    kinds = [a.kind for a in record.artifacts]
    for i, artifact in enumerate(record.artifacts):
        where = f"record.artifacts[{i}]"
        if artifact.kind is ArtifactKind.PATCH:
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
        elif artifact.kind is ArtifactKind.ANCHOR:
            if artifact.base_version != 0:
                raise InvalidArgument(f"{where}.base_version must be 0 for an ANCHOR")
            if not artifact.blobs:
                raise InvalidArgument(f"{where}: an ANCHOR needs at least one shard blob")
        else:
            raise InvalidArgument(f"{where}.kind must be ARTIFACT_KIND_PATCH or ARTIFACT_KIND_ANCHOR")
        for j, blob in enumerate(artifact.blobs):
            check_blob_ref(f"{where}.blobs[{j}]", record.run, blob)
    if kinds.count(ArtifactKind.PATCH) > 1 or kinds.count(ArtifactKind.ANCHOR) > 1:
        raise InvalidArgument("record.artifacts holds at most one PATCH and one ANCHOR")
    if n == 1 and ArtifactKind.ANCHOR not in kinds:
        raise FailedPrecondition("the run has no version yet: version 1 must carry an ANCHOR artifact")


def check_fits_layout(record: VersionRecord, run: str, layout: Layout) -> None:
    want = list(layout.names)
    got = [t.name for t in record.tensor_digests]
    if got != want:
        missing = [x for x in want if x not in set(got)]
        extra = [x for x in got if x not in set(want)]
        detail = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra else "out of order"
        raise FailedPrecondition(
            f"record.tensor_digests do not match the layout of run {run!r} "
            f"({len(got)} vs {len(want)} tensors; {detail})"
        )
    numel = {t.name: t.numel for t in layout.tensors}
    for ts in record.tensor_stats:
        if ts.name not in numel:
            raise FailedPrecondition(f"record.stats.tensors names {ts.name!r}, which is not in the run's layout")
        if ts.numel and ts.numel != numel[ts.name]:
            raise FailedPrecondition(
                f"record.stats for {ts.name!r} says numel {ts.numel}; the layout's shape has {numel[ts.name]}"
            )
