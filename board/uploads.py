"""Multipart uploads for publishers without blob-store credentials: the four RPCs and their
ledger in Redis.

A blob too large for one PUT (S3 refuses one over 5 GiB) goes up in parts: ``StartUpload``
opens an upload in the blob store (``BlobStore.start_multipart``) and presigns a PUT URL per
part, ``PresignUploadParts`` renews URLs that expired, ``CompleteUpload`` joins the parts,
``AbortUpload`` drops them. The board notes each upload in ``wb:{run}:uploads`` (upload id ->
the blob's key, digest, size, part size, the store's own upload id, start time), so any board
replica serves the later calls, and garbage collection finds uploads a publisher left open.

Invariants:
- Nothing is visible under the key until CompleteUpload, and nothing after AbortUpload: the
  store joins the parts at once or not at all. The layout (size, part size) is fixed at
  StartUpload and checked (``multipart.part_count``) before the store is asked anything.
- An upload id the ledger does not hold is NOT_FOUND, whatever the store holds.
- A completed upload stays in the ledger as done, so a repeated CompleteUpload (its first
  answer lost) succeeds again; a CompleteUpload whose store call finds the upload gone but
  the blob there (the ledger write was lost) succeeds too.
- ``collect_stale_uploads`` aborts uploads open longer than ``STALE_UPLOAD_S`` and forgets
  done ones after ``DONE_KEPT_S``; the publisher aborts its own failed uploads at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from dataclasses import asdict, dataclass
from typing import Any

import structlog

from weftboard.board.blobs.multipart import check_completed, part_count, part_span
from weftboard.board.store import RedisStore, now_ms
from weftboard.proto.errors import FailedPrecondition, InvalidArgument, NotFound
from weftboard.proto.names import blob_key, check_digest, check_name
from weftboard.proto.v1 import board_pb2 as pb

log = structlog.get_logger(__name__)

DEFAULT_PART_URL_S = 900  # as PresignUpload's URLs
MAX_PART_URL_S = 3600
MAX_UPLOAD_ID = 128
STALE_UPLOAD_S = 24 * 3600  # an upload open this long is abandoned (a publisher that died)
DONE_KEPT_S = 3600  # how long a completed upload still answers a repeated CompleteUpload


def k_uploads(run: str) -> str:
    """Hash: upload id -> JSON of the ``OpenUpload`` (the run's hash tag, like every run key)."""
    return f"wb:{{{run}}}:uploads"


@dataclass(frozen=True)
class OpenUpload:
    key: str
    digest: str
    size: int
    part_bytes: int
    store_id: str  # the blob store's own id of the upload
    started_ms: int
    done_ms: int = 0  # when it completed; 0 while open

    def part_sizes(self, numbers: list[int]) -> list[tuple[int, int]]:
        """``(part_number, size)`` of each part; ``InvalidArgument`` for one outside the upload."""
        return [(n, part_span(self.size, self.part_bytes, n)[1]) for n in numbers]


def _expires(value: int) -> int:
    expires = value or DEFAULT_PART_URL_S
    if expires > MAX_PART_URL_S:
        raise InvalidArgument(f"expires_s {expires} is too long; at most {MAX_PART_URL_S}")
    return expires


class UploadLedger:
    """The open and recently completed uploads of every run, in Redis."""

    def __init__(self, store: RedisStore) -> None:
        self.redis = store.redis

    async def put(self, run: str, upload_id: str, upload: OpenUpload) -> None:
        await self.redis.hset(k_uploads(run), upload_id, json.dumps(asdict(upload)))

    async def get(self, run: str, upload_id: str) -> OpenUpload:
        if not upload_id:
            raise InvalidArgument("upload_id is empty: name the id StartUpload returned")
        if len(upload_id) > MAX_UPLOAD_ID:
            raise InvalidArgument(f"upload_id is {len(upload_id)} characters; StartUpload's ids are shorter")
        raw = await self.redis.hget(k_uploads(run), upload_id)
        if raw is None:
            raise NotFound(f"no upload {upload_id!r} in run {run!r}: it was never started, or was aborted "
                           "(or completed long ago); start a new one")
        return OpenUpload(**json.loads(raw))

    async def forget(self, run: str, upload_ids: list[str]) -> None:
        if upload_ids:
            await self.redis.hdel(k_uploads(run), *upload_ids)

    async def all(self, run: str) -> dict[str, OpenUpload]:
        rows = await self.redis.hgetall(k_uploads(run))
        return {k.decode(): OpenUpload(**json.loads(v)) for k, v in rows.items()}


class UploadRpcs:
    """The multipart RPCs of ``BoardServicer`` (a base class of it): ``store`` is its Redis
    store, ``blobs`` its blob store (``BoardsOwnBlobs``)."""

    store: RedisStore
    blobs: Any

    @property
    def uploads(self) -> UploadLedger:
        return UploadLedger(self.store)

    async def StartUpload(self, request: pb.StartUploadRequest, context) -> pb.StartUploadResponse:
        check_name("run", request.run)
        check_digest("digest", request.digest)
        count = part_count(request.size, request.part_bytes)
        expires = _expires(request.expires_s)
        await self.store.get_run(request.run)
        key = blob_key(request.run, request.digest)
        store_id = await self.blobs.start_multipart(key, request.size, request.part_bytes, request.digest)
        if store_id is None:
            raise FailedPrecondition(f"the blob store ({self.blobs.describe()}) cannot take multipart uploads "
                                     "through URLs; upload with its credentials instead")
        upload = OpenUpload(key, request.digest, request.size, request.part_bytes, store_id, now_ms())
        upload_id = secrets.token_hex(16)
        try:
            await self.uploads.put(request.run, upload_id, upload)
            urls = await self.blobs.presign_parts(key, store_id, upload.part_sizes(list(range(1, count + 1))),
                                                  expires)
        except BaseException:
            with contextlib.suppress(Exception):  # the first failure is the one to report
                await asyncio.shield(self._drop(request.run, upload_id, upload))
            raise
        log.info("multipart upload started", key=key, upload_id=upload_id, parts=count, size=request.size)
        return pb.StartUploadResponse(key=key, upload_id=upload_id, expires_at_ms=now_ms() + expires * 1000,
                                      parts=[pb.UploadPartUrl(part_number=n, url=u) for n, u in enumerate(urls, 1)])

    async def PresignUploadParts(self, request: pb.PresignUploadPartsRequest,
                                 context) -> pb.PresignUploadPartsResponse:
        check_name("run", request.run)
        expires = _expires(request.expires_s)
        upload = await self._open(request.run, request.upload_id)
        numbers = list(request.part_numbers)
        if not numbers:
            raise InvalidArgument("part_numbers is empty: name the parts whose URLs to renew")
        if len(set(numbers)) != len(numbers):  # each URL is signed on the loop: no request makes millions
            raise InvalidArgument("part_numbers names a part twice: name each part once")
        urls = await self.blobs.presign_parts(upload.key, upload.store_id, upload.part_sizes(numbers), expires)
        return pb.PresignUploadPartsResponse(expires_at_ms=now_ms() + expires * 1000,
                                             parts=[pb.UploadPartUrl(part_number=n, url=u)
                                                    for n, u in zip(numbers, urls, strict=True)])

    async def CompleteUpload(self, request: pb.CompleteUploadRequest, context) -> pb.CompleteUploadResponse:
        check_name("run", request.run)
        upload = await self.uploads.get(request.run, request.upload_id)
        if request.digest and request.digest != upload.digest or request.size and request.size != upload.size:
            raise FailedPrecondition(f"upload {request.upload_id!r} is of blob {upload.digest} ({upload.size} bytes), "
                                     f"not {request.digest or upload.digest} ({request.size or upload.size} bytes)")
        if upload.done_ms:
            return pb.CompleteUploadResponse(key=upload.key, size=upload.size)
        parts = [(p.part_number, p.etag) for p in request.parts]
        check_completed(parts, part_count(upload.size, upload.part_bytes))
        try:
            await self.blobs.complete_multipart(upload.key, upload.store_id, parts, size=upload.size,
                                                digest=upload.digest)
        except NotFound:
            if await self.blobs.stat(upload.key) != upload.size:
                raise
            # completed before, and the ledger did not hear of it
        done = OpenUpload(**(asdict(upload) | {"done_ms": now_ms()}))
        await self.uploads.put(request.run, request.upload_id, done)
        log.info("multipart upload complete", key=upload.key, upload_id=request.upload_id, size=upload.size)
        return pb.CompleteUploadResponse(key=upload.key, size=upload.size)

    async def AbortUpload(self, request: pb.AbortUploadRequest, context) -> pb.AbortUploadResponse:
        check_name("run", request.run)
        upload = await self._open(request.run, request.upload_id)
        await self._drop(request.run, request.upload_id, upload)
        log.info("multipart upload aborted", key=upload.key, upload_id=request.upload_id)
        return pb.AbortUploadResponse()

    async def _open(self, run: str, upload_id: str) -> OpenUpload:
        upload = await self.uploads.get(run, upload_id)
        if upload.done_ms:
            raise NotFound(f"upload {upload_id!r} in run {run!r} is complete: {upload.key!r} holds its blob")
        return upload

    async def _drop(self, run: str, upload_id: str, upload: OpenUpload) -> None:
        """Abort the store's upload (gone already is fine), then forget it."""
        with contextlib.suppress(NotFound):
            await self.blobs.abort_multipart(upload.key, upload.store_id)
        await self.uploads.forget(run, [upload_id])

    async def collect_stale_uploads(self, run: str, *, dry_run: bool = False, keep_done_s: float = 0) -> list[str]:
        """Abort the run's uploads open longer than ``STALE_UPLOAD_S`` and forget completed ones
        older than ``DONE_KEPT_S`` (or ``keep_done_s``, GC's grace, if longer: GC ages their blobs
        by the completion noted here); returns the keys of the uploads aborted (or to abort)."""
        now = now_ms()
        done_kept_ms = max(DONE_KEPT_S, keep_done_s) * 1000
        aborted: list[str] = []
        forgotten: list[str] = []
        for upload_id, upload in (await self.uploads.all(run)).items():
            if upload.done_ms and now - upload.done_ms > done_kept_ms:
                forgotten.append(upload_id)
            elif not upload.done_ms and now - upload.started_ms > STALE_UPLOAD_S * 1000:
                aborted.append(upload.key)
                if not dry_run:
                    await self._drop(run, upload_id, upload)
        if not dry_run:
            await self.uploads.forget(run, forgotten)
        if aborted:
            log.info("stale multipart uploads aborted", keys=aborted, dry_run=dry_run)
        return aborted
