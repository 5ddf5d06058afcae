"""Multipart uploads through presigned part URLs (StartUpload, PresignUploadParts, CompleteUpload,
AbortUpload), against a board on the real SeaweedFS S3 server and one on a local directory it
serves over signed HTTP URLs; resumable ranged downloads of what they assemble; and the board
without the ``[s3]`` extra."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from boardkit import digest_of, make_run
from pubsubkit import Trainer, follow_each

from weftboard.board.blobs import LocalDirBlobStore, fetch_url
from weftboard.board.blobs.http import upload_part_url
from weftboard.board.blobs.multipart import MIN_PART_BYTES
from weftboard.board.blobs.transfer import Uploader
from weftboard.board.client import BoardClient
from weftboard.board.uploads import k_uploads
from weftboard.proto.errors import (
    DigestMismatch,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from weftboard.proto.names import blob_key
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.fetch import Fetcher

PART = MIN_PART_BYTES  # S3's smallest part, which SeaweedFS enforces as AWS does


class Rig:
    """A board on one blob store, an admin client, and the store to look at directly."""

    def __init__(self, board: Any, store: Any, client: BoardClient, redis_url: str) -> None:
        self.board, self.store, self.client, self.redis_url = board, store, client, redis_url

    async def ledger(self, run: str) -> dict[str, dict]:
        r = aioredis.Redis.from_url(self.redis_url)
        try:
            return {k.decode(): json.loads(v) for k, v in (await r.hgetall(k_uploads(run))).items()}
        finally:
            await r.aclose()


@pytest.fixture(params=["s3", "local"])
def blob_store(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, request.getfixturevalue("s3_store" if request.param == "s3" else "local_store")


@pytest_asyncio.fixture
async def rig(blob_store: tuple[str, Any], board_factory, redis_url: str) -> Any:
    kind, store = blob_store
    # A local directory is served by the board over signed URLs (blob_http_port), as `weftboard serve` does.
    board = await board_factory(blobs=store, **({"blob_http_port": 0} if kind == "local" else {}))
    async with BoardClient(board.address, board.admin_token, timeout_s=30) as client:
        await client.create_run(make_run("mp"))
        yield Rig(board, store, client, redis_url)


def _blob(size: int) -> bytes:
    return os.urandom(size)


def _upload_id_of(url: str) -> str:
    """The store's own upload id in a part URL (S3's ``uploadId``, the board's ``upload``)."""
    query = parse_qs(urlsplit(url).query)
    return (query.get("uploadId") or query["upload"])[0]


# ---------------------------------------------------------------------------
# The publisher's path, end to end
# ---------------------------------------------------------------------------


@pytest.mark.usefixtures("warm_kernels")  # as pubsubkit.WARM_KERNELS: the codec's kernels, compiled once
@pytest.mark.timeout(600)
async def test_a_publisher_without_credentials_uploads_its_anchor_in_parts(rig: Rig, tmp_path: Path) -> None:
    """The anchor (about 12.6 MiB of bf16) is over the part size, so it goes up as three
    presigned parts; the island, also without credentials, reaches every version bitwise."""
    trainer = Trainer(lr=1e-4, vocab=4096, d=512, hidden=1024, layers=1)
    views: dict[int, dict] = {}

    def train() -> None:
        with Publisher(rig.board.address, "big", token=rig.board.admin_token, blob_store=None,
                       upload_part_bytes=PART, anchor_every=2) as pub:
            for _ in range(3):
                trainer.step()
                views[pub.publish(trainer.model, step=trainer.step_no).version] = trainer.served()

    await asyncio.to_thread(train)
    records = [await rig.client.get_version("big", v) for v in (1, 2, 3)]
    anchors = [b for r in records for a in r.artifacts if a.kind == pb.ARTIFACT_KIND_ANCHOR for b in a.blobs]
    assert anchors and all(b.size > 2 * PART for b in anchors)
    done = {u["key"]: u for u in (await rig.ledger("big")).values() if u["done_ms"]}
    for blob in anchors:  # each anchor file went up as a completed multipart upload of 5 MiB parts
        assert done[blob.key]["part_bytes"] == PART and done[blob.key]["size"] == blob.size
        assert await rig.store.stat(blob.key) == blob.size
    await follow_each(rig.client, "big", None, tmp_path, views, presigned=True)


