"""Reading blobs through presigned URLs as a blob store's reads go (``UrlReader``), and a
credential-less island's fetcher judging its path and fetching a far one in parallel ranges.

Real S3 (SeaweedFS) presigned URLs, and a local aiohttp server where a test needs to see the
requests (their ranges, whether they were in flight at once) or to make one fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from weftboard.board.blobs import S3BlobStore, UrlReader, fetch_url
from weftboard.board.embedded import free_port
from weftboard.cuda.anchors import file_digest
from weftboard.proto.errors import Unavailable, UrlExpired
from weftboard.subscriber.fetch import PROBES, RANGES_MIN_FIRST_BYTE_S, Fetcher


def _payload(n: int, seed: int = 7) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


class _Chunks:
    """An ``on_chunk`` that rebuilds the blob and counts the bytes it was handed."""

    def __init__(self, size: int) -> None:
        self.got = bytearray(size)
        self.total = 0

    def __call__(self, at: int, chunk: bytes) -> None:
        self.got[at:at + len(chunk)] = chunk
        self.total += len(chunk)


async def test_a_presigned_url_reads_like_a_store_in_ranges_one_stream_or_resumed(
        s3_store: S3BlobStore, tmp_path: Path) -> None:
    """Real S3: parallel ranges, one stream and a resumed stream each give the blob, and
    ``on_chunk`` sees exactly the bytes fetched, where the file has them; every response's
    wait is timed, a probe too, and an expired URL is refused as such."""
    data = _payload(2 * (1 << 20) + 777, seed=5)
    await s3_store.put_bytes("r/blobs/url", data)
    url = await s3_store.presign_get("r/blobs/url", 60)
    reader = UrlReader()
    try:
        assert reader.first_byte_s() is None
        for ranges, offset in ((4, 0), (1, 0), (1, 12345), (8, 0)):
            dest = tmp_path / f"url-{ranges}-{offset}.bin"
            dest.write_bytes(data[:offset] if offset else b"stale bytes of an earlier attempt" * 100)
            seen = _Chunks(len(data))
            assert await reader.download_to(url, dest, offset, size=len(data), ranges=ranges,
                                            on_chunk=seen) == len(data)
            assert dest.read_bytes() == data
            assert seen.total == len(data) - offset and bytes(seen.got[offset:]) == data[offset:]
        first_byte = reader.first_byte_s()
        assert first_byte is not None and 0 < first_byte < 5.0
        samples = len(reader._first_byte)
        assert samples == 4 + 1 + 1 + 8  # one per range or stream
        await reader.probe_first_byte(url)
        assert len(reader._first_byte) == samples + 1
        short = await s3_store.presign_get("r/blobs/url", 1)
        await asyncio.sleep(2.1)
        with pytest.raises(UrlExpired, match="expired"):
            await reader.probe_first_byte(short)
        with pytest.raises(UrlExpired):
            await reader.download_to(short, tmp_path / "expired.bin", size=len(data), ranges=4)
    finally:
        await reader.close()


@contextlib.asynccontextmanager
async def _serving(handler: Callable[[web.Request], object]) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/obj", handler)  # type: ignore[arg-type]
    runner = web.AppRunner(app, handler_cancellation=True)  # a handler sees its client leave
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/obj?X-Amz-Signature=secret"
    finally:
        await runner.cleanup()


def _range_asked(body: bytes, request: web.Request) -> tuple[int, int]:
    """The first and last byte of ``body`` that ``request``'s Range asks for ("bytes=lo-hi" or "bytes=lo-")."""
    lo, hi = request.headers["Range"].removeprefix("bytes=").split("-")
    return int(lo), int(hi) if hi else len(body) - 1


def _ranged(body: bytes, request: web.Request) -> web.Response:
    lo, hi = _range_asked(body, request)
    return web.Response(status=206, body=body[lo:hi + 1],
                        headers={"Content-Range": f"bytes {lo}-{hi}/{len(body)}"})


