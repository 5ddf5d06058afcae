"""Patches in parts, staged before their commit: the publisher cuts and stages them, a watcher
sees the hints first, islands download early but apply only what a committed record names.

Real board (real Redis), real blob store, real AdamW steps on a small model; ``part_bytes`` is
set small so a small model's patch comes in several parts.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from boardkit import upload
from pubsubkit import (
    WARM_KERNELS,
    Trainer,
    bits_equal,
    first_difference,
    zeros_like_layout,
)

from weftboard.board.blobs import fetch_url
from weftboard.board.client import BoardClient
from weftboard.cuda.codec import join_patches, read_patch_info
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.live_tensors import LiveTensorsDestination
from weftboard.subscriber.subscriber import Subscriber

pytestmark = WARM_KERNELS

PART_BYTES = 2048


async def _watch_all(client: BoardClient, run: str, until: int, out: list[pb.WatchEvent], *,
                     presign: bool = False) -> None:
    async for event in client.watch(run, after_version=1, staged_parts=True, progress_interval_ms=5000,
                                    presign=presign):
        out.append(event)
        if event.WhichOneof("event") == "version" and event.version.version >= until:
            return


def _step_and_publish(trainer: Trainer, pub: Publisher, views: dict[int, dict]) -> pb.VersionRecord:
    """One AdamW step, published and committed; ``views`` gets its served view by step."""
    trainer.step()
    views[trainer.step_no] = trainer.served()
    return pub.publish(trainer.model, step=trainer.step_no).result(30)


def _patch_blobs(record: pb.VersionRecord) -> list[pb.BlobRef]:
    return [b for a in record.artifacts if a.kind == pb.ARTIFACT_KIND_PATCH for b in a.blobs]


@pytest.mark.parametrize("during_read", [True, False])
async def test_parts_are_staged_before_the_commit_and_islands_follow_bitwise(board, local_store, tmp_path: Path,
                                                                             during_read: bool) -> None:
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}
    published = threading.Event()
    go = threading.Event()

    def train() -> None:
        with Publisher(board.address, "p", token=board.admin_token, blob_store=local_store, part_bytes=PART_BYTES,
                       parts_during_read=during_read) as pub:
            trainer.step()
            views[pub.publish(trainer.model, step=1).version] = trainer.served()
            pub.flush()
            published.set()
            go.wait(30)  # the watcher is listening: hints sent from now on reach it
            for _ in range(3):
                trainer.step()
                views[pub.publish(trainer.model, step=trainer.step_no).version] = trainer.served()
                pub.flush()

    task = asyncio.ensure_future(asyncio.to_thread(train))
    async with BoardClient(board.address, board.admin_token) as client:
        await asyncio.to_thread(published.wait, 30)
        events: list[pb.WatchEvent] = []
        watching = asyncio.ensure_future(_watch_all(client, "p", 4, events))
        await asyncio.sleep(0.5)  # the stream is open before the first hint
        go.set()
        await asyncio.wait_for(watching, 60)
        await task
        records = {e.version.version: e.version for e in events if e.WhichOneof("event") == "version"}
        assert sorted(records) == [2, 3, 4]
        for v, record in records.items():
            blobs = _patch_blobs(record)
            assert len(blobs) >= 3, f"version {v}: a patch of {record.stats.patch_bytes} bytes in {len(blobs)} parts"
            assert record.stats.patch_bytes == sum(b.size for b in blobs)
            # Every part was hinted before the commit (the hint names the blob exactly), but for
            # a last one with what the read did not stage, which carries the root.
            order = [i for i, e in enumerate(events) if e.WhichOneof("event") == "staged" and e.staged.version == v]
            commit_at = next(i for i, e in enumerate(events) if e.WhichOneof("event") == "version" and e.version.version == v)
            hinted = sorted((events[i].staged.blob for i in order), key=blobs.index)  # uploads finish in any order
            assert hinted == blobs[:len(hinted)] and len(hinted) >= len(blobs) - 1 and all(i < commit_at for i in order)
            assert all(events[i].staged.base_version == v - 1 for i in order)
            datas = [await local_store.get_bytes(b.key) for b in blobs]
            infos = [read_patch_info(d) for d in datas]
            assert [i.target_root for i in infos] == [""] * len(hinted) + [record.root_digest] * (len(blobs) - len(hinted))
            joined = read_patch_info(join_patches(datas))
            assert sorted(t.name for t in joined.tensors) == sorted(views[v])  # every tensor exactly once
            staged_order = [t.name for i in infos[:len(hinted)] for t in i.tensors]
            if during_read:  # finished as the read folded them: the view's order
                assert staged_order == [n for n in views[v] if n in staged_order]
            else:  # finished after the read, the tensors with the most changes first
                changes = {t.name: t.changed for t in joined.tensors}
                assert [changes[n] for n in staged_order] == sorted((changes[n] for n in staged_order), reverse=True)
            assert joined.target_root == record.root_digest and joined.base_version == v - 1

        # Islands reach every version bitwise: one applying parts as they arrive (live
        # tensors, told its store is far), one through the joined container (a checkpoint
        # directory; the local store's measured opens make it near).
        live = LiveTensorsDestination(zeros_like_layout(views[4]))
        streaming = Subscriber(client, "p", live, island_id="live", blob_store=local_store,
                               cache_dir=tmp_path / "c1", heartbeat=False)
        streaming.fetcher.far = lambda: True  # type: ignore[method-assign]
        directory = CheckpointDirDestination(tmp_path / "ckpt")
        joining = Subscriber(client, "p", directory, island_id="dir", blob_store=local_store,
                             cache_dir=tmp_path / "c2", heartbeat=False)
        for v in range(1, 5):
            assert await streaming.sync_to(v) == v and await joining.sync_to(v) == v
            assert bits_equal(live.tensors, views[v]), f"version {v}: {first_difference(live.tensors, views[v])}"
            assert streaming.timings[v].get("streamed", 0.0) == (1.0 if v > 1 else 0.0)
        from safetensors.torch import load_file

        on_disk = load_file(directory.current_dir() / "model.safetensors")
        assert bits_equal(on_disk, views[4]), first_difference(on_disk, views[4])
        assert not list((tmp_path / "c2").glob("joined-*")), "the joined container is removed after its apply"


class _HeldCommits:
    """The publisher's commits, which pass until ``hold()`` and are then held back until
    ``release`` is set: ``held`` gets each record, ``holding`` is set when one waits."""

    def __init__(self, pub: Publisher, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pub, self.monkeypatch = pub, monkeypatch
        self.release = threading.Event()
        self.release.set()
        self.holding = threading.Event()
        self.held: list[pb.VersionRecord] = []

    def hold(self) -> None:
        """From now on (the publisher's client exists once it published), commits wait."""
        self.release.clear()
        self.holding.clear()
        real_commit = self.pub._client.commit_version

        async def held_commit(record: pb.VersionRecord) -> Any:
            self.held.append(record)
            self.holding.set()
            await asyncio.to_thread(self.release.wait, 30)
            return await real_commit(record)

        self.monkeypatch.setattr(self.pub._client, "commit_version", held_commit)

    async def publish_held(self, trainer: Trainer, views: dict[int, dict], pub: Publisher) -> Any:
        """One more AdamW step published (``hold()`` first); its handle once its commit waits."""
        trainer.step()
        views[trainer.step_no] = trainer.served()
        handle = await asyncio.to_thread(pub.publish, trainer.model, step=trainer.step_no)
        await asyncio.to_thread(self.holding.wait, 30)
        return handle


async def _first_version_followed(trainer: Trainer, views: dict[int, dict], pub: Publisher, client: BoardClient,
                                  run: str, blob_store: Any, cache: Path) -> tuple[Subscriber, asyncio.Future]:
    """Version 1 published, and an island (live tensors, told its blobs are far, so it asks for
    hints) following the run from it, its watch stream open."""
    trainer.step()
    views[1] = trainer.served()
    await asyncio.to_thread(lambda: (pub.publish(trainer.model, step=1), pub.flush()))
    sub = Subscriber(client, run, LiveTensorsDestination(zeros_like_layout(views[1])), island_id="early",
                     blob_store=blob_store, cache_dir=cache, heartbeat=False)
    sub.fetcher.far = lambda: True  # type: ignore[method-assign]  (hints are for far stores; loopback is near)
    following = asyncio.ensure_future(sub.run())
    await sub.wait_for_version(1, 30)
    await asyncio.sleep(0.5)  # its watch stream is open
    return sub, following


async def _prefetched_all(sub: Subscriber, digests: set[str]) -> None:
    """Wait (up to 10 s) until the island downloaded every one of ``digests`` early."""
    for _ in range(200):
        if digests <= set(sub.downloads.prefetched) and all(d.task.done() for d in sub.downloads.prefetched.values()):
            return
        await asyncio.sleep(0.05)


async def test_an_island_downloads_staged_parts_early_and_applies_only_after_the_commit(
    board, local_store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit is held back: the following island has the hinted parts (and one bogus hint's
    blob) on hand, still serves the previous version bit for bit, and after the commit holds the
    new version having downloaded each committed byte once; the bogus part is dropped."""
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}

    async with BoardClient(board.address, board.admin_token) as client:
        pub = Publisher(board.address, "q", token=board.admin_token, blob_store=local_store, part_bytes=PART_BYTES)
        commits = _HeldCommits(pub, monkeypatch)
        try:
            sub, following = await _first_version_followed(trainer, views, pub, client, "q", local_store,
                                                            tmp_path / "cache")
            dest = sub.destination
            commits.hold()
            bogus = await upload(local_store, "q", b"a part no record will name")
            await client.stage_part("q", 2, bogus)
            handle = await commits.publish_held(trainer, views, pub)
            # Every part is uploaded and hinted before the commit; the downloads the hints
            # start finish while the commit waits.
            hinted = {b.digest for b in _patch_blobs(commits.held[-1])
                      if not read_patch_info(await local_store.get_bytes(b.key)).target_root} | {bogus.digest}
            await _prefetched_all(sub, hinted)
            assert bogus.digest in sub.downloads.prefetched and len(sub.downloads.prefetched) >= 3
            assert sub.held_version == 1 and bits_equal(dest.tensors, views[1])  # nothing applied early
            downloaded_before = sub.fetcher.bytes_downloaded
            commits.release.set()
            record = await asyncio.to_thread(handle.result, 30)
            await sub.wait_for_version(2, 30)
            assert bits_equal(dest.tensors, views[2]), first_difference(dest.tensors, views[2])
            parts = _patch_blobs(record)
            unstaged = [b for b in parts if read_patch_info(await local_store.get_bytes(b.key)).target_root]
            assert len(unstaged) <= 1
            assert sub.fetcher.bytes_downloaded == downloaded_before + sum(b.size for b in unstaged)  # staged parts came once
            assert sum(b.size for b in parts) - sum(b.size for b in unstaged) + len(b"a part no record will name") <= downloaded_before
            assert sub.downloads.prefetched == {}  # the unused hint's download is gone with version 2
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        finally:
            commits.release.set()
            await asyncio.to_thread(pub.close)


async def test_an_island_without_credentials_downloads_presigned_staged_parts_early(
    board_factory, s3_store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An island with no blob-store credentials asks for hints and version events with presigned
    URLs (a watch that does not ask gets none; every watch that asks gets the same URL of a
    part), and takes the version without asking for a plan: while the commit is held back it downloads every hinted part
    through its URL and still serves the previous version; after the commit it holds the new
    version bit for bit, the staged parts downloaded once."""
    board = await board_factory(blobs=s3_store)
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}

    async with BoardClient(board.address, board.admin_token) as client:
        pub = Publisher(board.address, "u", token=board.admin_token, blob_store=s3_store, part_bytes=PART_BYTES)
        commits = _HeldCommits(pub, monkeypatch)
        try:
            sub, following = await _first_version_followed(trainer, views, pub, client, "u", None, tmp_path / "cache")
            dest = sub.destination
            commits.hold()
            plain: list[pb.WatchEvent] = []
            signed: list[pb.WatchEvent] = []
            watchers = [asyncio.ensure_future(_watch_all(client, "u", 2, plain)),
                        asyncio.ensure_future(_watch_all(client, "u", 2, signed, presign=True))]
            await asyncio.sleep(0.5)  # every watch stream is open
            handle = await commits.publish_held(trainer, views, pub)
            hinted = {b.digest for b in _patch_blobs(commits.held[-1])
                      if not read_patch_info(await s3_store.get_bytes(b.key)).target_root}
            assert len(hinted) >= 2
            await _prefetched_all(sub, hinted)
            assert hinted <= set(sub.downloads.prefetched) and all(d.task.done() for d in sub.downloads.prefetched.values())
            assert all(d.ref.url and not d.task.exception() for d in sub.downloads.prefetched.values())
            island_urls = {digest: d.ref.url for digest, d in sub.downloads.prefetched.items()}
            assert sub.held_version == 1 and bits_equal(dest.tensors, views[1])  # nothing applied early
            downloaded_before = sub.fetcher.bytes_downloaded
            plans: list[int] = []
            real_plan = client.plan_catch_up

            async def counted_plan(*args: Any, **kwargs: Any) -> pb.CatchUpPlan:
                plans.append(kwargs.get("want_version", 0))
                return await real_plan(*args, **kwargs)

            monkeypatch.setattr(client, "plan_catch_up", counted_plan)
            commits.release.set()
            record = await asyncio.to_thread(handle.result, 30)
            await sub.wait_for_version(2, 30)
            assert bits_equal(dest.tensors, views[2]), first_difference(dest.tensors, views[2])
            assert plans == []  # the version event's URLs made the plan: no PlanCatchUp round trip
            unstaged = [b for b in _patch_blobs(record) if b.digest not in hinted]
            assert sub.fetcher.bytes_downloaded == downloaded_before + sum(b.size for b in unstaged)

            await asyncio.wait_for(asyncio.gather(*watchers), 30)
            unsigned_hints = [e.staged.blob for e in plain if e.WhichOneof("event") == "staged"]
            signed_hints = [e.staged.blob for e in signed if e.WhichOneof("event") == "staged"]
            assert {b.digest for b in unsigned_hints} == {b.digest for b in signed_hints} == hinted
            assert not any(b.url for b in unsigned_hints)
            assert {b.digest: b.url for b in signed_hints} == island_urls  # one URL a part for every watcher
            signed_record, = [e.version for e in signed if e.WhichOneof("event") == "version"]
            unsigned_record, = [e.version for e in plain if e.WhichOneof("event") == "version"]
            assert all(b.url for b in _patch_blobs(signed_record)) and not any(b.url for b in _patch_blobs(unsigned_record))
            for blob in signed_hints:  # each URL reads its own part
                got = tmp_path / "via-url"
                await fetch_url(blob.url, got)
                assert got.read_bytes() == await s3_store.get_bytes(blob.key)
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        finally:
            commits.release.set()
            await asyncio.to_thread(pub.close)


def test_the_cutter_ships_disjoint_parts_of_about_part_bytes_and_the_rest_on_flush() -> None:
    """Pure: streams in, containers out, in order; each part is a valid container of its tensors."""
    import concurrent.futures

    import torch

    from weftboard.cuda.codec import encode_streams
    from weftboard.cuda.diff import diff_tensor
    from weftboard.proto.errors import InvalidArgument
    from weftboard.publisher.parts import PartCutter, staged_names

    g = torch.Generator().manual_seed(0)
    old = {f"t{i}": torch.randn(2000, generator=g).to(torch.bfloat16) for i in range(9)}
    new = {n: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(torch.bfloat16) for n, t in old.items()}
    new["t4"] = old["t4"].clone()  # unchanged: an empty stream, shipped with its neighbours
    streams = encode_streams([(n, diff_tensor(old[n], new[n])) for n in old])
    shipped: list[bytes] = []

    def ship(data: bytes) -> concurrent.futures.Future:
        shipped.append(data)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(len(shipped))
        return done

    size = int(streams[0].stream.nbytes) * 2
    cutter = PartCutter(5, "default", size, ship)
    for s in streams:
        cutter.add(s)
    cut = len(shipped)
    assert 2 <= cut < len(streams)
    cutter.flush()
    cutter.flush()  # nothing left: no empty part
    assert len(shipped) in (cut, cut + 1) and len(cutter.parts) == len(shipped)
    assert staged_names(cutter.parts) == set(old)
    infos = [read_patch_info(d) for d in shipped]
    assert [t.name for i in infos for t in i.tensors] == list(old)  # disjoint, in order
    assert all(i.base_version == 4 and i.target_version == 5 and i.target_root == "" for i in infos)
    assert all(sum(t.stream_bytes for t in i.tensors) >= size for i in infos[:cut])
    assert [f.result() for _, f in cutter.parts] == list(range(1, len(shipped) + 1))
    with pytest.raises(InvalidArgument, match="part_bytes"):
        PartCutter(2, "default", 0, ship)


async def test_an_island_ignores_hints_it_cannot_use_or_afford(local_store, tmp_path: Path) -> None:
    """Old versions, no blob-store credentials (and no URL), parts too large to hold, and a flood
    beyond the cap start no download; a usable hint starts one, and holding its version drops it."""
    from weftboard.subscriber import downloads as dlmod

    dest = LiveTensorsDestination({}, held_version=3)
    sub = Subscriber(None, "r", dest, island_id="x", blob_store=local_store, cache_dir=tmp_path / "c", heartbeat=False)
    part = await upload(local_store, "r", b"a staged part")

    def hint(version: int, blob: pb.BlobRef = part) -> pb.StagedPart:
        return pb.StagedPart(version=version, base_version=version - 1, blob=blob)

    downloads = sub.downloads
    downloads.prefetch(hint(3), sub.held_version)  # the island holds 3 already
    huge = pb.BlobRef(key=part.key, digest=part.digest, size=dlmod.MAX_PREFETCH_BYTES + 1)
    downloads.prefetch(hint(4, huge), sub.held_version)
    assert downloads.prefetched == {}
    no_creds = Subscriber(None, "r", dest, island_id="y", blob_store=None, cache_dir=tmp_path / "d", heartbeat=False)
    no_creds.downloads.prefetch(hint(4), no_creds.held_version)  # no store and no URL: nothing to read it with
    assert no_creds.downloads.prefetched == {}
    downloads.prefetch(hint(4), sub.held_version)
    downloads.prefetch(hint(4), sub.held_version)  # the same part twice: one download
    assert list(downloads.prefetched) == [part.digest]
    path, _ = await downloads.prefetched[part.digest].task
    assert path.read_bytes() == b"a staged part"
    for i in range(dlmod.MAX_PREFETCHED + 5):
        downloads.prefetch(hint(5, pb.BlobRef(key=part.key, digest=f"xxh3-128:{i:032x}", size=part.size)), sub.held_version)
    assert len(downloads.prefetched) == dlmod.MAX_PREFETCHED
    downloads.drop_prefetched(upto=5)
    assert downloads.prefetched == {}
    await asyncio.sleep(0.2)  # the cancelled downloads end and forget their files
    assert not path.exists()


@pytest.mark.parametrize("far", [True, False])
async def test_by_default_a_publisher_stages_parts_while_an_island_asks_for_them(
    board, local_store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, far: bool
) -> None:
    """An island asks for hints when its blob store is far; the board's answer to each commit
    tells the publisher (default ``part_bytes``) whether to cut the next versions in parts."""
    from weftboard.publisher import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "SUGGESTED_PART_BYTES", PART_BYTES)
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}
    records: dict[int, pb.VersionRecord] = {}

    def publish_one() -> None:
        record = _step_and_publish(trainer, pub, views)
        records[trainer.step_no] = record  # keyed by step, as views are

    async with BoardClient(board.address, board.admin_token) as client:
        pub = Publisher(board.address, "auto", token=board.admin_token, blob_store=local_store)
        try:
            await asyncio.to_thread(publish_one)
            first = min(views)
            dest = LiveTensorsDestination(zeros_like_layout(views[first]))
            sub = Subscriber(client, "auto", dest, island_id="i", blob_store=local_store,
                             cache_dir=tmp_path / "cache", heartbeat=False)
            sub.fetcher.far = lambda: far  # type: ignore[method-assign]
            following = asyncio.ensure_future(sub.run())
            for _ in range(3):
                await sub.wait_for_version(max(views), 30)  # the island's watch is open from here
                await asyncio.to_thread(publish_one)
            last = max(views)
            await sub.wait_for_version(last, 30)
            assert bits_equal(dest.tensors, views[last]), first_difference(dest.tensors, views[last])
            # The second commit was made with the island watching; the version read after it:
            assert pub._parts_wanted is far
            assert (len(_patch_blobs(records[last])) >= 3) is far, [b.size for b in _patch_blobs(records[last])]
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        finally:
            await asyncio.to_thread(pub.close)


