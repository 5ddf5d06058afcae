"""The board's own HTTP server for a local-directory blob store: signed, expiring URLs.

With no S3 store the board serves its blobs itself, on a port of its own, so a publisher and
islands in other processes or on other machines move bytes without credentials and without
the bytes passing through the gRPC service. The store (``LocalDirBlobStore``) presigns through
the ``UrlSigner`` this server installs on it once bound.

Routes (under ``/blobs/<key>``, every one checked by ``UrlSigner.check``):
- GET/HEAD: the object, streamed from disk, with ``Range`` (206, 416) as any S3 answers it.
- PUT: the body streamed to a temporary file, hashed, and renamed into place only when its
  digest and size are those the URL was signed for (``LocalDirBlobStore.put_stream``).
- PUT of a part (a URL signed for one part of a multipart upload): the body written as that
  part of the open upload (``LocalDirBlobStore.put_part``), answered with its ETag as S3 does;
  the blob appears only when the board completes the upload.

Invariants:
- Every request needs a valid, unexpired signature for its method and key: otherwise 403
  (which clients read as ``UrlExpired``: ask the board again). A missing blob (or an upload
  no longer open) is 404, a malformed key 400, bytes that do not match what the URL declares
  400 and nothing stored.
- No listing, no deletion: only what a presigned S3 URL allows.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import unquote

import structlog
from aiohttp import web

from weftboard.board.blobs.localdir import LocalDirBlobStore
from weftboard.board.blobs.signed_urls import BLOB_PATH, Grant, UrlSigner
from weftboard.proto.errors import (
    CorruptData,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)

log = structlog.get_logger(__name__)

_CHUNK = 1 << 20
_ANY_HOST = ("0.0.0.0", "::", "")


def advertised_host(bind_host: str) -> str:
    """The host name URLs carry: the bound one, or this machine's name for a wildcard bind."""
    return socket.getfqdn() if bind_host in _ANY_HOST else bind_host


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


@dataclass
class BlobHttpServer:
    """Serves ``store`` on ``host:port`` and makes ``store`` presign URLs to it."""

    store: LocalDirBlobStore
    secret: bytes
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    public_url: str | None = None  # the base URL others reach this server at; None: http://<host>:<port>
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Bind, install the signer on the store; returns the base URL the signed URLs use."""
        app = web.Application()
        app.router.add_get(BLOB_PATH + "{key:.+}", self._get)  # HEAD too
        app.router.add_put(BLOB_PATH + "{key:.+}", self._put)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        try:
            sock = socket.create_server((self.host, self.port), family=_family(self.host))
        except OSError:
            await self._runner.cleanup()
            self._runner = None
            raise
        self.port = int(sock.getsockname()[1])
        await web.SockSite(self._runner, sock).start()
        host = advertised_host(self.host)
        base = self.public_url or f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"
        self.store.signer = UrlSigner(base, self.secret)
        log.info("blob http serving", url=base, root=str(self.store.root))
        return base.rstrip("/")

    async def stop(self) -> None:
        self.store.signer = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _checked(self, request: web.Request, method: str) -> tuple[str, Grant]:
        key = unquote(request.match_info["key"])
        if self.store.signer is None:
            raise web.HTTPServiceUnavailable(text="the blob server is stopping")
        try:
            self.store.path_for(key)
            grant = self.store.signer.check(method, key, request.query)
        except PermissionDenied as exc:
            raise web.HTTPForbidden(text=str(exc)) from None
        except InvalidArgument as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        return key, grant

    async def _get(self, request: web.Request) -> web.StreamResponse:
        key, _ = self._checked(request, request.method)
        path = self.store.path_for(key)
        if not path.is_file():
            raise web.HTTPNotFound(text=f"blob {key!r} does not exist")
        return web.FileResponse(path, chunk_size=_CHUNK, headers={"Content-Type": "application/octet-stream"})

    async def _put(self, request: web.Request) -> web.Response:
        key, grant = self._checked(request, "PUT")
        declared = request.content_length
        if grant.size is not None and declared is not None and declared != grant.size:
            raise web.HTTPBadRequest(text=f"PUT of {key!r}: Content-Length {declared}, the URL is for {grant.size} bytes")
        if grant.upload_id:
            return await self._put_part(request, key, grant)
        try:
            size = await self.store.put_stream(key, request.content.iter_chunked(_CHUNK), digest=grant.digest,
                                               size=grant.size if grant.size is not None else declared)
        except CorruptData as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        log.debug("blob stored", key=key, size=size)
        return web.Response(status=200)

    async def _put_part(self, request: web.Request, key: str, grant: Grant) -> web.Response:
        try:
            etag = await self.store.put_part(key, grant.upload_id, grant.part_number,
                                             request.content.iter_chunked(_CHUNK), size=grant.size)
        except NotFound as exc:
            raise web.HTTPNotFound(text=str(exc)) from None
        except (CorruptData, InvalidArgument) as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        log.debug("blob part stored", key=key, upload_id=grant.upload_id, part=grant.part_number)
        return web.Response(status=200, headers={"ETag": f'"{etag}"'})
