"""Fetching plan blobs into the island's cache: streaming, resumable, digest-verified.

Invariants:
- A blob is downloaded to ``<cache>/<hex>.part`` (resuming from its current size after a
  crash or a dropped connection), then hashed; only a file whose size and xxh3-128 match
  the ``BlobRef`` is renamed to its final name. A final file is therefore always verified
  (and re-verified if found at start-up, since the disk may have been tampered with).
- Anchor shards keep their checkpoint file names (``<cache>/<hex>/<name>``) so a
  destination can lay them out as an HF checkpoint directly.
- With a blob store the island reads S3 with its own credentials; without, it uses the
  presigned URL the board put in the plan or hint (``UrlReader``: one HTTP session per
  fetcher and event loop, kept-alive connections, that ``close`` ends). Either way the same
  rules below hold, the reader's measured time to first byte judging the path.
- A blob of at most ``MAX_RANGED_BYTES`` (a patch) from a far store (its measured time to
  first byte at least ``RANGES_MIN_FIRST_BYTE_S``) is fetched as parallel byte ranges, the
  size coming from the record (no stat round trip); a failed ranged fetch starts over.
- ``on_chunk`` sees every byte of the blob once at least (as it lands when the store streams,
  else from disk), before the digest is checked: whoever uses those bytes early must wait
  for ``fetch`` to return before trusting them (``arriving.ArrivingBytes.verified``).
- Two fetches of one blob never write its files at once: the second waits for the first and
  then finds the verified file (a staged part's download and a plan's, say).
- A cancelled fetch (an island stopping, a newer plan) stops its download at once (the store's
  threads stop reading: ``board/blobs/stoppable.py``) and removes its ``.part`` file before the
  cancellation goes on; only a crash leaves a ``.part`` to resume. ``join`` likewise removes
  a joined patch file it was cancelled writing. ``fetch_all`` ends a step's other downloads
  the same way when one of them fails, before the failure goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from weftboard.board.blobs import UrlReader
from weftboard.board.blobs.base import ChunkCallback
from weftboard.board.blobs.transfer import with_retries
from weftboard.cuda.anchors import file_digest
from weftboard.cuda.codec import join_patches
from weftboard.proto.errors import (
    DigestMismatch,
    PermissionDenied,
    Unavailable,
    WeftboardError,
)
from weftboard.subscriber.cancel import cancel_and_wait

log = structlog.get_logger("weftboard.subscriber")

# Blobs up to this size (patches) are fetched in parallel byte ranges: on a long path several
# connections ramp up in a few round trips where one takes many. Larger blobs (anchor shards)
# come over one connection, which resumes from its last byte after a drop.
MAX_RANGED_BYTES = 64 << 20
# ... and only when the store answers slower than this (measured, see BlobStore.first_byte_s):
# on a short path each extra request costs more than the ramp-up it saves.
RANGES_MIN_FIRST_BYTE_S = 0.01
PROBES = 3  # small requests that sample the store's path before an island decides it is far


def _replay(path: Path, start: int, end: int, on_chunk: ChunkCallback, chunk: int = 1 << 20) -> None:
    """Hand bytes ``[start, end)`` of a file already on disk to ``on_chunk``."""
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        while pos < end:
            data = f.read(min(chunk, end - pos))
            if not data:
                raise Unavailable(f"{path} ends at byte {pos}, expected {end}")
            on_chunk(pos, data)
            pos += len(data)


def _join_files(out: Path, parts: list[Path]) -> Path:
    out.write_bytes(join_patches([p.read_bytes() for p in parts]))
    return out


def _cached_size(final: Path) -> int | None:
    """The size of a cached blob's file, None when there is none (its folder is made)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        return final.stat().st_size
    except FileNotFoundError:
        return None


def _resume_offset(part: Path, size: int) -> int:
    """Bytes of a ``size``-byte blob already in its ``.part`` file; one longer than the blob
    cannot be a prefix of it and starts over."""
    try:
        offset = part.stat().st_size
    except FileNotFoundError:
        return 0
    if offset > size:
        part.unlink()
        return 0
    return offset


