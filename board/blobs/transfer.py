"""Moving blobs into the blob store (``Uploader``) and retrying transient failures
(``with_retries``, used by publishers and islands alike).

Invariants:
- Keys are content addressed (``blob_key(run, digest)``), so a retried upload rewrites the
  same bytes and an upload whose key already holds a blob of the right size is skipped.
- Bytes never flow through the board: with credentials the uploader writes to the store;
  without, it asks the board for a short-lived presigned PUT URL and sends the bytes there.
- Transient failures (``Unavailable``, deadlines, connection errors) are retried with
  exponential backoff and jitter up to a total deadline; anything else is raised at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import structlog

from weftboard.board.blobs.http import upload_bytes_url, upload_url
from weftboard.proto.domain import blob_key
from weftboard.proto.errors import DeadlineExceeded, Unavailable

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


class Uploader:
    """Uploads content-addressed blobs of one run (``store`` given: direct; else presigned)."""

    def __init__(self, run: str, client, store=None, *, timeout_s: float = 600.0) -> None:
        self.run = run
        self.client = client
        self.store = store
        self.timeout_s = timeout_s

    async def upload(self, digest: str, size: int, *, path: Path | None = None, data: bytes | None = None,
                     skip_existing: bool = True) -> str:
        """Upload a file or bytes whose xxh3-128 is ``digest``; returns the key.

        ``skip_existing``: first ask whether the key holds the blob already (a retried
        publish); a caller whose bytes are new (a patch part) saves that round trip."""
        key = blob_key(self.run, digest)
        if self.store is not None:
            async def direct() -> None:
                if skip_existing and await self.store.stat(key) == size:
                    return
                if path is not None:
                    await asyncio.wait_for(self.store.put_file(key, path), self.timeout_s)
                else:
                    await asyncio.wait_for(self.store.put_bytes(key, data), self.timeout_s)

            await with_retries(f"upload of {key}", direct)
            return key

        async def presigned() -> None:
            grant = await self.client.presign_upload(self.run, digest, size)
            if path is not None:
                await upload_url(grant.url, path, timeout_s=self.timeout_s)
            else:
                await upload_bytes_url(grant.url, data, timeout_s=self.timeout_s)

        await with_retries(f"presigned upload of {key}", presigned)
        return key