@pytest.mark.parametrize("far", [False, True])
async def test_an_island_probes_its_store_and_asks_for_hints_only_when_far(
    board_factory, s3_store, tmp_path: Path, far: bool
) -> None:
    """The catch-up's one large GET waited long (a sample of 1 s): before it opens its watch,
    the island samples the path with small requests. Real loopback S3 answers those fast, so
    it asks for no hints and the publisher ships one blob; a far store (40 ms) keeps it asking
    until its later downloads show a near path."""
    board = await board_factory(blobs=s3_store)
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}

    def publish_one() -> pb.VersionRecord:
        return _step_and_publish(trainer, pub, views)

    pub = Publisher(board.address, "probed", token=board.admin_token, blob_store=s3_store)
    async with BoardClient(board.address, board.admin_token) as client:
        try:
            await asyncio.to_thread(publish_one)
            sub = Subscriber(client, "probed", LiveTensorsDestination(zeros_like_layout(views[1])), island_id="i",
                             blob_store=s3_store, cache_dir=tmp_path / "cache", heartbeat=False)
            assert await sub.sync_to(1) == 1
            s3_store._first_byte.clear()
            s3_store._first_byte.append(1.0)
            if far:
                s3_store.first_byte_s = lambda: 0.04  # type: ignore[method-assign]
            following = asyncio.ensure_future(sub.run())
            await asyncio.to_thread(publish_one)
            await sub.wait_for_version(2, 30)  # its watch is open from here
            assert sub.fetcher.far() is far and len(s3_store._first_byte) >= 4  # the slow one, three probes, v2
            record = await asyncio.to_thread(publish_one)
            assert pub._parts_wanted is far
            await sub.wait_for_version(3, 30)
            assert bits_equal(sub.destination.tensors, views[3])
            assert len(_patch_blobs(record)) >= 1
            if far:  # later downloads show a near path: the island watches again, without hints
                s3_store.first_byte_s = lambda: 0.002  # type: ignore[method-assign]
                for _ in range(10):
                    await asyncio.to_thread(publish_one)
                    if not pub._parts_wanted:
                        break
                assert not pub._parts_wanted
                await sub.wait_for_version(max(views), 30)
                assert bits_equal(sub.destination.tensors, views[max(views)])
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        finally:
            await asyncio.to_thread(pub.close)


