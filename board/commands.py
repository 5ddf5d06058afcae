"""Board commands of the ``weftboard`` CLI: serve, history, status, fleet, token, gc, bench board.

``serve`` runs one board process (board/process.py). With no Redis URL it starts the
embedded default (a bundled ``redis-server`` with an append-only file under the data dir)
and with no S3 endpoint a local-directory blob store (or SeaweedFS with ``--embedded-s3``),
which the board serves itself over signed, expiring HTTP URLs (``--blob-http-port``), so
publishers and islands in other processes and on other machines need no credentials; it
prints everything it started and stops it all on SIGINT/SIGTERM, board first.

The other commands are clients: ``--board`` and ``--token`` (``WEFTBOARD_BOARD``,
``WEFTBOARD_TOKEN``). Without a token they use the admin token that an embedded board
stored in the data dir, so the quick start needs no copy-and-paste. They speak TLS with
``--tls-ca`` (or ``--tls`` for the system's roots), mutual TLS with ``--tls-cert``/``--tls-key``,
and check the board's certificate against ``--tls-server-name`` when given (``WEFTBOARD_TLS``,
``WEFTBOARD_TLS_CA``, ``WEFTBOARD_TLS_CLIENT_CERT``, ``WEFTBOARD_TLS_CLIENT_KEY``,
``WEFTBOARD_TLS_SERVER_NAME``); the island's ``subscribe`` and ``sidecar`` take the same flags.

Errors from the board print as one line naming the gRPC status and exit with code 1; a TLS
file that cannot be read prints one line naming it and exits 2. With ``--json`` a read
command prints one JSON document on stdout (``board/report.py`` names its keys) and logs
only to stderr.

``serve``'s process (embedded services, the start-up checks, the banner, the stop order) is
board/serving.py. It exits 2 with one line on what only a changed setting cures: a usage error
(naming the setting), Redis or S3 refusing the credentials, an admin token refused; and 1
with one line on what may pass (Redis or S3 not answering, a directory it cannot make, a
port taken), after stopping whatever it had started.

Usage errors of the island's commands print one line naming the option and exit 2
(``usage_error``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from enum import Enum
from pathlib import Path
from typing import Any, NoReturn

import structlog
import typer
from pydantic import ValidationError
from rich.console import Console

from weftboard.board.bench.bench_board import BenchParams, run_bench
from weftboard.board.bench.bench_replicas import ReplicaParams, run_replica_bench
from weftboard.board.channel import TlsConfig, client_tls
from weftboard.board.client import BoardClient
from weftboard.board.config import BoardSettings, split_host_port
from weftboard.board.config_file import environment_wins
from weftboard.board.defaults import ADMIN_TOKEN_FILE, DEFAULT_LISTEN, default_data_dir
from weftboard.board.logs import configure
from weftboard.board.report import (
    fleet_document,
    gc_document,
    history_document,
    history_table,
    human_bytes,
    islands_table,
    runs_document,
    runs_table,
    when,
)
from weftboard.board.serving import serve_until_signal
from weftboard.proto.errors import DeadlineExceeded, Unavailable, WeftboardError
from weftboard.proto.v1 import board_pb2 as pb

# Piped output (grep, CI logs) gets full-width lines instead of an 80-column squeeze.
out = Console(width=None if sys.stdout.isatty() else 240)
err = Console(stderr=True, soft_wrap=True)
log = structlog.get_logger("weftboard.commands")

BOARD_OPTION = typer.Option(DEFAULT_LISTEN, "--board", envvar="WEFTBOARD_BOARD", help="Board address host:port.")
TOKEN_OPTION = typer.Option(
    None, "--token", envvar="WEFTBOARD_TOKEN",
    help="Bearer token. Default: the admin token an embedded board stored in the data dir.",
)
TLS_PANEL = "TLS to the board"
# The client commands' TLS flags, in one group (``with_tls_flags``): name, annotation, option.
TLS_FLAGS: tuple[tuple[str, Any, Any], ...] = (
    ("tls", bool, typer.Option(False, "--tls", envvar="WEFTBOARD_TLS", rich_help_panel=TLS_PANEL,
                               help="TLS to the board with the system's CA roots (implied by --tls-ca).")),
    ("tls_ca", Path | None, typer.Option(None, "--tls-ca", envvar="WEFTBOARD_TLS_CA", rich_help_panel=TLS_PANEL,
                                         help="CA bundle (PEM) that signed the board's certificate: TLS.")),
    ("tls_cert", Path | None, typer.Option(None, "--tls-cert", envvar="WEFTBOARD_TLS_CLIENT_CERT",
                                           rich_help_panel=TLS_PANEL,
                                           help="Client certificate (PEM) for a board that requires mutual TLS.")),
    ("tls_key", Path | None, typer.Option(None, "--tls-key", envvar="WEFTBOARD_TLS_CLIENT_KEY",
                                          rich_help_panel=TLS_PANEL,
                                          help="Key (PEM) of the client certificate (mutual TLS).")),
    ("tls_server_name", str | None, typer.Option(
        None, "--tls-server-name", envvar="WEFTBOARD_TLS_SERVER_NAME", rich_help_panel=TLS_PANEL,
        help="Name to check the board's certificate against (default: the host dialled).")),
)


class RoleName(str, Enum):
    publisher = "publisher"
    island = "island"
    reader = "reader"
    admin = "admin"


# ---------------------------------------------------------------------------
# Client plumbing
# ---------------------------------------------------------------------------


def resolve_token(token: str | None) -> str | None:
    """An explicit token, else the embedded board's admin token from the data dir."""
    if token:
        return token
    path = default_data_dir() / ADMIN_TOKEN_FILE
    if path.is_file():
        try:
            return path.read_text().strip() or None
        except OSError:
            return None
    return None