# ---------------------------------------------------------------------------
# Parts: retried alone, renewed URLs, aborts
# ---------------------------------------------------------------------------


async def test_a_part_that_fails_once_is_retried_alone(rig: Rig) -> None:
    data = _blob(2 * PART + 12_345)  # three parts, the last one short
    attempts: collections.Counter[int] = collections.Counter()

    async def flaky(url: str, **kw: Any) -> str:
        number = kw["offset"] // PART + 1
        attempts[number] += 1
        if number == 2 and attempts[number] == 1:
            # The first attempt lands other bytes of the right length, then the connection drops:
            # only the retry's bytes may end up in the blob.
            await upload_part_url(url, data=b"\xee" * kw["length"], offset=0, length=kw["length"])
            raise Unavailable("connection reset by peer (injected)")
        return await upload_part_url(url, **kw)

    uploader = Uploader("mp", rig.client, part_bytes=PART, put_part=flaky)
    key = await uploader.upload(digest_of(data), len(data), data=data)
    assert attempts == {1: 1, 2: 2, 3: 1}
    assert await rig.store.get_bytes(key) == data


async def test_a_part_url_the_store_refuses_is_renewed(rig: Rig, tmp_path: Path) -> None:
    """A part PUT answered 403 (an expired or altered URL) asks the board for a new URL
    (PresignUploadParts) and goes up with it; here the first URL of part 1 is altered."""
    source = tmp_path / "blob.bin"
    source.write_bytes(data := _blob(PART + 777))
    urls_used: dict[int, list[str]] = collections.defaultdict(list)

    async def altered_once(url: str, **kw: Any) -> str:
        number = kw["offset"] // PART + 1
        if number == 1 and not urls_used[1]:
            url = url.replace("Signature=", "Signature=0") if "Signature=" in url else url.replace("sig=", "sig=0")
        urls_used[number].append(url)
        return await upload_part_url(url, **kw)

    key = await Uploader("mp", rig.client, part_bytes=PART, put_part=altered_once).upload(
        digest_of(data), len(data), path=source)
    assert len(urls_used[1]) == 2 and len(set(urls_used[1])) == 2 and len(urls_used[2]) == 1
    assert await rig.store.get_bytes(key) == data


async def test_a_failed_upload_is_aborted_and_leaves_nothing(rig: Rig) -> None:
    data = _blob(2 * PART + 1)
    digest = digest_of(data)
    store_ids: set[str] = set()

    async def broken(url: str, **kw: Any) -> str:
        store_ids.add(_upload_id_of(url))
        if kw["offset"] // PART + 1 == 3:
            raise FailedPrecondition("the disk under the trainer is gone (injected, not retried)")
        return await upload_part_url(url, **kw)

    with pytest.raises(FailedPrecondition, match="injected"):
        await Uploader("mp", rig.client, part_bytes=PART, put_part=broken).upload(digest, len(data), data=data)
    key = blob_key("mp", digest)
    assert await rig.store.stat(key) is None
    assert await rig.ledger("mp") == {}  # aborted: the board forgot it
    (store_id,) = store_ids
    with pytest.raises(NotFound):  # the store holds no such upload any more
        await rig.store.complete_multipart(key, store_id, [(1, "x"), (2, "y"), (3, "z")], size=len(data),
                                             digest=digest)
    if isinstance(rig.store, LocalDirBlobStore):
        assert [p for p in rig.store.root.rglob("*") if p.is_file()] == []


