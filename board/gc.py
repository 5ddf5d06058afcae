"""Retention: which blobs garbage collection may delete, and the executor that deletes them.

``plan_gc`` is pure. Its invariants (tested directly):
- ``oldest_available`` never moves back, and every version in [oldest_available, head]
  stays reachable: the anchor at oldest_available and every patch after it are kept.
- Every blob a retained version's record names is kept, the oldest's patch included: the
  catch-up planner (``domain.plan_catch_up``) starts an island holding oldest_available - 1
  from that patch, and ``GetVersion`` must not name a deleted blob.
- No blob on the catch-up chain of a live island is deleted: the new oldest is at or
  below every live island's version, so the patches after it are all retained.
- The newest ``keep_anchors`` anchors are kept, and so are the patches after the oldest
  of them (the new oldest is at or below it).
- The newest ``keep_versions`` versions stay reachable.
- A key still named by a kept artifact is never deleted (content addressing means two
  versions may share a blob).
- Orphans (staged parts whose version was committed without them, see ``store.k_orphans``)
  are deleted, unless a kept artifact names their key; either way GC forgets them.
- A key in ``keep`` (the run's model files) is never deleted, whatever names it.

The executor moves ``oldest_available`` in Redis *first*, then deletes blobs: a reader
racing with GC is told a version is gone before its bytes disappear, never after.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from weftboard.proto.records import ArtifactKind, VersionRecord


@dataclass(frozen=True)
class VersionBlobs:
    """The blobs a version's artifacts name: (key, size) pairs."""

    version: int
    patch: tuple[tuple[str, int], ...] = ()
    anchor: tuple[tuple[str, int], ...] = ()

    @property
    def has_anchor(self) -> bool:
        return bool(self.anchor)


@dataclass(frozen=True)
class GcPlan:
    oldest_available: int
    delete: tuple[tuple[str, int], ...] = field(default_factory=tuple)
    orphans: tuple[str, ...] = ()  # the orphans this plan settles (deleted, or found named)

    @property
    def freed_bytes(self) -> int:
        return sum(size for _, size in self.delete)


def plan_gc(
    versions: Mapping[int, VersionBlobs],
    head: int,
    oldest_available: int,
    live_island_versions: Iterable[int],
    keep_anchors: int,
    keep_versions: int,
    orphans: Mapping[str, int] | None = None,
    keep: Iterable[str] = (),
) -> GcPlan:
    """Blobs to delete and the new oldest available version; never a key in ``keep``."""
    orphans = orphans or {}
    if head == 0:
        return GcPlan(oldest_available, orphans=tuple(sorted(orphans)))
    keep_anchors = max(keep_anchors, 1)
    keep_versions = max(keep_versions, 1)
    floor = max(head - keep_versions + 1, 1)
    for v in live_island_versions:
        if 0 < v <= head:
            floor = min(floor, v)
    anchors = sorted(v for v, blobs in versions.items() if blobs.has_anchor and v <= head)
    if anchors:
        floor = min(floor, anchors[-keep_anchors] if len(anchors) >= keep_anchors else anchors[0])
    # The newest anchor at or below the floor starts the retained chain.
    below = [a for a in anchors if a <= floor]
    new_oldest = below[-1] if below else oldest_available
    new_oldest = max(new_oldest, oldest_available)

    kept: set[str] = set(keep)
    dropped: dict[str, int] = {}
    for v, blobs in versions.items():
        if v < oldest_available:
            continue  # collected by an earlier run of GC
        # The oldest's own patch is kept with it: the catch-up planner hands it to an island
        # still holding oldest - 1, and a retained version's record names no deleted blob.
        keep = v >= new_oldest
        for key, size in blobs.patch:
            if keep:
                kept.add(key)
            else:
                dropped[key] = size
        for key, size in blobs.anchor:
            if keep:
                kept.add(key)
            else:
                dropped[key] = size
    dropped.update(orphans)
    delete = tuple(sorted((k, s) for k, s in dropped.items() if k not in kept))
    return GcPlan(new_oldest, delete, tuple(sorted(orphans)))


def version_blobs(record: VersionRecord) -> VersionBlobs:
    patch: list[tuple[str, int]] = []
    anchor: list[tuple[str, int]] = []
    for artifact in record.artifacts:
        target = patch if artifact.kind is ArtifactKind.PATCH else anchor
        target.extend((b.key, b.size) for b in artifact.blobs)
    return VersionBlobs(record.version, tuple(patch), tuple(anchor))


async def execute_gc(store, blobs, run: str, plan: GcPlan, *, dry_run: bool) -> GcPlan:
    """Apply ``plan``: advance oldest_available in Redis, then delete the blobs.

    Blobs already gone are fine (a previous GC may have been interrupted after its
    Redis step), so deletion is idempotent.
    """
    if dry_run:
        return plan
    oldest = await store.advance_oldest(run, plan.oldest_available)
    if plan.delete:
        await blobs.delete([key for key, _ in plan.delete])
    await store.forget_orphans(run, plan.orphans)
    return GcPlan(oldest, plan.delete, plan.orphans)
