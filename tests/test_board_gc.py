"""Retention: the pure GC planner (properties against brute force) and CollectGarbage end to end."""

from __future__ import annotations

import asyncio

import pytest
from boardkit import make_record, make_run, publish, upload
from hypothesis import given, settings
from hypothesis import strategies as st

from weftboard.board.client import BoardClient
from weftboard.board.gc import VersionBlobs, plan_gc
from weftboard.proto import errors
from weftboard.proto.domain import VersionArtifacts, plan_catch_up
from weftboard.proto.v1 import board_pb2 as pb


def history(anchor_every: set[int], head: int) -> dict[int, VersionBlobs]:
    out = {}
    for v in range(1, head + 1):
        patch = ((f"p{v}", 10),) if v > 1 else ()
        anchor = ((f"a{v}", 100),) if v == 1 or v in anchor_every else ()
        out[v] = VersionBlobs(v, patch, anchor)
    return out


def reachable(versions, deleted: set[str], v: int, oldest: int, head: int) -> bool:
    """Whether version v can be reached from some retained anchor with retained patches."""
    arts = {
        n: VersionArtifacts(
            n,
            None if not b.patch or any(k in deleted for k, _ in b.patch) else sum(s for _, s in b.patch),
            None if not b.anchor or any(k in deleted for k, _ in b.anchor) else sum(s for _, s in b.anchor),
        )
        for n, b in versions.items()
    }
    try:
        plan_catch_up(0, v, head, oldest, arts)
        return True
    except errors.FailedPrecondition:
        return False


def test_plan_keeps_newest_versions_and_anchors():
    versions = history({5, 10, 15}, 20)
    plan = plan_gc(versions, 20, 1, [], keep_anchors=2, keep_versions=4)
    deleted = {k for k, _ in plan.delete}
    # newest 4 versions: 17..20 -> floor 17; newest 2 anchors: 10, 15 -> floor 10 -> oldest 10
    assert plan.oldest_available == 10
    assert deleted == {"a1", "a5"} | {f"p{v}" for v in range(2, 10)}  # p10 stays with version 10
    assert plan.freed_bytes == 200 + 8 * 10
    # the next run, from oldest 10 to 15, collects version 10's patch with it
    later = plan_gc(versions, 20, 10, [], keep_anchors=1, keep_versions=4)
    assert later.oldest_available == 15
    assert {k for k, _ in later.delete} == {"a10"} | {f"p{v}" for v in range(10, 15)}


def test_plan_never_drops_a_live_islands_chain():
    versions = history({5, 10, 15}, 20)
    plan = plan_gc(versions, 20, 1, [7], keep_anchors=1, keep_versions=1)
    assert plan.oldest_available == 5  # newest anchor at or below the island's version 7
    deleted = {k for k, _ in plan.delete}
    assert not any(f"p{v}" in deleted for v in range(8, 21))


def test_plan_is_monotonic_and_shared_keys_survive():
    versions = history({5}, 8)
    versions[7] = VersionBlobs(7, (("shared", 10),), ())
    versions[3] = VersionBlobs(3, (("shared", 10),), ())
    plan = plan_gc(versions, 8, 6, [], keep_anchors=1, keep_versions=1)
    assert plan.oldest_available == 6  # never moves back below the current oldest
    assert "shared" not in {k for k, _ in plan.delete}


def test_plan_deletes_orphans_unless_a_kept_artifact_names_them():
    versions = history({5}, 8)
    plan = plan_gc(versions, 8, 1, [], keep_anchors=2, keep_versions=8,
                   orphans={"staged-3a": 7, "staged-6b": 9, "p7": 10})
    assert plan.oldest_available == 1 and plan.orphans == ("p7", "staged-3a", "staged-6b")
    assert dict(plan.delete) == {"staged-3a": 7, "staged-6b": 9}  # p7 is named by version 7: kept


