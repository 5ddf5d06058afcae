"""Board settings from flags and ``WEFTBOARD_*`` environment variables.

``BoardSettings`` is the one place that names every knob of a board process; ``weftboard
serve`` builds it from its flags (flags win over the environment, the environment over
defaults), and deploy/ files set the same names as environment variables.

Invariants:
- Every field maps to ``WEFTBOARD_<FIELD>`` (e.g. ``WEFTBOARD_REDIS_URL``).
- No Redis URL means "start the embedded redis-server under ``data_dir``"; no S3 endpoint
  means a local-directory blob store (or embedded SeaweedFS with ``embedded_s3``).
- Secrets (admin token, S3 secret key) are ``SecretStr`` so they never appear in a repr or
  a log line by accident.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from weftboard.board.blobs import BlobStore, LocalDirBlobStore, S3BlobStore
from weftboard.board.blobs.s3 import DEFAULT_BUCKET
from weftboard.board.defaults import ADMIN_TOKEN_FILE, DEFAULT_LISTEN, default_data_dir
from weftboard.board.gc import DEFAULT_STAGED_GRACE_S, grace_of
from weftboard.proto.errors import InvalidArgument

__all__ = ["ADMIN_TOKEN_FILE", "DEFAULT_LISTEN", "BoardSettings", "default_data_dir"]


def split_host_port(value: str) -> tuple[str, int]:
    """(host, port) of ``host:port`` (the host may be empty or a bracketed IPv6 address; port
    0..65535); ``ValueError`` otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} must be host:port, e.g. 127.0.0.1:8100")
    return host, int(port)


class BoardSettings(BaseSettings):
    """Settings of ``weftboard serve``; see deploy/README.md for a table of the variables."""

    model_config = SettingsConfigDict(env_prefix="WEFTBOARD_", extra="ignore")

    listen: str = Field(DEFAULT_LISTEN, description="host:port the gRPC server binds")
    redis_url: str | None = Field(None, description="redis://host:port/db, or a Redis Cluster: redis+cluster://host:port,host:port (rediss for TLS); empty starts the embedded redis-server")
    s3_endpoint: str | None = Field(None, description="S3 endpoint (host:port or URL); empty uses a local blob dir")
    s3_access_key: str | None = None
    s3_secret_key: SecretStr | None = None
    s3_bucket: str = DEFAULT_BUCKET
    s3_secure: bool = False
    s3_region: str | None = None
    s3_prefix: str = ""
    embedded_s3: bool = Field(False, description="start a local SeaweedFS S3 server instead of a blob dir")
    blob_dir: Path | None = Field(None, description="local blob store root (default: <data_dir>/blobs)")
    data_dir: Path = Field(default_factory=default_data_dir)
    admin_token: SecretStr | None = None
    previous_admin_token: SecretStr | None = Field(None, description="an admin token kept valid beside admin_token while every replica moves to the new one (rotation); needs admin_token")
    auth: bool = True
    metrics_port: int | None = Field(None, description="Prometheus /metrics port; unset disables, 0 picks one")
    metrics_host: str = "127.0.0.1"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    log_json: bool | None = None
    log_level: str = "INFO"
    watch_progress_s: float = 5.0
    staged_grace_s: float = Field(DEFAULT_STAGED_GRACE_S, description="GC deletes the staged parts and anchor files of a version never committed once they are this old (at least 900)")
    redis_min_replicas: int = Field(0, ge=0, description="a commit answers once this many Redis replicas acknowledged it (WAIT); 0: the master's word")
    redis_replica_timeout_ms: int = Field(1000, gt=0, description="how long a commit waits for those replicas before answering UNAVAILABLE (retryable)")
    blob_http_port: int = Field(0, description="port of the signed-URL HTTP server of a local blob store; 0 picks one, -1 serves none (readers must share the filesystem)")
    blob_http_host: str | None = Field(None, description="host the blob HTTP server binds (default: the host of listen)")
    blob_public_url: str | None = Field(None, description="base URL others reach the blob HTTP server at (default http://<host>:<port>)")

    @field_validator("listen")
    @classmethod
    def _listen_has_port(cls, value: str) -> str:
        try:
            host = split_host_port(value)[0]
        except ValueError:
            host = ""
        if not host:
            raise ValueError(f"listen {value!r} must be host:port, e.g. 0.0.0.0:7420")
        return value

    @field_validator("redis_url", "s3_endpoint", "s3_access_key", "s3_region", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("staged_grace_s")
    @classmethod
    def _grace_long_enough(cls, value: float) -> float:
        return grace_of(value)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
            raise ValueError(f"redis_url {value!r} must start with redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://")
        return value

    def secret(self, name: str) -> str | None:
        value = getattr(self, name)
        return value.get_secret_value() if value is not None else None


def external_blob_store(settings: BoardSettings) -> BlobStore | None:
    """The blob store the settings name explicitly (S3 endpoint), or None for an embedded one."""
    if not settings.s3_endpoint:
        return None
    if not settings.s3_access_key or settings.s3_secret_key is None:
        raise InvalidArgument(
            "an S3 endpoint needs credentials: set --s3-access-key/--s3-secret-key "
            "(or WEFTBOARD_S3_ACCESS_KEY / WEFTBOARD_S3_SECRET_KEY)"
        )
    return S3BlobStore(
        settings.s3_endpoint,
        settings.s3_access_key,
        settings.secret("s3_secret_key") or "",
        settings.s3_bucket,
        secure=settings.s3_secure,
        region=settings.s3_region,
        prefix=settings.s3_prefix,
    )


def local_blob_store(settings: BoardSettings) -> LocalDirBlobStore:
    return LocalDirBlobStore(settings.blob_dir or settings.data_dir / "blobs")


def load_or_create_admin_token(data_dir: Path) -> tuple[str, Path, bool]:
    """The admin token stored in ``data_dir`` (mode 0600), creating one on first use.

    Returns (token, file, created). A restarted embedded board keeps the same token, so the
    tokens it handed out (stored hashed in Redis) and the operator's notes stay valid.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / ADMIN_TOKEN_FILE
    if path.exists():
        token = path.read_text().strip()
        if len(token) >= 16:
            return token, path, False
    token = "wb_admin_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token, path, True


def load_or_create_s3_credentials(directory: Path) -> tuple[str, str]:
    """Stable credentials for an embedded SeaweedFS, kept beside its data (mode 0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "credentials.json"
    if path.exists():
        data = json.loads(path.read_text())
        return data["access_key"], data["secret_key"]
    access, secret = "wb" + secrets.token_hex(8), secrets.token_hex(20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"access_key": access, "secret_key": secret}, out)
    return access, secret
