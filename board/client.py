"""Async client of the board, used by the publisher, the subscriber, the sidecar and the CLI.

Invariants:
- Every unary call carries an explicit deadline (``timeout_s``; consume adds its own
  ``block_ms``). Watch has no deadline: it lives until the caller stops iterating or
  cancels, and cancellation is honoured at once.
- gRPC failures surface as ``weftboard.proto.errors`` classes (``from_status_code``), so
  callers handle ``Aborted`` or ``OutOfRange`` without knowing about grpc; a failure to
  connect names the board's address and says when TLS failed (``channel.unavailable_message``).
- The channel comes from ``channel.open_channel``: plaintext, TLS or mutual TLS as the
  ``tls``/``tls_ca``/``tls_cert``/``tls_key``/``server_name`` options say.
- ``watch`` resumes after the last *version* it yielded when the board becomes
  unreachable (UNAVAILABLE, or a stream the server tore down on shutdown): nothing is
  missed and nothing is yielded twice, also across a board restart or a move to another
  replica (every replica serves the same runs from the same Redis).
- Several board replicas: ``address`` may list them (``"h1:p,h2:p"`` or a sequence). The
  client talks to one at a time; when it is unreachable a watch moves to the next one at
  once, and a unary call that could not connect is sent to the next one (a call that may
  have reached a board is never re-sent: it raises ``Unavailable`` and the next call goes
  elsewhere). One DNS name with several records needs no list: gRPC's resolver tries them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path

import grpc
import structlog

from weftboard.board.channel import (
    TlsConfig,
    client_tls,
    open_channel,
    unavailable_message,
)
from weftboard.proto.errors import (
    InvalidArgument,
    Unavailable,
    WeftboardError,
    from_status_code,
)
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.proto.v1 import board_pb2_grpc as pb_grpc

__all__ = ["BoardClient", "TlsConfig"]

log = structlog.get_logger(__name__)

# Status codes after which a watch stream is re-opened. A board that stops while the
# stream is open ends it with UNAVAILABLE (or CANCELLED: the client itself never cancels
# through an AioRpcError, it gets asyncio.CancelledError).
_RECONNECT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


def board_addresses(address: str | Sequence[str]) -> tuple[str, ...]:
    """The replicas' ``host:port`` addresses from ``"h1:p,h2:p"`` or a sequence of them."""
    items = address.split(",") if isinstance(address, str) else list(address)
    addresses = tuple(a.strip() for a in items if a and a.strip())
    if not addresses:
        raise InvalidArgument("no board address given")
    return addresses


def never_sent(exc: grpc.aio.AioRpcError) -> bool:
    """Whether an UNAVAILABLE means the call never reached a board (so re-sending it is safe)."""
    return (exc.details() or "").lower().startswith("failed to connect")


def _convert(exc: grpc.aio.AioRpcError, address: str, tls: TlsConfig | None) -> WeftboardError:
    details = exc.details() or exc.code().name
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        details = unavailable_message(address, tls, details)
    return from_status_code(exc.code().name, details)


