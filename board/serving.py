"""The process behind ``weftboard serve``: embedded services, the blob store's start-up check,
the board, the banner, and a clean stop of all (the command's flags live in board/commands.py).

Invariants:
- Embedded servers (redis-server, SeaweedFS) are started from the main thread *before* the
  event loop exists, so they are tied to this process (they die with it even on SIGKILL)
  and their start-up never blocks a running loop.
- An S3 blob store must answer with working credentials before the board starts: its bucket
  is created if it is missing and a probe key is looked up; a store that cannot be reached or
  refuses the credentials raises (``Unavailable`` / ``PermissionDenied``), so ``serve`` exits
  (1 / 2) instead of serving a board whose every publish would fail.
- The banner names everything that was started: addresses, data paths, log files. It prints
  the admin token itself only when this start generated it (and stored it in the data dir);
  a token given by flag, environment, config file or read back from the data dir is named by
  where it came from and its public id (``bootstrap-<sha256 prefix>``, never reversible), so
  container and journal logs never hold a secret the operator supplied.
- Shutdown order on SIGINT/SIGTERM: the board (health NOT_SERVING, streams ended), then the
  blob store's connections, then the embedded servers in reverse start order.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from weftboard.board.auth import bootstrap_id
from weftboard.board.blobs import LocalDirBlobStore, S3BlobStore
from weftboard.board.blobs.signed_urls import load_or_create_url_secret
from weftboard.board.config import (
    BoardSettings,
    external_blob_store,
    load_or_create_admin_token,
    load_or_create_s3_credentials,
    local_blob_store,
)
from weftboard.board.embedded import start_redis, start_seaweedfs
from weftboard.board.process import BoardConfig, start_board, tune_gc_for_serving
from weftboard.proto.errors import InvalidArgument

banner_out = Console(soft_wrap=True)  # the serve banner: long lines kept whole

# The key an S3 store is probed with at start-up: looked up (HEAD), never written.
S3_PROBE_KEY = "weftboard-start-probe"
# Where an admin token given to ``serve`` came from, when the caller does not say.
GIVEN_TOKEN = "--admin-token / WEFTBOARD_ADMIN_TOKEN"


@dataclass
class Embedded:
    """What ``start_embedded`` started (or was told to use), and banner lines about it."""

    redis_url: str
    blobs: Any
    lines: list[tuple[str, str]] = field(default_factory=list)


def start_embedded(settings: BoardSettings, data_dir: Path, stack: ExitStack) -> Embedded:
    """Start the embedded Redis / SeaweedFS the settings call for; ``stack`` stops them."""
    lines: list[tuple[str, str]] = []
    redis_url = settings.redis_url
    if redis_url is None:
        redis = stack.enter_context(start_redis(data_dir / "redis", persistent=True))
        redis_url = redis.url
        lines.append(("redis", f"embedded redis-server at {redis.url} (append-only file in {redis.dir}, log {redis.log_path})"))
    else:
        lines.append(("redis", redis_url.split("@")[-1]))  # never print a password

    blobs = external_blob_store(settings)
    if blobs is not None:
        lines.append(("blobs", blobs.describe()))
    elif settings.embedded_s3:
        weed_dir = data_dir / "seaweedfs"
        access, secret = load_or_create_s3_credentials(weed_dir)
        weed = stack.enter_context(
            start_seaweedfs(weed_dir, access_key=access, secret_key=secret, bucket=settings.s3_bucket)
        )
        blobs = S3BlobStore(weed.endpoint, access, secret, settings.s3_bucket, region="us-east-1")
        lines.append(("blobs", f"embedded SeaweedFS S3 at {weed.url}, bucket {settings.s3_bucket!r} "
                               f"(credentials in {weed_dir / 'credentials.json'}, log {weed.log_path})"))
    else:
        blobs = local_blob_store(settings)
        served = ("served over signed HTTP URLs (see blob urls)" if settings.blob_http_port >= 0
                  else "islands must share this filesystem: --blob-http-port -1")
        lines.append(("blobs", f"local directory {blobs.describe()} ({served})"))
    return Embedded(redis_url=redis_url, blobs=blobs, lines=lines)


async def check_blob_store(blobs: Any) -> None:
    """Raise unless an S3 store answers with working credentials (its bucket created if missing:
    the store does that on its first call). Other stores are checked by opening them."""
    if isinstance(blobs, S3BlobStore):
        await blobs.stat(S3_PROBE_KEY)


def admin_token_line(token: str, note: str, generated: bool) -> tuple[str, str]:
    """The banner's admin-token line: the token only when this start generated it."""
    if generated:
        return "admin token", f"{token}  ({note})"
    return "admin token", f"{note}; not shown (token id {bootstrap_id(token)})"


