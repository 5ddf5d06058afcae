"""Start and stop a board process: gRPC server, Redis store, auth, metrics, health, reflection.

Used by ``weftboard serve``, the tests, the benchmark and the embedded demo.

Invariants:
- ``start_board`` returns only once Redis answered, the admin tokens are stored (hashed)
  and the server is bound; health reports SERVING from then on, NOT_SERVING during stop.
- Auth is on unless ``BoardConfig.auth`` is explicitly False (the embedded demo).
- ``RunningBoard.address`` is the ``host:port`` actually bound (``listen`` may say port 0).
- A local-directory blob store with ``blob_http_port`` set is served over signed, expiring
  HTTP URLs (``board/blob_http.py``) for as long as the board runs, so presigning works for
  it as for S3; ``RunningBoard.blob_url`` is that server's base URL.
- ``stop`` ends open Watch streams (clients resume by version on the next board) and
  releases every connection, thread and port the board took.
"""

from __future__ import annotations

import asyncio
import gc
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from weftboard.board.aio import within
from weftboard.board.auth import Authenticator
from weftboard.board.blob_http import BlobHttpServer
from weftboard.board.blobs import LocalDirBlobStore
from weftboard.board.fanout import FanOut
from weftboard.board.gc import DEFAULT_STAGED_GRACE_S
from weftboard.board.handlers import BoardServicer
from weftboard.board.logs import quiet_undelivered_responses
from weftboard.board.metrics import BoardMetrics
from weftboard.board.rpc_guard import add_board_to_server
from weftboard.board.store import RedisStore
from weftboard.proto.errors import InvalidArgument, PermissionDenied, Unavailable
from weftboard.proto.v1 import board_pb2 as pb

log = structlog.get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Board"].full_name


@dataclass
class BoardConfig:
    """Everything a board process needs. ``blob_store`` may instead be passed to ``start_board``."""

    listen: str = "127.0.0.1:0"
    redis_url: str = "redis://127.0.0.1:6379/0"  # or a cluster: redis+cluster://h:p,h:p (board/redis_conn.py)
    blob_store: Any = None
    admin_tokens: tuple[str, ...] = ()
    admin_token: str | None = None  # convenience: one more admin token
    auth: bool = True
    metrics_port: int | None = None  # None: no metrics endpoint; 0: a free port
    metrics_host: str = "127.0.0.1"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: mutual TLS, clients must present a cert it signed
    watch_progress_s: float = 5.0  # default Progress interval when a watcher asks for 0
    trajectory_maxlen: int = 1_000_000  # approximate cap of each run's trajectory stream; 0: no cap
    staged_grace_s: float = DEFAULT_STAGED_GRACE_S  # GC takes a never-committed version's leftovers after this
    redis_max_connections: int = 128
    # > 0: a commit answers only once this many Redis replicas acknowledged it (board/replica_ack.py)
    redis_min_replicas: int = 0
    redis_replica_timeout_ms: int = 1000
    islands_refresh_s: float = 15.0  # how often the islands-by-state gauge is refreshed
    health_check_s: float = 5.0  # how often Redis is pinged to keep the health status true
    # A local-directory blob store is served over signed HTTP URLs on this port (0: a free one;
    # None: not served, readers must share the filesystem), bound on ``blob_http_host`` (None:
    # the host of ``listen``); URLs carry ``blob_public_url`` when given (a proxy, a NAT).
    blob_http_port: int | None = None
    blob_http_host: str | None = None
    blob_public_url: str | None = None
    blob_url_secret: bytes | None = None  # None: a random one for this process

    def all_admin_tokens(self) -> tuple[str, ...]:
        return tuple(self.admin_tokens) + ((self.admin_token,) if self.admin_token else ())


