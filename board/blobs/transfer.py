"""Moving blobs into the blob store (``Uploader``) and retrying transient failures
(``with_retries``, used by publishers and islands alike).

Invariants:
- Keys are content addressed (``blob_key(run, digest)``), so a retried upload rewrites the
  same bytes and an upload whose key already holds a blob of the right size is skipped.
- Bytes never flow through the board: with credentials the uploader writes to the store;
  without, it asks the board for a short-lived presigned PUT URL and sends the bytes there.
- Without credentials a blob larger than ``part_bytes`` goes up as a multipart upload
  (``StartUpload``, one presigned PUT per part, ``CompleteUpload``): parts go in parallel,
  each retried on its own (with a fresh URL once its own expired), and an upload that fails
  is aborted (``AbortUpload``), so nothing is left under the key; one the publisher could not
  abort (its process died) is aborted by the board's garbage collection once stale.
- An uploader's presigned PUTs share one HTTP session per event loop (kept-alive
  connections, not a TCP and TLS handshake per blob or part) until ``close``.
- Transient failures (``Unavailable``, deadlines, connection errors) are retried with
  exponential backoff and jitter up to a total deadline; anything else is raised at once.
- Every PUT has an explicit limit that grows with its bytes (``Uploader.attempt_timeout_s``):
  ``timeout_s`` plus the bytes at ``min_bytes_per_s`` (the slowest link the uploader is meant
  to work over; a part's share of it when ``parallel_parts`` go at once). The retry deadline
  of such a PUT is that limit plus ``retry_deadline_s`` (120 s; the backoff comes out of it),
  so a first attempt that ran out its limit is tried once more before the upload fails as
  ``Unavailable``; no wait is unbounded (an upload ends within twice that deadline).
  Publishers set ``min_bytes_per_s`` with their ``upload_min_bytes_per_s`` option
  (``uploader_options``, checked when the publisher is made).
"""

from __future__ import annotations

import asyncio
import numbers
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from weftboard.board.blobs.http import (
    LoopSession,
    upload_bytes_url,
    upload_part_url,
    upload_url,
)
from weftboard.board.blobs.multipart import (
    DEFAULT_PART_BYTES,
    check_part_bytes,
    part_span,
)
from weftboard.proto.domain import blob_key
from weftboard.proto.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    Unavailable,
    UrlExpired,
    WeftboardError,
)

log = structlog.get_logger("weftboard.board.blobs.transfer")
T = TypeVar("T")
RETRYABLE = (Unavailable, DeadlineExceeded, ConnectionError, asyncio.TimeoutError)
# gRPC channel options: a board that restarts is found again within seconds, not after
# gRPC's default reconnect backoff (which grows to minutes).
FAST_RECONNECT = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                  ("grpc.max_reconnect_backoff_ms", 2000))