async def serve_async(settings: BoardSettings, embedded: Embedded, data_dir: Path, *,
                      ready: Callable[[dict[str, Any]], None] | None = None,
                      stop_event: asyncio.Event | None = None, token_source: str = GIVEN_TOKEN) -> None:
    """Run the board on ``embedded``'s Redis and blobs until a signal (or ``stop_event``).
    ``token_source`` names where a given admin token came from (for the banner)."""
    lines = list(embedded.lines)
    board = None
    try:
        admin_token = settings.secret("admin_token")
        previous = settings.previous_admin_token.get_secret_value() if settings.previous_admin_token else None
        if previous and not admin_token:
            raise InvalidArgument("--previous-admin-token (WEFTBOARD_PREVIOUS_ADMIN_TOKEN) keeps the admin token being "
                                  "rotated out valid beside the new one: give the new one with --admin-token too")
        token_note, generated = f"given by {token_source}", False
        if settings.auth and not admin_token:
            admin_token, token_path, generated = load_or_create_admin_token(data_dir)
            token_note = f"{'generated and stored in' if generated else 'read from'} {token_path}"
        await check_blob_store(embedded.blobs)
        config = BoardConfig(
            listen=settings.listen,
            redis_url=embedded.redis_url,
            admin_tokens=tuple(t for t in (admin_token, previous) if t) if settings.auth else (),  # the new one first
            auth=settings.auth,
            metrics_port=settings.metrics_port,
            metrics_host=settings.metrics_host,
            tls_cert=settings.tls_cert,
            tls_key=settings.tls_key,
            tls_client_ca=settings.tls_client_ca,
            watch_progress_s=settings.watch_progress_s,
            staged_grace_s=settings.staged_grace_s,
            redis_min_replicas=settings.redis_min_replicas,
            redis_replica_timeout_ms=settings.redis_replica_timeout_ms,
        )
        if isinstance(embedded.blobs, LocalDirBlobStore) and settings.blob_http_port >= 0:
            config.blob_http_port = settings.blob_http_port
            config.blob_http_host = settings.blob_http_host
            config.blob_public_url = settings.blob_public_url
            config.blob_url_secret = load_or_create_url_secret(data_dir)
        board = await start_board(config, blobs=embedded.blobs)
        lines.insert(0, ("board", f"listening on {board.address}" + (" (TLS)" if settings.tls_cert else "")))
        if board.blob_url is not None:
            lines.append(("blob urls", f"{board.blob_url}/blobs/ (signed, expiring; what the board presigns)"))
        if board.metrics_port is not None:
            lines.append(("metrics", f"http://{settings.metrics_host}:{board.metrics_port}/metrics"))
        if settings.auth and admin_token:
            lines.append(admin_token_line(admin_token, token_note, generated))
            if previous:
                lines.append(("previous admin token", f"valid until a start without it; not shown (token id "
                                                      f"{bootstrap_id(previous)})"))
        else:
            lines.append(("auth", "OFF: every caller is admin (--no-auth)"))
        lines.append(("data dir", str(data_dir)))
        stop = stop_event or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # before the banner: once it shows, a signal stops cleanly
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, stop.set)
        print_banner(lines)
        if ready is not None:
            ready({"address": board.address, "metrics_port": board.metrics_port, "admin_token": admin_token,
                   "redis_url": embedded.redis_url, "blobs": embedded.blobs.describe(), "blob_url": board.blob_url})
        await stop.wait()
        banner_out.print("stopping ...")
    finally:
        if board is not None:
            await board.stop()
        await embedded.blobs.close()


def serve_until_signal(settings: BoardSettings, *, token_source: str = GIVEN_TOKEN) -> None:
    """The body of ``weftboard serve``: embedded services, board, clean stop of all. An
    ``OSError`` at start-up (a directory that cannot be made, a port taken) propagates after
    everything started so far was stopped."""
    data_dir = Path(settings.data_dir).expanduser().resolve()
    with ExitStack() as stack:
        embedded = start_embedded(settings, data_dir, stack)
        tune_gc_for_serving()
        with contextlib.suppress(KeyboardInterrupt):  # a signal before the handlers were installed
            asyncio.run(serve_async(settings, embedded, data_dir, token_source=token_source))
    banner_out.print("stopped")


def print_banner(lines: list[tuple[str, str]]) -> None:
    """Print the serve banner: a title line, then one ``key value`` row per line."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in lines:
        table.add_row(key, value)
    banner_out.print("[bold]weftboard board is serving[/bold] (Ctrl-C to stop)")
    banner_out.print(table)
    sys.stdout.flush()