def tls_from_flags(tls: bool, tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None,
                   tls_server_name: str | None) -> TlsConfig | None:
    """The ``--tls*`` flags as client TLS settings (None: plaintext); a file that cannot be
    read, or a certificate without its key, exits 2 with one line naming it."""
    try:
        return client_tls(tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, server_name=tls_server_name)
    except WeftboardError as exc:
        err.print(f"[red]error[/red]: {exc}", highlight=False)
        raise typer.Exit(2) from None


def usage_error(option: str, message: str) -> NoReturn:
    """A usage error: one line naming ``option`` on stderr, exit code 2 (as click's own)."""
    err.print(f"[red]error[/red]: {option}: {message}", highlight=False)
    raise typer.Exit(2)


def check_host_port(option: str, value: str) -> tuple[str, int]:
    """``value`` as (host, port) for ``option`` (host may be empty; port 0..65535), else a usage error."""
    try:
        return split_host_port(value)
    except ValueError as exc:
        usage_error(option, str(exc))


def startup_error(what: str, exc: OSError) -> NoReturn:
    """An ``OSError`` that stopped a command starting (a directory it cannot make, a port taken):
    one line naming the path or address, exit code 1."""
    where = f" {exc.filename}" if exc.filename else ""
    err.print(f"[red]{what}[/red]: {exc.strerror or exc}{':' if where else ''}{where}", highlight=False)
    raise typer.Exit(1)


def with_flag_group(param: str, flags: tuple[tuple[str, Any, Any], ...],
                    build: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator giving a command the flags ``flags`` (name, annotation, typer option each),
    which it receives as one keyword ``param``: ``build`` applied to the flags' values in that
    order. typer reads the command's parameters from the signature this gives the wrapper."""
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        kept = [p for p in signature.parameters.values() if p.name != param]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
                 for name, annotation, option in flags]

        @functools.wraps(command)
        def with_group(**kwargs: Any) -> Any:
            value = build(*(kwargs.pop(name) for name, _, _ in flags))
            return command(**{param: value}, **kwargs)

        exposed = signature.replace(parameters=[*kept, *added])
        with_group.__signature__ = exposed  # type: ignore[attr-defined]
        with_group.__annotations__ = {p.name: p.annotation for p in exposed.parameters.values()}
        return with_group

    return decorate


