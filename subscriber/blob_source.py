"""Where an island reads its blobs, for ``weftboard subscribe`` and ``weftboard sidecar`` alike:
an S3 bucket it holds credentials for, a blob directory the board shares on the same filesystem,
or, with neither, the URLs the board presigns.

Invariants:
- Settings are checked whole when they are made: a key without its secret, an S3 endpoint beside
  a blob directory, an endpoint with a path, a bucket name S3 refuses or a prefix that is no key
  raise ``InvalidArgument`` naming what is wrong, before anything is opened.
- The S3 region is the one given, else the one an AWS endpoint's host names, else the bucket's
  own, asked of the store once (the minio client's ``GetBucketLocation``); nothing assumes
  ``us-east-1``, which AWS refuses for a bucket elsewhere.
- The bucket is the board's default (``weftboard``) unless one is named.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from weftboard.board.blobs import BlobStore, LocalDirBlobStore, S3BlobStore
from weftboard.board.blobs.s3 import DEFAULT_BUCKET, key_prefix, s3_location
from weftboard.proto.errors import InvalidArgument


@dataclass(frozen=True)
class IslandBlobSettings:
    s3_endpoint: str | None = None  # host:port or URL; None: a blob directory, or presigned URLs
    s3_access_key: str | None = None  # with the secret; neither: anonymous reads (a public bucket)
    s3_secret_key: str | None = None
    s3_bucket: str = DEFAULT_BUCKET
    s3_secure: bool = False  # HTTPS to a host:port endpoint (a URL's scheme decides for itself)
    s3_region: str | None = None  # None: from an AWS endpoint's host, else asked of the store
    s3_prefix: str = ""
    blob_dir: Path | None = None  # the board's local blob directory, read directly

    def __post_init__(self) -> None:
        if bool(self.s3_access_key) != bool(self.s3_secret_key):
            given, missing = ("--s3-access-key", "--s3-secret-key") if self.s3_access_key else (
                "--s3-secret-key", "--s3-access-key")
            raise InvalidArgument(f"{given} needs {missing} too (neither: anonymous reads)")
        if self.s3_endpoint:
            if self.blob_dir is not None:
                raise InvalidArgument("give --s3-endpoint or --blob-dir, not both")
            s3_location(self.s3_endpoint, self.s3_bucket, self.s3_secure)
            try:
                key_prefix(self.s3_prefix)
            except InvalidArgument as exc:
                raise InvalidArgument(f"--s3-prefix {self.s3_prefix!r} is not a key prefix: {exc}") from None

    def open(self) -> BlobStore | None:
        """The store to read from (the caller closes it), or None for the board's presigned URLs.
        ``OSError`` when a blob directory cannot be made."""
        if self.s3_endpoint:
            return S3BlobStore(self.s3_endpoint, self.s3_access_key or "", self.s3_secret_key or "", self.s3_bucket,
                               secure=self.s3_secure, region=self.s3_region, prefix=self.s3_prefix)
        if self.blob_dir is not None:
            return LocalDirBlobStore(self.blob_dir)
        return None


#: an island with no store of its own: every blob through the board's presigned URLs
PRESIGNED = IslandBlobSettings()