def test_parts_ship_while_the_read_still_folds_and_the_patch_is_exact() -> None:
    """``FinishAhead``: a tensor's part is shipped before the read folds the next tensor (the
    read checks here for the first part before folding on: a finish after the read would not
    have shipped it); the parts then patch the old view into the new one bitwise."""
    import concurrent.futures

    import torch

    from weftboard.cuda.codec import apply_patch_
    from weftboard.cuda.formats import Projector, ServedFormatSpec
    from weftboard.publisher.parts import FinishAhead, PartCutter
    from weftboard.publisher.served_view import ServedView

    g = torch.Generator().manual_seed(3)
    master = {f"t{i}": torch.randn(40_000 + 1000 * i, generator=g) for i in range(4)}
    with concurrent.futures.ThreadPoolExecutor(2) as hash_pool:
        view = ServedView("r", Projector(ServedFormatSpec("bf16")), "default", hash_pool)
        view.layout = [(n, "bfloat16", tuple(t.shape)) for n, t in master.items()]
        assert view.fold(master, anchor=True, scan=True) is None  # the first read makes the view
        old = {n: t.clone() for n, t in view.tensors.items()}
        master = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in master.items()}
        shipped: list[bytes] = []
        first_shipped = threading.Event()

        def ship(data: bytes) -> concurrent.futures.Future:
            shipped.append(data)
            first_shipped.set()
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(len(shipped))
            return done

        cutter = PartCutter(2, "default", 1, ship)  # a part per tensor
        ahead = FinishAhead(cutter, view.encode_scanned)
        folded_order: list[str] = []

        def on_scanned(name: str, scans: Any) -> None:
            ahead.add(name, scans)
            if not folded_order:
                assert first_shipped.is_set(), "the first tensor's part did not ship during the read"
            folded_order.append(name)

        folded = view.fold(master, anchor=False, scan=True, on_scanned=on_scanned)
        deltas, fused = view.finish(folded, cutter, False, ahead.streams())
    assert folded_order == list(master) and not deltas and sorted(fused) == sorted(master)
    assert [t.name for d in shipped for t in read_patch_info(d).tensors] == list(master)  # in fold order
    apply_patch_(old, join_patches(shipped))
    assert bits_equal(old, view.tensors), first_difference(old, view.tensors)


def test_a_failed_encode_during_the_read_is_raised_and_ships_nothing() -> None:
    import concurrent.futures

    from weftboard.publisher.parts import FinishAhead, PartCutter

    shipped: list[bytes] = []

    def ship(data: bytes) -> concurrent.futures.Future:
        shipped.append(data)
        raise AssertionError("nothing is shipped")

    def failing(name: str, scans: Any) -> Any:
        raise ValueError(f"cannot encode {name}")

    ahead = FinishAhead(PartCutter(2, "default", 1, ship), failing)
    with pytest.raises(ValueError, match="cannot encode w"):
        ahead.add("w", object())
    assert ahead.streams() == {} and shipped == []