async def test_nothing_is_visible_before_complete_and_an_abort_drops_the_parts(rig: Rig) -> None:
    data = _blob(PART + 10)
    digest = digest_of(data)
    started = await rig.client.start_upload("mp", digest, len(data), PART)
    assert started.key == blob_key("mp", digest) and [p.part_number for p in started.parts] == [1, 2]
    etags = [(p.part_number, await upload_part_url(p.url, data=data, offset=(p.part_number - 1) * PART,
                                                    length=min(PART, len(data) - (p.part_number - 1) * PART)))
             for p in started.parts]
    assert await rig.store.stat(started.key) is None  # every part is up, the blob is not
    with pytest.raises(FailedPrecondition, match="2 parts; 1"):
        await rig.client.complete_upload("mp", started.upload_id, etags[:1])
    with pytest.raises(FailedPrecondition, match="ETag"):
        await rig.client.complete_upload("mp", started.upload_id, [etags[0], (2, '"0000"')])
    for other in (pb.CompleteUploadRequest(digest=digest_of(b"another blob")), pb.CompleteUploadRequest(size=1)):
        other.MergeFrom(pb.CompleteUploadRequest(run="mp", upload_id=started.upload_id,
                                                 parts=[pb.UploadedPart(part_number=n, etag=e) for n, e in etags]))
        with pytest.raises(FailedPrecondition, match=f"is of blob {digest} \\({len(data)} bytes\\)"):
            await rig.client._call("CompleteUpload", other)
    with pytest.raises(InvalidArgument, match="twice"):
        await rig.client.presign_upload_parts("mp", started.upload_id, [1, 2, 1])
    assert await rig.store.stat(started.key) is None  # refused completes show nothing either
    await rig.client.abort_upload("mp", started.upload_id)
    with pytest.raises(NotFound):
        await rig.client.complete_upload("mp", started.upload_id, etags)
    with pytest.raises(NotFound):
        await rig.client.abort_upload("mp", started.upload_id)
    assert await rig.store.stat(started.key) is None

    again = await rig.client.start_upload("mp", digest, len(data), PART)
    fresh = await rig.client.presign_upload_parts("mp", again.upload_id, [2, 1])  # renewed URLs work too
    assert [p.part_number for p in fresh.parts] == [2, 1]
    urls = {p.part_number: p.url for p in fresh.parts}
    etags = [(n, await upload_part_url(urls[n], data=data, offset=(n - 1) * PART,
                                       length=min(PART, len(data) - (n - 1) * PART))) for n in (1, 2)]
    done = await rig.client.complete_upload("mp", again.upload_id, etags)
    assert (done.key, done.size) == (again.key, len(data))
    assert await rig.client.complete_upload("mp", again.upload_id, etags) == done  # a retry's answer
    assert await rig.store.get_bytes(again.key) == data


async def test_the_rpcs_refuse_bad_input_with_precise_codes(rig: Rig) -> None:
    client = rig.client
    digest = digest_of(b"x")
    for part_bytes in (PART - 1, (5 << 30) + 1, 0):
        with pytest.raises(InvalidArgument, match="part_bytes"):
            await client.start_upload("mp", digest, 3 * PART, part_bytes)
    with pytest.raises(InvalidArgument, match="at most 10000"):
        await client.start_upload("mp", digest, 10_001 * PART, PART)
    with pytest.raises(InvalidArgument, match="size must be positive"):
        await client.start_upload("mp", digest, 0, PART)
    with pytest.raises(InvalidArgument, match="digest"):
        await client.start_upload("mp", "md5:abc", 2 * PART, PART)
    with pytest.raises(NotFound):
        await client.start_upload("no-such-run", digest, 2 * PART, PART)
    for call in (client.complete_upload("mp", "0" * 32, [(1, "e")]), client.abort_upload("mp", "0" * 32),
                 client.presign_upload_parts("mp", "0" * 32, [1])):
        with pytest.raises(NotFound, match="never started"):
            await call
    with pytest.raises(InvalidArgument, match="upload_id is empty"):
        await client.abort_upload("mp", "")
    started = await client.start_upload("mp", digest, 2 * PART, PART)
    with pytest.raises(InvalidArgument, match="outside the upload's parts 1..2"):
        await client.presign_upload_parts("mp", started.upload_id, [3])
    with pytest.raises(FailedPrecondition, match="order"):
        await client.complete_upload("mp", started.upload_id, [(2, "e"), (1, "e")])
    reader = (await client.create_token("reader", pb.ROLE_READER)).token
    island = (await client.create_token("island", pb.ROLE_ISLAND)).token
    for token in (reader, island):
        async with BoardClient(rig.board.address, token) as other:
            with pytest.raises(PermissionDenied, match="StartUpload needs one of ADMIN, PUBLISHER"):
                await other.start_upload("mp", digest, 2 * PART, PART)
            with pytest.raises(PermissionDenied):
                await other.abort_upload("mp", started.upload_id)
    await client.abort_upload("mp", started.upload_id)