async def with_retries(
    what: str,
    call: Callable[[], Awaitable[T]],
    *,
    deadline_s: float = 120.0,
    first_backoff_s: float = 0.1,
    max_backoff_s: float = 5.0,
) -> T:
    """Run ``call`` until it succeeds, retrying transient errors with exponential backoff."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    backoff = first_backoff_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except RETRYABLE as exc:
            if loop.time() + backoff > end:
                raise Unavailable(f"{what} still failing after {attempt} attempts over {deadline_s:.0f}s: {exc}") from exc
            log.warning("retrying", what=what, attempt=attempt, backoff_s=round(backoff, 3), error=str(exc))
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, max_backoff_s)


# The slowest link an upload is meant to work over unless the caller says otherwise: 2 MiB/s
# (~17 Mbit/s), so a 5 GiB anchor shard gets 600 s + 2560 s per attempt.
DEFAULT_MIN_BYTES_PER_S = 2 << 20
# How long transient failures of one blob's PUTs are retried, beyond one attempt's limit.
DEFAULT_RETRY_DEADLINE_S = 120.0
# How fast a board is assumed to join an upload's parts (a local store hashes them all) when
# CompleteUpload's deadline is set; S3 joins them itself, in seconds.
_COMPLETE_BYTES_PER_S = 64 << 20
# ``put_part(url, *, path, data, offset, length, timeout_s) -> etag``: one part's PUT.
PartPut = Callable[..., Awaitable[str]]


def check_min_bytes_per_s(value: float, name: str = "min_bytes_per_s") -> float:
    """``value`` if it is a rate above 0 (bytes per second), else ``InvalidArgument`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise InvalidArgument(f"{name} must be > 0 (an upload's limit is never unbounded), got {value!r}")
    return value


def uploader_options(*, part_bytes: int = DEFAULT_PART_BYTES, min_bytes_per_s: float | None = None) -> dict[str, Any]:
    """The keyword arguments of a publisher's ``Uploader``, from its ``upload_part_bytes`` and
    ``upload_min_bytes_per_s`` options (None: ``DEFAULT_MIN_BYTES_PER_S``), checked now, so a
    publisher refuses a bad one when it is made, naming its own option."""
    return {"part_bytes": check_part_bytes(part_bytes),
            "min_bytes_per_s": DEFAULT_MIN_BYTES_PER_S if min_bytes_per_s is None
            else check_min_bytes_per_s(min_bytes_per_s, "upload_min_bytes_per_s")}


class Uploader:
    """Uploads content-addressed blobs of one run (``store`` given: direct; else presigned).

    Without a store, a blob over ``part_bytes`` goes up in parts of that size, ``parallel_parts``
    at a time, each PUT made by ``put_part`` (``upload_part_url``, given the shared ``session``;
    a test may wrap it). ``close`` ends the presigned PUTs' connections.

    ``timeout_s`` is the floor of every PUT's limit and ``min_bytes_per_s`` the slowest rate
    it must still complete at (``attempt_timeout_s``); ``retry_deadline_s`` how long transient
    failures are retried beyond one attempt's limit (the backoff
    before the next attempt, 0.1-5 s, comes out of it). The publishers build theirs with the
    defaults (links down to about 17 Mbit/s) unless given ``upload_min_bytes_per_s``, which one
    on a slower link sets below its rate (``uploader_options``)."""

    def __init__(self, run: str, client, store=None, *, timeout_s: float = 600.0,
                 min_bytes_per_s: float = DEFAULT_MIN_BYTES_PER_S,
                 retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
                 part_bytes: int = DEFAULT_PART_BYTES, parallel_parts: int = 4,
                 put_part: PartPut = upload_part_url) -> None:
        check_part_bytes(part_bytes)
        if parallel_parts < 1:
            raise InvalidArgument(f"parallel_parts must be >= 1, got {parallel_parts}")
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
        check_min_bytes_per_s(min_bytes_per_s)
        if not retry_deadline_s > 0:
            raise InvalidArgument(f"retry_deadline_s must be > 0 (it holds the backoff before the next "
                                  f"attempt), got {retry_deadline_s}")
        self.run = run
        self.client = client
        self.store = store
        self.timeout_s = timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        self.retry_deadline_s = retry_deadline_s
        self.part_bytes = part_bytes
        self.parallel_parts = parallel_parts
        self.put_part = put_part
        self._http = LoopSession()  # presigned PUTs: kept-alive connections, not a handshake per blob

    async def close(self) -> None:
        """Close the presigned PUTs' connections; a later upload opens new ones."""
        await self._http.close()

    def attempt_timeout_s(self, nbytes: int, *, sharing: int = 1) -> float:
        """The limit of one PUT of ``nbytes``: ``timeout_s`` plus the bytes at ``min_bytes_per_s``,
        of which the PUT gets a ``sharing``-th while that many PUTs go at once."""
        return self.timeout_s + max(nbytes, 0) * max(sharing, 1) / self.min_bytes_per_s

    def _retry_deadline_s(self, attempt_s: float) -> float:
        """How long a PUT whose attempts are limited to ``attempt_s`` is retried: long enough
        that an attempt that ran out its limit is tried again."""
        return attempt_s + self.retry_deadline_s

    async def upload(self, digest: str, size: int, *, path: Path | None = None, data: bytes | None = None,
                     skip_existing: bool = True) -> str:
        """Upload a file or bytes whose xxh3-128 is ``digest``; returns the key.

        ``skip_existing``: first ask whether the key holds the blob already (a retried
        publish); a caller whose bytes are new (a patch part) saves that round trip."""
        key = blob_key(self.run, digest)
        if self.store is not None:
            limit_s = self.attempt_timeout_s(size)

            async def direct() -> None:
                if skip_existing and await self.store.stat(key) == size:
                    return
                try:
                    if path is not None:
                        await asyncio.wait_for(self.store.put_file(key, path), limit_s)
                    else:
                        await asyncio.wait_for(self.store.put_bytes(key, data), limit_s)
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(
                        f"the upload of {size} bytes to {key} took over {limit_s:.0f}s (timeout_s "
                        f"{self.timeout_s:g} + the bytes at min_bytes_per_s {self.min_bytes_per_s:g}); "
                        "on a slower link give the uploader a lower min_bytes_per_s "
                        "(a publisher's upload_min_bytes_per_s)") from None

            await with_retries(f"upload of {key}", direct, deadline_s=self._retry_deadline_s(limit_s))
            return key

        if size > self.part_bytes:
            await self._upload_in_parts(key, digest, size, path, data)
            return key

        limit_s = self.attempt_timeout_s(size)

        async def presigned() -> None:
            grant = await self.client.presign_upload(self.run, digest, size)
            if path is not None:
                await upload_url(grant.url, path, timeout_s=limit_s, session=self._http.get())
            else:
                await upload_bytes_url(grant.url, data, timeout_s=limit_s, session=self._http.get())

        await with_retries(f"presigned upload of {key}", presigned, deadline_s=self._retry_deadline_s(limit_s))
        return key

    async def _upload_in_parts(self, key: str, digest: str, size: int, path: Path | None, data: bytes | None) -> None:
        """A multipart upload through presigned part URLs; aborted when it cannot complete."""
        started = await with_retries(f"starting the multipart upload of {key}",
                                     lambda: self.client.start_upload(self.run, digest, size, self.part_bytes))
        upload_id = started.upload_id
        urls = {part.part_number: part.url for part in started.parts}
        slots = asyncio.Semaphore(self.parallel_parts)
        sharing = min(self.parallel_parts, len(urls))  # parts at once share the link

        async def one_part(number: int) -> tuple[int, str]:
            offset, length = part_span(size, self.part_bytes, number)
            limit_s = self.attempt_timeout_s(length, sharing=sharing)

            async def attempt() -> str:
                try:
                    return await self.put_part(urls[number], path=path, data=data, offset=offset, length=length,
                                               timeout_s=limit_s, session=self._http.get())
                except UrlExpired as exc:
                    fresh = await self.client.presign_upload_parts(self.run, upload_id, [number])
                    urls[number] = fresh.parts[0].url
                    raise Unavailable(f"the URL of part {number} was refused ({exc}); PUT again with a new one") from exc

            async with slots:
                return number, await with_retries(f"part {number} of the upload of {key}", attempt,
                                                  deadline_s=self._retry_deadline_s(limit_s))

        tasks = [asyncio.ensure_future(one_part(n)) for n in sorted(urls)]
        try:
            etags = await asyncio.gather(*tasks)
            await with_retries(f"completing the multipart upload of {key}", lambda: self.client.complete_upload(
                self.run, upload_id, etags, timeout_s=self.client.timeout_s + size / _COMPLETE_BYTES_PER_S))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.shield(self._abort(key, upload_id))
            raise
        log.debug("multipart upload complete", key=key, parts=len(etags), size=size)

    async def _abort(self, key: str, upload_id: str) -> None:
        """Best effort: an upload left open is aborted by the board's garbage collection later."""
        try:
            await self.client.abort_upload(self.run, upload_id)
        except NotFound:
            return  # not open any more
        except (WeftboardError, asyncio.TimeoutError) as exc:
            log.warning("could not abort a failed multipart upload; garbage collection will",
                        key=key, upload_id=upload_id, error=str(exc))
