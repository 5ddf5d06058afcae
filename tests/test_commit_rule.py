"""The commit rule (``weftboard.proto.commit``): every outcome, and the same status whether
the servicer's precheck or the store's compare-and-set found the situation."""

from __future__ import annotations

import pytest

from weftboard.proto import convert, errors
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
from weftboard.proto.layout import check_layout
from weftboard.proto.records import ArtifactKind
from weftboard.proto.v1 import board_pb2 as pb


def precheck(version: int, head: int, found: Found) -> CommitOutcome:
    """What the servicer decides before the CAS: one read of the head and of version n."""
    return decide_commit(version, head, head, found)


@pytest.mark.parametrize(
    ("version", "head", "found", "outcome"),
    [
        (5, 4, Found.NOTHING, CommitOutcome.PROCEED),
        (5, 4, Found.SAME, CommitOutcome.ALREADY_COMMITTED),
        (5, 9, Found.SAME, CommitOutcome.ALREADY_COMMITTED),  # a late retry still succeeds
        (5, 5, Found.DIFFERENT, CommitOutcome.LOST_RACE),  # n is the head
        (5, 4, Found.DIFFERENT, CommitOutcome.LOST_RACE),  # n committed during this call
        (5, 6, Found.DIFFERENT, CommitOutcome.EXISTS_DIFFERENT),  # n is history
        (5, 2, Found.NOTHING, CommitOutcome.NOT_NEXT),
        (1, 0, Found.NOTHING, CommitOutcome.PROCEED),
    ],
)
def test_precheck_outcomes(version: int, head: int, found: Found, outcome: CommitOutcome) -> None:
    assert precheck(version, head, found) is outcome


@pytest.mark.parametrize(
    ("status", "head", "outcome"),
    [
        (StoreResult.COMMITTED, 5, CommitOutcome.COMMITTED),
        (StoreResult.ALREADY_COMMITTED, 5, CommitOutcome.ALREADY_COMMITTED),
        (StoreResult.EXISTS_DIFFERENT, 5, CommitOutcome.LOST_RACE),
        (StoreResult.EXISTS_DIFFERENT, 7, CommitOutcome.LOST_RACE),  # n taken during this call
        (StoreResult.HEAD_MISMATCH, 6, CommitOutcome.LOST_RACE),  # the head moved during this call
    ],
)
def test_store_results_after_a_passed_precheck(status: StoreResult, head: int, outcome: CommitOutcome) -> None:
    # The CAS runs only after the precheck saw head == n - 1 (here 4) and nothing at n.
    assert outcome_of_store(5, 4, CommitReport(status, head, 123)) is outcome


def test_store_results_are_strings_for_callers() -> None:
    assert StoreResult.COMMITTED == "committed" and StoreResult.HEAD_MISMATCH == "head_mismatch"


@pytest.mark.parametrize(
    ("found", "status", "store_head"),
    [
        (Found.SAME, StoreResult.ALREADY_COMMITTED, 5),
        (Found.DIFFERENT, StoreResult.EXISTS_DIFFERENT, 5),
    ],
)
def test_precheck_and_store_agree(found: Found, status: StoreResult, store_head: int) -> None:
    """The same situation (version 5 found identical / different while it is the head) maps to
    the same outcome and the same error class, whichever of the two checks saw it first."""
    early = precheck(5, store_head, found)
    late = outcome_of_store(5, 4, CommitReport(status, store_head, 1))
    assert early is late
    if early in COMMIT_ERRORS:
        a = commit_error(early, "r", 5, store_head)
        b = commit_error(late, "r", 5, store_head)
        assert type(a) is type(b) and a.grpc_code_name == b.grpc_code_name and str(a) == str(b)


def test_every_refusal_has_a_status_and_a_fix() -> None:
    assert set(COMMIT_ERRORS) == {CommitOutcome.LOST_RACE, CommitOutcome.EXISTS_DIFFERENT, CommitOutcome.NOT_NEXT}
    lost = commit_error(CommitOutcome.LOST_RACE, "r", 5, 4)
    assert isinstance(lost, errors.Aborted) and "lost a race" in str(lost) and "publish 6" in str(lost)
    exists = commit_error(CommitOutcome.EXISTS_DIFFERENT, "r", 5, 9)
    assert isinstance(exists, errors.AlreadyExists) and "immutable" in str(exists)
    not_next = commit_error(CommitOutcome.NOT_NEXT, "r", 5, 2)
    assert isinstance(not_next, errors.Aborted) and "next version to commit is 3" in str(not_next)
    with pytest.raises(KeyError):
        commit_error(CommitOutcome.COMMITTED, "r", 5, 4)


def test_convert_layout_and_record() -> None:
    run = pb.Run(run="r", served_format=pb.ServedFormat(kind=pb.FORMAT_KIND_BF16),
                 layout=pb.Layout(tensors=[pb.TensorSpec(name="w", dtype="bfloat16", shape=[2, 3])]))
    layout = convert.layout_from_pb(run)
    assert layout.served_format.kind == "bf16" and layout.names == ("w",) and layout.tensors[0].numel == 6
    check_layout(layout)
    unset = convert.layout_from_pb(pb.Run(run="r", layout=run.layout))
    with pytest.raises(errors.InvalidArgument, match="served_format.kind"):
        check_layout(unset)
    record = convert.record_from_pb(pb.VersionRecord(run="r", version=2, artifacts=[
        pb.Artifact(kind=pb.ARTIFACT_KIND_PATCH, base_version=1, blobs=[pb.BlobRef(key="k", digest="d", size=7)]),
        pb.Artifact(kind=pb.ARTIFACT_KIND_ANCHOR, blobs=[pb.BlobRef(key="a", digest="e", size=30, name="m")]),
        pb.Artifact(kind=99),
    ]))
    assert [a.kind for a in record.artifacts] == [ArtifactKind.PATCH, ArtifactKind.ANCHOR, ArtifactKind.UNSPECIFIED]
    sizes = convert.record_from_pb(pb.VersionRecord(run="r", version=2, artifacts=[
        pb.Artifact(kind=pb.ARTIFACT_KIND_PATCH, base_version=1, blobs=[pb.BlobRef(key="k", digest="d", size=7)]),
    ])).sizes()
    assert (sizes.patch_bytes, sizes.anchor_bytes) == (7, None)