#: ``command`` with the ``--tls*`` flags (``TLS_FLAGS``: the same names and variables for every
#: client command), which it receives as one ``tls_config: TlsConfig | None`` (None: plaintext).
with_tls_flags = with_flag_group("tls_config", TLS_FLAGS, tls_from_flags)


def print_json(document: dict[str, Any]) -> None:
    """The one JSON document a ``--json`` command prints (logs go to stderr)."""
    print(json.dumps(document, indent=2), flush=True)


def run_client(board: str, token: str | None, body: Callable[[Any], Awaitable[int | None]],
               tls: TlsConfig | None = None) -> None:
    """Open a BoardClient, run ``body(client)``, map weftboard errors to exit code 1."""
    configure(level="WARNING")  # stdout is the command's output (tables, JSON); logs go to stderr

    async def main() -> int | None:
        async with BoardClient(board, resolve_token(token), tls=tls) as client:
            return await body(client)

    try:
        code = asyncio.run(main())
    except WeftboardError as exc:
        err.print(f"[red]error[/red] ({exc.grpc_code_name}) from board {board}: {exc}", markup=True, highlight=False)
        raise typer.Exit(1) from None
    raise typer.Exit(code or 0)


# ---------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------


def serve(
    ctx: typer.Context,
    listen: str | None = typer.Option(None, help=f"host:port to bind (env WEFTBOARD_LISTEN; default {DEFAULT_LISTEN})"),
    redis_url: str | None = typer.Option(None, help="Redis URL (env WEFTBOARD_REDIS_URL); unset starts an embedded redis-server"),
    redis_min_replicas: int | None = typer.Option(
        None, help="answer a commit once this many Redis replicas hold it (env WEFTBOARD_REDIS_MIN_REPLICAS; default 0)"),
    redis_replica_timeout_ms: int | None = typer.Option(
        None, help="how long a commit waits for them (env WEFTBOARD_REDIS_REPLICA_TIMEOUT_MS; default 1000)"),
    s3_endpoint: str | None = typer.Option(None, help="S3 endpoint host:port or URL (env WEFTBOARD_S3_ENDPOINT)"),
    s3_access_key: str | None = typer.Option(None, help="(env WEFTBOARD_S3_ACCESS_KEY)"),
    s3_secret_key: str | None = typer.Option(None, help="(env WEFTBOARD_S3_SECRET_KEY)"),
    s3_bucket: str | None = typer.Option(None, help="(env WEFTBOARD_S3_BUCKET; default weftboard)"),
    s3_secure: bool | None = typer.Option(None, "--s3-secure/--s3-insecure", help="HTTPS to S3 (env WEFTBOARD_S3_SECURE)"),
    s3_region: str | None = typer.Option(None, help="(env WEFTBOARD_S3_REGION)"),
    s3_prefix: str | None = typer.Option(None, help="key prefix inside the bucket (env WEFTBOARD_S3_PREFIX)"),
    embedded_s3: bool | None = typer.Option(None, "--embedded-s3/--no-embedded-s3",
                                               help="start a local SeaweedFS S3 server (env WEFTBOARD_EMBEDDED_S3)"),
    blob_dir: Path | None = typer.Option(None, help="local blob store root (env WEFTBOARD_BLOB_DIR)"),
    data_dir: Path | None = typer.Option(None, help="embedded Redis/S3 data and admin token (env WEFTBOARD_DATA_DIR)"),
    blob_http_port: int | None = typer.Option(None, help="port serving a local blob store over signed URLs; 0 picks "
                                                         "one, -1 none (env WEFTBOARD_BLOB_HTTP_PORT; default 0)"),
    blob_http_host: str | None = typer.Option(None, help="host it binds (env WEFTBOARD_BLOB_HTTP_HOST; default: "
                                                         "the host of --listen)"),
    blob_public_url: str | None = typer.Option(None, help="base URL others reach it at, e.g. behind a proxy "
                                                          "(env WEFTBOARD_BLOB_PUBLIC_URL)"),
    admin_token: str | None = typer.Option(None, help="admin token (env WEFTBOARD_ADMIN_TOKEN); unset: generated and stored in the data dir"),
    previous_admin_token: str | None = typer.Option(None, help="the admin token being rotated out, kept valid beside "
                                                                "--admin-token until a start without it (env "
                                                                "WEFTBOARD_PREVIOUS_ADMIN_TOKEN)"),
    auth: bool | None = typer.Option(None, "--auth/--no-auth", help="bearer-token auth (env WEFTBOARD_AUTH; default on)"),
    metrics_port: int | None = typer.Option(None, help="Prometheus port, 0 picks one (env WEFTBOARD_METRICS_PORT)"),
    metrics_host: str | None = typer.Option(None, help="(env WEFTBOARD_METRICS_HOST; default 127.0.0.1)"),
    tls_cert: Path | None = typer.Option(None, help="server certificate (env WEFTBOARD_TLS_CERT)"),
    tls_key: Path | None = typer.Option(None, help="server key (env WEFTBOARD_TLS_KEY)"),
    tls_client_ca: Path | None = typer.Option(None, help="CA for client certs: mutual TLS (env WEFTBOARD_TLS_CLIENT_CA)"),
    log_json: bool | None = typer.Option(None, "--log-json/--log-console", help="(env WEFTBOARD_LOG_JSON)"),
    log_level: str | None = typer.Option(None, help="(env WEFTBOARD_LOG_LEVEL; default INFO)"),
) -> None:
    """Run a board. With no Redis or S3 given it starts the embedded default and says so."""
    flags = {k: v for k, v in locals().items() if v is not None and k != "ctx"}  # flags win over WEFTBOARD_* env
    try:
        given = environment_wins(ctx, flags)
        settings = BoardSettings(**given)  # ... and it over the config file
    except ValidationError as exc:
        for e in exc.errors():
            err.print(f"[red]invalid setting[/red] {'.'.join(map(str, e['loc']))}: {e['msg']}")
        raise typer.Exit(2) from None
    configure(json=settings.log_json, level=settings.log_level)
    try:
        serve_until_signal(settings, token_source=admin_token_source(ctx, given))
    except WeftboardError as exc:
        err.print(f"[red]cannot serve[/red] ({exc.grpc_code_name}): {exc}", highlight=False)
        # 1: a service that may come back (a supervisor restarts the board); 2: what only a
        # changed setting cures (credentials refused, an admin token revoked or too short)
        raise typer.Exit(1 if isinstance(exc, (Unavailable, DeadlineExceeded)) else 2) from None
    except OSError as exc:
        log.debug("serve could not start", exc_info=True)
        startup_error("cannot serve", exc)
    except KeyboardInterrupt:
        pass


