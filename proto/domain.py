"""The pure domain core: names, digests, blob keys, catch-up plans, version constraints.

No I/O here, and nothing that imports grpc, redis or torch: every other module depends
on this one, and its rules hold the same in the board, the publisher and the island.

Invariants stated here and relied on elsewhere:
- Versions of a run are 1, 2, 3, ... and immutable once committed; 0 means "none".
- A patch artifact of version n always applies to version n-1.
- Blob keys are content addressed (``<run>/blobs/<hex>``), so an upload retried
  after a crash overwrites a blob with the very same bytes.
- A catch-up plan is the cheapest (fewest bytes) chain of steps: either patches from
  what the island holds, or one anchor followed by the patches after it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from weftboard.proto.errors import FailedPrecondition, InvalidArgument, OutOfRange

# Matched whole (fullmatch): "$" would also accept a name ending in a newline.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DIGEST_ALGORITHM = "xxh3-128"
_DIGEST_PATTERN = re.compile(r"xxh3-128:[0-9a-f]{32}")


def check_name(field: str, value: str) -> str:
    """Validate a run or island name; the message names the field so a caller can fix it."""
    if not NAME_PATTERN.fullmatch(value or ""):
        raise InvalidArgument(
            f"{field} {value!r} is not a valid name: 1-64 characters of [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return value


def format_digest(raw: bytes) -> str:
    if len(raw) != 16:
        raise ValueError(f"an xxh3-128 digest has 16 bytes, got {len(raw)}")
    return f"{DIGEST_ALGORITHM}:{raw.hex()}"


def check_digest(field: str, value: str) -> str:
    if not _DIGEST_PATTERN.fullmatch(value or ""):
        raise InvalidArgument(f"{field} {value!r} is not a digest of the form 'xxh3-128:<32 lowercase hex>'")
    return value


def blob_key(run: str, digest: str) -> str:
    """Content-addressed key of a blob of ``run`` whose bytes hash to ``digest``."""
    check_name("run", run)
    check_digest("digest", digest)
    return f"{run}/blobs/{digest.split(':', 1)[1]}"


# ---------------------------------------------------------------------------
# Catch-up planning
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Version constraints on requests
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionConstraint:
    """Which versions a request accepts: an exact version, a minimum, or a staleness bound.

    Fields may be combined; all that are set must hold. An empty constraint accepts any
    version (but never "no version at all").
    """

    exact: int | None = None
    minimum: int | None = None
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        for field, value in (("exact", self.exact), ("minimum", self.minimum), ("max_staleness", self.max_staleness)):
            if value is not None and value < 0:
                raise InvalidArgument(f"version constraint {field} must be >= 0, got {value}")
        if self.exact is not None and self.exact == 0:
            raise InvalidArgument("version constraint exact must be >= 1")

    def accepts(self, version: int, head: int) -> bool:
        if version <= 0:
            return False
        if self.exact is not None and version != self.exact:
            return False
        if self.minimum is not None and version < self.minimum:
            return False
        if self.max_staleness is not None and head - version > self.max_staleness:
            return False
        return True

    def lowest_acceptable(self, head: int) -> int:
        """The lowest version that satisfies the constraint given ``head`` (a catch-up target)."""
        floor = 1
        if self.exact is not None:
            return self.exact
        if self.minimum is not None:
            floor = max(floor, self.minimum)
        if self.max_staleness is not None:
            floor = max(floor, head - self.max_staleness)
        return floor

    def satisfiable(self, head: int) -> bool:
        """Whether some version up to ``head`` (possibly after a catch-up) satisfies it."""
        target = self.lowest_acceptable(head)
        return 1 <= target <= head and self.accepts(target if self.exact is not None else head, head)

    @classmethod
    def parse(cls, text: str) -> VersionConstraint:
        """Parse the header form: ``exact=7``, ``min=5``, ``max_staleness=2``, comma separated."""
        values: dict[str, int] = {}
        aliases = {"exact": "exact", "min": "minimum", "minimum": "minimum", "max_staleness": "max_staleness"}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            field = aliases.get(key.strip())
            if not sep or field is None:
                raise InvalidArgument(
                    f"bad version constraint {part!r}: use exact=N, min=N or max_staleness=N, comma separated"
                )
            try:
                values[field] = int(raw.strip())
            except ValueError:
                raise InvalidArgument(f"bad version constraint {part!r}: {raw.strip()!r} is not an integer") from None
        return cls(**values)


def lag(head: int, version: int) -> int:
    return max(head - version, 0)


def sorted_unique(versions: Iterable[int]) -> list[int]:
    return sorted(set(versions))
