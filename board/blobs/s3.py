"""A blob store on any S3 API (MinIO, AWS S3, SeaweedFS) through the ``minio`` client.

Only the plain S3 API is used (PUT/GET/HEAD/DELETE objects, ListObjectsV2, multipart via
``fput_object``, SigV4 presigning), so the same code runs against every implementation.

Invariants:
- The bucket is created on first use if it is missing (and the credentials allow it).
- ``prefix`` namespaces every key inside the bucket (several boards or tests can share one
  bucket); keys passed in and listed out never include it.
- Every network call has an explicit timeout; connection failures surface as
  ``Unavailable`` naming the endpoint, a missing object as ``NotFound``, refused
  credentials as ``PermissionDenied``.
"""

from __future__ import annotations

import asyncio
import collections
import io
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, S3Error, ServerError
from minio.helpers import check_bucket_name

from weftboard.board.blobs.base import (
    FIRST_BYTE_SAMPLES,
    BlobStore,
    ChunkCallback,
    check_key,
    check_prefix,
    upload_source_size,
)
from weftboard.proto.errors import (
    DigestMismatch,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)

_MISSING = {"NoSuchKey", "NoSuchObject", "ResourceNotFound"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
_CHUNK = 1 << 20
_WATCHED_CHUNK = 64 << 10  # with on_chunk: a reader waiting for bytes sees them sooner
_MIN_RANGE = 256 << 10  # smallest byte range worth its own connection
_DELETE_BATCH = 1000
PART_SIZE = 16 << 20
MAX_PRESIGN_S = 7 * 24 * 3600


def _split_endpoint(endpoint: str, secure: bool) -> tuple[str, bool]:
    """Accept ``host:port`` or a URL; a URL's scheme decides TLS."""
    if "://" in endpoint:
        parts = urlsplit(endpoint)
        if parts.path not in ("", "/"):
            raise InvalidArgument(f"S3 endpoint {endpoint!r} must not contain a path")
        return parts.netloc, parts.scheme == "https"
    return endpoint, secure


class S3BlobStore(BlobStore):
    def __init__(
        self,
        endpoint: str,
        access_key: str,
        secret_key: str,
        bucket: str,
        secure: bool = False,
        region: str | None = None,
        *,
        prefix: str = "",
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        retries: int = 3,
        part_size: int = PART_SIZE,
    ):
        if part_size < 5 << 20:
            raise InvalidArgument(f"S3 multipart parts must be at least 5 MiB, got {part_size}")
        self.part_size = part_size
        host, self.secure = _split_endpoint(endpoint, secure)
        try:
            check_bucket_name(bucket)
        except ValueError:
            raise InvalidArgument(
                f"S3 bucket name {bucket!r} is invalid: 3-63 characters of lowercase letters, digits, '.' and '-'"
            ) from None
        self.endpoint = host
        self.bucket = bucket
        self.region = region
        if prefix:
            check_key(prefix.rstrip("/"))
            prefix = prefix.rstrip("/") + "/"
        self.prefix = prefix
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
            maxsize=32,
            retries=urllib3.Retry(
                total=retries, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504),
                allowed_methods=None,  # our writes are idempotent (content-addressed keys)
            ),
        )
        self._client = Minio(
            host, access_key=access_key, secret_key=secret_key, secure=self.secure,
            region=region, http_client=self._http,
        )
        self._first_byte: collections.deque[float] = collections.deque(maxlen=FIRST_BYTE_SAMPLES)
        self._bucket_ready = False
        self._bucket_lock = threading.Lock()

    def describe(self) -> str:
        scheme = "https" if self.secure else "http"
        return f"s3://{self.bucket}/{self.prefix} at {scheme}://{self.endpoint}"

    # -- plumbing ---------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self.prefix + check_key(key)

    @contextmanager
    def _errors(self, key: str | None = None) -> Iterator[None]:
        """Translate client exceptions into weftboard's errors, with actionable messages."""
        what = f"blob {key!r} in {self.describe()}" if key else self.describe()
        try:
            yield
        except S3Error as exc:
            if exc.code in _MISSING:
                raise NotFound(f"{what} does not exist") from None
            if exc.code == "NoSuchBucket":
                raise NotFound(f"bucket {self.bucket!r} does not exist at {self.endpoint}") from None
            if exc.code in _DENIED:
                raise PermissionDenied(
                    f"S3 refused the credentials for {what}: {exc.code} ({exc.message}); "
                    "check the access key, secret key and region"
                ) from None
            raise Unavailable(f"S3 error on {what}: {exc.code}: {exc.message}") from exc
        except (ServerError, InvalidResponseError) as exc:
            raise Unavailable(f"S3 server error on {what}: {exc}") from exc
        except (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as exc:
            raise Unavailable(f"cannot reach S3 at {self.endpoint} for {what}: {exc}") from exc

    def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        with self._bucket_lock, self._errors():
            if not self._bucket_ready:
                if not self._client.bucket_exists(self.bucket):
                    try:
                        self._client.make_bucket(self.bucket, location=self.region)
                    except S3Error as exc:
                        if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                            raise
                self._bucket_ready = True

    async def _run(self, key: str | None, fn, *args, **kwargs):
        def call():
            self._ensure_bucket()
            with self._errors(key):
                return fn(*args, **kwargs)

        return await asyncio.to_thread(call)

    # -- the port ---------------------------------------------------------------

    async def put_bytes(self, key: str, data: bytes) -> int:
        name = self._name(key)
        await self._run(key, self._client.put_object, self.bucket, name, io.BytesIO(data), len(data))
        return len(data)

    async def put_file(self, key: str, path: Path | str) -> int:
        name = self._name(key)
        size = await upload_source_size(path)
        await self._run(key, self._client.fput_object, self.bucket, name, str(path), part_size=self.part_size)
        return size

    async def get_bytes(self, key: str) -> bytes:
        name = self._name(key)

        def get() -> bytes:
            response = self._client.get_object(self.bucket, name)
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()

        return await self._run(key, get)

    async def download_to(self, key: str, path: Path | str, offset: int = 0, *, size: int | None = None,
                          ranges: int = 1, on_chunk: ChunkCallback | None = None) -> int:
        name = self._name(key)
        dest = Path(path)
        chunk_bytes = _stream_chunk(on_chunk)

        def download() -> int:
            total = size if size is not None else self._client.stat_object(self.bucket, name).size
            start = offset if 0 <= offset <= total else 0
            dest.parent.mkdir(parents=True, exist_ok=True)
            parts = min(ranges, total // _MIN_RANGE) if start == 0 else 1
            if parts > 1:
                return self._download_ranges(key, name, dest, total, parts, on_chunk)
            with open(dest, "r+b" if dest.exists() else "wb") as out:
                out.truncate(start)
                out.seek(start)
                if start < total:
                    response = self._get_range(name, start, total - start)
                    try:
                        _check_total(response, total, key)
                        for chunk in response.stream(chunk_bytes):
                            at = out.tell()
                            out.write(chunk)
                            if on_chunk is not None:
                                on_chunk(at, chunk)
                    finally:
                        response.close()
                        response.release_conn()
                written = out.tell()
            if written != total:
                raise Unavailable(
                    f"download of {key!r} stopped at byte {written} of {total}; call again with offset={written}"
                )
            return total

        return await self._run(key, download)

    def first_byte_s(self) -> float | None:
        return min(self._first_byte, default=None)  # the path's floor, not its moments of load

    async def probe_first_byte(self, key: str) -> None:
        name = self._name(key)

        def head() -> None:
            t0 = time.perf_counter()
            self._client.stat_object(self.bucket, name)
            self._first_byte.append(time.perf_counter() - t0)

        await self._run(key, head)

    def _get_range(self, name: str, offset: int, length: int) -> urllib3.BaseHTTPResponse:
        """GET a byte range, timing the wait for the response's headers."""
        t0 = time.perf_counter()
        response = self._client.get_object(self.bucket, name, offset=offset, length=length)
        self._first_byte.append(time.perf_counter() - t0)
        return response

    def _download_ranges(self, key: str, name: str, dest: Path, total: int, parts: int,
                         on_chunk: ChunkCallback | None = None) -> int:
        """``parts`` byte ranges on parallel connections into one preallocated file."""
        bounds = [total * i // parts for i in range(parts + 1)]
        with open(dest, "wb") as out:
            out.truncate(total)
        fd = os.open(dest, os.O_WRONLY)

        def fetch(lo: int, hi: int) -> None:
            with self._errors(key):
                response = self._get_range(name, lo, hi - lo)
                try:
                    _check_total(response, total, key)
                    pos = lo
                    for chunk in response.stream(_stream_chunk(on_chunk)):
                        if pos + len(chunk) > hi:
                            raise Unavailable(f"range {lo}-{hi} of {key!r} returned more than {hi - lo} bytes")
                        os.pwrite(fd, chunk, pos)
                        if on_chunk is not None:
                            on_chunk(pos, chunk)
                        pos += len(chunk)
                finally:
                    response.close()
                    response.release_conn()
                if pos != hi:
                    raise Unavailable(f"range {lo}-{hi} of {key!r} stopped at byte {pos}")

        try:
            with ThreadPoolExecutor(parts, thread_name_prefix="weftboard-range") as pool:
                for f in [pool.submit(fetch, lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]:
                    f.result()
        except BaseException:
            os.ftruncate(fd, 0)  # holes are not a resumable prefix: a retry starts over
            raise
        finally:
            os.close(fd)
        return total

    async def stat(self, key: str) -> int | None:
        name = self._name(key)

        def head() -> int | None:
            try:
                return self._client.stat_object(self.bucket, name).size
            except S3Error as exc:
                if exc.code in _MISSING:
                    return None
                raise

        return await self._run(key, head)

    async def delete(self, keys: Iterable[str]) -> int:
        names = [self._name(k) for k in keys]

        def remove() -> None:
            for i in range(0, len(names), _DELETE_BATCH):
                batch = [DeleteObject(n) for n in names[i : i + _DELETE_BATCH]]
                errors = [e for e in self._client.remove_objects(self.bucket, batch) if e.code not in _MISSING]
                if errors:
                    first = errors[0]
                    raise Unavailable(
                        f"S3 could not delete {len(errors)} of {len(batch)} objects in {self.describe()}; "
                        f"first: {first.name}: {first.code} {first.message}"
                    )

        if names:
            await self._run(None, remove)
        return len(names)

    async def list_keys(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        full = self.prefix + prefix

        def listing() -> list[str]:
            cut = len(self.prefix)
            return sorted(
                obj.object_name[cut:]
                for obj in self._client.list_objects(self.bucket, prefix=full, recursive=True)
                if not obj.is_dir
            )

        return await self._run(None, listing)

    async def presign_put(self, key: str, expires_s: int, *, size: int | None = None) -> str | None:
        return await self._presign("PUT", key, expires_s)

    async def presign_get(self, key: str, expires_s: int) -> str | None:
        return await self._presign("GET", key, expires_s)

    async def _presign(self, method: str, key: str, expires_s: int) -> str:
        if not 1 <= expires_s <= MAX_PRESIGN_S:
            raise InvalidArgument(f"presigned URL lifetime must be 1..{MAX_PRESIGN_S} s, got {expires_s}")
        name = self._name(key)
        return await self._run(
            key, self._client.get_presigned_url, method, self.bucket, name, expires=timedelta(seconds=expires_s)
        )

    async def close(self) -> None:
        self._http.clear()


def _stream_chunk(on_chunk: ChunkCallback | None) -> int:
    """Bytes per read of a response body: smaller when someone waits on each chunk."""
    return _CHUNK if on_chunk is None else _WATCHED_CHUNK


def _check_total(response: urllib3.BaseHTTPResponse, total: int, key: str) -> None:
    """A ranged GET names the object's size (``Content-Range: bytes a-b/size``): an object of
    another size than the caller expects is refused at once, not retried as a short read."""
    content_range = response.headers.get("Content-Range", "")
    _, _, size = content_range.rpartition("/")
    if size.isdigit() and int(size) != total:
        raise DigestMismatch(f"blob {key!r} holds {size} bytes, the record says {total}")
