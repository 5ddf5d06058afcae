"""Blob stores: the ``BlobStore`` port and its S3 and local-directory implementations.

Import from here: ``from weftboard.board.blobs import BlobStore, S3BlobStore,
LocalDirBlobStore, LoopSession, UrlReader, fetch_url, upload_url``.
"""

from weftboard.board.blobs.base import BlobStore, check_key
from weftboard.board.blobs.http import (
    LoopSession,
    UrlReader,
    fetch_url,
    upload_bytes_url,
    upload_url,
)
from weftboard.board.blobs.localdir import LocalDirBlobStore
from weftboard.board.blobs.s3 import S3BlobStore

__all__ = [
    "BlobStore",
    "LocalDirBlobStore",
    "LoopSession",
    "S3BlobStore",
    "UrlReader",
    "check_key",
    "fetch_url",
    "upload_bytes_url",
    "upload_url",
]
