"""CLI of the island: ``weftboard subscribe`` (a plain follower into a local destination) and
``weftboard sidecar`` (an island serving an engine with version-aware requests).

Flags may come from WEFTBOARD_* environment variables. Both reach the board over TLS with the
board commands' ``--tls*`` flags (``board/commands.py``). A refused token or request (what
retrying cannot cure) ends the command with exit code 1 and its reason, no traceback.
Usage errors (``--destination``, ``--activation``, ``--listen`` that name nothing valid) are
refused before anything starts, with one line naming the option and exit code 2; an ``OSError``
at start-up (an island directory that cannot be made, a port taken) is one line and exit code 1,
after closing what was opened. Blobs come from S3 (``--s3-endpoint``), else from the board's
local blob directory (``--blob-dir``, ``WEFTBOARD_BLOB_DIR``: a board on the same filesystem
serving no blob URLs, ``serve --blob-http-port -1``), else through URLs the board presigns: one
group of flags for both commands (``with_blob_flags``), checked together before anything starts
(``blob_source.py``; settings that do not fit together are a usage error, exit code 2).
Island metrics (subscriber/metrics.py): the sidecar serves them at ``/metrics`` on its own port,
``subscribe`` on ``--metrics-port``. Both are processes of their own: they tune the garbage
collector as ``weftboard serve`` does (``board/process.py`` ``tune_gc_for_serving``).
Only what the flags need is imported here (the command line loads no torch, see
``board/cli.py``); each command imports the island when it runs.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import typer

from weftboard.board.blobs import BlobStore
from weftboard.board.blobs.s3 import DEFAULT_BUCKET
from weftboard.board.channel import TlsConfig
from weftboard.board.commands import (
    check_host_port,
    startup_error,
    usage_error,
    with_flag_group,
    with_tls_flags,
)
from weftboard.board.logs import configure
from weftboard.board.process import tune_gc_for_serving
from weftboard.proto.errors import InvalidArgument, WeftboardError
from weftboard.subscriber.blob_source import PRESIGNED, IslandBlobSettings
from weftboard.subscriber.engines.base import ActivationMode

if TYPE_CHECKING:
    from weftboard.subscriber.engine_island import RunningIsland

log = structlog.get_logger("weftboard.commands")

DESTINATIONS = ("dir", "memory")
REGION_HELP = "Where this island runs, as its heartbeats report it (weftboard fleet shows it)."
BLOBS_PANEL = "Blobs (default: the board's presigned URLs)"
# The island commands' blob flags, in one group (``with_blob_flags``): name, annotation, option.
BLOB_FLAGS: tuple[tuple[str, object, object], ...] = (
    ("s3_endpoint", str | None, typer.Option(
        None, envvar="WEFTBOARD_S3_ENDPOINT", rich_help_panel=BLOBS_PANEL,
        help="Read blobs from S3 directly (host:port or URL); without it, presigned URLs from the board.")),
    ("s3_access_key", str | None, typer.Option(None, envvar="WEFTBOARD_S3_ACCESS_KEY", rich_help_panel=BLOBS_PANEL,
                                               help="With --s3-secret-key; neither: anonymous reads.")),
    ("s3_secret_key", str | None, typer.Option(None, envvar="WEFTBOARD_S3_SECRET_KEY", rich_help_panel=BLOBS_PANEL)),
    ("s3_bucket", str, typer.Option(DEFAULT_BUCKET, envvar="WEFTBOARD_S3_BUCKET", rich_help_panel=BLOBS_PANEL,
                                    help="The board's bucket.")),
    # --s3-insecure as `weftboard serve` spells it; --no-s3-secure, the name islands had first, still works
    ("s3_secure", bool, typer.Option(False, "--s3-secure/--s3-insecure", " /--no-s3-secure", envvar="WEFTBOARD_S3_SECURE",
                                     rich_help_panel=BLOBS_PANEL,
                                     help="HTTPS to a host:port endpoint (a URL's scheme decides for itself).")),
    ("s3_region", str | None, typer.Option(
        None, envvar="WEFTBOARD_S3_REGION", rich_help_panel=BLOBS_PANEL,
        help="The bucket's region for request signing; default: named by an AWS endpoint's host, else asked of "
             "the store (GetBucketLocation).")),
    ("s3_prefix", str, typer.Option("", envvar="WEFTBOARD_S3_PREFIX", rich_help_panel=BLOBS_PANEL,
                                    help="The board's key prefix inside the bucket.")),
    ("blob_dir", Path | None, typer.Option(
        None, envvar="WEFTBOARD_BLOB_DIR", rich_help_panel=BLOBS_PANEL,
        help="Read blobs from the board's local blob directory (same filesystem; for a board serving no blob "
             "URLs, --blob-http-port -1).")),
)


def blob_settings_from_flags(*values: object) -> IslandBlobSettings:
    """The blob flags as settings; settings that do not fit together (a key without its secret,
    an endpoint and a directory, a bucket name S3 refuses) exit 2 with one line saying so."""
    try:
        return IslandBlobSettings(**{name: value for (name, _, _), value in zip(BLOB_FLAGS, values, strict=True)})
    except InvalidArgument as exc:
        usage_error("blob settings", str(exc))
    except ImportError as exc:  # an S3 endpoint without the [s3] extra
        usage_error("--s3-endpoint", str(exc))


#: a command with the blob flags (``BLOB_FLAGS``), received as one ``blob_settings: IslandBlobSettings``
with_blob_flags = with_flag_group("blob_settings", BLOB_FLAGS, blob_settings_from_flags)


def check_port_free(option: str, host: str, port: int) -> None:
    """Exit 1 with one line when ``host:port`` cannot be bound (in use, not an address here),
    before anything is opened that a failed bind would leave behind. Port 0 always binds."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind(address)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        typer.echo(f"sidecar did not start: {option} {host}:{port}: {reason}", err=True)
        raise typer.Exit(1) from None


