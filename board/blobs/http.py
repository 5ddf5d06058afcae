"""Moving blobs through presigned URLs, for processes that hold no S3 credentials.

The board hands an island (or a credential-less publisher) a short-lived URL scoped to one
object; these helpers stream it to or from a local file with aiohttp.

Invariants:
- ``fetch_url`` resumes: with ``offset > 0`` it sends a Range request and appends; if the
  server ignores the range (200 instead of 206) the file is rewritten from byte 0.
- ``UrlReader`` reads as a blob store does (``download_to``, ``first_byte_s``,
  ``probe_first_byte``, a URL in place of a key): a fresh download of a known size may come
  as parallel byte ranges into a preallocated file; one failed range stops the others and
  empties the file (holes are no resumable prefix). ``on_chunk`` sees each chunk after it is
  written, on the event loop's thread.
- File I/O runs in worker threads so the caller's event loop keeps serving; a cancelled download
  waits for its threads' writes and its descriptor's close before it ends.
- HTTP statuses map to weftboard errors: 403 -> UrlExpired (a PermissionDenied: expired or
  foreign URL), 404 -> NotFound, 5xx, network failures and timeouts -> Unavailable
  (``_network_failures``), messages without the URL's signature.
- Each helper takes a caller's ``session`` (kept open, its kept-alive connections reused:
  ``LoopSession``) or opens and closes its own; the timeouts hold on every request either way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp

from weftboard.board.blobs.base import (
    FIRST_BYTE_SAMPLES,
    ChunkCallback,
    upload_source_size,
    without_queries,
)
from weftboard.proto.errors import NotFound, Unavailable, UrlExpired, WeftboardError

_CHUNK = 1 << 20
_MIN_RANGE = 256 << 10  # the smallest byte range worth its own connection (as the S3 store's)
_RANGE_CHUNK = 64 << 10  # a range's bytes are written (and reported) in chunks of this size
_CONTENT_RANGE = re.compile(r"bytes (?:(\d+)-(\d+)|\*)/(\d+)")


def _timeout(total_s: float | None, connect_s: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total_s, sock_connect=connect_s, sock_read=60.0)


class LoopSession:
    """One aiohttp session per event loop, made on first use and shared by every request made
    through it there (a version's blobs reuse kept-alive connections: no new TCP and TLS
    handshake per blob); a session of another (ended) loop is dropped. ``close`` ends it; a
    later request opens a new one."""

    def __init__(self) -> None:
        self._held: tuple[asyncio.AbstractEventLoop, aiohttp.ClientSession] | None = None

    def get(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._held is None or self._held[0] is not loop or self._held[1].closed:
            self._held = (loop, aiohttp.ClientSession())
        return self._held[1]

    async def close(self) -> None:
        if self._held is not None:
            (loop, session), self._held = self._held, None
            if loop is asyncio.get_running_loop():
                await session.close()


@contextlib.asynccontextmanager
async def _session_for(session: aiohttp.ClientSession | None) -> AsyncIterator[aiohttp.ClientSession]:
    """``session``, left open, or a session of this request's own, closed after it."""
    if session is not None:
        yield session
        return
    async with aiohttp.ClientSession() as own:
        yield own


def _redact(url: str) -> str:
    """The URL without its query (the signature), for error messages and logs."""
    return url.split("?", 1)[0]


@contextlib.contextmanager
def _network_failures(url: str, cannot: str, timed_out: Callable[[], str]) -> Iterator[None]:
    """What aiohttp raises inside as ``Unavailable``: a ``ClientError`` as "``cannot`` URL: why"
    (the URL and the error without their signatures), a timeout with ``timed_out()``'s message
    (read when it happens: where to resume). weftboard's own errors pass unchanged."""
    try:
        yield
    except aiohttp.ClientError as exc:
        raise Unavailable(f"{cannot} {_redact(url)}: {without_queries(str(exc))}") from None
    except asyncio.TimeoutError as exc:
        raise Unavailable(timed_out()) from exc


