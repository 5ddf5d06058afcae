"""Async client of the board, used by the publisher, the subscriber, the sidecar and the CLI.

Invariants:
- Every unary call carries an explicit deadline (``timeout_s``; consume adds its own
  ``block_ms``). Watch has no deadline: it lives until the caller stops iterating or
  cancels, and cancellation is honoured at once.
- gRPC failures surface as ``weftboard.proto.errors`` classes (``from_status_code``), so
  callers handle ``Aborted`` or ``OutOfRange`` without knowing about grpc.
- ``watch`` resumes after the last *version* it yielded when the board becomes
  unreachable (UNAVAILABLE, or a stream the server tore down on shutdown): nothing is
  missed and nothing is yielded twice, also across a board restart.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from weftboard.proto.errors import Unavailable, WeftboardError, from_status_code
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.proto.v1 import board_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

# Status codes after which a watch stream is re-opened. A board that stops while the
# stream is open ends it with UNAVAILABLE (or CANCELLED: the client itself never cancels
# through an AioRpcError, it gets asyncio.CancelledError).
_RECONNECT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


@dataclass(frozen=True)
class TlsConfig:
    """Client-side TLS: the CA that signed the board's certificate, and for mutual TLS
    a client certificate and key. ``server_name`` overrides the name checked against the
    certificate (useful when dialing an IP address)."""

    root_cert: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_files(
        cls,
        root_cert: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        server_name: str | None = None,
    ) -> TlsConfig:
        read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
        return cls(read(root_cert), read(client_cert), read(client_key), server_name)


def _convert(exc: grpc.aio.AioRpcError) -> WeftboardError:
    return from_status_code(exc.code().name, exc.details() or exc.code().name)


class BoardClient:
    """Typed async methods per RPC of ``weftboard.v1.Board``; use ``async with``.

    ``address`` is ``host:port``. ``token`` is sent as ``authorization: Bearer <token>``.
    ``wait_for_ready=True`` makes unary calls wait (up to their timeout) for a board that
    is restarting instead of failing at once with ``Unavailable``.
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        tls: TlsConfig | None = None,
        timeout_s: float = 10.0,
        wait_for_ready: bool = False,
        options: Sequence[tuple[str, object]] = (),
    ) -> None:
        self.address = address
        self.token = token
        self.timeout_s = timeout_s
        self.wait_for_ready = wait_for_ready
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        opts: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.keepalive_time_ms", 30_000),
            *options,
        ]
        if tls is None:
            self._channel = grpc.aio.insecure_channel(address, options=opts)
        else:
            if tls.server_name:
                opts.append(("grpc.ssl_target_name_override", tls.server_name))
            creds = grpc.ssl_channel_credentials(tls.root_cert, tls.client_key, tls.client_cert)
            self._channel = grpc.aio.secure_channel(address, creds, options=opts)
        self._stub = pb_grpc.BoardStub(self._channel)

    async def __aenter__(self) -> BoardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel

    async def _call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        try:
            return await getattr(self._stub, method)(
                request,
                metadata=self._metadata,
                timeout=timeout_s or self.timeout_s,
                wait_for_ready=self.wait_for_ready,
            )
        except grpc.aio.AioRpcError as exc:
            raise _convert(exc) from None

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the channel connects (a board that is still starting)."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"board at {self.address} not reachable within {timeout_s}s") from None

    # -- runs -------------------------------------------------------------

    async def create_run(self, run: pb.Run) -> pb.Run:
        return await self._call("CreateRun", pb.CreateRunRequest(run=run))

    async def get_run(self, run: str) -> pb.Run:
        return await self._call("GetRun", pb.GetRunRequest(run=run))

    async def list_runs(self, page_size: int = 0, page_token: str = "") -> pb.ListRunsResponse:
        return await self._call("ListRuns", pb.ListRunsRequest(page_size=page_size, page_token=page_token))

    async def all_runs(self) -> list[pb.Run]:
        runs: list[pb.Run] = []
        token = ""
        while True:
            page = await self.list_runs(page_size=1000, page_token=token)
            runs.extend(page.runs)
            token = page.next_page_token
            if not token:
                return runs

    # -- publishing -------------------------------------------------------

    async def presign_upload(self, run: str, digest: str, size: int, expires_s: int = 0) -> pb.PresignUploadResponse:
        return await self._call(
            "PresignUpload", pb.PresignUploadRequest(run=run, digest=digest, size=size, expires_s=expires_s)
        )

    async def commit_version(self, record: pb.VersionRecord) -> pb.CommitVersionResponse:
        return await self._call("CommitVersion", pb.CommitVersionRequest(record=record))

    # -- reading ----------------------------------------------------------

    async def stage_part(self, run: str, version: int, blob: pb.BlobRef) -> pb.StagePartResponse:
        """Tell watching islands that a part of ``version``'s patch is uploaded (a hint)."""
        return await self._call("StagePart", pb.StagePartRequest(run=run, version=version, blob=blob))

    async def get_version(self, run: str, version: int) -> pb.VersionRecord:
        return await self._call("GetVersion", pb.GetVersionRequest(run=run, version=version))

    async def get_head(self, run: str) -> pb.Head:
        return await self._call("GetHead", pb.GetHeadRequest(run=run))

    async def list_versions(
        self, run: str, from_version: int = 0, to_version: int = 0, page_size: int = 0, page_token: str = ""
    ) -> pb.ListVersionsResponse:
        return await self._call(
            "ListVersions",
            pb.ListVersionsRequest(
                run=run, from_version=from_version, to_version=to_version, page_size=page_size, page_token=page_token
            ),
        )

    async def iter_versions(self, run: str, from_version: int = 0, to_version: int = 0) -> AsyncIterator[pb.VersionRecord]:
        """Every version in the range, following pages."""
        token = ""
        while True:
            page = await self.list_versions(run, from_version, to_version, page_size=1000, page_token=token)
            for record in page.versions:
                yield record
            token = page.next_page_token
            if not token:
                return

    async def watch(
        self,
        run: str,
        after_version: int = 0,
        *,
        progress_interval_ms: int = 0,
        reconnect: bool = True,
        max_backoff_s: float = 5.0,
        staged_parts: bool = False,
    ) -> AsyncIterator[pb.WatchEvent]:
        """Every version committed after ``after_version`` in order, plus Progress events
        (and, with ``staged_parts``, StagedPart hints for the version after the last one).

        Reconnects with jittered exponential backoff when the board is unreachable,
        resuming after the last version yielded. Other errors (OUT_OF_RANGE below the
        retained history, NOT_FOUND, PERMISSION_DENIED) are raised.
        """
        last = after_version
        backoff = 0.05
        while True:
            call = self._stub.Watch(
                pb.WatchRequest(run=run, after_version=last, progress_interval_ms=progress_interval_ms,
                                staged_parts=staged_parts),
                metadata=self._metadata,
            )
            try:
                async for event in call:
                    backoff = 0.05
                    if event.WhichOneof("event") == "version":
                        if event.version.version <= last:
                            continue  # never yield a version twice
                        last = event.version.version
                    yield event
                return  # the server ended the stream normally (it never does by design)
            except grpc.aio.AioRpcError as exc:
                if not reconnect or exc.code() not in _RECONNECT_CODES:
                    raise _convert(exc) from None
                log.info("watch reconnecting", run=run, after_version=last, code=exc.code().name, backoff_s=backoff)
            finally:
                call.cancel()
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, max_backoff_s)

    # -- catch-up and fleet -----------------------------------------------

    async def plan_catch_up(
        self, run: str, have_version: int = 0, want_version: int = 0, *, presign: bool = False, presign_expires_s: int = 0
    ) -> pb.CatchUpPlan:
        return await self._call(
            "PlanCatchUp",
            pb.PlanCatchUpRequest(
                run=run,
                have_version=have_version,
                want_version=want_version,
                presign=presign,
                presign_expires_s=presign_expires_s,
            ),
        )

    async def heartbeat(self, status: pb.IslandStatus, lease_s: int = 0) -> pb.HeartbeatResponse:
        return await self._call("Heartbeat", pb.HeartbeatRequest(status=status, lease_s=lease_s))

    async def list_islands(self, run: str) -> pb.ListIslandsResponse:
        return await self._call("ListIslands", pb.ListIslandsRequest(run=run))

    # -- trajectories -----------------------------------------------------

    async def report_trajectories(self, records: Iterable[pb.TrajectoryRecord]) -> pb.ReportTrajectoriesResponse:
        return await self._call("ReportTrajectories", pb.ReportTrajectoriesRequest(records=list(records)))

    async def consume_trajectories(
        self,
        run: str,
        group: str,
        consumer: str,
        *,
        max_records: int = 0,
        block_ms: int = 0,
        max_staleness: int | None = None,
        redeliver_after_ms: int = 0,
    ) -> pb.ConsumeTrajectoriesResponse:
        request = pb.ConsumeTrajectoriesRequest(
            run=run,
            group=group,
            consumer=consumer,
            max_records=max_records,
            block_ms=block_ms,
            redeliver_after_ms=redeliver_after_ms,
        )
        if max_staleness is not None:
            request.max_staleness = max_staleness
        return await self._call("ConsumeTrajectories", request, self.timeout_s + block_ms / 1000.0)

    async def ack_trajectories(self, run: str, group: str, ids: Iterable[str]) -> pb.AckTrajectoriesResponse:
        return await self._call("AckTrajectories", pb.AckTrajectoriesRequest(run=run, group=group, ids=list(ids)))

    # -- administration ---------------------------------------------------

    async def collect_garbage(self, run: str, *, dry_run: bool = False, keep_anchors: int = 0) -> pb.CollectGarbageResponse:
        return await self._call(
            "CollectGarbage", pb.CollectGarbageRequest(run=run, dry_run=dry_run, keep_anchors=keep_anchors)
        )

    async def create_token(self, name: str, role: int) -> pb.CreateTokenResponse:
        return await self._call("CreateToken", pb.CreateTokenRequest(name=name, role=role))

    async def revoke_token(self, token_id: str) -> pb.RevokeTokenResponse:
        return await self._call("RevokeToken", pb.RevokeTokenRequest(token_id=token_id))