@settings(max_examples=200, deadline=None)
@given(
    head=st.integers(1, 30),
    anchors=st.sets(st.integers(2, 30), max_size=6),
    islands=st.lists(st.integers(0, 30), max_size=4),
    keep_anchors=st.integers(1, 4),
    keep_versions=st.integers(1, 10),
    oldest_seed=st.integers(0, 30),
)
def test_plan_properties(head, anchors, islands, keep_anchors, keep_versions, oldest_seed):
    versions = history(anchors, head)
    all_anchors = sorted({1} | {a for a in anchors if a <= head})
    oldest = max(a for a in all_anchors if a <= max(1, min(oldest_seed, head)))
    plan = plan_gc(versions, head, oldest, islands, keep_anchors, keep_versions)
    deleted = {k for k, _ in plan.delete}
    assert oldest <= plan.oldest_available <= head
    for v in range(plan.oldest_available, head + 1):
        assert reachable(versions, deleted, v, plan.oldest_available, head), v
    for v in range(max(head - keep_versions + 1, oldest), head + 1):
        assert v >= plan.oldest_available
    # a retained version's record names no deleted blob, the oldest's patch included
    for v in range(plan.oldest_available, head + 1):
        assert not {k for k, _ in versions[v].patch + versions[v].anchor} & deleted, v
    for a in all_anchors[-keep_anchors:]:
        assert f"a{a}" not in deleted or a < oldest
    for u in islands:
        if oldest <= u <= head:  # an island below the current oldest lost its chain earlier
            assert all(f"p{v}" not in deleted for v in range(u + 1, head + 1))
    # nothing below the current oldest is deleted again, and deletions are real keys
    assert all(int(k[1:]) >= oldest for k in deleted)


async def test_collect_garbage_end_to_end(board, local_store):
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("g", keep_anchors=1, keep_versions=2))
        await publish(client, local_store, "g", range(1, 5))
        await publish(client, local_store, "g", [5], anchor=True)
        await publish(client, local_store, "g", range(6, 9))
        before = set(await local_store.list_keys("g/"))
        dry = await client.collect_garbage("g", dry_run=True)
        assert dry.oldest_available == 5 and dry.deleted_keys
        assert set(await local_store.list_keys("g/")) == before  # dry run deletes nothing
        assert (await client.get_head("g")).oldest_available == 1
        done = await client.collect_garbage("g")
        assert done.deleted_keys == dry.deleted_keys and done.freed_bytes == dry.freed_bytes > 0
        after = set(await local_store.list_keys("g/"))
        assert after == before - set(done.deleted_keys)
        head = await client.get_head("g")
        assert (head.version, head.oldest_available) == (8, 5)
        # below retained history: precise errors naming the oldest available version
        with pytest.raises(errors.OutOfRange, match="oldest available version is 5"):
            await client.get_version("g", 3)
        with pytest.raises(errors.OutOfRange, match="oldest available version is 5"):
            async for _ in client.watch("g", after_version=2):
                pass
        with pytest.raises(errors.OutOfRange, match="garbage collected"):
            await client.plan_catch_up("g", want_version=4)
        with pytest.raises(errors.OutOfRange):
            await client.list_versions("g", from_version=2)
        # watch from 4 (= oldest - 1) and from 0 still work and start at the oldest
        events = []
        async for event in client.watch("g", after_version=0):
            events.append(event.version.version)
            if len(events) == 4:
                break
        assert events == [5, 6, 7, 8]
        plan = await client.plan_catch_up("g", have_version=0)
        assert [s.to_version for s in plan.steps] == [5, 6, 7, 8]
        # an island that lapsed at 4 (= oldest - 1) is sent the oldest's patch, which GC kept
        plan = await client.plan_catch_up("g", have_version=4)
        assert [(s.from_version, s.to_version) for s in plan.steps] == [(4, 5), (5, 6), (6, 7), (7, 8)]
        for step in plan.steps:
            assert all([await local_store.stat(b.key) for b in step.blobs]), step
        for v in range(5, 9):  # and no retained record names a deleted blob
            record = await client.get_version("g", v)
            assert all([await local_store.stat(b.key) for a in record.artifacts for b in a.blobs]), v
        again = await client.collect_garbage("g")
        assert list(again.deleted_keys) == [] and again.oldest_available == 5


