"""Signed, expiring URLs for a blob store that the board serves over HTTP itself.

A local-directory store has no S3 API to presign against, so the board signs URLs of its own
(``board/blob_http.py`` serves them): ``<base>/blobs/<key>?expires=<unix s>&sig=<hex>`` for a
GET, with ``&digest=...&size=...`` on a PUT, and ``&upload=...&part=...`` on the PUT of one part
of a multipart upload. The signature is an HMAC-SHA256, under a secret only the board holds, of
the method, the key, the expiry and (PUT) the digest and size the bytes must have (and the
upload and part number they belong to).

Invariants:
- A URL grants one method on one key until its expiry; changing any signed part (key, method,
  expiry, digest, size, upload, part) or the signature makes ``check`` refuse it with
  ``UrlExpired`` (HTTP 403), as does a URL past its expiry. Signatures are compared in
  constant time.
- A HEAD is allowed by a GET's signature (it reads no more than the GET would).
- The secret never leaves the board process and its data directory (a 0600 file).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode

from weftboard.proto.errors import InvalidArgument, UrlExpired

URL_SECRET_FILE = "blob-url-secret"
BLOB_PATH = "/blobs/"
MAX_URL_LIFETIME_S = 7 * 24 * 3600


@dataclass(frozen=True)
class Grant:
    """What a checked URL allows: ``method`` on ``key``; a PUT's bytes must have ``digest``
    (when not empty) and ``size`` (when not None), and are part ``part_number`` of multipart
    upload ``upload_id`` when that is not empty."""

    method: str
    key: str
    digest: str
    size: int | None
    upload_id: str = ""
    part_number: int = 0


class UrlSigner:
    """Signs and checks the URLs under ``base_url`` (``http://host:port``, no trailing '/')."""

    def __init__(self, base_url: str, secret: bytes) -> None:
        if len(secret) < 16:
            raise InvalidArgument("a URL signing secret must be at least 16 bytes")
        self.base_url = base_url.rstrip("/")
        self._secret = secret

    def _mac(self, method: str, key: str, expires: int, digest: str, size: str, part: str = "") -> str:
        fields = (method, key, str(expires), digest, size) + ((part,) if part else ())
        return hmac.new(self._secret, "\n".join(fields).encode(), hashlib.sha256).hexdigest()

    def sign(self, method: str, key: str, expires_s: int, *, digest: str = "", size: int | None = None,
             upload_id: str = "", part_number: int = 0, now: float | None = None) -> str:
        """A URL that allows ``method`` ("GET" or "PUT") on ``key`` for ``expires_s`` seconds
        (with ``upload_id``: the PUT of part ``part_number`` of that multipart upload)."""
        if method not in ("GET", "PUT"):
            raise InvalidArgument(f"only GET and PUT URLs are signed, not {method}")
        if upload_id and (method != "PUT" or part_number < 1):
            raise InvalidArgument("a part URL is a PUT of a part numbered from 1")
        if not 1 <= expires_s <= MAX_URL_LIFETIME_S:
            raise InvalidArgument(f"URL lifetime must be 1..{MAX_URL_LIFETIME_S} s, got {expires_s}")
        expires = int((time.time() if now is None else now) + expires_s)
        size_text = "" if size is None else str(size)
        query = {"expires": str(expires)}
        part = f"{upload_id}:{part_number}" if upload_id else ""
        if method == "PUT":
            query |= {"digest": digest, "size": size_text}
        if part:
            query |= {"upload": upload_id, "part": str(part_number)}
        query["sig"] = self._mac(method, key, expires, digest if method == "PUT" else "",
                                 size_text if method == "PUT" else "", part)
        return f"{self.base_url}{BLOB_PATH}{quote(key)}?{urlencode(query)}"

    def check(self, method: str, key: str, query: Mapping[str, str], *, now: float | None = None) -> Grant:
        """The grant of a request's URL; ``UrlExpired`` when expired, altered or not signed."""
        signed_method = "GET" if method == "HEAD" else method
        expires_text = query.get("expires", "")
        signature = query.get("sig", "")
        if not expires_text.isdigit() or not signature:
            raise UrlExpired(f"{method} {key}: the URL carries no signature or expiry")
        digest = query.get("digest", "") if signed_method == "PUT" else ""
        size_text = query.get("size", "") if signed_method == "PUT" else ""
        upload_id = query.get("upload", "") if signed_method == "PUT" else ""
        part_text = query.get("part", "") if upload_id else ""
        if upload_id and not part_text.isdigit():
            raise UrlExpired(f"{method} {key}: the URL names an upload but no part number")
        part = f"{upload_id}:{part_text}" if upload_id else ""
        expected = self._mac(signed_method, key, int(expires_text), digest, size_text, part)
        if not hmac.compare_digest(expected, signature):
            raise UrlExpired(f"{method} {key}: the signature does not match (another key, method or an altered URL)")
        if int(expires_text) < (time.time() if now is None else now):
            raise UrlExpired(f"{method} {key}: the URL expired; ask the board for a new one")
        return Grant(signed_method, key, digest, int(size_text) if size_text.isdigit() else None, upload_id,
                     int(part_text) if upload_id else 0)


def load_or_create_url_secret(data_dir: Path) -> bytes:
    """The board's URL signing secret, kept in ``data_dir`` (mode 0600) so URLs it handed out
    stay valid across a restart; created on first use."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / URL_SECRET_FILE
    if path.exists():
        text = path.read_text().strip()
        if len(text) >= 32:
            return bytes.fromhex(text)
    secret = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret.hex() + "\n")
    return secret
