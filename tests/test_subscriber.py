"""The subscriber against a real board: following, corrupted blobs (refetch, then anchor
fallback, ERROR heartbeats), resumable verified downloads."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web
from enginekit import CatchAllServer
from pubsubkit import WARM_KERNELS, Trainer, bits_equal, run_cli, zeros_like_layout
from test_engine_adapters import RecordingEngine

from weftboard.board.blobs import LocalDirBlobStore
from weftboard.board.client import BoardClient
from weftboard.proto.errors import ApplyError, DigestMismatch
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.admission import AdmissionGate, VersionState
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.engine_destination import EngineDestination
from weftboard.subscriber.engines.base import ActivationMode
from weftboard.subscriber.engines.sglang import SglangAdapter
from weftboard.subscriber.fetch import Fetcher, cache_path
from weftboard.subscriber.live_tensors import LiveTensorsDestination
from weftboard.subscriber.subscriber import Subscriber

pytestmark = WARM_KERNELS


async def _publish(board, store, run: str, n: int, **kw) -> dict[int, dict]:
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}

    def go() -> None:
        with Publisher(board.address, run, token=board.admin_token, blob_store=store, **kw) as pub:
            for _ in range(n):
                trainer.step()
                views[pub.publish(trainer.model, step=trainer.step_no).version] = trainer.served()

    await asyncio.to_thread(go)
    return views


class StateLog:
    def __init__(self, sub: Subscriber) -> None:
        self.states: list[tuple[int, str]] = []
        original = sub._set_state

        async def record(state: int, message: str = "") -> None:
            self.states.append((state, message))
            await original(state, message)

        sub._set_state = record  # observe the states the subscriber heartbeats


async def _corrupt(store, ref: pb.BlobRef) -> None:
    data = bytearray(await store.get_bytes(ref.key))
    data[len(data) // 2] ^= 0x5A
    await store.put_bytes(ref.key, bytes(data))


def _artifact(rec: pb.VersionRecord, kind: int) -> pb.Artifact:
    return next(a for a in rec.artifacts if a.kind == kind)


async def test_corrupted_patches_refetch_then_anchor_fallback(board, local_store, tmp_path: Path) -> None:
    views = await _publish(board, local_store, "cx", 3, anchor_every=2, anchor_patch_fraction=100.0)
    async with BoardClient(board.address, board.admin_token) as client:
        dest = LiveTensorsDestination(zeros_like_layout(views[1]))
        sub = Subscriber(client, "cx", dest, island_id="isl", blob_store=local_store, cache_dir=tmp_path / "c")
        log = StateLog(sub)
        assert await sub.sync_to(1) == 1
        for v in (2, 3):
            await _corrupt(local_store, _artifact(await client.get_version("cx", v), pb.ARTIFACT_KIND_PATCH).blobs[0])
        plan = await client.plan_catch_up("cx", have_version=1, want_version=3)
        assert [s.kind for s in plan.steps] == [pb.ARTIFACT_KIND_PATCH, pb.ARTIFACT_KIND_PATCH]
        assert await sub.sync_to(3) == 3
        assert bits_equal(dest.tensors, views[3])  # reached through the version-3 anchor
        errors = [m for s, m in log.states if s == pb.ISLAND_STATE_ERROR]
        assert len(errors) == 2 and all("DigestMismatch" in m for m in errors)
        assert log.states[-1][0] == pb.ISLAND_STATE_READY
        islands = {i.status.island_id: i.status for i in (await client.list_islands("cx")).islands}
        assert islands["isl"].state == pb.ISLAND_STATE_READY and islands["isl"].version == 3


async def test_everything_corrupted_keeps_old_version_and_reports_error(board, local_store, tmp_path: Path) -> None:
    views = await _publish(board, local_store, "cy", 2, anchor_every=1000, anchor_patch_fraction=100.0)
    async with BoardClient(board.address, board.admin_token) as client:
        dest = LiveTensorsDestination(zeros_like_layout(views[1]))
        sub = Subscriber(client, "cy", dest, island_id="isl", blob_store=local_store, cache_dir=tmp_path / "c")
        assert await sub.sync_to(1) == 1
        await _corrupt(local_store, _artifact(await client.get_version("cy", 2), pb.ARTIFACT_KIND_PATCH).blobs[0])
        await _corrupt(local_store, _artifact(await client.get_version("cy", 1), pb.ARTIFACT_KIND_ANCHOR).blobs[0])
        with pytest.raises(ApplyError, match="could not reach"):
            await sub.sync_to(2)
        assert sub.held_version == 1 and bits_equal(dest.tensors, views[1])
        status = {i.status.island_id: i.status for i in (await client.list_islands("cy")).islands}["isl"]
        assert status.state == pb.ISLAND_STATE_ERROR and status.version == 1 and "DigestMismatch" in status.message


async def test_one_patch_steps_apply_while_they_download_in_ranges(board_factory, s3_store, tmp_path: Path) -> None:
    """A follower one version behind applies each patch as its byte ranges arrive (the store
    looks far, so ranges are used) and ends bitwise on every version; from a near store, and
    for a plan of several steps, it downloads first and then applies."""
    board = await board_factory(blobs=s3_store)
    views = await _publish(board, s3_store, "cs", 6, anchor_every=1000, anchor_patch_fraction=100.0)
    s3_store.first_byte_s = lambda: 0.04
    ranged: list[int] = []
    real_ranges = s3_store._download_ranges

    def counting(key, name, dest, total, parts, on_chunk=None, **kw):
        ranged.append(parts)
        return real_ranges(key, name, dest, total, parts, on_chunk, **kw)

    s3_store._download_ranges = counting
    async with BoardClient(board.address, board.admin_token) as client:
        dest = LiveTensorsDestination(zeros_like_layout(views[1]))
        sub = Subscriber(client, "cs", dest, island_id="isl", blob_store=s3_store, cache_dir=tmp_path / "c",
                         heartbeat=False)
        sub.fetcher.ranges = 3
        assert await sub.sync_to(1) == 1
        for v in (2, 3):
            assert await sub.sync_to(v) == v
            assert bits_equal(dest.tensors, views[v])
            assert sub.timings[v].get("streamed") == 1.0
        assert ranged and all(p > 1 for p in ranged)  # the streamed patches came as parallel ranges
        s3_store.first_byte_s = lambda: 0.002  # a near store: download, then apply
        assert await sub.sync_to(4) == 4 and bits_equal(dest.tensors, views[4])
        assert "streamed" not in sub.timings[4]
        s3_store.first_byte_s = lambda: 0.04
        assert await sub.sync_to(6) == 6  # two steps: downloaded, then applied in order
        assert bits_equal(dest.tensors, views[6])
        assert "streamed" not in sub.timings.get(6, {})
        assert not any(p.is_file() for p in (tmp_path / "c").rglob("*"))  # applied blobs are dropped


async def test_run_follows_new_versions_and_signals(board, local_store, tmp_path: Path) -> None:
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}
    pub = Publisher(board.address, "fo", token=board.admin_token, blob_store=local_store)

    async def publish() -> int:
        def go() -> int:
            trainer.step()
            h = pub.publish(trainer.model, step=trainer.step_no)
            views[h.version] = trainer.served()
            h.result(30)
            return h.version
        return await asyncio.to_thread(go)

    try:
        await publish()
        async with BoardClient(board.address, board.admin_token) as client:
            dest = LiveTensorsDestination(zeros_like_layout(views[1]))
            sub = Subscriber(client, "fo", dest, island_id="f", blob_store=local_store, cache_dir=tmp_path / "c", heartbeat_s=0.5)
            seen: list[int] = []
            sub.add_listener(seen.append)
            task = asyncio.ensure_future(sub.run())
            try:
                assert await sub.wait_for_version(1, 20) == 1
                assert sub.version_changed.is_set()
                sub.version_changed.clear()
                for v in (2, 3, 4):
                    assert await publish() == v
                assert await sub.wait_for_version(4, 20) == 4
                assert sub.version_changed.is_set()
                # READY follows the version: after the CATCHING_UP report's round trip
                for _ in range(200):
                    if sub.state == pb.ISLAND_STATE_READY:
                        break
                    await asyncio.sleep(0.05)
                assert seen == [1, 2, 3, 4] and sub.head == 4 and sub.state == pb.ISLAND_STATE_READY
                assert bits_equal(dest.tensors, views[4])
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    finally:
        await asyncio.to_thread(pub.close, False)


class CountingStore(LocalDirBlobStore):
    """The board's blob directory, counting the island's downloads of each key."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: Counter[str] = Counter()

    async def download_to(self, key: str, path, offset: int = 0, **kw) -> int:
        self.reads[key] += 1
        return await super().download_to(key, path, offset, **kw)


