"""The BlobStore port, run identically against a real S3 server (SeaweedFS) and a local dir."""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import make_s3_store

from weftboard.board.blobs import (
    BlobStore,
    LocalDirBlobStore,
    S3BlobStore,
    check_key,
    fetch_url,
    upload_bytes_url,
    upload_url,
)
from weftboard.board.embedded import free_port
from weftboard.proto.errors import (
    DigestMismatch,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
    UrlExpired,
)


@pytest.fixture(params=["s3", "local"])
def store(request: pytest.FixtureRequest) -> BlobStore:
    return request.getfixturevalue("s3_store" if request.param == "s3" else "local_store")


def _payload(n: int, seed: int = 7) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


async def test_put_get_stat_roundtrip(store: BlobStore) -> None:
    data = _payload(10_000)
    assert await store.put_bytes("run-a/blobs/one", data) == len(data)
    assert await store.get_bytes("run-a/blobs/one") == data
    assert await store.stat("run-a/blobs/one") == len(data)
    assert await store.stat("run-a/blobs/absent") is None
    # overwrite with the same key replaces the whole object
    await store.put_bytes("run-a/blobs/one", b"short")
    assert await store.get_bytes("run-a/blobs/one") == b"short"


async def test_empty_object(store: BlobStore) -> None:
    await store.put_bytes("r/blobs/empty", b"")
    assert await store.stat("r/blobs/empty") == 0
    assert await store.get_bytes("r/blobs/empty") == b""


async def test_missing_key_is_not_found(store: BlobStore, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="r/blobs/nothing"):
        await store.get_bytes("r/blobs/nothing")
    with pytest.raises(NotFound):
        await store.download_to("r/blobs/nothing", tmp_path / "out")


async def test_put_file_and_download(store: BlobStore, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    data = _payload(3 * (1 << 20) + 123)
    src.write_bytes(data)
    assert await store.put_file("r/blobs/file", src) == len(data)
    dest = tmp_path / "dl" / "copy.bin"
    assert await store.download_to("r/blobs/file", dest) == len(data)
    assert dest.read_bytes() == data


async def test_s3_multipart_upload(s3_server, tmp_path: Path) -> None:
    """A file larger than one part goes up as an S3 multipart upload and comes back intact."""
    store = S3BlobStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, s3_server.bucket,
                        region="us-east-1", prefix=f"mp-{tmp_path.name}", part_size=5 << 20)
    try:
        src = tmp_path / "big.bin"
        data = _payload(11 * (1 << 20) + 17, seed=5)  # three parts: 5 + 5 + 1 MiB
        src.write_bytes(data)
        assert await store.put_file("r/blobs/big", src) == len(data)
        assert await store.stat("r/blobs/big") == len(data)
        # S3 gives a multipart object an ETag ending in "-<parts>"
        etag = store._client.stat_object(store.bucket, store.prefix + "r/blobs/big").etag
        assert etag.strip('"').endswith("-3"), etag
        dest = tmp_path / "big.out"
        dest.write_bytes(data[: 7 << 20])
        assert await store.download_to("r/blobs/big", dest, offset=7 << 20) == len(data)
        assert dest.read_bytes() == data
    finally:
        await store.close()
    with pytest.raises(InvalidArgument, match="5 MiB"):
        S3BlobStore("127.0.0.1:9", "k", "secret-key", "bucket", part_size=1 << 20)


async def test_download_resumes_from_offset(store: BlobStore, tmp_path: Path) -> None:
    data = _payload(200_000, seed=3)
    await store.put_bytes("r/blobs/resume", data)
    dest = tmp_path / "partial.bin"
    # a partial download whose tail is garbage beyond the offset: only the prefix is trusted
    dest.write_bytes(data[:77_777] + b"\xff" * 500)
    assert await store.download_to("r/blobs/resume", dest, offset=77_777) == len(data)
    assert dest.read_bytes() == data
    # resuming a complete file is a no-op that still reports the size
    assert await store.download_to("r/blobs/resume", dest, offset=len(data)) == len(data)
    assert dest.read_bytes() == data
    # an offset past the end means the file is not a prefix: start over
    dest.write_bytes(b"x" * (len(data) + 10))
    assert await store.download_to("r/blobs/resume", dest, offset=len(data) + 10) == len(data)
    assert dest.read_bytes() == data