async def test_ranges_are_in_flight_at_once_and_one_failure_stops_the_rest_and_empties_the_file(
        tmp_path: Path) -> None:
    """Four ranges tile the blob and are all requested before any is answered; when one of
    them fails, the others are stopped, the file is left empty (no holes to resume from) and
    the error names the URL without its signature."""
    body = _payload(1 << 20, seed=3)
    ranges: list[str] = []
    all_asked = asyncio.Event()
    fail_one = False
    stopped = 0

    async def handler(request: web.Request) -> web.Response:
        nonlocal stopped
        ranges.append(request.headers["Range"])
        if len(ranges) % 4 == 0:
            all_asked.set()
        await asyncio.wait_for(all_asked.wait(), 10)
        if fail_one:
            if request.headers["Range"].startswith("bytes=0-"):
                return web.Response(status=503, text="busy")
            try:
                await asyncio.sleep(10)  # held until the client gives up on it
            except asyncio.CancelledError:
                stopped += 1
                raise
        return _ranged(body, request)

    reader = UrlReader()
    try:
        async with _serving(handler) as url:
            dest = tmp_path / "o"
            seen = _Chunks(len(body))
            assert await reader.download_to(url, dest, size=len(body), ranges=4, on_chunk=seen) == len(body)
            assert dest.read_bytes() == body and seen.total == len(body)
            q = len(body) // 4
            assert sorted(ranges, key=lambda r: int(r[6:].split("-")[0])) == [
                f"bytes={i * q}-{(i + 1) * q - 1}" for i in range(4)]

            ranges.clear()
            all_asked.clear()
            fail_one = True
            with pytest.raises(Unavailable) as caught:
                await reader.download_to(url, dest, size=len(body), ranges=4)
            assert "503" in str(caught.value) and "secret" not in str(caught.value)
            assert dest.stat().st_size == 0
            for _ in range(50):
                if stopped == 3:
                    break
                await asyncio.sleep(0.02)
            assert stopped == 3
    finally:
        await reader.close()


@pytest.mark.parametrize("answer", ["whole object", "other size"])
async def test_a_range_answered_wrong_is_refused(tmp_path: Path, answer: str) -> None:
    """A server that answers a range with the whole object (200), or with another object's
    size, fails the download (the fetcher then starts over) instead of writing wrong bytes."""
    body = _payload(600_000)

    async def handler(request: web.Request) -> web.Response:
        if answer == "whole object":
            return web.Response(body=body)
        return _ranged(body + b"more", request)

    reader = UrlReader()
    try:
        async with _serving(handler) as url:
            with pytest.raises(Unavailable, match="200" if answer == "whole object" else "600000-byte"):
                await reader.download_to(url, tmp_path / "o", size=len(body), ranges=2)
            assert (tmp_path / "o").stat().st_size == 0
    finally:
        await reader.close()


