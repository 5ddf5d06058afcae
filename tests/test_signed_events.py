"""Watch events signed for watchers without blob-store credentials (``board.signed_events``): one
signing an event for every such watcher, renewed before its URLs could run short, URLs that read
the blobs, a version event's every blob signed and nothing else changed. Real S3 (SeaweedFS)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from weftboard.board.blobs import LocalDirBlobStore, S3BlobStore, fetch_url
from weftboard.board.signed_events import SignedEvents
from weftboard.proto.v1 import board_pb2 as pb


class _Counting:
    """A blob store whose presign_get calls are counted."""

    def __init__(self, store) -> None:
        self.store = store
        self.signed: list[str] = []

    async def presign_get(self, key: str, expires_s: int) -> str | None:
        self.signed.append(key)
        return await self.store.presign_get(key, expires_s)


def _hint(key: str, version: int = 7) -> bytes:
    blob = pb.BlobRef(key=key, digest="xxh3-128:" + "ab" * 16, size=4)
    return pb.WatchEvent(staged=pb.StagedPart(version=version, base_version=version - 1, blob=blob)).SerializeToString()


async def test_every_watcher_gets_one_url_a_part_until_it_is_renewed(s3_store: S3BlobStore, tmp_path: Path) -> None:
    await s3_store.put_bytes("r/blobs/part-a", b"AAAA")
    await s3_store.put_bytes("r/blobs/part-b", b"BBBB")
    blobs = _Counting(s3_store)
    hints = SignedEvents(blobs, 900, reuse_s=0.3, max_kept=1)
    a, b = _hint("r/blobs/part-a"), _hint("r/blobs/part-b")
    first = await asyncio.gather(*(hints.event(a) for _ in range(5)))  # five watchers, one hint
    assert blobs.signed == ["r/blobs/part-a"] and len(set(first)) == 1
    event = pb.WatchEvent.FromString(first[0])
    assert event.staged.version == 7 and event.staged.blob.key == "r/blobs/part-a" and "Signature" in event.staged.blob.url
    await fetch_url(event.staged.blob.url, tmp_path / "a")
    assert (tmp_path / "a").read_bytes() == b"AAAA"
    await hints.event(b)  # a second part; only the latest is kept (max_kept 1)
    await hints.event(a)
    assert blobs.signed == ["r/blobs/part-a", "r/blobs/part-b", "r/blobs/part-a"]
    await asyncio.sleep(0.35)  # past reuse_s: signed anew
    await hints.event(a)
    assert blobs.signed.count("r/blobs/part-a") == 3


async def test_a_store_that_cannot_presign_gives_hints_without_urls(local_store: LocalDirBlobStore) -> None:
    event = pb.WatchEvent.FromString(await SignedEvents(local_store, 900).event(_hint("r/blobs/x")))
    assert event.staged.blob.key == "r/blobs/x" and event.staged.blob.url == ""
    with pytest.raises(ValueError, match="less than its URLs live"):
        SignedEvents(local_store, 60, reuse_s=60)


async def test_a_failed_signing_reaches_its_watchers_and_is_not_kept(s3_store: S3BlobStore) -> None:
    class _Failing(_Counting):
        async def presign_get(self, key: str, expires_s: int) -> str | None:
            self.signed.append(key)
            if len(self.signed) == 1:
                raise RuntimeError("the store is away")
            return await self.store.presign_get(key, expires_s)

    blobs = _Failing(s3_store)
    hints = SignedEvents(blobs, 900)
    results = await asyncio.gather(hints.event(_hint("r/blobs/c")), hints.event(_hint("r/blobs/c")),
                                   return_exceptions=True)
    assert [type(r) for r in results] == [RuntimeError, RuntimeError] and len(blobs.signed) == 1
    assert "Signature" in pb.WatchEvent.FromString(await hints.event(_hint("r/blobs/c"))).staged.blob.url
    assert len(blobs.signed) == 2


async def test_a_version_event_gets_a_url_for_every_blob_and_keeps_the_rest(s3_store: S3BlobStore,
                                                                           tmp_path: Path) -> None:
    """A committed version's event: every blob of every artifact (its patch parts, an anchor's
    files) gets the URL of its own blob; the record is otherwise the feed's, byte for byte."""
    datas = {"r/blobs/p1": b"part one", "r/blobs/p2": b"part two", "r/blobs/a1": b"anchor file"}
    for key, data in datas.items():
        await s3_store.put_bytes(key, data)
    record = pb.VersionRecord(run="r", version=9, root_digest="xxh3-128:" + "cd" * 16, artifacts=[
        pb.Artifact(kind=pb.ARTIFACT_KIND_PATCH, base_version=8,
                    blobs=[pb.BlobRef(key="r/blobs/p1", size=8), pb.BlobRef(key="r/blobs/p2", size=8)]),
        pb.Artifact(kind=pb.ARTIFACT_KIND_ANCHOR, blobs=[pb.BlobRef(key="r/blobs/a1", size=11, name="model.safetensors")]),
    ])
    blobs = _Counting(s3_store)
    payload = pb.WatchEvent(version=record).SerializeToString()
    signed = pb.WatchEvent.FromString(await SignedEvents(blobs, 900).event(payload))
    assert sorted(blobs.signed) == sorted(datas)
    for artifact in signed.version.artifacts:
        for blob in artifact.blobs:
            await fetch_url(blob.url, tmp_path / "b")
            assert (tmp_path / "b").read_bytes() == datas[blob.key]
            blob.url = ""
    assert signed.version == record
    progress = pb.WatchEvent(progress=pb.Progress(head=9)).SerializeToString()
    assert await SignedEvents(blobs, 900).event(progress) == progress and len(blobs.signed) == 3