async def test_download_in_parallel_ranges_with_a_known_size(store: BlobStore, tmp_path: Path) -> None:
    data = _payload(3 * (1 << 20) + 4321, seed=9)
    await store.put_bytes("r/blobs/ranged", data)
    for ranges in (1, 3, 8):
        dest = tmp_path / f"ranged-{ranges}.bin"
        dest.write_bytes(b"stale bytes of an earlier attempt" * 1000)  # a fresh download replaces them
        assert await store.download_to("r/blobs/ranged", dest, size=len(data), ranges=ranges) == len(data)
        assert dest.read_bytes() == data


async def test_chunks_are_reported_as_they_are_written(store: BlobStore, tmp_path: Path) -> None:
    """``on_chunk`` sees every byte exactly where the file has it: one stream, parallel
    ranges, and a resumed download (which reports only what it fetched)."""
    data = _payload(2 * (1 << 20) + 777, seed=5)
    await store.put_bytes("r/blobs/watched", data)
    for ranges, offset in ((1, 0), (4, 0), (1, 12345)):
        dest = tmp_path / f"watched-{ranges}-{offset}.bin"
        dest.write_bytes(data[:offset])
        got = bytearray(len(data))
        sizes: list[int] = []  # chunks come from the store's threads; list.append is atomic

        def on_chunk(at: int, chunk: bytes) -> None:
            got[at:at + len(chunk)] = chunk
            sizes.append(len(chunk))

        assert await store.download_to("r/blobs/watched", dest, offset, size=len(data), ranges=ranges,
                                       on_chunk=on_chunk) == len(data)
        assert sum(sizes) == len(data) - offset and bytes(got[offset:]) == data[offset:]
        assert dest.read_bytes() == data


async def test_time_to_first_byte_is_measured_by_every_store(store: BlobStore, tmp_path: Path) -> None:
    """A GET's wait for its headers, a file's open: unknown before the first download."""
    assert store.first_byte_s() is None
    await store.put_bytes("r/blobs/timed", b"x" * 1000)
    await store.download_to("r/blobs/timed", tmp_path / "timed.bin", size=1000)
    first_byte = store.first_byte_s()
    assert first_byte is not None and 0 < first_byte < 5.0
    if isinstance(store, LocalDirBlobStore):  # a local disk: far below what makes a store far
        from weftboard.subscriber.fetch import RANGES_MIN_FIRST_BYTE_S

        assert first_byte < RANGES_MIN_FIRST_BYTE_S


async def test_a_probe_samples_the_path_of_every_store(store: BlobStore) -> None:
    """A small request counts as a sample of the path; the smallest sample is the estimate, so
    one slow large download does not make a near store look far."""
    await store.put_bytes("r/blobs/probed", b"y" * 1000)
    await store.probe_first_byte("r/blobs/probed")
    probed = store.first_byte_s()
    assert probed is not None and 0 < probed < 5.0
    store._first_byte.append(7.0)  # type: ignore[attr-defined]  (a download that waited long)
    assert store.first_byte_s() == probed
    with pytest.raises(NotFound):
        await store.probe_first_byte("r/blobs/absent")