async def test_staged_parts_no_commit_names_are_deleted_by_gc_and_checks_do_not_pile_up(board, local_store, redis_url):
    """A publisher staged two parts of version 3, restarted, and committed version 3 as one
    blob: the two parts are orphans, which GC deletes (after a dry run that lists them), while
    a part staged for version 4 (in flight) stays. A commit that names its staged parts leaves
    no check behind."""
    from weftboard.board.store import RedisStore, k_checked

    store = RedisStore(redis_url)  # what the board keeps, read beside it
    try:
        async with BoardClient(board.address, board.admin_token) as client:
            await client.create_run(make_run("o"))
            await publish(client, local_store, "o", [1, 2])
            lost = [await upload(local_store, "o", f"part {i} of version 3, never committed".encode()) for i in range(2)]
            for part in lost:
                await client.stage_part("o", 3, part)
            early = await upload(local_store, "o", b"a part of version 4, staged before 3 committed")
            await client.stage_part("o", 4, early)
            record = await make_record(local_store, "o", 3)  # the restarted publisher's one blob
            await client.commit_version(record)
            redis = store.redis
            assert set(await store.orphans("o")) == {p.key for p in lost}
            assert set(await redis.hkeys(k_checked("o"))) == {early.key.encode()}
            dry = await client.collect_garbage("o", dry_run=True)
            assert set(dry.deleted_keys) == {p.key for p in lost} and dry.freed_bytes == sum(p.size for p in lost)
            assert all([await local_store.stat(p.key) for p in lost])  # a dry run deletes nothing
            done = await client.collect_garbage("o")
            assert set(done.deleted_keys) == {p.key for p in lost}
            assert [await local_store.stat(p.key) for p in lost] == [None, None]
            assert await local_store.stat(early.key) == early.size
            assert await store.orphans("o") == {}
            assert (await client.get_version("o", 3)).root_digest == record.root_digest
            # version 4 commits naming its staged part: nothing is left to check or to collect
            record4 = await make_record(local_store, "o", 4)
            record4.artifacts[0].ClearField("blobs")
            record4.artifacts[0].blobs.append(early)
            await client.commit_version(record4)
            assert await redis.hlen(k_checked("o")) == 0 and await store.orphans("o") == {}
            assert list((await client.collect_garbage("o")).deleted_keys) == []
    finally:
        await store.close()


async def test_parts_staged_long_before_their_version_commits_are_still_settled(board, local_store, redis_url,
                                                                                monkeypatch):
    """A publisher staged a part of version 3 and died; it came back twenty minutes later,
    past ``CHECKED_TTL_S``, and committed version 3 as another blob. The part is still known
    (the ledger of staged parts does not expire), so it becomes an orphan that GC deletes. Its
    check, though, is stale: a part whose blob vanished meanwhile fails the commit's check."""
    from weftboard.board import store as store_module
    from weftboard.board.store import CHECKED_TTL_S, RedisStore, k_checked

    store = RedisStore(redis_url)
    real_now_ms = store_module.now_ms
    try:
        async with BoardClient(board.address, board.admin_token) as client:
            await client.create_run(make_run("late"))
            await publish(client, local_store, "late", [1, 2])
            lost = await upload(local_store, "late", b"a part of version 3 whose publisher died")
            await client.stage_part("late", 3, lost)
            assert await store.redis.ttl(k_checked("late")) == -1  # exists, with no expiry
            later = (CHECKED_TTL_S + 300) * 1000
            monkeypatch.setattr(store_module, "now_ms", lambda: real_now_ms() + later)
            assert await store.checked_sizes("late", [lost.key]) == {}  # the check is stale ...
            assert set(await store.redis.hkeys(k_checked("late"))) == {lost.key.encode()}  # ... the note is not

            await client.commit_version(await make_record(local_store, "late", 3))
            assert await store.orphans("late") == {lost.key: lost.size}
            assert list((await client.collect_garbage("late")).deleted_keys) == [lost.key]
            assert await local_store.stat(lost.key) is None

            # A part of version 4, checked now, then its blob deleted behind the board's back:
            # twenty minutes on, the commit asks the store again instead of trusting the check.
            monkeypatch.setattr(store_module, "now_ms", real_now_ms)
            gone = await upload(local_store, "late", b"a part of version 4 that an operator deleted")
            await client.stage_part("late", 4, gone)
            await local_store.delete([gone.key])
            record4 = await make_record(local_store, "late", 4)
            record4.artifacts[0].ClearField("blobs")
            record4.artifacts[0].blobs.append(gone)
            monkeypatch.setattr(store_module, "now_ms", lambda: real_now_ms() + later)
            with pytest.raises(errors.FailedPrecondition, match="does not exist"):
                await client.commit_version(record4)
    finally:
        await store.close()


