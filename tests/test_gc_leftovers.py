"""GC collects what a publisher that died before its commit left: the parts it staged and the
anchor files it uploaded for a version that never committed, once they are older than the
grace period (``staged_grace_s``), never before, and never a blob a record names. The GC
report counts them."""

from __future__ import annotations

import os
import time

import pytest
import torch
from boardkit import make_record, make_run, publish, upload

from weftboard.board import gc as gcmod
from weftboard.board.client import BoardClient
from weftboard.board.config import BoardSettings
from weftboard.board.report import gc_document
from weftboard.board.store import CHECKED_TTL_S, RedisStore, k_checked
from weftboard.board.uploads import OpenUpload, UploadLedger

GRACE_S = 3600.0


async def test_leftovers_of_a_version_never_committed_are_collected_once_past_the_grace(board, local_store,
                                                                                        redis_url) -> None:
    store = RedisStore(redis_url)  # the board's Redis, read beside it
    try:
        async with BoardClient(board.address, board.admin_token) as client:
            await client.create_run(make_run("dead"))
            records = await publish(client, local_store, "dead", [1, 2])
            parts = [await upload(local_store, "dead", os.urandom(300 + i)) for i in range(2)]
            for part in parts:
                await client.stage_part("dead", 3, part)  # the publisher of version 3 died after this
            anchor = await upload(local_store, "dead", os.urandom(2000), name="model.safetensors")  # never noted
            t0 = int(time.time() * 1000)
            named = {b.key for r in records for a in r.artifacts for b in a.blobs}
            leftovers = {p.key for p in parts} | {anchor.key}

            async def gc(now_ms: int, *, dry_run: bool = False) -> gcmod.GcPlan:
                run = await client.get_run("dead")
                return await gcmod.collect_garbage(store, local_store, run, keep_anchors=2, keep_versions=64,
                                                   staged_grace_s=GRACE_S, dry_run=dry_run, now_ms=now_ms)

            # Within the grace the version could still commit: nothing of it is touched.
            within = await gc(t0 + int(GRACE_S * 1000) - 60_000)
            assert within.delete == () and within.staged_parts_collected == within.abandoned_blobs_collected == 0
            assert all([await local_store.stat(k) for k in leftovers])
            assert len(await store.redis.hkeys(k_checked("dead"))) == 2

            past = t0 + int(GRACE_S * 1000) + 60_000
            dry = await gc(past, dry_run=True)
            assert {k for k, _ in dry.delete} == leftovers
            assert (dry.staged_parts_collected, dry.abandoned_blobs_collected) == (2, 1)
            assert all([await local_store.stat(k) for k in leftovers])  # a dry run deletes nothing

            done = await gc(past)
            assert {k for k, _ in done.delete} == leftovers
            assert done.freed_bytes == sum(p.size for p in parts) + anchor.size
            assert (done.staged_parts_collected, done.abandoned_blobs_collected) == (2, 1)
            assert [await local_store.stat(k) for k in sorted(leftovers)] == [None] * 3
            assert await store.redis.hlen(k_checked("dead")) == 0  # their notes are gone too
            assert all([await local_store.stat(k) for k in named])  # the committed versions' blobs stay
            assert set(await local_store.list_keys("dead/")) == named
            assert (await client.get_head("dead")).oldest_available <= 1

            # the publisher comes back and commits version 3: the board checks its blobs again
            assert (await client.commit_version(await make_record(local_store, "dead", 3))).record.version == 3
            again = await gc(past + 60_000)
            assert again.delete == ()  # a committed version's blobs are never leftovers, however old
    finally:
        await store.close()


async def test_a_version_still_uploading_keeps_its_early_files_past_the_grace(board, local_store, redis_url) -> None:
    """An anchor of many files uploads one after another for longer than the grace: the
    first file's note is old, the newest is fresh. GC keeps every file of that version until
    the version's newest note is past the grace, then collects them all."""
    store = RedisStore(redis_url)
    try:
        async with BoardClient(board.address, board.admin_token) as client:
            await client.create_run(make_run("long"))
            await publish(client, local_store, "long", [1, 2])
            files = [await upload(local_store, "long", os.urandom(2000 + i), name=f"model-0000{i}.safetensors")
                     for i in (1, 2)]
            for f in files:
                await client.stage_part("long", 3, f)
            t0 = int(time.time() * 1000)
            first_at = t0 - 2 * int(GRACE_S * 1000)  # the first file was noted two graces ago
            await store.redis.hset(k_checked("long"), files[0].key, f"{files[0].size}:3:{first_at}")

            async def gc(now_ms: int) -> gcmod.GcPlan:
                return await gcmod.collect_garbage(store, local_store, await client.get_run("long"), keep_anchors=2,
                                                   keep_versions=64, staged_grace_s=GRACE_S, dry_run=False,
                                                   now_ms=now_ms)

            assert (await gc(t0 + 60_000)).delete == ()  # the version's newest file is a minute old
            assert [await local_store.stat(f.key) for f in files] == [f.size for f in files]
            late = await gc(t0 + int(GRACE_S * 1000) + 60_000)  # nothing for a grace: the publisher died
            assert {k for k, _ in late.delete} == {f.key for f in files} and late.staged_parts_collected == 2
    finally:
        await store.close()


