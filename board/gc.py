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
- Leftovers of a version that never committed (a publisher that died before its commit) are
  deleted once older than the grace period, unless a kept artifact names their key: staged
  parts and noted anchor files (``staged``: their note (``RedisStore.staged_notes``) is for a
  version after the head, and every note of that version is older than the grace: a version
  whose upload still goes on, one file after another, keeps all of them; GC forgets the
  notes), and blobs under
  the run's ``blobs/`` that nothing names or notes (``abandoned``: an anchor file a
  publisher uploaded, aged by the blob store's last write, or for a multipart upload by its
  completion in the board's upload ledger). Before the grace such a version could still
  commit, so nothing of it is touched.

``collect_garbage`` gathers the inputs (Redis, a listing of the blob store) and runs both.
The executor moves ``oldest_available`` in Redis *first*, then deletes blobs: a reader
racing with GC is told a version is gone before its bytes disappear, never after. The grace
is at least ``CHECKED_TTL_S`` (a commit trusts a younger note without asking the store), and
leftovers are dropped from a plan whose run committed while GC looked: a version that
commits naming a leftover (a blob reused by content) keeps it, short of a commit landing in
the milliseconds between that check and the deletion.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from weftboard.board import model_files
from weftboard.board.store import CHECKED_TTL_S
from weftboard.board.uploads import UploadLedger
from weftboard.proto import convert
from weftboard.proto.names import blobs_prefix
from weftboard.proto.records import ArtifactKind, VersionRecord
from weftboard.proto.v1 import board_pb2 as pb

log = structlog.get_logger("weftboard.board.gc")
DEFAULT_STAGED_GRACE_S = 3600.0  # how old a never-committed version's leftovers must be before GC takes them


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
    staged: tuple[str, ...] = ()  # notes of never-committed versions' parts this plan settles
    staged_parts_collected: int = 0  # staged parts and noted anchor files deleted (orphans or past the grace)
    abandoned_blobs_collected: int = 0  # blobs nothing named or noted, deleted past the grace

    @property
    def freed_bytes(self) -> int:
        return sum(size for _, size in self.delete)


@dataclass(frozen=True)
class Leftovers:
    """What a version that never committed left, past the grace: blob key -> size."""

    staged: Mapping[str, int] = field(default_factory=dict)  # noted by StagePart
    abandoned: Mapping[str, int] = field(default_factory=dict)  # never noted


def plan_gc(
    versions: Mapping[int, VersionBlobs],
    head: int,
    oldest_available: int,
    live_island_versions: Iterable[int],
    keep_anchors: int,
    keep_versions: int,
    orphans: Mapping[str, int] | None = None,
    keep: Iterable[str] = (),
    leftovers: Leftovers | None = None,
) -> GcPlan:
    """Blobs to delete and the new oldest available version; never a key in ``keep``."""
    orphans = orphans or {}
    leftovers = leftovers or Leftovers()
    if head == 0:
        return _with_leftovers(GcPlan(oldest_available, orphans=tuple(sorted(orphans))), orphans, leftovers,
                               set(keep))
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
    return _with_leftovers(GcPlan(new_oldest, delete, tuple(sorted(orphans))), orphans, leftovers, kept)


def _with_leftovers(plan: GcPlan, orphans: Mapping[str, int], leftovers: Leftovers, kept: set[str]) -> GcPlan:
    """``plan`` deleting the leftovers too (none a kept key names), and counting what it collects."""
    delete = dict(plan.delete)
    for found in (leftovers.staged, leftovers.abandoned):
        delete.update((k, s) for k, s in found.items() if k not in kept)
    return replace(
        plan,
        delete=tuple(sorted(delete.items())),
        staged=tuple(sorted(leftovers.staged)),
        staged_parts_collected=sum(1 for k in delete if k in orphans or k in leftovers.staged),
        abandoned_blobs_collected=sum(1 for k in delete if k in leftovers.abandoned and k not in orphans),
    )


def version_blobs(record: VersionRecord) -> VersionBlobs:
    patch: list[tuple[str, int]] = []
    anchor: list[tuple[str, int]] = []
    for artifact in record.artifacts:
        target = patch if artifact.kind is ArtifactKind.PATCH else anchor
        target.extend((b.key, b.size) for b in artifact.blobs)
    return VersionBlobs(record.version, tuple(patch), tuple(anchor))


