"""A blob store in a local directory: the embedded default and a test double-free option.

Given a ``UrlSigner`` (``board/blobs/signed_urls.py``), it presigns: its URLs point at the
HTTP server the board runs over this directory (``board/blob_http.py``), so processes on other
machines, without any credentials, reach its blobs like an S3 store's.

Invariants:
- ``<root>/<key>`` is the object; keys pass ``check_key`` and the resolved path must stay
  inside the root, so no key reaches outside it.
- Writes go to a temporary file in the destination directory, are fsynced, then
  ``os.replace``d into place: a crash leaves either the old object or the new one, never a
  torn file. Temporary files start with ``.tmp-`` and are invisible to listings.
- ``put_stream`` checks the bytes against the digest and size they must have before the
  rename: bytes that do not match leave nothing behind.
- Without a signer ``presign_get``/``presign_put`` return None (readers share the filesystem).
- A multipart upload lives in ``.tmp-uploads/<upload id>/`` (invisible, unreachable by keys):
  ``meta.json`` (key, size, part size, digest), ``data`` (each part written at its offset) and
  a marker ``part-<n>`` holding the ETag of each part received whole. Completing checks every
  marker and the digest of ``data``, then renames it into place: the key shows nothing before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

import xxhash

from weftboard.board.blobs.base import (
    FIRST_BYTE_SAMPLES,
    BlobStore,
    ChunkCallback,
    ListedBlob,
    check_key,
    check_prefix,
    upload_source_size,
)
from weftboard.board.blobs.multipart import check_completed, part_count, part_span
from weftboard.board.blobs.signed_urls import UrlSigner
from weftboard.board.blobs.stoppable import Stopper
from weftboard.proto.errors import (
    DigestMismatch,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from weftboard.proto.names import DIGEST_ALGORITHM, format_digest

_TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20
_HEX128 = re.compile(r"[0-9a-f]{32}")
_UPLOADS = _TMP_PREFIX + "uploads"  # open multipart uploads, one folder each


class LocalDirBlobStore(BlobStore):
    def __init__(self, root: Path | str, *, signer: UrlSigner | None = None):
        self.root = Path(root).resolve()
        self.signer = signer  # set (by the board's blob HTTP server) once its address is known
        self.root.mkdir(parents=True, exist_ok=True)
        # Opening a file is this store's time to first byte: microseconds on a local disk, a
        # round trip on a network mount, so readers judge a directory like any other store.
        self._first_byte: collections.deque[float] = collections.deque(maxlen=FIRST_BYTE_SAMPLES)

    def describe(self) -> str:
        return f"file://{self.root}"

    def path_for(self, key: str) -> Path:
        """The file that holds ``key``; refuses anything that resolves outside the root."""
        check_key(key)
        if any(segment.startswith(_TMP_PREFIX) for segment in key.split("/")):
            raise InvalidArgument(f"blob key {key!r} uses the reserved prefix {_TMP_PREFIX!r}")
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root):
            raise InvalidArgument(f"blob key {key!r} resolves outside the store root {self.root}")
        return path

    # -- writes ---------------------------------------------------------------

    def _write_atomic(self, key: str, fill: Callable[[BinaryIO], None]) -> int:
        path = self.path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                fill(out)
                out.flush()
                os.fsync(out.fileno())
                size = out.tell()
            os.replace(tmp_name, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise
        _fsync_dir(path.parent)
        return size

    async def put_bytes(self, key: str, data: bytes) -> int:
        return await asyncio.to_thread(self._write_atomic, key, lambda out: out.write(data))

    async def put_stream(self, key: str, chunks: AsyncIterable[bytes], *, digest: str = "",
                         size: int | None = None) -> int:
        """Store the streamed bytes under ``key`` if they hash to ``digest`` and number ``size``
        (each when given); ``DigestMismatch`` (nothing written) otherwise. Returns the size."""
        path = self.path_for(key)

        def open_temp() -> tuple[BinaryIO, str]:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
            return os.fdopen(fd, "wb"), name

        out, tmp_name = await asyncio.to_thread(open_temp)
        hasher = xxhash.xxh3_128()
        written = 0
        try:
            try:
                async for chunk in chunks:
                    written += len(chunk)
                    if size is not None and written > size:
                        raise DigestMismatch(f"PUT of {key!r} carries more than the {size} bytes it declared")
                    hasher.update(chunk)
                    await asyncio.to_thread(out.write, chunk)
                await asyncio.to_thread(_flush_and_sync, out)
            finally:
                await asyncio.to_thread(out.close)
            if size is not None and written != size:
                raise DigestMismatch(f"PUT of {key!r} carried {written} bytes; it declared {size}")
            got = format_digest(hasher.digest())
            if digest and got != digest:
                raise DigestMismatch(f"PUT of {key!r}: the bytes hash to {got}, not the declared {digest}")
            await asyncio.to_thread(os.replace, tmp_name, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise
        await asyncio.to_thread(_fsync_dir, path.parent)
        return written

    async def put_file(self, key: str, path: Path | str) -> int:
        def copy(out: BinaryIO) -> None:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, out, _CHUNK)

        await upload_source_size(path)
        return await asyncio.to_thread(self._write_atomic, key, copy)

    # -- reads ----------------------------------------------------------------

    async def get_bytes(self, key: str) -> bytes:
        path = self.path_for(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise NotFound(f"blob {key!r} does not exist in {self.describe()}") from None

    async def download_to(self, key: str, path: Path | str, offset: int = 0, *, size: int | None = None,
                          ranges: int = 1, on_chunk: ChunkCallback | None = None) -> int:
        source = self.path_for(key)
        stopper = Stopper()  # cancelled, the copy stops at its next chunk and ends before the caller goes on

        def watched(at: int, chunk: bytes) -> None:
            stopper.check()
            if on_chunk is not None:
                on_chunk(at, chunk)

        return await stopper.run(_copy_from, source, Path(path), offset, key, self.describe(), watched,
                                 self._first_byte.append)

    def first_byte_s(self) -> float | None:
        return min(self._first_byte, default=None)

    async def probe_first_byte(self, key: str) -> None:
        path = self.path_for(key)

        def stat() -> None:
            t0 = time.perf_counter()
            try:
                os.stat(path)
            except FileNotFoundError:
                raise NotFound(f"blob {key!r} does not exist in {self.describe()}") from None
            self._first_byte.append(time.perf_counter() - t0)

        await asyncio.to_thread(stat)

    async def stat(self, key: str) -> int | None:
        path = self.path_for(key)
        try:
            return (await asyncio.to_thread(os.stat, path)).st_size
        except FileNotFoundError:
            return None

    async def delete(self, keys: Iterable[str]) -> int:
        paths = [self.path_for(k) for k in keys]

        def unlink_all() -> None:
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

        await asyncio.to_thread(unlink_all)
        return len(paths)

    async def presign_get(self, key: str, expires_s: int) -> str | None:
        self.path_for(key)
        return self.signer.sign("GET", key, expires_s) if self.signer is not None else None

    async def presign_put(self, key: str, expires_s: int, *, size: int | None = None) -> str | None:
        self.path_for(key)
        if self.signer is None:
            return None
        return self.signer.sign("PUT", key, expires_s, digest=content_digest(key), size=size)

    async def list_keys(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        return await asyncio.to_thread(self._list, prefix)

    async def list_blobs(self, prefix: str = "") -> dict[str, ListedBlob]:
        check_prefix(prefix)

        def listing() -> dict[str, ListedBlob]:
            found = {}
            for key in self._list(prefix):
                with contextlib.suppress(FileNotFoundError):  # deleted since the walk
                    st = os.stat(self.root / key)
                    found[key] = ListedBlob(st.st_size, st.st_mtime)
            return found

        return await asyncio.to_thread(listing)

    # -- multipart uploads ----------------------------------------------------

    def _upload_dir(self, key: str, upload_id: str) -> Path:
        if not _HEX128.fullmatch(upload_id):
            raise NotFound(f"no multipart upload {upload_id!r} of {key!r} in {self.describe()}")
        return self.root / _UPLOADS / upload_id

    def _upload_meta(self, key: str, upload_id: str) -> tuple[Path, dict]:
        """An open upload's folder and meta data; ``NotFound`` unless it is open for ``key``."""
        folder = self._upload_dir(key, upload_id)
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except FileNotFoundError:
            raise NotFound(f"no multipart upload {upload_id!r} of {key!r} in {self.describe()} "
                           "(completed, aborted or never started)") from None
        if meta["key"] != key:
            raise NotFound(f"multipart upload {upload_id!r} is of {meta['key']!r}, not {key!r}")
        return folder, meta

    async def start_multipart(self, key: str, size: int, part_bytes: int, digest: str) -> str | None:
        self.path_for(key)
        if self.signer is None:
            return None
        part_count(size, part_bytes)
        upload_id = secrets.token_hex(16)
        folder = self.root / _UPLOADS / upload_id
        meta = {"key": key, "size": size, "part_bytes": part_bytes, "digest": digest}

        def create() -> None:
            folder.mkdir(parents=True)
            (folder / "data").touch()
            (folder / "meta.json").write_text(json.dumps(meta))  # last: the upload is open once it is there

        await asyncio.to_thread(create)
        return upload_id

    async def presign_parts(self, key: str, upload_id: str, parts: Sequence[tuple[int, int]],
                            expires_s: int) -> list[str]:
        self._upload_dir(key, upload_id)
        if self.signer is None:
            raise FailedPrecondition(f"{self.describe()} is not served over HTTP: no URLs to sign")
        return [self.signer.sign("PUT", key, expires_s, size=size, upload_id=upload_id, part_number=n)
                for n, size in parts]

    async def put_part(self, key: str, upload_id: str, part_number: int, chunks: AsyncIterable[bytes], *,
                       size: int | None = None) -> str:
        """Write the streamed bytes as part ``part_number`` of an open upload; returns its ETag.
        Bytes of another size than the part's (or ``size``) raise ``DigestMismatch`` and leave
        the part missing (its earlier copy too: a complete waits for a whole one)."""
        folder, meta = await asyncio.to_thread(self._upload_meta, key, upload_id)
        offset, length = part_span(meta["size"], meta["part_bytes"], part_number)
        if size is not None and size != length:
            raise DigestMismatch(f"part {part_number} of {key!r} holds {length} bytes, not {size}")
        marker = folder / f"part-{part_number}"

        def open_data() -> int:
            marker.unlink(missing_ok=True)
            return os.open(folder / "data", os.O_WRONLY)

        try:
            fd = await asyncio.to_thread(open_data)
        except FileNotFoundError:
            raise NotFound(f"multipart upload {upload_id!r} of {key!r} was completed or aborted meanwhile") from None
        hasher = xxhash.xxh3_128()
        written = 0
        try:
            async for chunk in chunks:
                if written + len(chunk) > length:
                    raise DigestMismatch(f"part {part_number} of {key!r} carries more than its {length} bytes")
                hasher.update(chunk)
                await asyncio.to_thread(os.pwrite, fd, chunk, offset + written)
                written += len(chunk)
            if written != length:
                raise DigestMismatch(f"part {part_number} of {key!r} carried {written} bytes, not its {length}")
            await asyncio.to_thread(os.fsync, fd)
        finally:
            await asyncio.to_thread(os.close, fd)
        etag = hasher.hexdigest()
        await asyncio.to_thread(_write_marker, marker, etag)
        return etag

    async def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]], *, size: int,
                                 digest: str) -> None:
        path = self.path_for(key)

        def complete() -> None:
            folder, meta = self._upload_meta(key, upload_id)
            if (meta["size"], meta["digest"]) != (size, digest):
                raise FailedPrecondition(f"multipart upload {upload_id!r} is of {meta['size']} bytes hashing to "
                                         f"{meta['digest']}, not {size} bytes hashing to {digest}")
            etags = check_completed(parts, part_count(size, meta["part_bytes"]))
            for number, etag in enumerate(etags, start=1):
                try:
                    held = (folder / f"part-{number}").read_text()
                except FileNotFoundError:
                    raise FailedPrecondition(f"part {number} of upload {upload_id!r} was not uploaded whole; "
                                             "PUT it, then complete again") from None
                if held != etag:
                    raise FailedPrecondition(f"part {number} of upload {upload_id!r} holds ETag {held}, not "
                                             f"{etag}: name the ETag of its last PUT")
            data = folder / "data"
            hasher = xxhash.xxh3_128()
            with open(data, "rb") as src:
                while chunk := src.read(_CHUNK):
                    hasher.update(chunk)
                held_size = src.tell()
            got = format_digest(hasher.digest())
            if held_size != size or (digest and got != digest):
                raise DigestMismatch(f"upload {upload_id!r} of {key!r}: its {held_size} bytes hash to {got}, not the "
                                     f"declared {size} bytes hashing to {digest}; upload the parts again")
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(data, path)
            _fsync_dir(path.parent)
            shutil.rmtree(folder, ignore_errors=True)

        await asyncio.to_thread(complete)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        def abort() -> None:
            folder, _ = self._upload_meta(key, upload_id)
            shutil.rmtree(folder, ignore_errors=True)

        await asyncio.to_thread(abort)

    def _list(self, prefix: str) -> list[str]:
        # Walk only the deepest directory the prefix pins down.
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(_TMP_PREFIX)]
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    continue
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        keys.sort()
        return keys