class BoardClient:
    """Typed async methods per RPC of ``weftboard.v1.Board``; use ``async with``.

    ``address`` is ``host:port``, or several replicas' addresses (comma-separated or a
    sequence; the first is tried first). ``token`` is sent as ``authorization: Bearer <token>``.
    ``wait_for_ready=True`` makes unary calls wait (up to their timeout) for a board that
    is restarting instead of failing at once with ``Unavailable``.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        token: str | None = None,
        *,
        tls: TlsConfig | bool | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        server_name: str | None = None,
        timeout_s: float = 10.0,
        wait_for_ready: bool = False,
        options: Sequence[tuple[str, object]] = (),
    ) -> None:
        self.addresses = board_addresses(address)
        self.token = token
        self.tls = client_tls(tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, server_name=server_name)
        self.timeout_s = timeout_s
        self.wait_for_ready = wait_for_ready
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._options = [
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.keepalive_time_ms", 30_000),
            *options,
        ]
        self._index = 0
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._stubs: dict[int, pb_grpc.BoardStub] = {}

    @property
    def address(self) -> str:
        """The replica this client talks to now."""
        return self.addresses[self._index]

    @property
    def _stub(self) -> pb_grpc.BoardStub:
        """The stub of the current replica; its channel opens on first use."""
        index = self._index
        if index not in self._stubs:
            self._stubs[index] = pb_grpc.BoardStub(self.channel)
        return self._stubs[index]

    def _move_on(self, failed: int) -> bool:
        """After replica ``failed`` was unreachable, talk to the next one; False with one address."""
        if len(self.addresses) == 1:
            return False
        if self._index == failed:
            self._index = (failed + 1) % len(self.addresses)
            log.info("moving to another board replica", failed=self.addresses[failed], now=self.address)
        return True

    async def __aenter__(self) -> BoardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for channel in channels:
            await channel.close()

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel to the current replica (opened on first use)."""
        index = self._index
        if index not in self._channels:
            self._channels[index] = open_channel(self.addresses[index], self.tls, self._options)
        return self._channels[index]

    async def _call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        for attempt in range(len(self.addresses)):
            index = self._index
            try:
                return await getattr(self._stub, method)(
                    request,
                    metadata=self._metadata,
                    timeout=timeout_s or self.timeout_s,
                    wait_for_ready=self.wait_for_ready,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or not self._move_on(index):
                    raise _convert(exc, self.addresses[index], self.tls) from None
                if not never_sent(exc) or attempt == len(self.addresses) - 1:
                    raise _convert(exc, self.addresses[index], self.tls) from None
        raise AssertionError("unreachable")

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the channel connects (a board that is still starting)."""
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"board at {self.address} not reachable within {timeout_s}s") from None

    # -- runs -------------------------------------------------------------

    async def create_run(self, run: pb.Run) -> pb.Run:
        return await self._call("CreateRun", pb.CreateRunRequest(run=run))

    async def get_run(self, run: str) -> pb.Run:
        return await self._call("GetRun", pb.GetRunRequest(run=run))

    async def list_runs(self, page_size: int = 0, page_token: str = "") -> pb.ListRunsResponse:
        return await self._call("ListRuns", pb.ListRunsRequest(page_size=page_size, page_token=page_token))

    async def get_model_files(self, run: str, *, presign: bool = False) -> list[pb.BlobRef]:
        """The run's model files (config, tokenizer), with presigned GET URLs when asked for."""
        return list((await self._call("GetModelFiles", pb.GetModelFilesRequest(run=run, presign=presign))).files)

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

    async def start_upload(self, run: str, digest: str, size: int, part_bytes: int,
                           expires_s: int = 0) -> pb.StartUploadResponse:
        """Open a multipart upload of one blob; the response presigns a PUT URL per part."""
        return await self._call("StartUpload", pb.StartUploadRequest(run=run, digest=digest, size=size,
                                                                     part_bytes=part_bytes, expires_s=expires_s))

    async def presign_upload_parts(self, run: str, upload_id: str, part_numbers: Iterable[int],
                                   expires_s: int = 0) -> pb.PresignUploadPartsResponse:
        return await self._call("PresignUploadParts", pb.PresignUploadPartsRequest(
            run=run, upload_id=upload_id, part_numbers=list(part_numbers), expires_s=expires_s))

    async def complete_upload(self, run: str, upload_id: str, parts: Iterable[tuple[int, str]], *,
                              timeout_s: float | None = None) -> pb.CompleteUploadResponse:
        """Join the uploaded parts (``(part_number, etag)``, every part in order) into the blob.
        ``timeout_s``: a large blob may take the board longer than an ordinary call."""
        request = pb.CompleteUploadRequest(run=run, upload_id=upload_id,
                                           parts=[pb.UploadedPart(part_number=n, etag=e) for n, e in parts])
        return await self._call("CompleteUpload", request, timeout_s)

    async def abort_upload(self, run: str, upload_id: str) -> pb.AbortUploadResponse:
        return await self._call("AbortUpload", pb.AbortUploadRequest(run=run, upload_id=upload_id))

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
        presign: bool = False,
    ) -> AsyncIterator[pb.WatchEvent]:
        """Every version committed after ``after_version`` in order, plus Progress events
        (and, with ``staged_parts``, StagedPart hints for the version after the last one); with
        ``presign``, hints and live version events carry presigned GET URLs of their blobs.

        Reconnects with jittered exponential backoff when the board is unreachable,
        resuming after the last version yielded. Other errors (OUT_OF_RANGE below the
        retained history, NOT_FOUND, PERMISSION_DENIED) are raised.
        """
        last = after_version
        backoff = 0.05
        while True:
            index = self._index
            moved = False
            call = self._stub.Watch(
                pb.WatchRequest(run=run, after_version=last, progress_interval_ms=progress_interval_ms,
                                staged_parts=staged_parts, presign=presign),
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
                    raise _convert(exc, self.addresses[index], self.tls) from None
                log.info("watch reconnecting", run=run, after_version=last, code=exc.code().name, backoff_s=backoff,
                         error=unavailable_message(self.addresses[index], self.tls, exc.details() or ""))
                moved = self._move_on(index)
            finally:
                call.cancel()
            if moved and backoff <= 0.05:
                backoff *= 2  # the first try on another replica goes at once
                continue
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