async def test_gc_spares_live_island(board, local_store):
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("g", keep_anchors=1, keep_versions=1))
        await publish(client, local_store, "g", range(1, 4))
        await publish(client, local_store, "g", [4], anchor=True)
        await publish(client, local_store, "g", range(5, 7))
        await client.heartbeat(pb.IslandStatus(island_id="slow", run="g", version=2, state=pb.ISLAND_STATE_READY), lease_s=60)
        done = await client.collect_garbage("g")
        assert done.oldest_available == 1 and list(done.deleted_keys) == []
        plan = await client.plan_catch_up("g", have_version=2)
        assert [s.from_version for s in plan.steps] == [2, 3, 4, 5]
        # the island's lease runs out: now its chain may go
        await client.heartbeat(pb.IslandStatus(island_id="slow", run="g", version=2, state=pb.ISLAND_STATE_READY), lease_s=1)
        await asyncio.sleep(1.1)
        done = await client.collect_garbage("g")
        assert done.oldest_available == 4
        with pytest.raises(errors.NotFound):
            await client.collect_garbage("missing")


async def test_a_plan_reads_the_index_only_as_far_down_as_a_cheaper_chain_could_start(board, local_store) -> None:
    """PlanCatchUp reads the version index from the target down, a chunk at a time, and stops
    once no older start can be the cheapest: an island near the head of a long history (or a
    newcomer, with an anchor near the head) costs the board a chunk, not the whole history."""
    from boardkit import make_record

    from weftboard.board import handlers

    run, head = "long-history", 2 * handlers.PLAN_INDEX_CHUNK + 40
    read: list[int] = []
    store = board.handle.store  # the board runs in this process: its own Redis store, counted
    get_index = store.get_index

    async def counting(name: str, first: int, last: int):
        rows = await get_index(name, first, last)
        read.append(len(rows))
        return rows

    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run(run))
        for v in range(1, head + 1):
            record = await make_record(local_store, run, v, anchor=v in (1, head - 5))
            await client.commit_version(record)
        store.get_index = counting
        try:
            near = await client.plan_catch_up(run, have_version=head - 2)
            assert [(s.from_version, s.to_version) for s in near.steps] == [(head - 2, head - 1), (head - 1, head)]
            assert sum(read) <= handlers.PLAN_INDEX_CHUNK
            read.clear()
            newcomer = await client.plan_catch_up(run, have_version=0)
            assert newcomer.steps[0].kind == pb.ARTIFACT_KIND_ANCHOR and newcomer.steps[0].to_version == head - 5
            assert sum(read) <= handlers.PLAN_INDEX_CHUNK
            read.clear()
            old = await client.plan_catch_up(run, want_version=head - 10)  # below the newer anchor: the first one
            assert old.steps[0].to_version == 1 and len(old.steps) == head - 10
            assert sum(read) == head - 10  # every version down to it, as no chain is shorter
        finally:
            del store.get_index


async def test_a_watch_replaying_history_never_skips_what_gc_trimmed_meanwhile(board, local_store) -> None:
    """A Watch from 0 replays the log in batches; when GC moves the oldest version (and trims
    the log) between two batches, the stream ends with OUT_OF_RANGE naming the oldest version
    instead of jumping over the collected ones."""
    from boardkit import make_record

    run, head = "trimmed-meanwhile", 600
    store = board.handle.store  # the board runs in this process: its own Redis store
    events_after = store.events_after
    calls = 0

    async def gc_between_batches(name: str, after: int, count: int | None = None):
        nonlocal calls
        calls += 1
        if calls == 2:  # the replay's second batch: GC ran meanwhile
            await store.advance_oldest(name, 550)
        return await events_after(name, after, count=count)

    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run(run))
        for v in range(1, head + 1):
            await client.commit_version(await make_record(local_store, run, v, anchor=v in (1, 550)))
        store.events_after = gc_between_batches
        seen: list[int] = []
        try:
            with pytest.raises(errors.OutOfRange, match="oldest available version is 550"):
                async for event in client.watch(run, after_version=0):
                    if event.HasField("version"):
                        seen.append(event.version.version)
                        if seen[-1] == head:  # a stream that skipped the trimmed versions got here
                            break
        finally:
            del store.events_after
        assert seen == list(range(1, len(seen) + 1)) and len(seen) == 500  # in order, no gap