async def execute_gc(store, blobs, run: str, plan: GcPlan, *, dry_run: bool) -> GcPlan:
    """Apply ``plan``: advance oldest_available in Redis and forget the settled notes, then
    delete the blobs.

    Blobs already gone are fine (a previous GC may have been interrupted after its
    Redis step), so deletion is idempotent.
    """
    if dry_run:
        return plan
    oldest = await store.advance_oldest(run, plan.oldest_available)
    if plan.staged:  # first: a commit of their version now asks the blob store, which says gone
        await store.forget_staged_notes(run, list(plan.staged))
    if plan.delete:
        await blobs.delete([key for key, _ in plan.delete])
    await store.forget_orphans(run, plan.orphans)
    return replace(plan, oldest_available=oldest)


async def find_leftovers(store, blobs, run: str, head: int, known: set[str], *, now_ms: int,
                         grace_s: float) -> Leftovers:
    """The leftovers of versions after ``head`` older than ``grace_s`` at ``now_ms`` (see the
    module docstring); ``known``: keys that are no leftovers (named by a record, the run's
    model files, orphans)."""
    before_ms = now_ms - int(max(grace_s, CHECKED_TTL_S) * 1000)
    notes = await store.staged_notes(run)
    noted = set(notes)
    last_note_ms: dict[int, int] = {}  # per version: its newest note
    for _, version, checked_ms in notes.values():
        last_note_ms[version] = max(last_note_ms.get(version, 0), checked_ms)
    staged = {key: size for key, (size, version, checked_ms) in notes.items()  # notes without a time: kept
              if version > head and checked_ms > 0 and last_note_ms[version] <= before_ms and key not in known}
    listed = await blobs.list_blobs(blobs_prefix(run))
    abandoned = {key: b.size for key, b in listed.items()
                 if key not in known and key not in noted and b.modified_s * 1000 <= before_ms}
    return Leftovers(staged, abandoned)


async def collect_garbage(store, blobs, run: pb.Run, *, keep_anchors: int, keep_versions: int,
                          staged_grace_s: float, dry_run: bool, now_ms: int) -> GcPlan:
    """One garbage collection of ``run`` (its record with head and oldest_available) at
    ``now_ms``: plan (``plan_gc``), then execute (``execute_gc``)."""
    name = run.run
    records = await store.get_index(name, max(run.oldest_available, 1), run.head)
    versions = {v: version_blobs(convert.record_from_pb(r)) for v, r in records.items()}
    live = [r.status.version for r in await store.islands(name) if r.lease_expires_at_ms >= now_ms]
    orphans = await store.orphans(name)
    keep = model_files.keys(run)
    # a blob a multipart upload made is aged from its completion, not from the store's date
    # (S3 dates such an object from the upload's start): open and recently done ones are kept
    grace_ms = int(max(staged_grace_s, CHECKED_TTL_S) * 1000)
    uploading = {u.key for u in (await UploadLedger(store).all(name)).values()
                 if not u.done_ms or u.done_ms > now_ms - grace_ms}
    known = {k for b in versions.values() for k, _ in (*b.patch, *b.anchor)} | keep | set(orphans) | uploading
    leftovers = await find_leftovers(store, blobs, name, run.head, known, now_ms=now_ms, grace_s=staged_grace_s)
    if (leftovers.staged or leftovers.abandoned) and (await store.run_state(name)).head != run.head:
        log.info("the run committed while GC looked; its leftovers wait for the next GC", run=name)
        leftovers = Leftovers()
    plan = plan_gc(versions, run.head, run.oldest_available, live, keep_anchors, keep_versions,
                   orphans=orphans, keep=keep, leftovers=leftovers)
    return await execute_gc(store, blobs, name, plan, dry_run=dry_run)


def grace_of(value: Any) -> float:
    """A configured grace period, refused when shorter than a staged part's check stands."""
    grace = float(value)
    if grace < CHECKED_TTL_S:
        raise ValueError(f"staged_grace_s {grace:g} is shorter than {CHECKED_TTL_S} s, how long a commit trusts "
                         "a staged part's check: GC could delete a part a commit is about to name")
    return grace