async def test_the_publisher_notes_each_anchor_shard_once_it_is_up(board, local_store, redis_url, tmp_path) -> None:
    """``commit.upload_and_note``, the publisher's upload of an anchor shard: the shard is in
    the blob store and noted for its version, so GC ages it with that version's newest note
    (and collects it if the version never commits)."""
    from weftboard.board.blobs.transfer import Uploader
    from weftboard.cuda.anchors import write_checkpoint
    from weftboard.publisher.commit import upload_and_note

    store = RedisStore(redis_url)
    try:
        async with BoardClient(board.address, board.admin_token) as client:
            await client.create_run(make_run("noted"))
            await publish(client, local_store, "noted", [1, 2])
            shards = write_checkpoint(tmp_path / "v3", [(f"w{i}", torch.randn(64, 64)) for i in range(4)],
                                      shard_bytes=20_000)
            assert len(shards) >= 2
            uploader = Uploader("noted", client, local_store)
            keys = [await upload_and_note(wf, 3, run="noted", client=client, uploader=uploader) for wf in shards]
            assert [await local_store.stat(k) for k in keys] == [wf.size for wf in shards]
            notes = await store.staged_notes("noted")
            assert {k: notes[k][:2] for k in keys} == {k: (wf.size, 3) for k, wf in zip(keys, shards, strict=True)}
            t0 = int(time.time() * 1000)
            plan = await gcmod.collect_garbage(store, local_store, await client.get_run("noted"), keep_anchors=2,
                                               keep_versions=64, staged_grace_s=GRACE_S, dry_run=True,
                                               now_ms=t0 + int(GRACE_S * 1000) + 60_000)
            assert {k for k, _ in plan.delete} == set(keys) and plan.staged_parts_collected == len(keys)
    finally:
        await store.close()


async def test_a_multipart_blob_is_aged_from_its_completion_not_its_date(board, local_store, redis_url) -> None:
    """S3 dates an object made by a multipart upload from the upload's start: a long upload
    must not make a fresh blob look abandoned. GC ages it from the completion the board's
    upload ledger noted, and collects it only once its version stayed uncommitted that long."""
    store = RedisStore(redis_url)
    try:
        async with BoardClient(board.address, board.admin_token) as client:
            await client.create_run(make_run("slow"))
            await publish(client, local_store, "slow", [1, 2])
            blob = await upload(local_store, "slow", os.urandom(3000), name="model.safetensors")
            t0 = int(time.time() * 1000)
            old = time.time() - 2 * GRACE_S  # the store's date: when the upload began, long ago
            os.utime(local_store.root / blob.key, (old, old))
            await UploadLedger(store).put("slow", "up-1", OpenUpload(key=blob.key, digest=blob.digest, size=blob.size,
                                                                      part_bytes=5 << 20, store_id="s",
                                                                      started_ms=int(old * 1000), done_ms=t0))

            async def gc(now_ms: int) -> gcmod.GcPlan:
                return await gcmod.collect_garbage(store, local_store, await client.get_run("slow"), keep_anchors=2,
                                                   keep_versions=64, staged_grace_s=GRACE_S, dry_run=False,
                                                   now_ms=now_ms)

            assert (await gc(t0 + 60_000)).delete == ()  # completed a minute ago: its version may commit
            assert await local_store.stat(blob.key) == blob.size
            late = await gc(t0 + int(GRACE_S * 1000) + 60_000)  # a grace after its completion: abandoned
            assert [k for k, _ in late.delete] == [blob.key] and late.abandoned_blobs_collected == 1
    finally:
        await store.close()


async def test_the_gc_report_counts_staged_parts_collected(board, local_store) -> None:
    """Through the RPC: parts of version 3 that its commit did not name (orphans) are
    collected and counted, in the response and in ``gc --json``'s document."""
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("counted"))
        await publish(client, local_store, "counted", [1, 2])
        lost = [await upload(local_store, "counted", os.urandom(100 + i)) for i in range(3)]
        for part in lost:
            await client.stage_part("counted", 3, part)
        await client.commit_version(await make_record(local_store, "counted", 3))
        dry = await client.collect_garbage("counted", dry_run=True)
        assert dry.staged_parts_collected == 3 and dry.abandoned_blobs_collected == 0
        done = await client.collect_garbage("counted")
        assert set(done.deleted_keys) == {p.key for p in lost} and done.staged_parts_collected == 3
        document = gc_document("counted", False, done)
        assert document["staged_parts_collected"] == 3 and document["abandoned_blobs_collected"] == 0
        assert (await client.collect_garbage("counted")).staged_parts_collected == 0


def test_the_grace_is_a_setting_no_shorter_than_a_staged_parts_check() -> None:
    assert BoardSettings().staged_grace_s == GRACE_S
    assert BoardSettings(staged_grace_s=2 * GRACE_S).staged_grace_s == 2 * GRACE_S
    with pytest.raises(ValueError, match="staged_grace_s"):
        BoardSettings(staged_grace_s=CHECKED_TTL_S - 1)


@pytest.mark.parametrize("kind", ["s3", "local"])
async def test_blob_stores_list_sizes_and_last_writes(kind: str, s3_store, local_store) -> None:
    """What GC ages a never-named blob by: each store's listing of sizes and last writes."""
    store = s3_store if kind == "s3" else local_store
    before = time.time() - 5  # clocks of a store and its host may differ by a little
    await store.put_bytes("r/blobs/a", b"x" * 10)
    await store.put_bytes("r/blobs/b", b"y" * 20)
    await store.put_bytes("other/blobs/c", b"z")
    listed = await store.list_blobs("r/blobs/")
    assert {k: b.size for k, b in listed.items()} == {"r/blobs/a": 10, "r/blobs/b": 20}
    assert all(before <= b.modified_s <= time.time() + 5 for b in listed.values())
