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

    # suffix[n] = bytes of the patches n+1..target, None when one is missing. It reaches
    # down to oldest_available - 1: an island may still hold a collected version, and the
    # patch of the oldest retained version applies to it.
    suffix: dict[int, int | None] = {target: 0}
    running: int | None = 0
    for n in range(target, max(oldest_available - 1, 1) - 1, -1):
        suffix[n] = running
        if running is not None:
            patch = artifacts.get(n)
            running = None if patch is None or patch.patch_bytes is None else running + patch.patch_bytes

    best: tuple[tuple[int, int, int], Plan] | None = None

    def consider(start_steps: list[Step], start: int) -> None:
        nonlocal best
        tail = suffix.get(start)
        if tail is None:
            return
        steps = list(start_steps)
        for n in range(start + 1, target + 1):
            steps.append(Step(StepKind.PATCH, n - 1, n, artifacts[n].patch_bytes or 0))
        plan = Plan(have if not start_steps else 0, target, tuple(steps))
        key = (plan.total_bytes, len(steps), -start)
        if best is None or key < best[0]:
            best = (key, plan)

    if 0 < have < target and have >= oldest_available - 1:
        consider([], have)
    for n in range(max(oldest_available, 1), target + 1):
        node = artifacts.get(n)
        if node is not None and node.anchor_bytes is not None:
            consider([Step(StepKind.ANCHOR, 0, n, node.anchor_bytes)], n)
    if best is None:
        raise FailedPrecondition(
            f"no retained chain reaches version {target} from version {have}: "
            "no anchor at or below it is retained"
        )
    return best[1]
