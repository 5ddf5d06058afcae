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

No I/O, no clock, no torch: the same inputs always give the same answer.
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