def _descriptors_on(path: Path) -> int:
    """How many of this process's descriptors are open on the file ``path``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    return count


async def _stalling(body: bytes, sent: int, request: web.Request) -> web.StreamResponse:
    """The answer to ``request`` (whole or a range of ``body``) that sends its first ``sent``
    bytes and then nothing."""
    lo = 0
    status = 200
    headers = {}
    if "Range" in request.headers:
        lo, hi = _range_asked(body, request)
        status = 206
        headers["Content-Range"] = f"bytes {lo}-{hi}/{len(body)}"
        body = body[:hi + 1]
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = len(body) - lo
    await response.prepare(request)
    await response.write(body[lo:lo + sent])
    await asyncio.sleep(3600)
    return response


async def test_a_stalled_download_times_out_with_where_to_resume(tmp_path: Path) -> None:
    """A stream that stalls part way is ``Unavailable`` within its limit, naming the offset
    its file holds (the bytes written), and a download resumed there gives the blob; a ranged
    download with one stalled range names that range and byte, and leaves an empty file and no
    open descriptor behind."""
    body = _payload(800_000)
    stall = True

    async def handler(request: web.Request) -> web.StreamResponse:
        lo = int(request.headers.get("Range", "bytes=0-")[6:].split("-")[0])
        if stall and lo == 0:
            return await _stalling(body, 70_000, request)
        return _ranged(body, request) if "Range" in request.headers else web.Response(body=body)

    async with _serving(handler) as url:
        dest = tmp_path / "o"
        with pytest.raises(Unavailable, match="timed out; resume with offset=70000") as caught:
            await fetch_url(url, dest, timeout_s=1.0)
        assert "secret" not in str(caught.value)
        assert dest.read_bytes() == body[:70_000]
        assert await fetch_url(url, dest, offset=70_000) == len(body) and dest.read_bytes() == body

        reader = UrlReader()
        try:
            with pytest.raises(Unavailable, match=r"range 0-400000 of .* timed out at byte 65536"):
                await reader.download_to(url, dest, size=len(body), ranges=2, timeout_s=1.0)
            assert dest.stat().st_size == 0 and _descriptors_on(dest) == 0
            stall = False
            assert await reader.download_to(url, dest, size=len(body), ranges=2) == len(body)
            assert dest.read_bytes() == body
        finally:
            await reader.close()


async def test_a_cancelled_ranged_download_closes_its_file_empty(tmp_path: Path) -> None:
    """Cancelling a download whose ranges are part way leaves an empty file and no descriptor
    open: the writes under way end and the file is closed before the cancellation goes on."""
    body = _payload(800_000)

    async def handler(request: web.Request) -> web.StreamResponse:
        return await _stalling(body, 100_000, request)

    reader = UrlReader()
    try:
        async with _serving(handler) as url:
            dest = tmp_path / "o"
            written: list[int] = []
            task = asyncio.ensure_future(reader.download_to(url, dest, size=len(body), ranges=2,
                                                            on_chunk=lambda at, chunk: written.append(at)))
            for _ in range(100):
                if len(written) >= 2:
                    break
                await asyncio.sleep(0.02)
            assert sorted(written) == [0, 400_000]  # each range wrote its first whole chunk
            assert _descriptors_on(dest) == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert dest.stat().st_size == 0 and _descriptors_on(dest) == 0
    finally:
        await reader.close()


async def test_a_fetcher_without_a_store_judges_its_urls_path(s3_store: S3BlobStore, tmp_path: Path) -> None:
    """An island without blob-store credentials assumes its URLs far until it has measured
    them (its first patch comes in parallel ranges, verified against the record), then judges
    them as a store's reads: loopback S3 is near, a path whose waits are long is far, and a
    probe samples the last blob's URL."""
    data = _payload(1 << 20, seed=11)
    await s3_store.put_bytes("r/blobs/p", data)
    digest = file_digest(_write(tmp_path / "src", data))
    ref = SimpleNamespace(key="r/blobs/p", digest=digest, size=len(data), name="",
                          url=await s3_store.presign_get("r/blobs/p", 60))
    fetcher = Fetcher(tmp_path / "cache")
    try:
        assert fetcher.first_byte_s() is None and fetcher.far()
        path = await fetcher.fetch(ref)
        assert path.read_bytes() == data
        assert len(fetcher.urls._first_byte) == 4  # a fresh far download: ranges of 256 KiB at least
        # four ranges on fresh connections can each wait over 10 ms on a loaded two-core host;
        # the probes on warm ones sample the path itself, as the island does after its first blob
        await fetcher.measure()
        assert len(fetcher.urls._first_byte) == 4 + PROBES
        assert fetcher.first_byte_s() < RANGES_MIN_FIRST_BYTE_S and not fetcher.far()
        fetcher.urls._first_byte.clear()
        fetcher.urls._first_byte.append(1.0)  # one long wait: a sample of the path is taken first
        assert fetcher.far()
        await fetcher.measure()
        assert len(fetcher.urls._first_byte) == 4 and not fetcher.far()
        bad = SimpleNamespace(**{**vars(ref), "digest": "xxh3:" + hashlib.sha256(b"x").hexdigest()[:32]})
        fetcher.forget(ref)
        with pytest.raises(Exception, match="hashing to"):
            await fetcher.fetch(bad)
    finally:
        await fetcher.close()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