def admin_token_source(ctx: typer.Context, given: dict[str, Any]) -> str:
    """Where ``serve``'s admin token came from, for its banner: the flag, the config file or
    the environment (``given``: the settings taken from flags and the file)."""
    if "admin_token" in given:
        source = ctx.get_parameter_source("admin_token")
        return "the config file" if source is not None and source.name == "DEFAULT_MAP" else "--admin-token"
    if os.environ.get("WEFTBOARD_ADMIN_TOKEN"):
        return "WEFTBOARD_ADMIN_TOKEN"
    return "the environment"


# ---------------------------------------------------------------------------
# client commands
# ---------------------------------------------------------------------------


@with_tls_flags
def history(
    run: str = typer.Argument(..., help="Run name."),
    from_version: int = typer.Option(0, "--from", help="First version (0: oldest available)."),
    to_version: int = typer.Option(0, "--to", help="Last version (0: head)."),
    last: int = typer.Option(0, help="Only the newest N versions."),
    as_json: bool = typer.Option(False, "--json", help='One JSON document {"run", "versions": [record, ...]}.'),
    board: str = BOARD_OPTION,
    token: str | None = TOKEN_OPTION,
    tls_config: TlsConfig | None = None,  # the --tls* flags (with_tls_flags)
) -> None:
    """The versions of a run: step, parent, artifacts, patch/anchor bytes, density."""

    async def body(client: Any) -> None:
        start = from_version
        if last and not from_version:
            head = await client.get_head(run)
            start = max(1, head.version - last + 1, head.oldest_available)
        records = [r async for r in client.iter_versions(run, start, to_version)]
        if as_json:
            print_json(history_document(run, records))
            return
        out.print(history_table(run, records))
        if not records:
            out.print("(no versions in that range)")

    run_client(board, token, body, tls_config)


