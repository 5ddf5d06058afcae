"""The pure domain core, in one import: names and digests, layout, version records and
artifacts, catch-up plans, version constraints and the commit decision.

No I/O here, and nothing that imports grpc, redis, torch or protobuf: every other module
depends on these, and their rules hold the same in the board, the publisher and the island.
The definitions live in the small modules named below; this module gathers them.
"""

from __future__ import annotations

from weftboard.proto.commit import (
    COMMIT_ERRORS,
    CommitOutcome,
    CommitReport,
    Found,
    StoreResult,
    commit_error,
    decide_commit,
    outcome_of_store,
)
from weftboard.proto.constraints import VersionConstraint, lag
from weftboard.proto.layout import Layout, ServedFormat, TensorSpec, check_layout
from weftboard.proto.names import (
    DIGEST_ALGORITHM,
    NAME_PATTERN,
    blob_key,
    check_digest,
    check_name,
    format_digest,
)
from weftboard.proto.plans import Plan, Step, StepKind, VersionArtifacts, plan_catch_up
from weftboard.proto.records import (
    Artifact,
    ArtifactKind,
    BlobRef,
    TensorDigest,
    TensorStats,
    VersionRecord,
    check_blob_ref,
    check_record,
)

__all__ = [
    "COMMIT_ERRORS",
    "DIGEST_ALGORITHM",
    "NAME_PATTERN",
    "Artifact",
    "ArtifactKind",
    "BlobRef",
    "CommitOutcome",
    "CommitReport",
    "Found",
    "Layout",
    "Plan",
    "ServedFormat",
    "Step",
    "StepKind",
    "StoreResult",
    "TensorDigest",
    "TensorSpec",
    "TensorStats",
    "VersionArtifacts",
    "VersionConstraint",
    "VersionRecord",
    "blob_key",
    "check_blob_ref",
    "check_digest",
    "check_layout",
    "check_name",
    "check_record",
    "commit_error",
    "decide_commit",
    "format_digest",
    "lag",
    "outcome_of_store",
    "plan_catch_up",
]
