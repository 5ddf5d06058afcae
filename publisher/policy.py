"""When a version carries a full anchor: a pure function of the publication history.

An anchor is what a late joiner (or an island that fell out of retained history) starts
from; patches are what everyone else follows. The policy writes an anchor:

- at the first version of a run (there is nothing to patch from), and whenever the
  publisher has no trusted base view (a restart whose state differs from the head);
- every ``anchor_every`` versions (counted from the last anchor), so a late joiner never
  replays more than that many patches;
- whenever the patch bytes written since the last anchor (including the version being
  decided, estimated if not yet encoded) exceed ``patch_fraction`` of one anchor's size,
  because past that point a joiner downloads less by taking a newer anchor.

``decide_anchor`` is pure (no I/O, no clock, no torch: the same inputs always give the same
answer); ``AnchorLedger`` keeps its inputs for a publisher as versions are read and committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class AnchorReason(str, Enum):
    NONE = ""
    FIRST = "first version"
    NO_BASE = "no trusted base view"
    EVERY_K = "anchor_every reached"
    PATCH_BYTES = "patch bytes since last anchor exceed the fraction"
    ADAPTER = "adapter runs publish whole versions"


@dataclass(frozen=True)
class AnchorPolicy:
    anchor_every: int = 50
    patch_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {self.anchor_every}")
        if not self.patch_fraction > 0:
            raise ValueError(f"anchor_patch_fraction must be > 0, got {self.patch_fraction}")


@dataclass(frozen=True)
class AnchorDecision:
    anchor: bool
    reason: AnchorReason

    def __bool__(self) -> bool:
        return self.anchor


def decide_anchor(
    policy: AnchorPolicy,
    *,
    version: int,
    last_anchor_version: int,
    patch_bytes_since_anchor: int,
    anchor_bytes: int,
    has_base: bool = True,
    adapter: bool = False,
) -> AnchorDecision:
    """Whether ``version`` carries an anchor.

    ``patch_bytes_since_anchor`` sums the patches of versions after ``last_anchor_version``
    up to and including ``version`` (estimated where not encoded yet). ``anchor_bytes`` is
    the size of one full anchor (the served view's stored bytes).
    """
    if version < 1:
        raise ValueError(f"versions start at 1, got {version}")
    if adapter:
        return AnchorDecision(True, AnchorReason.ADAPTER)
    if version == 1:
        return AnchorDecision(True, AnchorReason.FIRST)
    if not has_base:
        return AnchorDecision(True, AnchorReason.NO_BASE)
    if last_anchor_version > 0 and version - last_anchor_version >= policy.anchor_every:
        return AnchorDecision(True, AnchorReason.EVERY_K)
    if last_anchor_version <= 0 and version - 1 >= policy.anchor_every:
        # A run whose anchors are unknown to us (should not happen): treat version 1 as one.
        return AnchorDecision(True, AnchorReason.EVERY_K)
    if anchor_bytes > 0 and patch_bytes_since_anchor > policy.patch_fraction * anchor_bytes:
        return AnchorDecision(True, AnchorReason.PATCH_BYTES)
    return AnchorDecision(False, AnchorReason.NONE)


@dataclass
class AnchorLedger:
    """What ``decide_anchor`` needs to know about the run so far, kept by the publisher.

    A version's patch size is estimated when it is read (``bytes_per_change`` times its
    changed elements) and replaced by the real size when it commits, so decisions made while
    earlier versions are still uploading count them too. The caller serialises access.
    """

    policy: AnchorPolicy
    last_anchor: int = 0
    patch_bytes_since_anchor: int = 0  # committed or estimated patch bytes after last_anchor
    last_patch_bytes: int = 0
    bytes_per_change: float = 1.5
    anchor_bytes: int = 0  # one full anchor of the run's layout

    def decide(self, version: int, *, has_base: bool) -> AnchorReason:
        return decide_anchor(
            self.policy,
            version=version,
            last_anchor_version=self.last_anchor,
            patch_bytes_since_anchor=self.patch_bytes_since_anchor + self.last_patch_bytes,
            anchor_bytes=self.anchor_bytes,
            has_base=has_base,
        ).reason

    def estimate(self, changed: dict[str, int]) -> int:
        """A patch's estimated size from its changed elements per tensor."""
        return int(sum(changed.values()) * self.bytes_per_change) + 64 * len(changed)

    def read(self, version: int, *, anchor: bool, estimate: int, replaced_estimate: int = 0) -> None:
        """A version was read (merged into a queued patch whose estimate was ``replaced_estimate``)."""
        self.patch_bytes_since_anchor -= replaced_estimate
        if anchor:
            self.last_anchor, self.patch_bytes_since_anchor = version, 0
        else:
            self.patch_bytes_since_anchor += estimate
            self.last_patch_bytes = estimate

    def committed(self, version: int, *, anchor: bool, estimate: int, patch_bytes: int, changed_elements: int) -> None:
        """A version committed: its real patch size replaces the estimate made at the read."""
        if not anchor and version > self.last_anchor:
            self.patch_bytes_since_anchor += patch_bytes - estimate
        if patch_bytes:
            self.last_patch_bytes = patch_bytes
            if changed_elements:
                self.bytes_per_change = max(patch_bytes / changed_elements, 0.1)