@with_tls_flags
def status(
    run: str | None = typer.Argument(None, help="Run name; without it, every run's head."),
    as_json: bool = typer.Option(False, "--json", help='One JSON document: {"runs": [...]}, or with RUN the '
                                                       "fleet document (as 'fleet --json')."),
    board: str = BOARD_OPTION,
    token: str | None = TOKEN_OPTION,
    tls_config: TlsConfig | None = None,  # the --tls* flags (with_tls_flags)
) -> None:
    """Head and fleet: each island's version, lag behind the head, state and lease."""

    async def body(client: Any) -> None:
        if run is None:
            runs = await client.all_runs()
            if as_json:
                print_json(runs_document(runs))
            else:
                out.print(runs_table(runs))
            return
        await print_fleet(client, run, as_json, with_head_line=True)

    run_client(board, token, body, tls_config)


async def print_fleet(client: Any, run: str, as_json: bool, *, with_head_line: bool) -> None:
    """The run's head and islands, as a table (after a head line) or as the fleet document."""
    head = await client.get_head(run)
    islands = await client.list_islands(run)
    if as_json:
        print_json(fleet_document(run, head, islands))
        return
    if with_head_line:
        out.print(
            f"[bold]{run}[/bold]: head {head.version} (committed {when(head.committed_at_ms)} UTC), "
            f"oldest available {head.oldest_available or '-'}"
        )
    out.print(islands_table(run, islands))


@with_tls_flags
def fleet(
    run: str = typer.Argument(..., help="Run name."),
    as_json: bool = typer.Option(False, "--json", help='One JSON document {"run", "head", ..., "islands": [...]}.'),
    board: str = BOARD_OPTION,
    token: str | None = TOKEN_OPTION,
    tls_config: TlsConfig | None = None,  # the --tls* flags (with_tls_flags)
) -> None:
    """The islands following a run: version, lag, state, capacity, last heartbeat, lease."""

    async def body(client: Any) -> None:
        await print_fleet(client, run, as_json, with_head_line=False)

    run_client(board, token, body, tls_config)