def cache_path(cache_dir: Path, ref: Any) -> Path:
    hexpart = ref.digest.split(":", 1)[1]
    if ref.name:
        return cache_dir / hexpart / ref.name
    return cache_dir / f"{hexpart}.patch"


async def fetch_all(fetches: Sequence[Awaitable[Path]]) -> list[Path]:
    """The files of ``fetches`` run at once, in order. The first failure (or a cancellation)
    cancels the others and waits for them to end (their downloads stopped, their ``.part``
    files removed) before it goes on: no download outlives the step that wanted it."""
    tasks = [asyncio.ensure_future(f) for f in fetches]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await cancel_and_wait(tasks)  # those done stay as they are; gather raised the first failure


class Fetcher:
    def __init__(self, cache_dir: Path, blob_store: Any = None, *, parallel: int = 4, timeout_s: float = 600.0,
                 on_bytes: Callable[[int], None] | None = None, ranges: int = 8) -> None:
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.store = blob_store
        self.timeout_s = timeout_s
        self._sem = asyncio.Semaphore(parallel)
        self.on_bytes = on_bytes
        self.ranges = ranges  # byte ranges on parallel connections for a fresh download of one blob
        self.bytes_downloaded = 0
        self._last_key: str | None = None  # a blob known to exist, for probing the store's path
        self._last_url = ""  # ... and its presigned URL, without a store
        self._busy: dict[Path, tuple[asyncio.Lock, int]] = {}  # cache file -> (its lock, fetches holding or awaiting it)
        self.urls = UrlReader()  # presigned-URL downloads: a version's blobs reuse its connections

    async def close(self) -> None:
        """Close the presigned-URL downloads' connections; a later fetch opens new ones."""
        await self.urls.close()

    @contextlib.asynccontextmanager
    async def _exclusive(self, path: Path) -> AsyncIterator[None]:
        lock, users = self._busy.get(path, (asyncio.Lock(), 0))
        self._busy[path] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._busy[path]
            if users == 1:
                del self._busy[path]
            else:
                self._busy[path] = (lock, users - 1)

    def _reader(self, key: str, url: str) -> tuple[Any, str]:
        """What reads a blob, and what it names it by: the store and the key, or, without a
        store, the presigned URLs' reader and the URL ("" when there is none)."""
        return (self.store, key) if self.store is not None else (self.urls, url)

    def can_read(self, ref: Any) -> bool:
        """Whether ``ref`` can be downloaded: with the island's store, or through its URL."""
        return bool(self._reader(ref.key, ref.url)[1])

    def first_byte_s(self) -> float | None:
        """The blob store's (or, without one, the presigned URLs') measured time to first byte."""
        return (self.store if self.store is not None else self.urls).first_byte_s()

    def far(self) -> bool:
        """Whether the blobs are far enough for parallel ranges (and applying while
        downloading) to pay: each range is one more request, which on a short path (same host
        or datacenter) costs more than the single connection's ramp-up it saves. Unknown (no
        download yet): assume far."""
        first_byte = self.first_byte_s()
        return first_byte is None or first_byte >= RANGES_MIN_FIRST_BYTE_S

    async def measure(self, probes: int = PROBES) -> None:
        """Sample the store's time to first byte with ``probes`` small requests, so ``far()``
        judges the path rather than one large download's wait (a large object's first byte
        also waits on the store's disk). Needs one blob fetched before (without a store, its
        URL; an expired one fails the probe); a failed probe leaves the judgement as it was."""
        if self._last_key is None:
            return
        reader, source = self._reader(self._last_key, self._last_url)
        if not source:
            return
        for _ in range(probes):
            try:
                await reader.probe_first_byte(source)
            except WeftboardError as exc:
                log.info("probing the blob store failed", key=self._last_key, error=str(exc))
                return

    async def fetch(self, ref: Any, on_chunk: ChunkCallback | None = None) -> Path:
        """The verified local file of ``ref`` (downloading or resuming as needed).

        ``on_chunk(offset, data)`` sees every byte of the blob, as it arrives when the blob
        store streams it (from the download's threads), else once it is on disk; bytes seen
        are not verified until this returns (see ``arriving.ArrivingBytes``).
        """
        final = cache_path(self.cache_dir, ref)
        async with self._exclusive(final):
            return await self._fetch(ref, final, on_chunk)

    async def _fetch(self, ref: Any, final: Path, on_chunk: ChunkCallback | None) -> Path:
        # Every file-system call goes through a worker thread: the cache may sit on network
        # storage, where a stat can wait on the server, and the event loop serves the board's
        # watch stream and heartbeats meanwhile.
        cached = await asyncio.to_thread(_cached_size, final)
        if cached is not None:
            if cached == ref.size and await asyncio.to_thread(file_digest, final) == ref.digest:
                if on_chunk is not None:
                    await asyncio.to_thread(_replay, final, 0, ref.size, on_chunk)
                self._last_key, self._last_url = ref.key, ref.url
                return final
            await asyncio.to_thread(final.unlink, missing_ok=True)
        part = final.with_name(final.name + ".part")
        try:
            return await self._download(ref, final, part, on_chunk)
        except asyncio.CancelledError:
            # The store's download has stopped by now (its thread ended): nothing writes the
            # part file any more, and a cancelled fetch leaves nothing partial behind.
            await asyncio.shield(asyncio.to_thread(part.unlink, missing_ok=True))
            raise

    async def _download(self, ref: Any, final: Path, part: Path, on_chunk: ChunkCallback | None) -> Path:
        streamed = False
        async with self._sem:
            async def attempt() -> None:
                nonlocal streamed
                offset = await asyncio.to_thread(_resume_offset, part, ref.size)
                if offset == ref.size:
                    return
                if not self.can_read(ref):
                    raise PermissionDenied(
                        f"blob {ref.key}: no blob-store credentials and the plan carries no presigned URL"
                    )
                reader, source = self._reader(ref.key, ref.url)
                ranges = self.ranges if ref.size <= MAX_RANGED_BYTES and self.far() else 1
                if on_chunk is not None and offset:  # a resumed download: its prefix is on disk
                    await asyncio.to_thread(_replay, part, 0, offset, on_chunk)
                streamed = on_chunk is not None
                await asyncio.wait_for(
                    reader.download_to(source, part, offset, size=ref.size, ranges=ranges, on_chunk=on_chunk),
                    self.timeout_s,
                )

            await with_retries(f"download of {ref.key}", attempt, deadline_s=self.timeout_s)
        size = (await asyncio.to_thread(part.stat)).st_size
        self.bytes_downloaded += size
        if self.on_bytes is not None:
            self.on_bytes(size)
        digest = await asyncio.to_thread(file_digest, part) if size == ref.size else None
        if digest != ref.digest:
            await asyncio.to_thread(part.unlink, missing_ok=True)
            raise DigestMismatch(
                f"blob {ref.key}: downloaded {size} bytes hashing to {digest}, the record says "
                f"{ref.size} bytes hashing to {ref.digest}"
            )
        await asyncio.to_thread(os.replace, part, final)
        self._last_key, self._last_url = ref.key, ref.url
        if on_chunk is not None and not streamed:
            await asyncio.to_thread(_replay, final, 0, size, on_chunk)
        return final

    async def join(self, version: int, parts: Sequence[Path]) -> Path:
        """A patch's part files joined into one container file in the cache (for a destination
        that takes a single file); the caller removes it. Cancelled, the join's thread is let
        finish and its file removed before the cancellation goes on."""
        out = self.cache_dir / f"joined-v{version}.patch"
        work = asyncio.ensure_future(asyncio.to_thread(_join_files, out, list(parts)))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            await asyncio.wait([work])
            if not work.cancelled():
                work.exception()  # retrieved: the join's own outcome no longer matters
            await asyncio.to_thread(out.unlink, missing_ok=True)
            raise

    def forget(self, ref: Any) -> None:
        """Drop a blob's cached file (after it was applied, or when it proved bad)."""
        final = cache_path(self.cache_dir, ref)
        for p in (final, final.with_name(final.name + ".part")):
            p.unlink(missing_ok=True)
        if ref.name:  # its folder (two levels for a model file in a subfolder), once empty
            with contextlib.suppress(OSError):
                for folder in final.relative_to(self.cache_dir).parents[:-1]:
                    (self.cache_dir / folder).rmdir()
