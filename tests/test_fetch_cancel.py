"""A cancelled fetch stops its download at once and leaves no partial file behind.

The blob comes from a local aiohttp server that trickles bytes (an S3 endpoint for
``S3BlobStore``, one stream or parallel ranges, or a presigned URL): once the first bytes
arrived the fetch is cancelled, and the server must see every connection closed within
about a second, and the cache must hold nothing of the blob once the cancellation returned.
A patch joined from its parts, cancelled while joining, leaves no joined file either.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import pytest
import xxhash
from aiohttp import web

from weftboard.board.blobs import S3BlobStore
from weftboard.proto.domain import blob_key, format_digest
from weftboard.proto.errors import DigestMismatch
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.subscriber.fetch import Fetcher, fetch_all

BUCKET = "slow"
SIZE = 4 << 20  # 16 ranges of 256 KiB at most; trickled, it would take hours
CLOSE_WITHIN_S = 2.0


class TricklingServer:
    """Answers HEAD on anything with 200, and GET (with or without a Range) with the blob's
    bytes, 1 KiB every 20 ms; notes each response it starts and when its client went away."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.open = 0
        self.expect = 1  # responses the test waits to see under way
        self.started = asyncio.Event()  # ``expect`` responses under way, some bytes out
        self.all_closed = asyncio.Event()
        self.closed_at: list[float] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> TricklingServer:
        app = web.Application()
        app.router.add_route("HEAD", "/{tail:.*}", self._head)
        app.router.add_get("/{tail:.*}", self._get, allow_head=False)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def _head(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        lo, hi = 0, len(self.data)
        match = re.match(r"bytes=(\d+)-(\d*)", request.headers.get("Range", ""))
        status = 200
        headers = {}
        if match:
            lo = int(match.group(1))
            hi = int(match.group(2)) + 1 if match.group(2) else len(self.data)
            status = 206
            headers["Content-Range"] = f"bytes {lo}-{hi - 1}/{len(self.data)}"
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = hi - lo
        self.open += 1
        self.all_closed.clear()
        try:
            await response.prepare(request)
            for at in range(lo, hi, 1024):
                await response.write(self.data[at:min(at + 1024, hi)])
                if self.open >= self.expect:
                    self.started.set()
                await asyncio.sleep(0.02)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.closed_at.append(time.monotonic())
            self.open -= 1
            if self.open == 0:
                self.all_closed.set()
        return response


def _ref(data: bytes, url: str = "") -> pb.BlobRef:
    digest = format_digest(xxhash.xxh3_128_digest(data))
    return pb.BlobRef(key=blob_key("r", digest), digest=digest, size=len(data), url=url)


def _leftovers(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())


@pytest.mark.parametrize("how", ["s3-one-stream", "s3-ranges", "presigned-url"])
async def test_a_cancelled_fetch_closes_its_connections_and_removes_its_part_file(tmp_path: Path, how: str) -> None:
    data = os.urandom(SIZE)
    async with TricklingServer(data) as server:
        store = None
        if how.startswith("s3"):
            store = S3BlobStore(server.url, "key", "secret", BUCKET, region="us-east-1", retries=0)
        fetcher = Fetcher(tmp_path / "cache", store, ranges=8 if how == "s3-ranges" else 1)
        ref = _ref(data, url=f"{server.url}/blob" if store is None else "")
        server.expect = 8 if how == "s3-ranges" else 1
        fetch = asyncio.ensure_future(fetcher.fetch(ref))
        try:
            await asyncio.wait_for(server.started.wait(), 10)
            for _ in range(1000):  # the client opens the .part file once the first bytes are in
                if _leftovers(fetcher.cache_dir):
                    break
                await asyncio.sleep(0.01)
            assert _leftovers(fetcher.cache_dir)  # the .part file is being written
            fetch.cancel()
            t_cancel = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await fetch
            left = _leftovers(fetcher.cache_dir)
            try:  # the server saw every connection closed, promptly
                await asyncio.wait_for(server.all_closed.wait(), CLOSE_WITHIN_S)
            except TimeoutError:
                pytest.fail(f"{server.open} responses still being read {CLOSE_WITHIN_S} s after the cancellation")
            assert max(server.closed_at) - t_cancel < CLOSE_WITHIN_S
            assert left == []  # nothing partial was left once the cancellation returned
            assert _leftovers(fetcher.cache_dir) == []  # and no thread wrote anything after
        finally:
            fetch.cancel()
            await asyncio.gather(fetch, return_exceptions=True)
            await fetcher.close()
            if store is not None:
                await store.close()


async def test_a_failed_blob_stops_the_other_downloads_of_its_step(tmp_path: Path) -> None:
    """A step's blobs download at once; when one fails while another is still downloading,
    ``fetch_all`` raises that failure only once the other stopped: its connection closed and
    its ``.part`` file gone, so nothing keeps downloading for a step that already failed."""
    data = os.urandom(SIZE)
    async with TricklingServer(data) as server:
        store = S3BlobStore(server.url, "key", "secret", BUCKET, region="us-east-1", retries=0)
        fetcher = Fetcher(tmp_path / "cache", store, ranges=1)

        async def fails_once_the_other_writes() -> Path:
            await asyncio.wait_for(server.started.wait(), 10)
            for _ in range(1000):
                if _leftovers(fetcher.cache_dir):
                    break
                await asyncio.sleep(0.01)
            assert _leftovers(fetcher.cache_dir)  # the other blob's .part file is being written
            raise DigestMismatch("the second blob of the step is not what the record says")

        try:
            with pytest.raises(DigestMismatch, match="second blob"):
                await fetch_all([fetcher.fetch(_ref(data)), fails_once_the_other_writes()])
            assert server.open <= 1
            left = _leftovers(fetcher.cache_dir)
            try:
                await asyncio.wait_for(server.all_closed.wait(), CLOSE_WITHIN_S)
            except TimeoutError:
                pytest.fail(f"{server.open} responses still being read {CLOSE_WITHIN_S} s after the step failed")
            assert left == []  # the .part file was gone when the failure reached the caller
            assert _leftovers(fetcher.cache_dir) == []
        finally:
            await store.close()


async def test_a_join_cancelled_midway_leaves_no_joined_file(tmp_path: Path) -> None:
    """The parts of a patch are joined into one file for a destination; cancelled while the
    join runs (its thread blocked reading a part), the joined file is removed once the thread
    ended, before the cancellation returns. The scenario runs on a loop of its own, whose end
    waits for every worker thread it started: a join left running would write its file then."""
    from test_arriving import _groups, _part_bytes
    from test_destinations import _step, _view

    old = _view(3)
    parts = _part_bytes(old, _step(old, 4, frac=0.2), _groups(sorted(old), 2))
    cache = tmp_path / "cache"
    first = tmp_path / "part-0"
    first.write_bytes(parts[0])
    blocking = tmp_path / "part-1"
    os.mkfifo(blocking)  # reading it blocks until the test writes: the join is caught midway

    def feed() -> None:
        with open(blocking, "wb") as out:  # opens once the join's thread opened it to read
            out.write(parts[1])

    async def scenario() -> list:
        fetcher = Fetcher(cache)
        joining = asyncio.ensure_future(fetcher.join(2, [first, blocking]))
        await asyncio.sleep(0)  # the join starts
        joining.cancel()
        return await asyncio.gather(joining, asyncio.to_thread(feed), return_exceptions=True)

    results = await asyncio.to_thread(asyncio.run, scenario())
    assert isinstance(results[0], asyncio.CancelledError), results
    assert _leftovers(cache) == []
