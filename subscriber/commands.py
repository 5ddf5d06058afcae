"""``weftboard subscribe``: the island daemon's command line (flags or WEFTBOARD_* env)."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command()
    def subscribe(
        board: str = typer.Option(..., envvar="WEFTBOARD_BOARD", help="Board address host:port."),
        run: str = typer.Option(..., envvar="WEFTBOARD_RUN", help="Run to follow."),
        dir: Path = typer.Option(..., envvar="WEFTBOARD_DIR", help="Island directory: checkpoint/ (current -> versions/vN) and cache/."),
        token: str | None = typer.Option(None, envvar="WEFTBOARD_TOKEN", help="Bearer token (ISLAND role)."),
        island_id: str = typer.Option("island", envvar="WEFTBOARD_ISLAND_ID"),
        region: str = typer.Option("local", envvar="WEFTBOARD_REGION"),
        s3_endpoint: str | None = typer.Option(None, envvar="WEFTBOARD_S3_ENDPOINT", help="Read blobs from S3 directly; without it, presigned URLs from the board."),
        s3_access_key: str | None = typer.Option(None, envvar="WEFTBOARD_S3_ACCESS_KEY"),
        s3_secret_key: str | None = typer.Option(None, envvar="WEFTBOARD_S3_SECRET_KEY"),
        s3_bucket: str | None = typer.Option(None, envvar="WEFTBOARD_S3_BUCKET"),
        s3_secure: bool = typer.Option(False, envvar="WEFTBOARD_S3_SECURE"),
        s3_prefix: str = typer.Option("", envvar="WEFTBOARD_S3_PREFIX"),
        destination: str = typer.Option("dir", help="dir: HF checkpoint directory; memory: live tensors in this process."),
        heartbeat_s: float = typer.Option(5.0),
        lease_s: int = typer.Option(15),
        events: bool = typer.Option(False, help="Print a JSON line to stdout for every verified version."),
        exit_at_version: int = typer.Option(0, help="Exit once this version is held (0: follow forever)."),
        progress: bool | None = typer.Option(None, "--progress/--no-progress", help="Progress display (default: on a terminal)."),
        log_json: bool | None = typer.Option(None, envvar="WEFTBOARD_LOG_JSON"),
    ) -> None:
        """Follow RUN into a local checkpoint directory, verified, atomically replaced."""
        import asyncio

        from weftboard.board.logs import configure
        from weftboard.proto.errors import WeftboardError
        from weftboard.subscriber.daemon import DaemonConfig, run_daemon

        configure(json=log_json)
        cfg = DaemonConfig(
            board=board, run=run, dir=dir, token=token, island_id=island_id, region=region,
            s3_endpoint=s3_endpoint, s3_access_key=s3_access_key, s3_secret_key=s3_secret_key, s3_bucket=s3_bucket,
            s3_secure=s3_secure, s3_prefix=s3_prefix, destination=destination, heartbeat_s=heartbeat_s,
            lease_s=lease_s, events=events, exit_at_version=exit_at_version, progress=progress,
        )
        try:
            code = asyncio.run(run_daemon(cfg))
        except WeftboardError as exc:  # what retrying cannot cure (a refused token): the reason, no traceback
            typer.echo(f"subscribe stopped: {type(exc).__name__}: {exc}", err=True)
            raise typer.Exit(1) from None
        raise typer.Exit(code)