async def serve_until_stopped(island: RunningIsland, run: str) -> None:
    """Serve until SIGINT/SIGTERM, or exit 1 when the island stops following its run."""
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
        typer.echo(f"sidecar stopped: the island no longer follows run {run}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("engine")
    def bench_engine(
        versions: int = typer.Option(8, "--versions", min=1),
        hidden: int = typer.Option(1024, "--hidden", min=32, help="a multiple of 32"),
        layers: int = typer.Option(12, "--layers", min=1),
        engine_python: Path | None = typer.Option(
            None, "--engine-python", envvar="WEFTBOARD_ENGINE_PYTHON",
            help="the Python of an environment that has vLLM (a GPU build); default: a CPU one under ~/.cache"),
        clients: int = typer.Option(3, "--clients", min=0, help="concurrent clients during the swaps"),
        as_json: bool = typer.Option(False, "--json", help="print the result as JSON on the last line"),
    ) -> None:
        """vLLM in place (pause, patch, resume) against its own full reload, version by version."""
        # imported when the command runs: the command line loads no torch (board/cli.py)
        from weftboard.subscriber.bench import engine as engine_bench

        result = engine_bench.run(versions=versions, hidden=hidden, layers=layers, clients=clients,
                                  engine_python=engine_python,
                                  say=(lambda line: typer.echo(line, err=True)) if as_json else typer.echo)
        if as_json:
            print(json.dumps(result))
        else:
            typer.echo(f"swap_speedup x{result['swap_speedup']:.2f}, requests failed {result['requests_failed']}")

    @app.command()
    @with_tls_flags
    @with_blob_flags
    def subscribe(
        board: str = typer.Option(..., envvar="WEFTBOARD_BOARD", help="Board address host:port."),
        run: str = typer.Option(..., envvar="WEFTBOARD_RUN", help="Run to follow."),
        dir: Path = typer.Option(..., envvar="WEFTBOARD_DIR", help="Island directory: checkpoint/ (current -> versions/vN) and cache/."),
        token: str | None = typer.Option(None, envvar="WEFTBOARD_TOKEN", help="Bearer token (ISLAND role)."),
        island_id: str = typer.Option("island", envvar="WEFTBOARD_ISLAND_ID"),
        region: str = typer.Option("local", envvar="WEFTBOARD_REGION", help=REGION_HELP),
        destination: str = typer.Option("dir", help="dir: HF checkpoint directory; memory: live tensors in this process."),
        heartbeat_s: float = typer.Option(5.0),
        lease_s: int = typer.Option(15),
        events: bool = typer.Option(False, help="Print a JSON line to stdout for every verified version."),
        exit_at_version: int = typer.Option(0, help="Exit once this version is held (0: follow forever)."),
        progress: bool | None = typer.Option(None, "--progress/--no-progress", help="Progress display (default: on a terminal)."),
        log_json: bool | None = typer.Option(None, envvar="WEFTBOARD_LOG_JSON"),
        metrics_port: int | None = typer.Option(None, envvar="WEFTBOARD_METRICS_PORT",
                                                help="Serve Prometheus /metrics on this port (0 picks one)."),
        metrics_host: str = typer.Option("127.0.0.1", envvar="WEFTBOARD_METRICS_HOST", help="Host /metrics binds."),
        tls_config: TlsConfig | None = None,  # the --tls* flags (with_tls_flags)
        blob_settings: IslandBlobSettings = PRESIGNED,  # the blob flags (with_blob_flags)
    ) -> None:
        """Follow RUN into a local checkpoint directory, verified, atomically replaced."""
        if destination not in DESTINATIONS:
            usage_error("--destination", f"must be dir or memory, not {destination!r}")
        # imported when the command runs: the command line loads no torch (board/cli.py)
        from weftboard.subscriber.local_follower import (
            LocalFollowerConfig,
            run_local_follower,
        )

        configure(json=log_json)
        cfg = LocalFollowerConfig(
            board=board, run=run, dir=dir, token=token, island_id=island_id, region=region,
            blobs=blob_settings, destination=destination, heartbeat_s=heartbeat_s,
            lease_s=lease_s, events=events, exit_at_version=exit_at_version, progress=progress, tls=tls_config,
            metrics_port=metrics_port, metrics_host=metrics_host,
        )
        tune_gc_for_serving()  # this process only follows the run
        try:
            code = asyncio.run(run_local_follower(cfg))
        except WeftboardError as exc:  # what retrying cannot cure (a refused token): the reason, no traceback
            typer.echo(f"subscribe stopped: {type(exc).__name__}: {exc}", err=True)
            raise typer.Exit(1) from None
        except OSError as exc:  # the island directory cannot be made, the metrics port is taken
            log.debug("subscribe could not start", exc_info=True)
            startup_error("subscribe stopped", exc)
        raise typer.Exit(code)

    @app.command()
    @with_tls_flags
    @with_blob_flags
    def sidecar(
        board: str = typer.Option(..., envvar="WEFTBOARD_BOARD", help="Board address host:port."),
        run: str = typer.Option(..., envvar="WEFTBOARD_RUN", help="Run whose versions this island serves."),
        token: str | None = typer.Option(None, envvar="WEFTBOARD_TOKEN", help="Bearer token (ISLAND role)."),
        engine: str = typer.Option("reference", help="reference | vllm | sglang."),
        engine_url: str | None = typer.Option(
            None, help="Where the engine serves HTTP. Omit with --engine reference to run it in this process."),
        engine_api_key: str | None = typer.Option(
            None, envvar="WEFTBOARD_ENGINE_API_KEY",
            help="The engine's --api-key: sent by the island's weight calls, and by the sidecar in place of "
                 "the caller's Authorization."),
        listen: str = typer.Option("127.0.0.1:8100", help="host:port the sidecar serves the OpenAI API on."),
        dir: Path = typer.Option(Path("./island"), "--dir", envvar="WEFTBOARD_DIR",
                                 help="Island directory: checkpoint/ (for engines in their own process) and cache/."),
        activation: str = typer.Option("drain", help="drain | in_place: how a new version is activated."),
        island_id: str = typer.Option("island", envvar="WEFTBOARD_ISLAND_ID"),
        region: str = typer.Option("local", envvar="WEFTBOARD_REGION", help=REGION_HELP),
        deadline_ms: int = typer.Option(30_000, help="Default request deadline when a request names none."),
        scrub_interval_s: float = typer.Option(3600.0, envvar="WEFTBOARD_SCRUB_INTERVAL_S",
                                               help="Re-hash what the island serves this often (0: never); a "
                                                    "damaged version is quarantined and fetched again."),
        log_json: bool | None = typer.Option(None, envvar="WEFTBOARD_LOG_JSON"),
        tls_config: TlsConfig | None = None,  # the --tls* flags (with_tls_flags)
        blob_settings: IslandBlobSettings = PRESIGNED,  # the blob flags (with_blob_flags)
    ) -> None:
        """Serve RUN through ENGINE with version-aware requests, following the board."""
        modes = [m.value for m in ActivationMode]
        if activation not in modes:
            usage_error("--activation", f"must be {' or '.join(modes)}, not {activation!r}")
        mode = ActivationMode(activation)
        host, port = check_host_port("--listen", listen)
        host = host.strip("[]")  # an IPv6 address binds without its brackets
        host = host or "127.0.0.1"
        # imported when the command runs (after the usage checks, before anything opens): the
        # command line loads no torch (board/cli.py)
        from weftboard.subscriber.engine_island import start_island

        configure(json=log_json)
        check_port_free("--listen", host, port)
        store: BlobStore | None = None
        try:
            store = blob_settings.open()
        except OSError as exc:  # a blob directory that cannot be made
            startup_error("sidecar did not start", exc)

        async def main() -> None:
            try:
                island = await start_island(
                    board=board, token=token, run=run, island_id=island_id, region=region, engine=engine,
                    engine_url=engine_url, checkpoint_dir=dir / "checkpoint", cache_dir=dir / "cache", mode=mode, host=host,
                    port=port, blob_store=store, default_deadline_s=deadline_ms / 1000.0, tls=tls_config,
                    engine_api_key=engine_api_key, scrub_interval_s=scrub_interval_s,
                )
            except (WeftboardError, OSError) as exc:  # start_island closed what it had opened; the store is ours
                if store is not None:
                    await store.close()
                if isinstance(exc, OSError):  # a directory that cannot be made, a port taken since the check
                    log.debug("sidecar could not start", exc_info=True)
                    startup_error("sidecar did not start", exc)
                typer.echo(f"sidecar did not start: {type(exc).__name__}: {exc}", err=True)
                raise typer.Exit(1) from None
            typer.echo(f"sidecar for run {run} serving on {island.url} (engine {engine}, activation {mode.value}; "
                       f"metrics at {island.url}/metrics)")
            await serve_until_stopped(island, run)

        tune_gc_for_serving()  # this process only serves the run
        asyncio.run(main())
