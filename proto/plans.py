"""Catch-up planning: the cheapest chain of anchor and patch steps from what an island holds.

Invariants:
- Versions of a run are 1, 2, 3, ... and immutable once committed; 0 means "none".
- A patch artifact of version n always applies to version n-1.
- A plan is the cheapest (fewest bytes) chain: either patches from what the island holds,
  or one anchor followed by the patches after it; ties go to fewer steps, then the newer start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from weftboard.proto.errors import FailedPrecondition, OutOfRange


class StepKind(str, Enum):
    ANCHOR = "anchor"
    PATCH = "patch"


@dataclass(frozen=True)
class VersionArtifacts:
    """What the board retains for one version: the sizes of its patch and anchor, if any."""

    version: int
    patch_bytes: int | None = None
    anchor_bytes: int | None = None


@dataclass(frozen=True)
class Step:
    kind: StepKind
    from_version: int  # PATCH: version it applies to; ANCHOR: 0
    to_version: int
    nbytes: int


@dataclass(frozen=True)
class Plan:
    from_version: int
    to_version: int
    steps: tuple[Step, ...]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.steps)


def plan_catch_up(
    have: int,
    want: int,
    head: int,
    oldest_available: int,
    artifacts: Mapping[int, VersionArtifacts],
) -> Plan:
    """Cheapest ordered steps from ``have`` (0 = nothing) to ``want`` (0 = head).

    Candidates: patches from ``have`` (when ``have`` <= ``want`` and every patch after
    it is retained), or any retained anchor at or below ``want`` followed by patches.
    Ties go to fewer steps, then to the newer start. Raises OutOfRange for a ``want``
    beyond the head or below retained history, FailedPrecondition when no chain exists.
    """
    if head == 0:
        raise FailedPrecondition("the run has no committed version yet")
    target = head if want == 0 else want
    if target > head:
        raise OutOfRange(f"version {target} is beyond the head ({head})")
    if target < oldest_available:
        raise OutOfRange(
            f"version {target} was garbage collected; the oldest available version is {oldest_available}"
        )
    if have == target:
        return Plan(have, target, ())

    # suffix reaches down to oldest_available - 1: an island may still hold a collected
    # version, and the patch of the oldest retained version applies to it.
    suffix = _suffix_bytes(artifacts, target, max(oldest_available - 1, 1))
    best = _cheapest(have, target, artifacts, suffix, max(oldest_available, 1))
    if best is None:
        raise FailedPrecondition(
            f"no retained chain reaches version {target} from version {have}: "
            "no anchor at or below it is retained"
        )
    (_, _, neg_start), anchored = best
    start = -neg_start
    steps = [Step(StepKind.ANCHOR, 0, start, artifacts[start].anchor_bytes or 0)] if anchored else []
    steps += [Step(StepKind.PATCH, n - 1, n, artifacts[n].patch_bytes or 0) for n in range(start + 1, target + 1)]
    return Plan(0 if anchored else have, target, tuple(steps))


def _suffix_bytes(artifacts: Mapping[int, VersionArtifacts], target: int, lowest: int) -> dict[int, int | None]:
    """suffix[n] = bytes of the patches n+1..target, for n from ``target`` down to ``lowest``;
    None from where a patch is missing (no chain passes it)."""
    suffix: dict[int, int | None] = {target: 0}
    running: int | None = 0
    for n in range(target, lowest - 1, -1):
        suffix[n] = running
        if running is not None:
            patch = artifacts.get(n)
            running = None if patch is None or patch.patch_bytes is None else running + patch.patch_bytes
    return suffix


def _cheapest(have: int, target: int, artifacts: Mapping[int, VersionArtifacts], suffix: Mapping[int, int | None],
              lowest: int) -> tuple[tuple[int, int, int], bool] | None:
    """The cheapest start for ``target``: its key (bytes, steps, -start: ties go to fewer steps,
    then the newer start) and whether it is an anchor; None when none chains. Candidates are
    the patches from ``have`` (where ``suffix`` reaches it) and every anchor from ``lowest`` up,
    each costed without building its steps, so a long history with many anchors stays linear."""
    best: tuple[tuple[int, int, int], bool] | None = None
    if 0 < have < target and suffix.get(have) is not None:
        best = ((suffix[have] or 0, target - have, -have), False)
    for n in range(lowest, target + 1):
        node = artifacts.get(n)
        tail = suffix.get(n)
        if node is not None and node.anchor_bytes is not None and tail is not None:
            key = (node.anchor_bytes + tail, 1 + target - n, -n)
            if best is None or key < best[0]:
                best = (key, True)
    return best


def needs_older(have: int, target: int, artifacts: Mapping[int, VersionArtifacts], lowest: int) -> bool:
    """Whether a chain starting below ``lowest`` could still be the cheapest, given the
    artifacts of versions ``lowest..target``: only while some start is possible below it and
    the patches from ``lowest`` up cost less than the best chain starting at or above it (any
    start below pays at least those patches, and has more steps). A board reads the index
    from the target down in chunks and stops once this is False."""
    suffix = _suffix_bytes(artifacts, target, lowest)
    floor = suffix.get(lowest)
    if floor is None:
        return False  # a patch at or above ``lowest`` is missing: nothing below can chain through
    best = _cheapest(have, target, artifacts, suffix, lowest)
    return best is None or floor < best[0][0]