class RefusingEngine(RecordingEngine):
    """An SGLang engine over HTTP that answers its next ``refusals`` weight loads with an error."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals = 0

    async def _handle(self, request: web.Request) -> web.Response:
        if request.path == "/update_weights_from_disk" and self.refusals > 0:
            self.refusals -= 1
            return web.json_response({"error": "engine restarting"}, status=500)
        return await super()._handle(request)


async def test_an_engine_failure_keeps_the_verified_blobs_for_the_retry(board, local_store, tmp_path: Path) -> None:
    """A weight load the engine refuses (an ApplyError, not bad bytes) is retried from the
    blobs already verified in the cache, not downloaded again; once the version is held none
    of them is left; blobs kept for a retry that the next plan does not use are dropped."""
    await _publish(board, local_store, "ek", 2, anchor_every=1000, anchor_patch_fraction=100.0)
    store, cache = CountingStore(tmp_path / "blobs"), tmp_path / "c"
    engine = await RefusingEngine().start()
    adapter = SglangAdapter(engine.url, timeout_s=5)
    folder = CheckpointDirDestination(tmp_path / "ckpt")
    dest = EngineDestination(adapter, AdmissionGate(ActivationMode.DRAIN), VersionState(), folder,
                             checkpoint_dir=folder.current)
    try:
        async with BoardClient(board.address, board.admin_token) as client:
            sub = Subscriber(client, "ek", dest, island_id="isl", blob_store=store, cache_dir=cache, heartbeat=False)
            anchor = _artifact(await client.get_version("ek", 1), pb.ARTIFACT_KIND_ANCHOR).blobs
            patch = _artifact(await client.get_version("ek", 2), pb.ARTIFACT_KIND_PATCH).blobs
            engine.refusals = 1  # attempt 1 refused, attempt 2 loads
            assert await sub.sync_to(1) == 1 and engine.refusals == 0
            assert [store.reads[b.key] for b in anchor] == [1] * len(anchor)  # downloaded once
            assert not any(p.is_file() for p in cache.rglob("*"))  # held: nothing of it left

            engine.refusals = 3  # every attempt refused: patch 2 twice, then anchor 1 + patch 2
            with pytest.raises(ApplyError, match="could not reach"):
                await sub.sync_to(2)
            assert sub.held_version == 1 and cache_path(cache, patch[0]).is_file()  # kept for the next try
            assert all(cache_path(cache, b).is_file() for b in anchor)
            assert await sub.sync_to(2) == 2  # a patch from 1: the kept anchor is not used, so dropped
            assert [store.reads[b.key] for b in patch] == [1] * len(patch)
            assert not any(p.is_file() for p in cache.rglob("*"))
    finally:
        await dest.close()
        await adapter.close()
        await engine.stop()


class FlakyBoard:
    """A real board client whose ``get_head`` first raises each of ``failures`` in turn."""

    def __init__(self, client: BoardClient, failures: list[BaseException]) -> None:
        self._client, self.failures, self.raised = client, list(failures), []

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    async def get_head(self, run: str) -> pb.Head:
        if self.failures:
            self.raised.append(self.failures.pop(0))
            raise self.raised[-1]
        return await self._client.get_head(run)


async def test_run_outlasts_what_retrying_cures_and_ends_on_what_it_cannot(board, local_store, tmp_path: Path,
                                                                           monkeypatch) -> None:
    """A slow board (DEADLINE_EXCEEDED), an internal error or an exhausted resource on it (the
    client's bare WeftboardError), an expired presigned URL and a full disk are retried until
    the island holds the version; a token the board refuses ends ``run()`` with that error."""
    from weftboard.proto import errors
    from weftboard.subscriber import subscriber as subscriber_module

    waits: list[float] = []
    monkeypatch.setattr(subscriber_module, "retry_delay_s", lambda failures: waits.append(failures) or 0.01)
    views = await _publish(board, local_store, "fl", 1)
    transient = [errors.DeadlineExceeded("deadline"), errors.from_status_code("INTERNAL", "boom"),
                 errors.from_status_code("RESOURCE_EXHAUSTED", "busy"), errors.Unavailable("away"),
                 errors.UrlExpired("403"), OSError(28, "No space left on device")]
    async with BoardClient(board.address, board.admin_token) as real:
        flaky = FlakyBoard(real, transient)
        dest = LiveTensorsDestination(zeros_like_layout(views[1]))
        sub = Subscriber(flaky, "fl", dest, island_id="fl", blob_store=local_store, cache_dir=tmp_path / "c",
                         heartbeat=False)
        task = asyncio.ensure_future(sub.run())
        try:
            assert await sub.wait_for_version(1, 30) == 1
            assert bits_equal(dest.tensors, views[1]) and len(flaky.raised) == len(transient)
            assert waits == [1, 2, 3, 4, 5, 6]  # the failures in a row, counted for the growing delay
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        for fatal in (errors.Unauthenticated("token refused"), errors.PermissionDenied("not this run")):
            sub = Subscriber(FlakyBoard(real, [fatal]), "fl", LiveTensorsDestination(zeros_like_layout(views[1])),
                             island_id="fl2", blob_store=local_store, cache_dir=tmp_path / "c2", heartbeat=False)
            with pytest.raises(type(fatal)):
                await asyncio.wait_for(sub.run(), 10)


def test_retry_delay_grows_to_its_cap() -> None:
    from weftboard.subscriber.subscriber import RETRY_MAX_S, retry_delay_s

    assert [retry_delay_s(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert retry_delay_s(50) == RETRY_MAX_S == 30.0


async def _stored_blob(store, data: bytes) -> pb.BlobRef:
    """``data`` put in ``store`` under its content-addressed key of run "r"."""
    import xxhash

    from weftboard.proto.domain import blob_key, format_digest

    digest = format_digest(xxhash.xxh3_128(data).digest())
    await store.put_bytes(blob_key("r", digest), data)
    return pb.BlobRef(key=blob_key("r", digest), digest=digest, size=len(data))


async def test_fetch_resumes_partial_download_and_rejects_bad_bytes(local_store, tmp_path: Path) -> None:
    data = bytes(range(256)) * 4000
    ref = await _stored_blob(local_store, data)
    fetcher = Fetcher(tmp_path / "cache", local_store)
    part = cache_path(fetcher.cache_dir, ref).with_name(cache_path(fetcher.cache_dir, ref).name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(data[:300_000])  # an interrupted earlier download
    path = await fetcher.fetch(ref)
    assert path.read_bytes() == data
    assert fetcher.bytes_downloaded == len(data)
    fetcher.forget(ref)

    part.write_bytes(b"\0" * 300_000)  # a partial file with wrong bytes: caught by the digest
    with pytest.raises(DigestMismatch):
        await fetcher.fetch(ref)
    assert not part.exists() and not path.exists()
    assert (await fetcher.fetch(ref)).read_bytes() == data  # the next attempt starts clean


async def test_fetch_starts_over_from_a_part_longer_than_the_blob_and_replaces_a_bad_cached_file(
        local_store, tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000
    ref = await _stored_blob(local_store, data)
    fetcher = Fetcher(tmp_path / "cache", local_store)
    final = cache_path(fetcher.cache_dir, ref)
    part = final.with_name(final.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(data + b"tail")  # cannot be a prefix of the blob: downloaded again, whole
    assert (await fetcher.fetch(ref)).read_bytes() == data
    assert fetcher.bytes_downloaded == len(data) and not part.exists()

    final.write_bytes(b"\1" * len(data))  # the cached file damaged in place, its size intact
    assert (await fetcher.fetch(ref)).read_bytes() == data
    assert fetcher.bytes_downloaded == 2 * len(data)

    assert (await fetcher.fetch(ref)).read_bytes() == data  # a good cached file is taken as is
    assert fetcher.bytes_downloaded == 2 * len(data)


async def test_a_local_directory_store_is_judged_near_once_measured(local_store, tmp_path: Path) -> None:
    """Unknown at first (assume far: hints and ranges cost little if wrong), then the opens of
    its files say near, so its island asks for no staged parts and fetches in one stream."""
    fetcher = Fetcher(tmp_path / "cache", local_store)
    assert fetcher.far()
    await fetcher.fetch(await _stored_blob(local_store, b"z" * 5000))
    assert not fetcher.far()


async def test_two_fetches_of_one_blob_download_it_once_and_both_see_every_byte(local_store, tmp_path: Path) -> None:
    """A staged part's download and a plan's of the same blob: one writes the file, the other
    waits and replays it; neither sees torn bytes."""
    data = bytes(range(256)) * 3000
    ref = await _stored_blob(local_store, data)
    fetcher = Fetcher(tmp_path / "cache", local_store)
    seen = [bytearray(len(data)), bytearray(len(data))]

    def sink(i: int):
        def put(offset: int, chunk: bytes) -> None:
            seen[i][offset:offset + len(chunk)] = chunk
        return put

    paths = await asyncio.gather(fetcher.fetch(ref, on_chunk=sink(0)), fetcher.fetch(ref, on_chunk=sink(1)))
    assert paths[0] == paths[1] and paths[0].read_bytes() == data
    assert fetcher.bytes_downloaded == len(data)  # downloaded once
    assert bytes(seen[0]) == data and bytes(seen[1]) == data
    assert fetcher._busy == {}


async def test_presigned_url_downloads_share_kept_alive_connections_until_closed(tmp_path: Path) -> None:
    """An island without blob-store credentials fetches a version's blobs over one HTTP
    session: the second blob comes over the first one's connection (no new TCP or TLS
    handshake on a long path); after ``close`` a fetch opens a new one."""
    import xxhash

    from weftboard.proto.domain import format_digest

    blobs = {f"/b{i}": bytes((i * 31 + j) & 0xFF for j in range(50_000 + i)) for i in range(3)}
    peers: list[tuple[str, int]] = []

    class BlobServer(CatchAllServer):
        async def _handle(self, request: web.Request) -> web.Response:
            peers.append(request.transport.get_extra_info("peername"))
            return web.Response(body=blobs[request.path])

    server = await BlobServer().start()
    refs = [pb.BlobRef(key=f"runs/r/blobs/{name[1:]}", digest=format_digest(xxhash.xxh3_128(data).digest()),
                       size=len(data), url=f"{server.url}{name}?X-Amz-Signature=s")
            for name, data in blobs.items()]
    fetcher = Fetcher(tmp_path / "cache", None)
    try:
        for ref, data in zip(refs[:2], blobs.values(), strict=False):
            assert (await fetcher.fetch(ref)).read_bytes() == data
        assert len(peers) == 2 and peers[0] == peers[1]  # one connection, kept alive
        await fetcher.close()
        assert (await fetcher.fetch(refs[2])).read_bytes() == blobs["/b2"]
        assert len(peers) == 3 and peers[2] != peers[0]
    finally:
        await fetcher.close()
        await server.stop()


async def test_fetch_takes_patches_in_parallel_ranges_and_anchor_shards_whole(s3_store, tmp_path: Path) -> None:
    import xxhash

    from weftboard.proto.domain import blob_key, format_digest
    from weftboard.subscriber import fetch as fetch_mod

    calls: list[tuple[int, int]] = []
    real = s3_store.download_to

    async def recording(key, path, offset=0, *, size=None, ranges=1, **kw):
        calls.append((size, ranges))
        return await real(key, path, offset, size=size, ranges=ranges, **kw)

    s3_store.download_to = recording
    fetcher = Fetcher(tmp_path / "cache", s3_store)
    # Ranges when the store is far (a 40 ms first byte) or not yet measured; one stream when near.
    for n, first_byte in ((3 << 20, 0.04), (1 << 20, None), (2 << 20, 0.002)):
        s3_store.first_byte_s = lambda first_byte=first_byte: first_byte
        data = bytes((i * 7) & 0xFF for i in range(n))
        digest = format_digest(xxhash.xxh3_128(data).digest())
        key = blob_key("r", digest)
        await s3_store.put_bytes(key, data)
        ref = pb.BlobRef(key=key, digest=digest, size=len(data))
        assert (await fetcher.fetch(ref)).read_bytes() == data
    assert calls == [(3 << 20, fetcher.ranges), (1 << 20, fetcher.ranges), (2 << 20, 1)]
    s3_store.first_byte_s = lambda: 0.04
    calls.clear()
    old_max = fetch_mod.MAX_RANGED_BYTES
    fetch_mod.MAX_RANGED_BYTES = 2 << 20  # as if the 3 MiB blob were an anchor shard
    try:
        data = bytes((i * 13) & 0xFF for i in range(3 << 20))
        digest = format_digest(xxhash.xxh3_128(data).digest())
        await s3_store.put_bytes(blob_key("r", digest), data)
        ref = pb.BlobRef(key=blob_key("r", digest), digest=digest, size=len(data))
        assert (await fetcher.fetch(ref)).read_bytes() == data
    finally:
        fetch_mod.MAX_RANGED_BYTES = old_max
    assert calls == [(3 << 20, 1)]


async def test_progress_reporter_reports_download_bytes(tmp_path: Path) -> None:
    import structlog

    from weftboard.subscriber.progress import ProgressReporter

    target = tmp_path / "blob.patch"
    with structlog.testing.capture_logs() as logs:
        rep = ProgressReporter(rich=False, interval_s=0.01, log_every_s=0.0)
        rep.begin(7, "patch", 100, [target])
        (tmp_path / "blob.patch.part").write_bytes(b"x" * 40)  # a download in flight
        await asyncio.sleep(0.1)
        rep.applying(7)
        rep.end(7)
        rep.close()
    seen = [e for e in logs if e["event"] == "downloading" and e["version"] == 7]
    assert seen and seen[-1]["done_bytes"] == 40 and seen[-1]["percent"] == 40.0
    fancy = ProgressReporter(rich=True)  # the terminal display starts and stops cleanly
    fancy.begin(1, "anchor", 10, [target])
    fancy.end(1)
    fancy.close()


async def test_subscribe_with_a_token_the_board_refuses_exits_1_with_the_reason(board, tmp_path: Path) -> None:
    code, err = await run_cli("subscribe", "--board", board.address, "--run", "r", "--dir", str(tmp_path / "island"),
                              "--token", "not-a-token", "--no-progress")
    assert code == 1 and "subscribe stopped: Unauthenticated" in err and "Traceback" not in err, err[-2000:]


class SlowFirstReport:
    """A real board client whose first heartbeat reaches the board ``delay_s`` late."""

    def __init__(self, client: BoardClient, delay_s: float) -> None:
        self._client, self.delay_s = client, delay_s

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    async def heartbeat(self, status: pb.IslandStatus, **kw) -> pb.HeartbeatResponse:
        delay, self.delay_s = self.delay_s, 0.0
        await asyncio.sleep(delay)
        return await self._client.heartbeat(status, **kw)


async def test_a_late_report_never_overwrites_a_newer_state_on_the_board(board, local_store, tmp_path: Path) -> None:
    """The CATCHING_UP report travels in the background; when it is slow and READY follows, the
    board must end on READY (the reports go one at a time, each built when its turn comes)."""
    views = await _publish(board, local_store, "hb", 1)
    async with BoardClient(board.address, board.admin_token) as client:
        sub = Subscriber(SlowFirstReport(client, 0.5), "hb", LiveTensorsDestination(zeros_like_layout(views[1])),
                         island_id="h", blob_store=local_store, cache_dir=tmp_path / "c", heartbeat_s=60)
        catching_up = sub._set_state_soon(pb.ISLAND_STATE_CATCHING_UP, "to version 1")
        await asyncio.sleep(0.05)  # the slow report is on its way
        await sub._set_state(pb.ISLAND_STATE_READY)
        await catching_up
        fleet = await client.list_islands("hb")
        assert [(i.status.island_id, i.status.state) for i in fleet.islands] == [("h", pb.ISLAND_STATE_READY)]
