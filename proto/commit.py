"""The commit rule: what committing version n of a run means, decided in one pure function.

The board asks twice: before the compare-and-set (the servicer's cheap precheck, from the
head it read and the record the store holds for n) and after it (from what the Lua script
reported). Both go through ``decide_commit``, and ``commit_error`` turns a refusal into the
exception (and so the gRPC status) the caller sees.

Invariants:
- Versions are immutable: an identical record for n is always ALREADY_COMMITTED (a retry),
  a different one is refused.
- A different record for n is a lost race (ABORTED: re-read the head and publish the next)
  when n was the head or got committed during this call; once n is older than the head the
  call began with, it is ALREADY_EXISTS (history is immutable).
- With nothing at n, only head == n - 1 may go on; a head that moved during the call is a
  lost race, a head that was elsewhere from the start is NOT_NEXT (ABORTED too).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from weftboard.proto.errors import Aborted, AlreadyExists, WeftboardError


class Found(Enum):
    """What the store holds for the version being committed."""

    NOTHING = "nothing"
    SAME = "same"  # the identical record (its board-set fields aside)
    DIFFERENT = "different"


class StoreResult(str, Enum):
    """What the store's compare-and-set reported (the Lua script's result codes 0-3)."""

    COMMITTED = "committed"  # written now
    ALREADY_COMMITTED = "already_committed"  # the identical record was there
    EXISTS_DIFFERENT = "exists_different"  # a different record was there
    HEAD_MISMATCH = "head_mismatch"  # nothing at n, and the head is not n - 1


@dataclass(frozen=True)
class CommitReport:
    """The store's answer to a compare-and-set: its result, the head then, the commit time."""

    status: StoreResult
    head: int
    committed_at_ms: int


class CommitOutcome(str, Enum):
    PROCEED = "proceed"  # nothing at n and the head is n - 1: check the blobs, then the CAS
    COMMITTED = "committed"
    ALREADY_COMMITTED = "already_committed"
    LOST_RACE = "lost_race"
    EXISTS_DIFFERENT = "exists_different"
    NOT_NEXT = "not_next"


# The refusals and the error each travels as; the outcomes not here succeed.
COMMIT_ERRORS: dict[CommitOutcome, type[WeftboardError]] = {
    CommitOutcome.LOST_RACE: Aborted,
    CommitOutcome.EXISTS_DIFFERENT: AlreadyExists,
    CommitOutcome.NOT_NEXT: Aborted,
}

_FOUND_BY_RESULT = {
    StoreResult.COMMITTED: Found.NOTHING,
    StoreResult.ALREADY_COMMITTED: Found.SAME,
    StoreResult.EXISTS_DIFFERENT: Found.DIFFERENT,
    StoreResult.HEAD_MISMATCH: Found.NOTHING,
}


def decide_commit(version: int, head_at_start: int, head: int, found: Found, *, written: bool = False) -> CommitOutcome:
    """The outcome of committing ``version``, given the head the call began with, the head
    the store reports now, what the store holds for ``version`` and whether it wrote it."""
    if written:
        return CommitOutcome.COMMITTED
    if found is Found.SAME:
        return CommitOutcome.ALREADY_COMMITTED
    if found is Found.DIFFERENT:
        return CommitOutcome.LOST_RACE if version >= head_at_start else CommitOutcome.EXISTS_DIFFERENT
    if head == version - 1:
        return CommitOutcome.PROCEED
    return CommitOutcome.LOST_RACE if head_at_start == version - 1 else CommitOutcome.NOT_NEXT


def outcome_of_store(version: int, head_at_start: int, report: CommitReport) -> CommitOutcome:
    """``decide_commit`` on what the store's compare-and-set reported."""
    return decide_commit(version, head_at_start, report.head, _FOUND_BY_RESULT[report.status],
                         written=report.status is StoreResult.COMMITTED)


def commit_error(outcome: CommitOutcome, run: str, version: int, head: int) -> WeftboardError:
    """The error a refused commit raises (``COMMIT_ERRORS[outcome]``), its message naming the fix."""
    error = COMMIT_ERRORS[outcome]
    if outcome is CommitOutcome.LOST_RACE:
        now = max(head, version)  # a different record for n exists, or the head moved past n - 1
        return error(
            f"version {version} of run {run!r} lost a race: another publisher committed a "
            f"different record first and the head is now {now}; re-read the head and publish {now + 1}"
        )
    if outcome is CommitOutcome.EXISTS_DIFFERENT:
        return error(
            f"version {version} of run {run!r} is already committed with a different record; "
            "versions are immutable: commit the next version instead"
        )
    return error(
        f"version {version} of run {run!r} cannot commit: the head is {head}; "
        f"the next version to commit is {head + 1}"
    )