async def test_s3_size_other_than_expected_is_refused_at_once(s3_store: BlobStore, tmp_path: Path) -> None:
    """The record's size is checked against the object's (Content-Range), not retried as a
    short read, in the one-connection and in the parallel path; the parallel path leaves no
    holes behind (an empty file: a retry starts over)."""
    data = _payload(2 << 20, seed=4)
    await s3_store.put_bytes("r/blobs/sized", data)
    for ranges in (1, 4):
        dest = tmp_path / f"sized-{ranges}.bin"
        with pytest.raises(DigestMismatch, match="holds 2097152 bytes, the record says 2097153"):
            await s3_store.download_to("r/blobs/sized", dest, size=len(data) + 1, ranges=ranges)
        if ranges > 1:
            assert dest.stat().st_size == 0


async def test_list_and_delete(store: BlobStore) -> None:
    keys = ["run-a/blobs/1", "run-a/blobs/2", "run-a/manifest", "run-b/blobs/1"]
    for k in keys:
        await store.put_bytes(k, k.encode())
    assert await store.list_keys("run-a/") == ["run-a/blobs/1", "run-a/blobs/2", "run-a/manifest"]
    assert await store.list_keys("run-a/blobs/") == ["run-a/blobs/1", "run-a/blobs/2"]
    assert await store.list_keys("run-a/bl") == ["run-a/blobs/1", "run-a/blobs/2"]
    assert await store.list_keys() == sorted(keys)
    assert await store.delete(["run-a/blobs/1", "run-a/blobs/never-existed"]) == 2
    assert await store.stat("run-a/blobs/1") is None
    assert await store.list_keys("run-a/blobs/") == ["run-a/blobs/2"]
    assert await store.delete([]) == 0


async def test_concurrent_writes_are_all_or_nothing(store: BlobStore) -> None:
    """Readers racing writers of one key only ever see one complete version."""
    versions = [bytes([i]) * 300_000 for i in range(4)]

    async def writer(i: int) -> None:
        await store.put_bytes("r/blobs/race", versions[i])

    async def reader() -> set[bytes]:
        seen = set()
        for _ in range(5):
            try:
                seen.add(await store.get_bytes("r/blobs/race"))
            except NotFound:
                pass
        return seen

    results = await asyncio.gather(*(writer(i) for i in range(4)), reader(), reader())
    for seen in results[4:]:
        assert seen <= set(versions)
    assert await store.get_bytes("r/blobs/race") in versions


@pytest.mark.parametrize(
    "key", ["", "/abs", "a/../b", "../x", "a//b", "a/./b", "a\\b", "a\x00b", "x" * 1025, "a/"]
)
async def test_bad_keys_rejected(store: BlobStore, key: str) -> None:
    with pytest.raises(InvalidArgument):
        await store.put_bytes(key, b"x")
    with pytest.raises(InvalidArgument):
        check_key(key)