def _copy_from(source: Path, dest: Path, offset: int, key: str, where: str, on_chunk: ChunkCallback | None = None,
               opened_in: Callable[[float], None] | None = None) -> int:
    """Copy ``source`` from ``offset`` on into ``dest``; ``opened_in(seconds)`` hears how long
    opening it took (the store's time to first byte)."""
    t0 = time.perf_counter()
    try:
        src = open(source, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise NotFound(f"blob {key!r} does not exist in {where}") from None
    if opened_in is not None:
        opened_in(time.perf_counter() - t0)
    with src:
        total = os.fstat(src.fileno()).st_size
        if offset < 0 or offset > total:
            offset = 0  # a partial file longer than the object is not a prefix of it: restart
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "r+b" if dest.exists() else "wb") as out:
            out.truncate(offset)
            out.seek(offset)
            src.seek(offset)
            if on_chunk is None:
                shutil.copyfileobj(src, out, _CHUNK)
            else:
                while chunk := src.read(_CHUNK):
                    at = out.tell()
                    out.write(chunk)
                    on_chunk(at, chunk)
    return total


def content_digest(key: str) -> str:
    """The digest a content-addressed key (``<run>/blobs/<hex>``) names, else ""."""
    parts = key.split("/")
    if len(parts) == 3 and parts[1] == "blobs" and _HEX128.fullmatch(parts[2]):
        return f"{DIGEST_ALGORITHM}:{parts[2]}"
    return ""


def _write_marker(marker: Path, etag: str) -> None:
    """A part's marker, through a temporary file: it exists only with the whole ETag in it."""
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(etag)
    os.replace(tmp, marker)


def _flush_and_sync(out: BinaryIO) -> None:
    out.flush()
    os.fsync(out.fileno())


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