def _raise_for_status(status: int, url: str, body: str) -> None:
    where = _redact(url)
    snippet = body[:300].strip()
    if status == 403:
        raise UrlExpired(f"GET/PUT {where} refused (403): the presigned URL expired or is for another object; ask the board for a new one. {snippet}")
    if status == 404:
        raise NotFound(f"{where} does not exist (404)")
    if status >= 500:
        raise Unavailable(f"{where} answered {status}; retry later. {snippet}")
    raise WeftboardError(f"{where} answered HTTP {status}: {snippet}")


async def fetch_url(
    url: str,
    path: Path | str,
    offset: int = 0,
    *,
    timeout_s: float | None = 600.0,
    connect_timeout_s: float = 10.0,
    session: aiohttp.ClientSession | None = None,
    on_chunk: ChunkCallback | None = None,
    on_headers: Callable[[float], None] | None = None,
) -> int:
    """Download ``url`` into ``path`` (resuming at ``offset``); returns the object's size.
    With ``session`` its kept-alive connections are reused (and it is left open); the timeouts
    hold either way. ``on_chunk(offset, data)`` after each chunk is written; ``on_headers``
    gets the seconds the response's headers took."""
    dest = Path(path)
    headers = {"Range": f"bytes={offset}-"} if offset > 0 else {}
    timeout = _timeout(timeout_s, connect_timeout_s)
    written = offset  # the file's bytes a resume keeps: the caller's prefix, then what was written
    with _network_failures(url, "cannot download",
                           lambda: f"download of {_redact(url)} timed out; resume with offset={written}"):
        t0 = time.perf_counter()
        async with _session_for(session) as http, http.get(url, headers=headers, timeout=timeout) as response:
            if on_headers is not None:
                on_headers(time.perf_counter() - t0)
            if response.status == 416 and offset > 0:
                # Range starts at or past the end: complete already, or longer than the object.
                match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
                total = int(match.group(3)) if match else -1
                if total == offset:
                    return total
                return await fetch_url(url, dest, 0, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                                       session=http, on_chunk=on_chunk, on_headers=on_headers)
            if response.status not in (200, 206):
                _raise_for_status(response.status, url, await response.text(errors="replace"))
            start = offset if response.status == 206 else 0
            written = start  # a 200 rewrites the file from byte 0
            if response.status == 206:
                match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
                total = int(match.group(3)) if match else start + (response.content_length or 0)
            else:
                total = response.content_length if response.content_length is not None else -1
            out = await asyncio.to_thread(_open_at, dest, start)
            try:
                async for chunk in response.content.iter_chunked(_CHUNK):
                    await asyncio.to_thread(out.write, chunk)
                    if on_chunk is not None:
                        on_chunk(written, chunk)
                    written += len(chunk)
            finally:
                await asyncio.to_thread(out.close)
    if total >= 0 and written != total:
        raise Unavailable(f"download of {_redact(url)} stopped at byte {written} of {total}; resume with offset={written}")
    return written