async def test_local_store_never_escapes_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = LocalDirBlobStore(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(InvalidArgument, match="outside"):
        await store.put_bytes("link/evil", b"x")
    assert not (outside / "evil").exists()
    with pytest.raises(InvalidArgument, match="reserved"):
        await store.put_bytes("r/.tmp-sneaky", b"x")


async def test_uploading_a_file_that_is_not_there_is_not_found(store: BlobStore, tmp_path: Path) -> None:
    for source in (tmp_path / "no-such-file", tmp_path):  # missing, and a directory
        with pytest.raises(NotFound, match="no such file"):
            await store.put_file("r/blobs/gone", source)
        with pytest.raises(NotFound, match="no such file"):  # refused before any request is made
            await upload_url("http://127.0.0.1:9/never-asked", source)
    assert await store.stat("r/blobs/gone") is None


async def test_local_store_leaves_no_temp_files(local_store: LocalDirBlobStore, tmp_path: Path) -> None:
    await local_store.put_bytes("r/blobs/a", b"abc")
    missing = tmp_path / "no-such-file"
    with pytest.raises(NotFound):
        await local_store.put_file("r/blobs/b", missing)
    leftovers = [p for p in local_store.root.rglob("*") if p.name.startswith(".tmp-")]
    assert leftovers == []
    assert await local_store.list_keys() == ["r/blobs/a"]


async def test_local_store_cannot_presign(local_store: LocalDirBlobStore) -> None:
    assert await local_store.presign_get("r/blobs/a", 60) is None
    assert await local_store.presign_put("r/blobs/a", 60) is None
    assert local_store.describe().startswith("file://")


async def test_s3_presigned_put_and_get(s3_store: S3BlobStore, tmp_path: Path) -> None:
    data = _payload(1_500_000, seed=11)
    src = tmp_path / "up.bin"
    src.write_bytes(data)
    put_url = await s3_store.presign_put("r/blobs/presigned", 60)
    assert put_url and "X-Amz-Signature" in put_url
    assert await upload_url(put_url, src) == len(data)
    assert await s3_store.get_bytes("r/blobs/presigned") == data

    get_url = await s3_store.presign_get("r/blobs/presigned", 60)
    dest = tmp_path / "down.bin"
    assert await fetch_url(get_url, dest) == len(data)
    assert dest.read_bytes() == data
    # resume from the middle with a Range request
    dest.write_bytes(data[:600_000])
    assert await fetch_url(get_url, dest, offset=600_000) == len(data)
    assert dest.read_bytes() == data
    # already complete: the server answers 416 and nothing changes
    assert await fetch_url(get_url, dest, offset=len(data)) == len(data)
    assert dest.read_bytes() == data

    small = await s3_store.presign_put("r/blobs/small", 60)
    assert await upload_bytes_url(small, b"tiny") == 4
    assert await s3_store.get_bytes("r/blobs/small") == b"tiny"


async def test_s3_presigned_url_is_scoped_to_one_object(s3_store: S3BlobStore, tmp_path: Path) -> None:
    await s3_store.put_bytes("r/blobs/a", b"aaa")
    await s3_store.put_bytes("r/blobs/b", b"bbb")
    url_a = await s3_store.presign_get("r/blobs/a", 60)
    tampered = url_a.replace("/r/blobs/a?", "/r/blobs/b?")
    assert tampered != url_a
    with pytest.raises(UrlExpired):
        await fetch_url(tampered, tmp_path / "x")
    missing = await s3_store.presign_get("r/blobs/missing", 60)
    with pytest.raises(NotFound):
        await fetch_url(missing, tmp_path / "y")
    with pytest.raises(InvalidArgument):
        await s3_store.presign_get("r/blobs/a", 0)


async def test_s3_expired_presigned_url_is_refused(s3_store: S3BlobStore, tmp_path: Path) -> None:
    await s3_store.put_bytes("r/blobs/exp", b"x")
    url = await s3_store.presign_get("r/blobs/exp", 1)
    await asyncio.sleep(2.1)
    with pytest.raises(UrlExpired, match="expired"):  # a PermissionDenied that a new plan cures
        await fetch_url(url, tmp_path / "x")


async def test_s3_prefixes_isolate_stores(s3_server, s3_store: S3BlobStore) -> None:
    other = make_s3_store(s3_server, prefix=s3_store.prefix + "other")
    try:
        await other.put_bytes("r/blobs/x", b"other")
        await s3_store.put_bytes("r/blobs/x", b"mine")
        assert await other.get_bytes("r/blobs/x") == b"other"
        assert await s3_store.get_bytes("r/blobs/x") == b"mine"
        assert await s3_store.list_keys("r/") == ["r/blobs/x"]
    finally:
        await other.close()


async def test_s3_close_finishes_calls_under_way_then_ends_the_stores_threads(s3_server) -> None:
    store = make_s3_store(s3_server, prefix=f"t-close-{uuid.uuid4().hex[:8]}")
    await store.put_bytes("r/blobs/warm", b"warm")  # the store's threads exist now
    assert any(t.name.startswith("weftboard-s3") for t in threading.enumerate())
    started = asyncio.gather(*(store.put_bytes(f"r/blobs/{i}", bytes([i]) * 1000) for i in range(8)))
    await asyncio.sleep(0)  # the puts are on the store's threads before close is called
    await store.close()
    await started  # none was dropped
    assert not any(t.name.startswith("weftboard-s3") for t in threading.enumerate())
    with pytest.raises(Unavailable, match="is closed"):
        await store.get_bytes("r/blobs/0")
    await store.close()  # twice is harmless
    reader = make_s3_store(s3_server, prefix=store.prefix.rstrip("/"))
    try:
        assert [await reader.get_bytes(f"r/blobs/{i}") for i in range(8)] == [bytes([i]) * 1000 for i in range(8)]
    finally:
        await reader.close()


async def test_s3_creates_a_missing_bucket(s3_server) -> None:
    store = S3BlobStore(s3_server.endpoint, s3_server.access_key, s3_server.secret_key,
                        "weftboard-fresh-bucket", region="us-east-1")
    try:
        await store.put_bytes("r/blobs/x", b"x")
        assert await store.list_keys() == ["r/blobs/x"]
        await store.delete(["r/blobs/x"])
    finally:
        await store.close()


async def test_s3_wrong_credentials_are_permission_denied(s3_server) -> None:
    store = S3BlobStore(s3_server.endpoint, "nobody", "not-the-secret", s3_server.bucket, region="us-east-1")
    try:
        with pytest.raises(PermissionDenied, match="credentials"):
            await store.stat("r/blobs/x")
    finally:
        await store.close()


async def test_s3_unreachable_is_unavailable() -> None:
    port = free_port()  # nothing listens there
    store = S3BlobStore(f"http://127.0.0.1:{port}", "k", "secret-key", "bucket", region="us-east-1",
                        connect_timeout_s=1, retries=0)
    try:
        with pytest.raises(Unavailable, match=f"127.0.0.1:{port}"):
            await store.get_bytes("r/blobs/x")
    finally:
        await store.close()


async def test_s3_errors_never_carry_a_presigned_query() -> None:
    """The multipart calls go through URLs the store presigns for itself; when S3 cannot be
    reached, urllib3 names that URL. The error says where and what, never the query (the
    access key id and a signature that is still valid), and chains nothing that does."""
    port = free_port()
    store = S3BlobStore(f"http://127.0.0.1:{port}", "AKIDSECRETID", "secret-key", "bucket", region="us-east-1",
                        connect_timeout_s=1, retries=0)
    store._bucket_ready = True  # straight to the presigned request
    try:
        with pytest.raises(Unavailable, match=f"127.0.0.1:{port}") as caught:
            await store.abort_multipart("r/blobs/x", "upload-1")
        text = f"{caught.value} {caught.value.__cause__} {caught.value.__context__ if not caught.value.__suppress_context__ else ''}"
        assert "AKIDSECRETID" not in text and "Signature" not in text, text
    finally:
        await store.close()


async def test_fetch_url_unreachable_is_unavailable(tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(Unavailable):
        await fetch_url(f"http://127.0.0.1:{port}/b/k?X-Amz-Signature=x", tmp_path / "o", connect_timeout_s=1)


async def test_fetch_url_restarts_when_server_ignores_range(tmp_path: Path) -> None:
    """A server that answers 200 to a Range request gets the file rewritten from byte 0."""
    from aiohttp import web

    body = _payload(50_000)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body)

    app = web.Application()
    app.router.add_get("/obj", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        dest = tmp_path / "o"
        dest.write_bytes(b"garbage-prefix")
        assert await fetch_url(f"http://127.0.0.1:{port}/obj", dest, offset=14) == len(body)
        assert dest.read_bytes() == body
    finally:
        await runner.cleanup()


def test_s3_invalid_bucket_name_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="bucket name"):
        S3BlobStore("127.0.0.1:9", "k", "secret-key", "B")


def test_describe_hides_credentials(s3_store: S3BlobStore) -> None:
    text = s3_store.describe()
    assert s3_store.bucket in text and s3_store.endpoint in text
    assert "secret" not in text.lower()


async def test_s3_calls_do_not_queue_behind_the_loops_default_executor(s3_store: S3BlobStore, tmp_path: Path) -> None:
    # A publisher uploads a version's parts at once while other work holds to_thread threads
    # (cpu_count + 4 of them on the default executor): the store's calls run on its own.
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(1))
    release = threading.Event()
    busy = asyncio.ensure_future(asyncio.to_thread(release.wait, 60))
    try:
        data = [bytes([i]) * (1000 + i) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(s3_store.put_bytes(f"p/{i}", d) for i, d in enumerate(data))), 30)
        sizes = await asyncio.wait_for(asyncio.gather(*(s3_store.stat(f"p/{i}") for i in range(8))), 30)
        assert sizes == [len(d) for d in data]
        assert await asyncio.wait_for(s3_store.get_bytes("p/3"), 30) == data[3]
    finally:
        release.set()
        await busy


