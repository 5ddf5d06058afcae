"""The island's blob downloads into its cache, by digest (step 3 of ``subscriber.Subscriber``).

Staged parts (hints sent while a version is still being encoded) start downloading before their
version commits (``prefetch``); the plan step that names the same digest takes the running
download over (``for_ref``), so a blob is never downloaded twice. The verified blobs of a step
that was not applied stay cached (``keep``) for a retry, whose fetch re-hashes them, until a
plan executes without them (``forget_kept``) or the island stops.

Invariants:
- At most ``MAX_PREFETCHED`` staged parts download or wait at once, none larger than
  ``MAX_PREFETCH_BYTES`` (each is held in memory as it lands), and only for versions after the
  held one that the fetcher can read (``Fetcher.can_read``).
- A staged part's download that failed or was cancelled is not handed over: the step starts a
  fresh one. Dropped parts (``drop_prefetched``) are cancelled and their files forgotten once
  their task ends; their errors are retrieved, not logged (nobody waits for them).
- Removing cached files runs on a worker thread (an anchor's shards can take a while).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from weftboard.proto.errors import ApplyError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.subscriber.arriving import ArrivingBytes
from weftboard.subscriber.fetch import Fetcher, fetch_all

MAX_PREFETCHED = 64  # staged parts downloading or waiting for their commit; later hints are ignored
MAX_PREFETCH_BYTES = 64 << 20  # a staged part is held in memory as it lands: a larger one waits for the commit


@dataclass
class Download:
    """One blob on its way into the cache, its bytes visible as they land."""

    version: int  # the version whose step (or staged part) it belongs to
    ref: pb.BlobRef
    bytes: ArrivingBytes
    task: asyncio.Future  # -> (final path, perf_counter time it was verified)


@dataclass
class Downloads:
    """The downloads of one island's fetcher: staged parts by digest, and blobs kept for a retry."""

    fetcher: Fetcher
    prefetched: dict[str, Download] = field(default_factory=dict)  # digest -> a staged part's download
    kept: dict[str, pb.BlobRef] = field(default_factory=dict)  # digest -> a cached blob of a step not applied

    def start(self, version: int, ref: pb.BlobRef) -> Download:
        """Download ``ref`` now, its bytes visible as they land; a failure reaches their readers."""
        blob = ArrivingBytes(ref.size)

        async def download() -> tuple[Path, float]:
            try:
                path = await self.fetcher.fetch(ref, on_chunk=blob.put)
            except BaseException as exc:
                blob.fail(exc if isinstance(exc, Exception) else ApplyError("the download was cancelled"))
                raise
            blob.verified()
            return path, time.perf_counter()

        return Download(version, ref, blob, asyncio.ensure_future(download()))

    def prefetch(self, part: pb.StagedPart, held: int) -> None:
        """Start downloading a staged part of a version after ``held`` (a hint), within the limits."""
        if (not self.fetcher.can_read(part.blob) or part.version <= held
                or part.blob.digest in self.prefetched or len(self.prefetched) >= MAX_PREFETCHED
                or part.blob.size > MAX_PREFETCH_BYTES):
            return
        self.prefetched[part.blob.digest] = self.start(part.version, part.blob)

    def for_ref(self, version: int, ref: pb.BlobRef) -> Download:
        """The download of a blob of ``version``'s step: a staged part's (same digest, same bytes),
        if one runs or ran well, else a new one."""
        pre = self.prefetched.pop(ref.digest, None)
        if pre is not None and not (pre.task.done() and (pre.task.cancelled() or pre.task.exception() is not None)):
            return pre
        return self.start(version, ref)

    async def fetch_step(self, step: pb.PlanStep) -> list[Path]:
        """The verified files of every blob of ``step``, downloaded at once (a staged part's
        download where one runs); when one fails, the others are stopped before the failure
        goes on (``fetch.fetch_all``)."""
        return await fetch_all([self._fetched(step.to_version, b) for b in step.blobs])

    async def _fetched(self, version: int, ref: pb.BlobRef) -> Path:
        if ref.digest in self.prefetched:
            return (await self.for_ref(version, ref).task)[0]
        return await self.fetcher.fetch(ref)

    def keep(self, refs: list[pb.BlobRef]) -> None:
        """Keep these verified blobs cached for a retry of their step."""
        self.kept.update((b.digest, b) for b in refs)

    async def forget_step(self, step: pb.PlanStep) -> None:
        """Drop a step's cached blobs: applied, or proved bad (a retry fetches them anew)."""
        for b in step.blobs:
            self.kept.pop(b.digest, None)
        await asyncio.to_thread(lambda: [self.fetcher.forget(b) for b in step.blobs])

    async def forget_kept(self, used: set[str]) -> None:
        """Drop the kept blobs that ``used`` does not name."""
        gone = [self.kept.pop(d) for d in [d for d in self.kept if d not in used]]
        if gone:
            await asyncio.to_thread(lambda: [self.fetcher.forget(b) for b in gone])

    def drop_prefetched(self, upto: int) -> None:
        """Cancel and forget the staged parts' downloads of versions up to ``upto``."""
        for digest, pre in list(self.prefetched.items()):
            if pre.version <= upto:
                del self.prefetched[digest]
                pre.task.cancel()

                def forget(task: asyncio.Future, ref: pb.BlobRef = pre.ref) -> None:
                    if not task.cancelled():
                        task.exception()  # retrieved, not logged: nobody waits for this part
                    self.fetcher.forget(ref)

                pre.task.add_done_callback(forget)

    async def drop(self, downloads: list[Download], fetching: asyncio.Future) -> None:
        """Stop a step's downloads (and ``fetching``, their gathering) and forget their files."""
        fetching.cancel()
        for d in downloads:
            d.task.cancel()
        await asyncio.gather(fetching, *(d.task for d in downloads), return_exceptions=True)
        for d in downloads:
            self.fetcher.forget(d.ref)