@dataclass
class RunningBoard:
    address: str
    metrics_port: int | None
    config: BoardConfig
    server: grpc.aio.Server
    store: RedisStore
    metrics: BoardMetrics
    fanout: FanOut
    health: Any
    blob_http: BlobHttpServer | None = None
    blob_url: str | None = None  # the base URL of the blob HTTP server, when it runs
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _stopped: bool = False

    @property
    def admin_token(self) -> str | None:
        tokens = self.config.all_admin_tokens()
        return tokens[0] if tokens else None

    async def stop(self, grace: float = 1.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        feeds = self.fanout.cancel_all()
        await self.server.stop(grace)
        if self.blob_http is not None:
            await self.blob_http.stop()
        await self.store.close()  # closes the sockets a cancelled XREAD may still wait on
        pending = [t for t in (*self._tasks, *feeds) if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=5)
        await asyncio.to_thread(self.metrics.stop)
        log.info("board stopped", address=self.address)


def _server_credentials(config: BoardConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None and config.tls_key is None:
        if config.tls_client_ca is not None:
            raise InvalidArgument("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise InvalidArgument("TLS needs both tls_cert and tls_key")
    cert = Path(config.tls_cert).read_bytes()
    key = Path(config.tls_key).read_bytes()
    ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


async def _refresh_islands(servicer: BoardServicer, every_s: float) -> None:
    """Keep the islands-by-state gauge current for runs whose islands talk to this board."""
    while True:
        await asyncio.sleep(every_s)
        for run in list(servicer.heartbeat_runs):
            try:
                await servicer.island_infos(run)
            except Exception as exc:  # noqa: BLE001 - a metrics refresh must never kill the board
                log.warning("islands gauge refresh failed", run=run, error=str(exc))


async def _watch_redis(store: RedisStore, health_servicer: Any, every_s: float) -> None:
    """Health follows Redis: NOT_SERVING while it does not answer, SERVING again once it does."""
    serving = True
    while True:
        await asyncio.sleep(every_s)
        try:
            await within(store.ping(), every_s)
            ok = True
        except (Unavailable, PermissionDenied, asyncio.TimeoutError):
            ok = False
        if ok != serving:
            serving = ok
            status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)
            log.warning("health changed", serving=ok, redis=store.target.redacted)


SERVING_GC_THRESHOLDS = (20_000, 20, 20)


def tune_gc_for_serving() -> None:
    """For a process weftboard runs as a service of its own (``weftboard serve``, and an
    island's ``weftboard subscribe`` and ``sidecar``), called once its modules are imported:
    what exists now is frozen out of the collector's generations, and the youngest generation
    is collected every 20,000 allocations instead of 700.

    Why: with thousands of Watch streams, a commit puts thousands of write futures in flight at
    once; they outlive a young collection and push the collector into full passes over every
    stream's objects and every module, a fifth of a replica's CPU during fan-out. An island's
    downloads allocate as fast (chunks, events, futures) over a heap of torch, numba and grpc
    objects: collections took about a quarter of its CPU in ``bench sync --wan``
    (``cuda/PERFORMANCE.md``). Not for a host that embeds a board or a ``Subscriber`` in its
    own process (its collector is its own business)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


async def start_board(config: BoardConfig, *, blobs: Any = None) -> RunningBoard:
    blob_store = blobs if blobs is not None else config.blob_store
    if blob_store is None:
        raise InvalidArgument("BoardConfig.blob_store (or start_board(blobs=...)) is required")
    store = RedisStore(config.redis_url, max_connections=config.redis_max_connections,
                       min_replicas=config.redis_min_replicas, replica_timeout_ms=config.redis_replica_timeout_ms)
    try:
        await asyncio.wait_for(store.ping(), 10)
    except (asyncio.TimeoutError, Unavailable) as exc:
        await store.close()
        raise Unavailable(f"cannot start the board: Redis at {store.target.redacted} does not answer ({exc})") from None
    except PermissionDenied as exc:
        await store.close()
        raise PermissionDenied(f"cannot start the board: {exc}") from None
    auth = Authenticator(store, enabled=config.auth)
    if config.auth and not config.all_admin_tokens():
        log.warning("auth is on but no admin token is configured; only tokens already in Redis will work")
    try:
        await auth.bootstrap(config.all_admin_tokens())
    except BaseException:
        await store.close()
        raise

    metrics = BoardMetrics()
    fanout = FanOut(store)
    servicer = BoardServicer(
        store,
        blob_store,
        auth,
        metrics,
        fanout,
        trajectory_maxlen=config.trajectory_maxlen,
        default_progress_ms=max(int(config.watch_progress_s * 1000), 100),
        staged_grace_s=config.staged_grace_s,
    )
    quiet_undelivered_responses()  # a client's cancelled call is not the board's error
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.max_concurrent_streams", 100_000),
            ("grpc.so_reuseport", 0),  # a second board on a busy port must fail, not share it
            # Clients may ping (BoardClient: every 30 s), with or without calls, every 10 s at
            # most; the board's own keepalive pings idle connections too.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            # The board pings too, so a dead or stopped peer (a SIGSTOPped island, a partition)
            # is noticed within 80 s and its streams end, rather than wait in a write for hours.
            # Pings are not flow controlled: a stream stalled on a full window still gets them.
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
        ]
    )
    add_board_to_server(servicer, auth, metrics, store.target.redacted, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    creds = _server_credentials(config)
    try:
        port = server.add_secure_port(config.listen, creds) if creds else server.add_insecure_port(config.listen)
    except RuntimeError as exc:
        await store.close()
        raise Unavailable(f"cannot listen on {config.listen}: {exc}") from None
    if port == 0:
        await store.close()
        raise Unavailable(f"cannot listen on {config.listen} (address in use?)")
    host = config.listen.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    try:
        metrics_port = metrics.serve(config.metrics_port, config.metrics_host) if config.metrics_port is not None else None
    except OSError as exc:
        await server.stop(0)
        await store.close()
        raise Unavailable(f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {exc}") from None
    blob_http = None
    if isinstance(blob_store, LocalDirBlobStore) and config.blob_http_port is not None:
        blob_http = BlobHttpServer(blob_store, config.blob_url_secret or secrets.token_bytes(32),
                                   host=(config.blob_http_host or host).strip("[]"), port=config.blob_http_port,
                                   public_url=config.blob_public_url)
        try:
            await blob_http.start()
        except OSError as exc:
            await server.stop(0)
            await asyncio.to_thread(metrics.stop)
            await store.close()
            raise Unavailable(f"cannot serve blobs over HTTP on {blob_http.host}:{blob_http.port}: {exc}") from None
    running = RunningBoard(address, metrics_port, config, server, store, metrics, fanout, health_servicer,
                           blob_http=blob_http, blob_url=blob_store.signer.base_url if blob_http else None)
    running._tasks.append(asyncio.create_task(_refresh_islands(servicer, config.islands_refresh_s)))
    running._tasks.append(asyncio.create_task(_watch_redis(store, health_servicer, config.health_check_s)))
    log.info(
        "board serving",
        address=address,
        tls=creds is not None,
        mutual_tls=config.tls_client_ca is not None,
        auth=config.auth,
        metrics_port=metrics_port,
        blobs=blob_store.describe(),
        blob_url=running.blob_url,
    )
    return running