async def test_an_uploaders_presigned_puts_share_kept_alive_connections_until_closed(tmp_path: Path) -> None:
    """A publisher without blob-store credentials PUTs a version's blobs and parts over one
    HTTP session: every PUT after the first comes over the first one's connection (no new TCP
    or TLS handshake per blob on a long path); after ``close`` an upload opens a new one."""
    from types import SimpleNamespace

    from aiohttp import web
    from boardkit import digest_of
    from enginekit import CatchAllServer

    from weftboard.board.blobs.multipart import MIN_PART_BYTES
    from weftboard.board.blobs.transfer import Uploader

    peers: list[tuple[str, int]] = []
    received: dict[str, bytes] = {}
    completed: list[object] = []

    class PutServer(CatchAllServer):
        async def _handle(self, request: web.Request) -> web.Response:
            peers.append(request.transport.get_extra_info("peername"))
            received[request.path] = await request.content.read()  # not request.read(): parts pass 1 MiB
            return web.Response(headers={"ETag": f'"{len(received)}"'})

    server = await PutServer().start()

    class Board:  # the presign calls a credential-less uploader makes
        timeout_s = 10.0
        async def presign_upload(self, run: str, digest: str, size: int) -> SimpleNamespace:
            return SimpleNamespace(url=f"{server.url}/one/{digest[-8:]}?X-Amz-Signature=s")

        async def start_upload(self, run: str, digest: str, size: int, part_bytes: int) -> SimpleNamespace:
            return SimpleNamespace(upload_id="u", parts=[SimpleNamespace(part_number=n, url=f"{server.url}/part/{n}")
                                                         for n in (1, 2, 3)])

        async def complete_upload(self, run: str, upload_id: str, etags: object, *, timeout_s: float) -> None:
            completed.append(etags)

        async def abort_upload(self, run: str, upload_id: str) -> None:
            raise AssertionError("an upload that completes is not aborted")

    up = Uploader("r", Board(), part_bytes=MIN_PART_BYTES, parallel_parts=1)
    small, other = _payload(1000), _payload(3000, seed=9)
    big = _payload(2 * MIN_PART_BYTES + 100, seed=11)
    (tmp_path / "other").write_bytes(other)
    try:
        await up.upload(digest_of(small), len(small), data=small)
        await up.upload(digest_of(other), len(other), path=tmp_path / "other")
        await up.upload(digest_of(big), len(big), data=big)
        assert len(peers) == 5 and set(peers) == {peers[0]}  # two blobs and three parts, one connection
        assert b"".join(received[f"/part/{n}"] for n in (1, 2, 3)) == big and len(completed) == 1
        assert received[f"/one/{digest_of(other)[-8:]}"] == other
        await up.close()
        await up.upload(digest_of(small), len(small), data=small)
        assert len(peers) == 6 and peers[5] != peers[0]
    finally:
        await up.close()
        await server.stop()
