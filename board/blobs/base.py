"""The blob store port: where anchors and patches live, addressed by key.

Everything that moves blob bytes (publisher, board checks, island fetchers, GC) codes
against ``BlobStore`` only, so S3 (MinIO, AWS, SeaweedFS) and a local directory are
interchangeable.

Invariants:
- Keys are relative, '/'-separated paths without empty, '.' or '..' segments, no
  backslashes, no NUL: ``check_key`` enforces this for every store, so a key can never
  escape a local root or alias another key.
- Writes are all-or-nothing: a reader sees either no object or the complete bytes.
- A missing object raises ``NotFound`` on reads and is ``None`` for ``stat``; an
  unreachable backend raises ``Unavailable`` (safe to retry).
- Every method is a coroutine; blocking client calls run on worker threads (``to_thread``,
  a store's own pool, or a transfer's own thread) so a server's event loop never stalls on
  storage.
"""

from __future__ import annotations

import abc
import asyncio
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from weftboard.proto.errors import InvalidArgument, NotFound

# ``(offset, data)``: bytes of an object written to the destination file at ``offset``.
ChunkCallback = Callable[[int, bytes], None]

MAX_KEY_BYTES = 1024
# Recent requests whose time to first byte estimate a store's path (``first_byte_s``).
FIRST_BYTE_SAMPLES = 16


_QUERY = re.compile(r"\?[^\s'\")]*")


def without_queries(text: str) -> str:
    """``text`` with every URL query cut out: a presigned URL names the access key id and a live
    signature there, which no error message, log line or chained exception may carry."""
    return _QUERY.sub("?...", text)


def check_key(key: str) -> str:
    """Refuse keys that could escape a root, alias another key, or break S3 naming."""
    if not isinstance(key, str) or not key:
        raise InvalidArgument("a blob key must be a non-empty string")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidArgument(f"blob key is {len(key.encode())} bytes; the limit is {MAX_KEY_BYTES}")
    if "\\" in key or "\x00" in key:
        raise InvalidArgument(f"blob key {key!r} contains a backslash or NUL")
    if key.startswith("/"):
        raise InvalidArgument(f"blob key {key!r} must be relative (no leading '/')")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidArgument(f"blob key {key!r} has an empty, '.' or '..' segment")
    return key


async def upload_source_size(path: Path | str) -> int:
    """The size of a file about to be uploaded, NotFound when it is not a file. Asked from a
    worker thread: the file may sit on network storage, where a stat waits on the server."""

    def size() -> int:
        if not os.path.isfile(path):
            raise NotFound(f"cannot upload {path}: no such file")
        return os.path.getsize(path)

    return await asyncio.to_thread(size)