class UrlReader:
    """Downloads through presigned GET URLs, read as a blob store's are (``BlobStore``'s
    ``download_to``, ``first_byte_s`` and ``probe_first_byte``, a URL in place of a key), over
    one ``LoopSession`` that ``close`` ends: an island without blob-store credentials judges
    its path and fetches a far one in parallel ranges like one with them."""

    def __init__(self, *, connect_timeout_s: float = 10.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._http = LoopSession()
        self._first_byte: collections.deque[float] = collections.deque(maxlen=FIRST_BYTE_SAMPLES)

    async def close(self) -> None:
        await self._http.close()

    def first_byte_s(self) -> float | None:
        """The smallest of the last responses' waits for their headers (the path's floor), or
        None before the first."""
        return min(self._first_byte, default=None)

    async def probe_first_byte(self, url: str, *, timeout_s: float = 30.0) -> None:
        """Time one GET of the object's first byte as a sample of ``first_byte_s``."""
        with _network_failures(url, "cannot reach", lambda: f"probing {_redact(url)} timed out"):
            t0 = time.perf_counter()
            async with self._http.get().get(url, headers={"Range": "bytes=0-0"},
                                            timeout=_timeout(timeout_s, self.connect_timeout_s)) as response:
                waited = time.perf_counter() - t0
                body = await response.read()
                if response.status not in (200, 206):
                    _raise_for_status(response.status, url, body.decode(errors="replace"))
        self._first_byte.append(waited)

    async def download_to(self, url: str, path: Path | str, offset: int = 0, *, size: int | None = None,
                          ranges: int = 1, on_chunk: ChunkCallback | None = None,
                          timeout_s: float | None = 600.0) -> int:
        """``BlobStore.download_to`` through ``url``: a fresh download of a known ``size``
        (at least two ``_MIN_RANGE``) in up to ``ranges`` parallel byte ranges, else one
        resumable stream; returns the object's size."""
        parts = min(ranges, size // _MIN_RANGE) if size is not None and offset == 0 else 1
        if parts <= 1:
            return await fetch_url(url, path, offset, timeout_s=timeout_s, connect_timeout_s=self.connect_timeout_s,
                                   session=self._http.get(), on_chunk=on_chunk, on_headers=self._first_byte.append)
        dest = Path(path)
        fd = await asyncio.to_thread(_preallocated, dest, size)
        bounds = [size * i // parts for i in range(parts + 1)]
        timeout = _timeout(timeout_s, self.connect_timeout_s)
        tasks = [asyncio.ensure_future(self._range(url, fd, lo, hi, size, timeout, on_chunk))
                 for lo, hi in zip(bounds, bounds[1:], strict=False)]
        failed = False
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            failed = True
            for task in tasks:  # one range failed (or the download was cancelled): the others stop
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # no write through fd is under way now
            raise
        finally:
            await _whole_on_thread(_release, fd, failed)  # emptied on failure: holes are no resumable prefix
        return size

    async def _range(self, url: str, fd: int, lo: int, hi: int, total: int, timeout: aiohttp.ClientTimeout,
                     on_chunk: ChunkCallback | None) -> None:
        """Bytes ``[lo, hi)`` of the ``total``-byte object at ``url``, written at their offsets."""
        pos = lo
        with _network_failures(url, "cannot download",
                               lambda: f"range {lo}-{hi} of {_redact(url)} timed out at byte {pos}"):
            t0 = time.perf_counter()
            async with self._http.get().get(url, headers={"Range": f"bytes={lo}-{hi - 1}"}, timeout=timeout) as response:
                self._first_byte.append(time.perf_counter() - t0)
                if response.status != 206:
                    if response.status == 200:
                        raise Unavailable(f"{_redact(url)} answered a byte range with the whole object (200)")
                    _raise_for_status(response.status, url, await response.text(errors="replace"))
                match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
                if match is None or int(match.group(3)) != total:
                    raise Unavailable(f"{_redact(url)} is not the {total}-byte object the record names "
                                      f"(Content-Range {response.headers.get('Content-Range', '')!r})")
                if response.content_length is not None and response.content_length != hi - lo:
                    raise Unavailable(f"range {lo}-{hi} of {_redact(url)} answered {response.content_length} bytes")
                while pos < hi:  # whole chunks: a write and a hop to its thread per 64 KiB, not per read
                    try:
                        chunk = await response.content.readexactly(min(_RANGE_CHUNK, hi - pos))
                    except asyncio.IncompleteReadError as exc:
                        raise Unavailable(f"range {lo}-{hi} of {_redact(url)} stopped at byte "
                                          f"{pos + len(exc.partial)}") from None
                    await _pwrite(fd, chunk, pos)
                    if on_chunk is not None:
                        on_chunk(pos, chunk)
                    pos += len(chunk)


async def _pwrite(fd: int, data: bytes, pos: int) -> None:
    """``os.pwrite`` on a worker thread, waited for to its end even when cancelled."""
    await _whole_on_thread(os.pwrite, fd, data, pos)


async def _whole_on_thread(fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)`` on a worker thread; cancelled, this waits for the call to end first, so no
    thread still works on a descriptor once the download has closed it (its number may be
    reused) and a descriptor is closed before the cancellation goes on."""
    call = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await asyncio.shield(call)
    except asyncio.CancelledError:
        await asyncio.wait([call])
        if not call.cancelled():
            call.exception()  # retrieved: the cancellation is what goes on
        raise


def _release(fd: int, empty: bool) -> None:
    """Close ``fd``, first cutting its file to 0 bytes when ``empty``."""
    try:
        if empty:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _preallocated(dest: Path, size: int) -> int:
    """A descriptor for writing a ``size``-byte file at ``dest`` (made, or cut to size)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        out.truncate(size)
    return os.open(dest, os.O_WRONLY)


def _open_at(dest: Path, start: int):
    dest.parent.mkdir(parents=True, exist_ok=True)
    out = open(dest, "r+b" if dest.exists() else "wb")  # noqa: SIM115
    out.truncate(start)
    out.seek(start)
    return out


def _read_chunk(handle, size: int, last: bool) -> bytes:
    """Up to ``size`` bytes of ``handle`` (in a worker thread); closes it after the ``last`` read."""
    try:
        return handle.read(size)
    finally:
        if last:
            handle.close()


async def _file_chunks(path: Path, offset: int, length: int) -> AsyncIterator[bytes]:
    """``length`` bytes of the file from ``offset``. The thread that reads the last chunk closes
    the file: nothing is awaited after the last chunk is handed over, so aiohttp's body writer
    is done when the response comes and the connection stays alive for the next request."""
    handle = await asyncio.to_thread(open, path, "rb")
    try:
        await asyncio.to_thread(handle.seek, offset)
        left = length
        while left > 0:
            want = min(_CHUNK, left)
            chunk = await asyncio.to_thread(_read_chunk, handle, want, want == left)
            if len(chunk) < want:
                raise Unavailable(f"{path} ends {left - len(chunk)} bytes before the bytes it is uploading")
            left -= want
            yield chunk
    finally:
        if not handle.closed:
            await asyncio.to_thread(handle.close)


async def upload_url(
    url: str,
    path: Path | str,
    *,
    timeout_s: float | None = 600.0,
    connect_timeout_s: float = 10.0,
    session: aiohttp.ClientSession | None = None,
) -> int:
    """PUT a local file to a presigned URL (streamed, with Content-Length); returns its size."""
    source = Path(path)
    size = await upload_source_size(source)
    await _put(url, _file_chunks(source, 0, size), size, _timeout(timeout_s, connect_timeout_s), session, "")
    return size


async def upload_part_url(
    url: str,
    *,
    path: Path | str | None = None,
    data: bytes | None = None,
    offset: int,
    length: int,
    timeout_s: float | None = 600.0,
    session: aiohttp.ClientSession | None = None,
) -> str:
    """PUT bytes ``[offset, offset + length)`` of a file (``path``) or of ``data`` to a presigned
    URL of one part of a multipart upload; returns the ETag the store answered for it."""
    body = _file_chunks(Path(path), offset, length) if path is not None else memoryview(data)[offset:offset + length]
    etag = await _put(url, body, length, _timeout(timeout_s, 10.0), session, " a part")
    if not etag:
        raise Unavailable(f"{_redact(url)} answered the part's PUT without an ETag; PUT it again")
    return etag


async def upload_bytes_url(url: str, data: bytes, *, timeout_s: float = 120.0,
                           session: aiohttp.ClientSession | None = None) -> int:
    """PUT bytes to a presigned URL; returns their size."""
    await _put(url, data, len(data), _timeout(timeout_s, 10.0), session, "")
    return len(data)


async def _put(url: str, body, length: int, timeout: aiohttp.ClientTimeout, session: aiohttp.ClientSession | None,
               what: str) -> str:
    """One PUT of ``length`` bytes (``what``: "" or " a part", for messages); returns the ETag
    answered ("" if none)."""
    with _network_failures(url, f"cannot upload{what} to",
                           lambda: f"upload{' of' + what if what else ''} to {_redact(url)} timed out"):
        async with _session_for(session) as http, http.put(
                url, data=body, headers={"Content-Length": str(length)}, timeout=timeout) as response:
            if response.status not in (200, 201, 204):
                _raise_for_status(response.status, url, await response.text(errors="replace"))
            return response.headers.get("ETag", "")
