"""A blob store on any S3 API (MinIO, AWS S3, SeaweedFS) through the ``minio`` client.

Only the plain S3 API is used (PUT/GET/HEAD/DELETE objects, ListObjectsV2, multipart via
``fput_object``, SigV4 presigning), so the same code runs against every implementation.
Multipart uploads for credential-less publishers (``start_multipart`` ...) are the S3
multipart API requested through URLs the store presigns for itself (minio's public API
presigns any request; it runs its multipart calls only inside ``fput_object``).

``minio`` (and its ``urllib3``) is the optional ``[s3]`` extra: it is imported when an
``S3BlobStore`` is made, which without it raises ``ImportError`` naming the extra, so a board
or island on another store runs without it.

Invariants:
- The bucket is created on first use if it is missing (and the credentials allow it).
- ``prefix`` namespaces every key inside the bucket (several boards or tests can share one
  bucket); keys passed in and listed out never include it.
- Every blocking client call runs on the store's own threads, as many as its connection pool
  (``POOL_CONNECTIONS``): a version's uploads or stats never queue behind the event loop's
  default executor (``cpu_count + 4`` threads, shared with every ``to_thread`` call).
  ``close`` waits for the calls under way, then ends those threads; later calls raise
  ``Unavailable``.
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
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from weftboard.board.blobs.base import (
    FIRST_BYTE_SAMPLES,
    BlobStore,
    ChunkCallback,
    ListedBlob,
    check_key,
    check_prefix,
    upload_source_size,
    without_queries,
)
from weftboard.board.blobs.multipart import bare_etag, check_completed
from weftboard.board.blobs.stoppable import Stopper
from weftboard.proto.errors import (
    DigestMismatch,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)

if TYPE_CHECKING:
    import urllib3

_MISSING = {"NoSuchKey", "NoSuchObject", "ResourceNotFound"}
# Refused requests that retrying cannot cure (the last: signed for a region other than the bucket's).
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AuthorizationHeaderMalformed"}
_CHUNK = 1 << 20
_WATCHED_CHUNK = 64 << 10  # with on_chunk: a reader waiting for bytes sees them sooner
_MIN_RANGE = 256 << 10  # smallest byte range worth its own connection
_DELETE_BATCH = 1000
DEFAULT_BUCKET = "weftboard"  # the bucket a board and its islands use when none is named
POOL_CONNECTIONS = 32  # per host: the urllib3 pool's size, and the store's threads for blocking calls
PART_SIZE = 16 << 20
MAX_PRESIGN_S = 7 * 24 * 3600
# A multipart request the store presigns for itself needs its URL only for the request.
_OWN_REQUEST_S = 600
# S3 errors of a multipart upload: the upload is not open; the parts named do not fit it.
_NO_UPLOAD = {"NoSuchUpload"}
_BAD_PARTS = {"InvalidPart", "InvalidPartOrder", "EntityTooSmall", "EntityTooLarge"}


@dataclass(frozen=True)
class _MinioApi:
    """The pieces of the optional ``minio`` client (and its ``urllib3``) this store uses."""

    urllib3: ModuleType
    Minio: Any
    DeleteObject: Any
    S3Error: type[Exception]
    server_errors: tuple[type[Exception], ...]
    check_bucket_name: Any


def _minio_api() -> _MinioApi:
    """``minio``, imported when an S3 store is made: it is the optional ``[s3]`` extra."""
    try:
        import urllib3  # optional dependency (weftboard[s3]): the minio client's HTTP pool
        from minio import Minio, deleteobjects, error, helpers  # optional: [s3]
    except ModuleNotFoundError as exc:
        raise ImportError(f"an S3 blob store needs the minio client ({exc.name} is not installed): "
                          "pip install 'weftboard[s3]'", name=exc.name) from exc
    return _MinioApi(urllib3, Minio, deleteobjects.DeleteObject, error.S3Error,
                     (error.InvalidResponseError, error.ServerError), helpers.check_bucket_name)


def key_prefix(prefix: str) -> str:
    """``prefix`` as the store's keys begin with it: empty, or a key and one ``/`` (``runs`` and
    ``runs/`` alike give ``runs/``); ``InvalidArgument`` for one that is no key (``/``, ``a//b``,
    ``..``)."""
    if not prefix:
        return ""
    return check_key(prefix.rstrip("/")) + "/"


def s3_location(endpoint: str, bucket: str, secure: bool = False) -> tuple[str, bool]:
    """``(host, TLS)`` of ``endpoint`` (``host:port``, or a URL whose scheme decides TLS) once it
    and the bucket's name are checked, else ``InvalidArgument`` saying what is wrong. Opens
    nothing; needs the ``[s3]`` extra (the bucket-name rule is the minio client's)."""
    if "://" in endpoint:
        parts = urlsplit(endpoint)
        if parts.path not in ("", "/"):
            raise InvalidArgument(f"S3 endpoint {endpoint!r} must not contain a path")
        host, secure = parts.netloc, parts.scheme == "https"
    else:
        host = endpoint
    try:
        _minio_api().check_bucket_name(bucket)
    except ValueError:
        raise InvalidArgument(
            f"S3 bucket name {bucket!r} is invalid: 3-63 characters of lowercase letters, digits, '.' and '-'"
        ) from None
    return host, secure


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
        host, self.secure = s3_location(endpoint, bucket, secure)
        self._api = api = _minio_api()
        urllib3 = api.urllib3
        self.endpoint = host
        self.bucket = bucket
        self.region = region
        self.prefix = key_prefix(prefix)
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
            maxsize=POOL_CONNECTIONS,
            retries=urllib3.Retry(
                total=retries, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504),
                allowed_methods=None,  # our writes are idempotent (content-addressed keys)
            ),
        )
        self._client = api.Minio(
            host, access_key=access_key, secret_key=secret_key, secure=self.secure,
            region=region, http_client=self._http,
        )
        self._first_byte: collections.deque[float] = collections.deque(maxlen=FIRST_BYTE_SAMPLES)
        self._io = ThreadPoolExecutor(POOL_CONNECTIONS, thread_name_prefix="weftboard-s3")
        self._bucket_ready = False
        self._bucket_lock = threading.Lock()
        self._closed = False

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
        except self._api.S3Error as exc:
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
        except self._api.server_errors as exc:
            raise Unavailable(f"S3 server error on {what}: {without_queries(str(exc))}") from None
        except (self._api.urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as exc:
            # urllib3 names the URL it gave up on: a presigned one carries the access key id and a
            # live signature, so its query never reaches a message, a log or a chained exception
            raise Unavailable(f"cannot reach S3 at {self.endpoint} for {what}: {without_queries(str(exc))}") from None

    def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        with self._bucket_lock, self._errors():
            if not self._bucket_ready:
                if not self._client.bucket_exists(self.bucket):
                    try:
                        self._client.make_bucket(self.bucket, location=self.region)
                    except self._api.S3Error as exc:
                        if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                            raise
                self._bucket_ready = True

    async def _run(self, key: str | None, fn, *args, **kwargs):
        def call():
            self._ensure_bucket()
            with self._errors(key):
                return fn(*args, **kwargs)

        if self._closed:
            raise Unavailable(f"{self.describe()} is closed")
        return await asyncio.get_running_loop().run_in_executor(self._io, call)

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
        stopper = Stopper()  # a cancelled download stops reading at once (stoppable.py)

        def download() -> int:
            total = size if size is not None else self._client.stat_object(self.bucket, name).size
            start = offset if 0 <= offset <= total else 0
            dest.parent.mkdir(parents=True, exist_ok=True)
            parts = min(ranges, total // _MIN_RANGE) if start == 0 else 1
            if parts > 1:
                return self._download_ranges(key, name, dest, total, parts, on_chunk, stopper=stopper)
            with open(dest, "r+b" if dest.exists() else "wb") as out:
                out.truncate(start)
                out.seek(start)
                if start < total:
                    response = self._get_range(name, start, total - start)
                    try:
                        with stopper.reading(response.shutdown):
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

        def call() -> int:
            self._ensure_bucket()
            with self._errors(key):
                return download()

        return await stopper.run(call)

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
                         on_chunk: ChunkCallback | None = None, *, stopper: Stopper | None = None) -> int:
        """``parts`` byte ranges on parallel connections into one preallocated file; ``stopper``
        stops every range at once."""
        stopper = stopper or Stopper()
        bounds = [total * i // parts for i in range(parts + 1)]
        with open(dest, "wb") as out:
            out.truncate(total)
        fd = os.open(dest, os.O_WRONLY)

        def fetch(lo: int, hi: int) -> None:
            with self._errors(key):
                response = self._get_range(name, lo, hi - lo)
                try:
                    with stopper.reading(response.shutdown):
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
                try:
                    for f in [pool.submit(fetch, lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]:
                        f.result()
                except BaseException:
                    stopper.stop()  # one range failed: the others stop too, the whole download starts over
                    raise
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
            except self._api.S3Error as exc:
                if exc.code in _MISSING:
                    return None
                raise

        return await self._run(key, head)

    async def delete(self, keys: Iterable[str]) -> int:
        names = [self._name(k) for k in keys]

        def remove() -> None:
            for i in range(0, len(names), _DELETE_BATCH):
                batch = [self._api.DeleteObject(n) for n in names[i : i + _DELETE_BATCH]]
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

    async def list_blobs(self, prefix: str = "") -> dict[str, ListedBlob]:
        check_prefix(prefix)
        full = self.prefix + prefix

        def listing() -> dict[str, ListedBlob]:
            cut = len(self.prefix)
            return {obj.object_name[cut:]: ListedBlob(obj.size or 0, obj.last_modified.timestamp())
                    for obj in self._client.list_objects(self.bucket, prefix=full, recursive=True)
                    if not obj.is_dir and obj.last_modified is not None}

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

    # -- multipart uploads through presigned URLs -----------------------------------------

    def _own_request(self, what: str, method: str, name: str, query: dict[str, str], body: bytes | None = None, *,
                     retry: bool = True) -> ElementTree.Element | None:
        """One S3 request through a URL this store presigns for itself (run inside ``_run``):
        the XML document it answers, None for an empty body. An S3 error (also the 200 whose
        body is an ``<Error>`` that CompleteMultipartUpload may send) raises its weftboard error."""
        url = self._client.get_presigned_url(method, self.bucket, name, expires=timedelta(seconds=_OWN_REQUEST_S),
                                             extra_query_params=dict(query))
        headers = {"Content-Type": "application/xml" if body else "application/octet-stream"}
        response = self._http.request(method, url, body=body, headers=headers, retries=None if retry else False)
        try:
            document = ElementTree.fromstring(response.data) if response.data.strip() else None
        except ElementTree.ParseError as exc:
            raise Unavailable(f"{what}: S3 answered {response.status} with a body that is not XML: {exc}") from None
        error = document is not None and document.tag.rpartition("}")[2] == "Error"
        if response.status < 300 and not error:
            return document
        code = (document.findtext("{*}Code") or "") if document is not None else ""
        message = (document.findtext("{*}Message") or "") if document is not None else ""
        if code in _NO_UPLOAD:
            raise NotFound(f"{what}: S3 has no such upload (completed, aborted or never started)")
        if code in _BAD_PARTS:
            raise FailedPrecondition(f"{what}: S3 refused the parts: {code}: {message}")
        if code in _DENIED or response.status == 403:
            raise PermissionDenied(f"S3 refused the credentials for {what}: {code} ({message})")
        if response.status >= 500 or not code:
            raise Unavailable(f"{what}: S3 answered {response.status} {code}: {message}")
        raise FailedPrecondition(f"{what}: S3 refused it: {code}: {message}")

    async def start_multipart(self, key: str, size: int, part_bytes: int, digest: str) -> str | None:
        name = self._name(key)
        what = f"starting a multipart upload of {key!r} in {self.describe()}"

        def create() -> str:
            # No retry: a repeated CreateMultipartUpload would open a second upload nobody completes.
            document = self._own_request(what, "POST", name, {"uploads": ""}, retry=False)
            upload_id = document.findtext("{*}UploadId") if document is not None else None
            if not upload_id:
                raise Unavailable(f"{what}: S3 answered no UploadId")
            return upload_id

        return await self._run(key, create)

    async def presign_parts(self, key: str, upload_id: str, parts: Sequence[tuple[int, int]],
                            expires_s: int) -> list[str]:
        if not 1 <= expires_s <= MAX_PRESIGN_S:
            raise InvalidArgument(f"presigned URL lifetime must be 1..{MAX_PRESIGN_S} s, got {expires_s}")
        name = self._name(key)

        def presign() -> list[str]:
            # S3 does not bind a part URL to a size: CompleteMultipartUpload's check of the
            # listed parts' sizes stands in for it.
            return [self._client.get_presigned_url("PUT", self.bucket, name, expires=timedelta(seconds=expires_s),
                                                   extra_query_params={"partNumber": str(n), "uploadId": upload_id})
                    for n, _ in parts]

        return await self._run(key, presign)

    def _listed_parts(self, what: str, name: str, upload_id: str) -> dict[int, dict[str, int]]:
        """Part number -> {bare ETag: size} of every part S3 holds for the upload (ListParts;
        SeaweedFS lists each PUT of a part number, AWS the last one)."""
        listed: dict[int, dict[str, int]] = {}
        marker = ""
        while True:
            query = {"uploadId": upload_id, "max-parts": "1000"} | ({"part-number-marker": marker} if marker else {})
            document = self._own_request(what, "GET", name, query)
            if document is None:
                raise Unavailable(f"{what}: S3 answered ListParts with an empty body")
            for part in document.iterfind("{*}Part"):
                copies = listed.setdefault(int(part.findtext("{*}PartNumber") or 0), {})
                copies[bare_etag(part.findtext("{*}ETag") or "")] = int(part.findtext("{*}Size") or -1)
            marker = document.findtext("{*}NextPartNumberMarker") or ""
            if (document.findtext("{*}IsTruncated") or "").lower() != "true" or not marker:
                return listed

    async def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]], *, size: int,
                                 digest: str) -> None:
        etags = check_completed(parts)
        name = self._name(key)
        what = f"completing upload {upload_id!r} of {key!r} in {self.describe()}"

        def complete() -> None:
            listed = self._listed_parts(what, name, upload_id)
            total = 0
            for number, etag in enumerate(etags, start=1):
                if number not in listed:
                    raise FailedPrecondition(f"{what}: part {number} was not uploaded; PUT it, then complete again")
                if etag not in listed[number]:
                    raise FailedPrecondition(f"{what}: part {number} holds ETag {', '.join(listed[number])}, not "
                                             f"{etag}: name the ETag of its last PUT")
                total += listed[number][etag]
            if total != size:
                raise FailedPrecondition(f"{what}: the parts hold {total} bytes; the blob has {size}")
            body = ElementTree.Element("CompleteMultipartUpload")
            for number, etag in enumerate(etags, start=1):
                part = ElementTree.SubElement(body, "Part")
                ElementTree.SubElement(part, "PartNumber").text = str(number)
                ElementTree.SubElement(part, "ETag").text = f'"{etag}"'
            self._own_request(what, "POST", name, {"uploadId": upload_id}, ElementTree.tostring(body))

        await self._run(key, complete)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        name = self._name(key)
        what = f"aborting upload {upload_id!r} of {key!r} in {self.describe()}"
        await self._run(key, self._own_request, what, "DELETE", name, {"uploadId": upload_id})

    async def close(self) -> None:
        """Stop taking calls (they raise ``Unavailable``), let those under way finish, then
        release the store's threads and sockets. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._io.shutdown, wait=True)
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
