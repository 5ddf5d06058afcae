"""``weftboard serve``: start the embedded services a board needs, run it, stop everything.

Invariants:
- Embedded servers (redis-server, SeaweedFS) are started from the main thread *before* the
  event loop exists, so they are tied to this process (they die with it even on SIGKILL)
  and their start-up never blocks a running loop.
- The banner names everything that was started: addresses, data paths, log files, and the
  admin token with the file it is kept in.
- Shutdown order on SIGINT/SIGTERM: the board (health NOT_SERVING, streams ended), then the
  blob store's connections, then the embedded servers in reverse start order.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from weftboard.board import services
from weftboard.board.config import (
    BoardSettings,
    external_blob_store,
    load_or_create_admin_token,
    load_or_create_s3_credentials,
    local_blob_store,
)

out = Console(soft_wrap=True)


@dataclass
class Embedded:
    """What ``start_embedded`` started (or was told to use), and banner lines about it."""

    redis_url: str
    blobs: Any
    lines: list[tuple[str, str]] = field(default_factory=list)


def start_embedded(settings: BoardSettings, data_dir: Path, stack: ExitStack) -> Embedded:
    """Start the embedded Redis / SeaweedFS the settings call for; ``stack`` stops them."""
    from weftboard.board.blobs import S3BlobStore  # noqa: PLC0415

    lines: list[tuple[str, str]] = []
    redis_url = settings.redis_url
    if redis_url is None:
        redis = stack.enter_context(services.start_redis(data_dir / "redis", persistent=True))
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
            services.start_seaweedfs(weed_dir, access_key=access, secret_key=secret, bucket=settings.s3_bucket)
        )
        blobs = S3BlobStore(weed.endpoint, access, secret, settings.s3_bucket, region="us-east-1")
        lines.append(("blobs", f"embedded SeaweedFS S3 at {weed.url}, bucket {settings.s3_bucket!r} "
                               f"(credentials in {weed_dir / 'credentials.json'}, log {weed.log_path})"))
    else:
        blobs = local_blob_store(settings)
        lines.append(("blobs", f"local directory {blobs.describe()} (islands must share this filesystem; "
                               "use --s3-endpoint or --embedded-s3 for remote islands)"))
    return Embedded(redis_url=redis_url, blobs=blobs, lines=lines)


async def serve_async(settings: BoardSettings, embedded: Embedded, data_dir: Path, *,
                      ready: Callable[[dict[str, Any]], None] | None = None,
                      stop_event: asyncio.Event | None = None) -> None:
    """Run the board on ``embedded``'s Redis and blobs until a signal (or ``stop_event``)."""
    from weftboard.board.server import BoardConfig, start_board  # noqa: PLC0415

    lines = list(embedded.lines)
    board = None
    try:
        admin_token = settings.secret("admin_token")
        token_note = "given by --admin-token / WEFTBOARD_ADMIN_TOKEN"
        if settings.auth and not admin_token:
            admin_token, token_path, created = load_or_create_admin_token(data_dir)
            token_note = f"{'generated and stored in' if created else 'read from'} {token_path}"
        config = BoardConfig(
            listen=settings.listen,
            redis_url=embedded.redis_url,
            admin_token=admin_token if settings.auth else None,
            auth=settings.auth,
            metrics_port=settings.metrics_port,
            metrics_host=settings.metrics_host,
            tls_cert=settings.tls_cert,
            tls_key=settings.tls_key,
            tls_client_ca=settings.tls_client_ca,
            watch_progress_s=settings.watch_progress_s,
        )
        board = await start_board(config, blobs=embedded.blobs)
        lines.insert(0, ("board", f"listening on {board.address}" + (" (TLS)" if settings.tls_cert else "")))
        if board.metrics_port is not None:
            lines.append(("metrics", f"http://{settings.metrics_host}:{board.metrics_port}/metrics"))
        if settings.auth:
            lines.append(("admin token", f"{admin_token}  ({token_note})"))
        else:
            lines.append(("auth", "OFF: every caller is admin (--no-auth)"))
        lines.append(("data dir", str(data_dir)))
        print_banner(lines)
        if ready is not None:
            ready({"address": board.address, "metrics_port": board.metrics_port, "admin_token": admin_token,
                   "redis_url": embedded.redis_url, "blobs": embedded.blobs.describe()})

        stop = stop_event or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        await stop.wait()
        out.print("stopping ...")
    finally:
        if board is not None:
            await board.stop()
        await embedded.blobs.close()


def serve_until_signal(settings: BoardSettings) -> None:
    """The body of ``weftboard serve``: embedded services, board, clean stop of all."""
    data_dir = Path(settings.data_dir).expanduser().resolve()
    with ExitStack() as stack:
        embedded = start_embedded(settings, data_dir, stack)
        try:
            asyncio.run(serve_async(settings, embedded, data_dir))
        except KeyboardInterrupt:  # a signal before the handlers were installed
            pass
    out.print("stopped")


def print_banner(lines: list[tuple[str, str]]) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in lines:
        table.add_row(key, value)
    out.print("[bold]weftboard board is serving[/bold] (Ctrl-C to stop)")
    out.print(table)
    sys.stdout.flush()