@with_tls_flags
def gc(
    run: str = typer.Argument(..., help="Run name."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only show what would be deleted."),
    keep_anchors: int = typer.Option(0, help="Newest anchors to keep (0: the run's retention policy)."),
    as_json: bool = typer.Option(False, "--json", help='One JSON document {"run", "dry_run", "deleted_keys", '
                                                       '"deleted_blobs", "freed_bytes", "oldest_available", '
                                                       '"staged_parts_collected", "abandoned_blobs_collected"}.'),
    board: str = BOARD_OPTION,
    token: str | None = TOKEN_OPTION,
    tls_config: TlsConfig | None = None,  # the --tls* flags (with_tls_flags)
) -> None:
    """Delete blobs no live island and no kept anchor needs, and staged parts no commit named (admin)."""

    async def body(client: Any) -> None:
        response = await client.collect_garbage(run, dry_run=dry_run, keep_anchors=keep_anchors)
        if as_json:
            print_json(gc_document(run, dry_run, response))
            return
        verb = "would delete" if dry_run else "deleted"
        out.print(
            f"{verb} {len(response.deleted_keys)} blobs, {human_bytes(response.freed_bytes)} "
            f"({response.freed_bytes} bytes); oldest available version {'would be' if dry_run else 'is'} "
            f"{response.oldest_available}; staged parts {response.staged_parts_collected}, abandoned blobs "
            f"{response.abandoned_blobs_collected} (of versions never committed or committed without them)"
        )
        for key in response.deleted_keys:
            out.print(f"  {key}", highlight=False)

    run_client(board, token, body, tls_config)


@with_tls_flags
def token_create(
    name: str = typer.Argument(..., help="A label for the token (who holds it)."),
    role: RoleName = typer.Option(..., help="publisher, island, reader or admin."),
    board: str = BOARD_OPTION,
    token: str | None = TOKEN_OPTION,
    tls_config: TlsConfig | None = None,  # the --tls* flags (with_tls_flags)
) -> None:
    """Create a token (admin). The token is printed once; the board keeps only its hash."""

    async def body(client: Any) -> None:
        response = await client.create_token(name, pb.Role.Value(f"ROLE_{role.value.upper()}"))
        out.print(f"token id: {response.token_id}", highlight=False)
        out.print(f"token:    {response.token}", highlight=False)
        out.print("(shown once; revoke with: weftboard token revoke " + response.token_id + ")", highlight=False)

    run_client(board, token, body, tls_config)


@with_tls_flags
def token_revoke(
    token_id: str = typer.Argument(..., help="The token id printed by 'token create'."),
    board: str = BOARD_OPTION,
    token: str | None = TOKEN_OPTION,
    tls_config: TlsConfig | None = None,  # the --tls* flags (with_tls_flags)
) -> None:
    """Revoke a token (admin); it stops working at once on this board, within seconds on others."""

    async def body(client: Any) -> None:
        if (await client.revoke_token(token_id)).was_stored:
            out.print(f"revoked {token_id}", highlight=False)
        else:  # a bootstrap id: retired for good all the same
            out.print(f"no token was stored under {token_id} (retired by a later start, never configured, or "
                      "mistyped); the id is retired for good: no start stores it again", highlight=False)

    run_client(board, token, body, tls_config)


def bench_board(
    watchers: int = typer.Option(0, help="Concurrent Watch streams (0: 1,000; 4,000 with --replicas)."),
    commits: int = typer.Option(0, help="Versions committed while everyone watches (0: 30; 40 with --replicas)."),
    channels: int = typer.Option(8, help="gRPC channels the watch streams share."),
    reporters: int = typer.Option(8, help="Concurrent trajectory reporters."),
    traj_seconds: float = typer.Option(5.0, help="How long the trajectory reporters run."),
    batch: int = typer.Option(500, help="Trajectory records per ReportTrajectories call."),
    replicas: int = typer.Option(0, help="Board replicas on a Redis Cluster, one killed mid-run (0: one board)."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line (always printed last)."),
) -> None:
    """Board fan-out and ingest: 1,000 watchers, commit-to-delivery p50/p99, trajectories/s;
    with --replicas, watchers spread over replicas on a Redis Cluster and one replica killed."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: stop every server it started
    if replicas:
        replica_params = ReplicaParams(replicas=replicas, watchers=watchers or 4000, commits=commits or 40)
        result = run_replica_bench(replica_params, log=lambda line: print(line, flush=True))
    else:
        params = BenchParams(watchers=watchers or 1000, commits=commits or 30, channels=channels,
                             reporters=reporters, traj_seconds=traj_seconds, batch=batch)
        result = run_bench(params, log=lambda line: print(line, flush=True))
    if as_json:
        print(json.dumps(result), flush=True)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    app.command()(serve)
    app.command()(history)
    app.command()(status)
    app.command()(fleet)
    app.command()(gc)
    tokens = typer.Typer(help="Create and revoke bearer tokens (admin).", no_args_is_help=True)
    tokens.command("create")(token_create)
    tokens.command("revoke")(token_revoke)
    app.add_typer(tokens, name="token")
    bench.command("board")(bench_board)
