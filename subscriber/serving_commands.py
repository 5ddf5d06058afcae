"""CLI: ``weftboard sidecar`` (a version-aware island) and ``weftboard demo`` (a small RL loop).

Heavy imports (torch, grpc, aiohttp) happen inside the command bodies so ``--help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command()
    def sidecar(
        board: str = typer.Option(..., envvar="WEFTBOARD_BOARD", help="Board address host:port."),
        run: str = typer.Option(..., envvar="WEFTBOARD_RUN", help="Run whose versions this island serves."),
        token: str | None = typer.Option(None, envvar="WEFTBOARD_TOKEN", help="Bearer token (ISLAND role)."),
        engine: str = typer.Option("reference", help="reference | vllm | sglang."),
        engine_url: str | None = typer.Option(
            None, help="Where the engine serves HTTP. Omit with --engine reference to run it in this process."),
        listen: str = typer.Option("127.0.0.1:8100", help="host:port the sidecar serves the OpenAI API on."),
        dir: Path = typer.Option(Path("./island"), "--dir", envvar="WEFTBOARD_DIR",
                                 help="Island directory: checkpoint/ (for engines in their own process) and cache/."),
        activation: str = typer.Option("drain", help="drain | in_place: how a new version is activated."),
        island_id: str = typer.Option("island", envvar="WEFTBOARD_ISLAND_ID"),
        deadline_ms: int = typer.Option(30_000, help="Default request deadline when a request names none."),
        s3_endpoint: str | None = typer.Option(None, envvar="WEFTBOARD_S3_ENDPOINT",
                                                  help="Read blobs from S3 directly; without it, presigned URLs."),
        s3_access_key: str | None = typer.Option(None, envvar="WEFTBOARD_S3_ACCESS_KEY"),
        s3_secret_key: str | None = typer.Option(None, envvar="WEFTBOARD_S3_SECRET_KEY"),
        s3_bucket: str | None = typer.Option(None, envvar="WEFTBOARD_S3_BUCKET"),
        s3_secure: bool = typer.Option(False, envvar="WEFTBOARD_S3_SECURE"),
        s3_prefix: str = typer.Option("", envvar="WEFTBOARD_S3_PREFIX"),
        blob_dir: Path | None = typer.Option(None, help="Read blobs from a local blob directory (same machine)."),
        log_json: bool | None = typer.Option(None, envvar="WEFTBOARD_LOG_JSON"),
    ) -> None:
        """Serve RUN through ENGINE with version-aware requests, following the board."""
        import asyncio
        import signal

        from weftboard.board.logs import configure
        from weftboard.proto.errors import WeftboardError
        from weftboard.subscriber.engines.base import require_mode
        from weftboard.subscriber.island import start_island

        configure(json=log_json)
        host, _, port = listen.rpartition(":")
        mode = require_mode(activation)
        store = None
        if s3_endpoint:
            from weftboard.board.blobs import S3BlobStore

            store = S3BlobStore(s3_endpoint, s3_access_key or "", s3_secret_key or "", s3_bucket or "",
                                secure=s3_secure, prefix=s3_prefix)
        elif blob_dir is not None:
            from weftboard.board.blobs import LocalDirBlobStore

            store = LocalDirBlobStore(blob_dir)

        async def main() -> None:
            try:
                island = await start_island(
                    board=board, token=token, run=run, island_id=island_id, engine=engine, engine_url=engine_url,
                    checkpoint_dir=dir / "checkpoint", cache_dir=dir / "cache", mode=mode, host=host or "127.0.0.1",
                    port=int(port), blob_store=store, default_deadline_s=deadline_ms / 1000.0,
                )
            except WeftboardError as exc:
                typer.echo(f"sidecar did not start: {type(exc).__name__}: {exc}", err=True)
                raise typer.Exit(1) from None
            typer.echo(f"sidecar for run {run} serving on {island.url} (engine {engine}, activation {mode.value})")
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            stopping = asyncio.ensure_future(stop.wait())
            failing = asyncio.ensure_future(island.failed())
            try:
                await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in (stopping, failing):
                    waiter.cancel()
                await island.stop()
            if failing.done() and not failing.cancelled():
                exc = failing.result()
                typer.echo(f"sidecar stopped: the island no longer follows run {run}: {type(exc).__name__}: {exc}",
                           err=True)
                raise typer.Exit(1)

        asyncio.run(main())

    @app.command()
    def demo(
        steps: int = typer.Option(30, help="Optimizer steps (each publishes a version)."),
        out: Path = typer.Option(Path("weftboard-demo"), help="Directory for the plot, summary and data."),
        seed: int = typer.Option(0, help="Seed of the model and the rollouts."),
        s3: bool = typer.Option(False, "--s3", help="Use a bundled SeaweedFS S3 server instead of a local blob dir."),
        rollouts: int = typer.Option(16, help="Rollouts per step."),
        live: bool | None = typer.Option(None, "--live/--no-live", help="Live terminal view (default: on a terminal)."),
    ) -> None:
        """A complete small RL loop: trainer, board, two islands (one joins late), trajectories back."""
        import asyncio

        from rich.console import Console

        from weftboard.subscriber.demo import DemoConfig, run_demo

        console = Console()
        if not console.is_terminal:  # logs and CI: wide enough for the summary table
            console = Console(width=120)
        result = asyncio.run(run_demo(DemoConfig(steps=steps, out=out, seed=seed, s3=s3, rollouts=rollouts,
                                                 live=live), console=console))
        raise typer.Exit(0 if result.ok else 1)