async def test_a_local_store_the_board_does_not_serve_cannot_take_parts(board, tmp_path: Path) -> None:
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("mp"))
        with pytest.raises(FailedPrecondition, match="cannot take multipart uploads"):
            await client.start_upload("mp", digest_of(b"x"), 2 * PART, PART)


async def test_garbage_collection_aborts_stale_uploads(rig: Rig) -> None:
    started = await rig.client.start_upload("mp", digest_of(b"stale"), 2 * PART, PART)
    await rig.client.collect_garbage("mp")
    assert started.upload_id in await rig.ledger("mp")  # fresh: left alone
    r = aioredis.Redis.from_url(rig.redis_url)
    try:  # started two days ago, as if its publisher died then
        entry = json.loads(await r.hget(k_uploads("mp"), started.upload_id))
        entry["started_ms"] -= 2 * 24 * 3600 * 1000
        await r.hset(k_uploads("mp"), started.upload_id, json.dumps(entry))
    finally:
        await r.aclose()
    await rig.client.collect_garbage("mp", dry_run=True)
    assert started.upload_id in await rig.ledger("mp")
    await rig.client.collect_garbage("mp")
    assert await rig.ledger("mp") == {}
    with pytest.raises(NotFound):  # the store holds no such upload any more
        await rig.store.complete_multipart(started.key, entry["store_id"], [(1, "e"), (2, "e")],
                                             size=2 * PART, digest=entry["digest"])


# ---------------------------------------------------------------------------
# Downloads of what was assembled: ranged and resumable
# ---------------------------------------------------------------------------


async def test_a_download_resumes_with_a_range_request(rig: Rig, tmp_path: Path) -> None:
    data = _blob(2 * PART + 99)
    key = await Uploader("mp", rig.client, part_bytes=PART).upload(digest_of(data), len(data), data=data)
    get = await rig.store.presign_get(key, 60)
    dest = tmp_path / "partial.bin"
    kept = PART + 3  # a marker prefix: a download that started over would overwrite it
    dest.write_bytes(b"\x01" * kept)
    assert await fetch_url(get, dest, offset=kept) == len(data)
    assert dest.read_bytes() == b"\x01" * kept + data[kept:]

    ref = pb.BlobRef(key=key, digest=digest_of(data), size=len(data), url=get)
    fetcher = Fetcher(tmp_path / "cache", None)
    part_file = tmp_path / "cache" / (ref.digest.split(":", 1)[1] + ".patch.part")
    part_file.parent.mkdir(parents=True, exist_ok=True)
    part_file.write_bytes(b"\x01" * kept)  # resumed: the wrong prefix stays and the digest refuses it
    with pytest.raises(DigestMismatch):
        await fetcher.fetch(ref)
    part_file.write_bytes(data[:kept])  # resumed from a true prefix: verified
    final = await fetcher.fetch(ref)
    await fetcher.close()
    assert final.read_bytes() == data


# ---------------------------------------------------------------------------
# The [s3] extra
# ---------------------------------------------------------------------------

_WITHOUT_MINIO = textwrap.dedent("""
    import sys

    class NoS3Client:  # as if weftboard were installed without its [s3] extra
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("minio", "urllib3"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoS3Client())
    from weftboard.board.cli import build_app
    build_app()
    import weftboard.board.process, weftboard.publisher.publisher, weftboard.subscriber.subscriber
    from weftboard.board.blobs import S3BlobStore
    try:
        S3BlobStore("127.0.0.1:9", "key", "secret", "bucket")
    except ImportError as exc:
        print("refused:", exc)
    print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in ("minio", "urllib3")))
""")


def test_everything_but_an_s3_store_runs_without_the_s3_extra() -> None:
    result = subprocess.run([sys.executable, "-c", _WITHOUT_MINIO], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused: an S3 blob store needs the minio client" in result.stdout
    assert "pip install 'weftboard[s3]'" in result.stdout
    assert "loaded: []" in result.stdout