def check_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a key-like string (it may end with '/')."""
    if prefix:
        stripped = prefix.rstrip("/")
        if not stripped:
            raise InvalidArgument(f"listing prefix {prefix!r} must not start with '/'")
        check_key(stripped)
    return prefix


@dataclass(frozen=True)
class ListedBlob:
    """An object as a listing finds it."""

    size: int
    modified_s: float  # unix time of its last write


class BlobStore(abc.ABC):
    """Async key/value store for immutable blobs. See the module docstring for the rules."""

    @abc.abstractmethod
    async def put_file(self, key: str, path: Path | str) -> int:
        """Upload a local file (multipart when large); returns its size."""

    @abc.abstractmethod
    async def put_bytes(self, key: str, data: bytes) -> int:
        """Store ``data`` under ``key``; returns its size."""

    @abc.abstractmethod
    async def get_bytes(self, key: str) -> bytes:
        """The whole object; ``NotFound`` when missing."""

    @abc.abstractmethod
    async def download_to(self, key: str, path: Path | str, offset: int = 0, *, size: int | None = None,
                          ranges: int = 1, on_chunk: ChunkCallback | None = None) -> int:
        """Write the object to ``path``, resuming a partial file at ``offset``.

        Bytes before ``offset`` are kept as they are (the caller verifies the digest of the
        whole file afterwards); returns the object's total size. ``size``: the size the caller
        expects (from a record), which spares a stat round trip. ``ranges``: a fresh download
        (offset 0) may fetch up to this many byte ranges over parallel connections, which on a
        long path ramps up in a few round trips where one connection's slow start takes many;
        a failed parallel download leaves an empty file, so a retry starts over.
        ``on_chunk(offset, data)``: called (on the downloading thread) after each chunk is
        written, so a reader can use bytes before the whole object is here.
        """

    def first_byte_s(self) -> float | None:
        """The store's recent time to first byte (the smallest of the last downloads' waits
        between a request and its first byte: a GET's response headers, a file's open), or None
        until measured (and for a store that cannot tell). A reader uses it to decide whether
        parallel byte ranges and early downloads pay for their extra requests: they help on long
        paths, and only cost on a short one (a local disk is the shortest)."""
        return None

    async def probe_first_byte(self, key: str) -> None:
        """Time one small request for ``key`` (its metadata) as a sample of ``first_byte_s``,
        for a reader that must judge the path before its downloads have (a large object's
        first GET may wait on the server rather than the path). Nothing for a store that cannot
        tell; ``NotFound`` when the key does not exist."""
        return None

    @abc.abstractmethod
    async def stat(self, key: str) -> int | None:
        """Size in bytes, or None when the object does not exist."""

    @abc.abstractmethod
    async def delete(self, keys: Iterable[str]) -> int:
        """Delete objects (missing ones are fine); returns how many keys were asked for."""

    @abc.abstractmethod
    async def list_keys(self, prefix: str = "") -> list[str]:
        """Every key starting with ``prefix``, sorted."""

    async def list_blobs(self, prefix: str = "") -> dict[str, ListedBlob]:
        """Every key starting with ``prefix``, with its size and the time of its last write;
        {} from a store that cannot tell (garbage collection then finds no abandoned blobs)."""
        return {}

    async def presign_put(self, key: str, expires_s: int, *, size: int | None = None) -> str | None:
        """A URL that lets its holder PUT this one object until it expires; None if unsupported.
        ``size``: the bytes the PUT must carry, where the store can hold the URL to it."""
        return None

    async def presign_get(self, key: str, expires_s: int) -> str | None:
        """A URL that lets its holder GET this one object until it expires; None if unsupported."""
        return None

    # -- multipart uploads through presigned URLs (``multipart.py`` fixes the part layout) --

    async def start_multipart(self, key: str, size: int, part_bytes: int, digest: str) -> str | None:
        """Open a multipart upload of a ``size``-byte blob hashing to ``digest``, in parts of
        ``part_bytes``; returns its upload id, None when this store cannot take parts through
        presigned URLs. Nothing is visible under ``key`` until ``complete_multipart``."""
        return None

    async def presign_parts(self, key: str, upload_id: str, parts: Sequence[tuple[int, int]],
                            expires_s: int) -> list[str]:
        """For each ``(part_number, size)`` of an open upload, a URL that lets its holder PUT
        that part (exactly ``size`` bytes) until it expires; the PUT answers the part's ETag."""
        raise NotFound(f"no multipart upload {upload_id!r} of {key!r} in {self.describe()}")

    async def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]], *, size: int,
                                 digest: str) -> None:
        """Join the parts (``(part_number, etag)``, every part in order) into ``key`` at once,
        once they add up to ``size`` (and hash to ``digest`` where the store can tell);
        ``FailedPrecondition`` (the upload stays open) otherwise. Completing again once the
        blob is there succeeds; ``NotFound`` for an upload that is not open."""
        raise NotFound(f"no multipart upload {upload_id!r} of {key!r} in {self.describe()}")

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        """Drop an open upload and its parts; ``NotFound`` for an upload that is not open."""
        raise NotFound(f"no multipart upload {upload_id!r} of {key!r} in {self.describe()}")

    @abc.abstractmethod
    def describe(self) -> str:
        """A one-line, credential-free description for logs and ``serve``'s banner."""

    async def close(self) -> None:
        """Release connections; the default has nothing to release."""
        return None
