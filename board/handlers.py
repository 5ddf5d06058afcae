"""The ``weftboard.v1.Board`` gRPC servicer (grpc.aio): what each RPC does.

Auth, error-to-status mapping, metrics and log context are not here: ``rpc_guard``
wraps every method (the one place for them). Methods raise ``weftboard.proto.errors``.
Wire messages become domain types (``proto.convert``) where a domain rule is applied.

Invariants:
- CommitVersion checks the record (``validate``) and every blob it names *before* the
  Lua compare-and-set; the blob store is not in Redis, and the CAS is the only writer.
  The precheck and the CAS's result are both decided by ``proto.commit.decide_commit``
  (the commit rule, and the status of each refusal, are stated there).
- Watch sends history from XRANGE, then live events from the run's shared feed, never
  a version twice and never with a gap (see fanout.py). Staged-part hints go only to
  watchers that asked, and only for versions after the last one sent. A watcher that asked
  for presigned URLs gets them in its hints and live version events (``signed_events``).
- StagePart checks the part exists (so an island's download finds it), notes it and relays
  the hint; an anchor file (a named blob) is only noted, so GC collects it if its version
  commits without it. A commit checks every blob it names, taking a note younger than
  ``CHECKED_TTL_S`` for a part instead of asking the store again: keys are content
  addressed, so a blob never changes, and GC deletes only keys of collected versions, never
  a staged part. The note itself stays until a commit of its version or a later one settles
  it (named, or an orphan for GC), however long the publisher takes to get there.
- A run's model files are fixed at CreateRun; version 1 commits only once they are in the
  blob store, and GC keeps them (``model_files``).
- Nothing here blocks the event loop: Redis and the blob store are awaited.
- The blob store refusing the board's own credentials is UNAVAILABLE to the caller, naming
  the operator's fix (``BoardsOwnBlobs``): PERMISSION_DENIED would read as the caller's token.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import structlog

from weftboard.board import gc as gcmod
from weftboard.board import model_files, validate
from weftboard.board.auth import Authenticator
from weftboard.board.fanout import TICK, FanOut, StagedEvent
from weftboard.board.metrics import BoardMetrics
from weftboard.board.signed_events import SignedEvents
from weftboard.board.store import RedisStore, canonical_record, now_ms
from weftboard.board.uploads import UploadRpcs
from weftboard.proto import convert
from weftboard.proto.commit import (
    COMMIT_ERRORS,
    CommitOutcome,
    Found,
    commit_error,
    decide_commit,
    outcome_of_store,
)
from weftboard.proto.constraints import lag
from weftboard.proto.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    Unavailable,
)
from weftboard.proto.limits import MAX_TRAJECTORY_BATCH
from weftboard.proto.names import blob_key, check_digest, check_name
from weftboard.proto.plans import StepKind, VersionArtifacts, needs_older, plan_catch_up
from weftboard.proto.records import ArtifactKind, VersionRecord
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.proto.v1 import board_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

MAX_PAGE_BYTES = 16 << 20  # a ListVersions page ends before this many bytes of records (the limit is 64 MiB)
CONSUME_CHUNK = 100  # trajectories read per XREADGROUP: a reply ends within MAX_PAGE_BYTES + 100 records
PLAN_INDEX_CHUNK = 256  # PlanCatchUp's index reads, from the target down: a chunk or two near the head
MAX_PRESIGN_S = 3600
DEFAULT_PRESIGN_S = 900
MAX_BLOCK_MS = 60_000
EXPIRED_VISIBLE_MS = 3_600_000

class BoardsOwnBlobs:
    """The board's blob store, as the servicer calls it with the board's credentials."""

    def __init__(self, blobs: Any) -> None:
        self._blobs = blobs

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._blobs, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr

        @functools.wraps(attr)
        async def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return await attr(*args, **kwargs)
            except PermissionDenied as exc:
                raise Unavailable(f"the board's blob store refused the board's own credentials ({exc}); the "
                                  "board's operator must fix its blob store settings; retry later") from None

        return call


class BoardServicer(UploadRpcs, pb_grpc.BoardServicer):  # multipart uploads: uploads.py
    def __init__(
        self,
        store: RedisStore,
        blobs: Any,
        auth: Authenticator,
        metrics: BoardMetrics,
        fanout: FanOut,
        *,
        trajectory_maxlen: int = 1_000_000,
        default_progress_ms: int = 5000,
        staged_grace_s: float = gcmod.DEFAULT_STAGED_GRACE_S,
    ) -> None:
        self.store = store
        self.blobs = BoardsOwnBlobs(blobs)
        self.signed_events = SignedEvents(self.blobs, DEFAULT_PRESIGN_S)  # one signing an event for every watcher
        self.auth = auth
        self.metrics = metrics
        self.fanout = fanout
        self.trajectory_maxlen = trajectory_maxlen
        self.default_progress_ms = default_progress_ms
        self.staged_grace_s = staged_grace_s  # GC takes a never-committed version's leftovers after this
        self.heartbeat_runs: set[str] = set()

    # -- runs -------------------------------------------------------------

    async def CreateRun(self, request: pb.CreateRunRequest, context) -> pb.Run:
        run = pb.Run()
        run.CopyFrom(request.run)
        validate.check_run(run)
        model_files.canonicalize(run)
        run.created_at_ms = now_ms()
        stored, created = await self.store.create_run(run)
        if not created:
            if not validate.same_definition(stored, run):
                raise AlreadyExists(
                    f"run {run.run!r} exists with a different kind, served format or layout; "
                    "pick another run name"
                )
            if difference := validate.model_files_changed(stored, run):
                raise AlreadyExists(f"run {run.run!r} exists with other model files: {difference}; a run's model "
                                    "files are fixed when it is created: pick another run name")
            return await self.store.get_run(run.run)
        log.info("run created", tensors=len(run.layout.tensors))
        return stored

    async def GetRun(self, request: pb.GetRunRequest, context) -> pb.Run:
        check_name("run", request.run)
        return await self.store.get_run(request.run)

    async def ListRuns(self, request: pb.ListRunsRequest, context) -> pb.ListRunsResponse:
        size = validate.page_size(request.page_size)
        if request.page_token:
            check_name("page_token", request.page_token)
        names = await self.store.list_runs(request.page_token, size + 1)
        more = len(names) > size
        names = names[:size]
        runs = await asyncio.gather(*(self.store.get_run(n) for n in names))
        return pb.ListRunsResponse(runs=runs, next_page_token=names[-1] if more else "")

    async def GetModelFiles(self, request: pb.GetModelFilesRequest, context) -> pb.ModelFiles:
        run = await self._run_and_state(request.run)
        if not request.presign:
            return pb.ModelFiles(files=run.model_files)
        expires = request.presign_expires_s or DEFAULT_PRESIGN_S
        if expires > MAX_PRESIGN_S:
            raise InvalidArgument(f"presign_expires_s {expires} is too long; at most {MAX_PRESIGN_S}")
        return pb.ModelFiles(files=await model_files.presigned(self.blobs, run, expires))

    # -- publishing -------------------------------------------------------

    async def PresignUpload(self, request: pb.PresignUploadRequest, context) -> pb.PresignUploadResponse:
        check_name("run", request.run)
        check_digest("digest", request.digest)
        expires = request.expires_s or DEFAULT_PRESIGN_S
        if expires > MAX_PRESIGN_S:
            raise InvalidArgument(f"expires_s {expires} is too long; at most {MAX_PRESIGN_S}")
        await self.store.get_run(request.run)
        key = blob_key(request.run, request.digest)
        url = await self.blobs.presign_put(key, expires, size=request.size)
        if url is None:
            raise FailedPrecondition(
                f"the blob store ({self.blobs.describe()}) cannot presign URLs; upload with its credentials instead"
            )
        return pb.PresignUploadResponse(key=key, url=url, expires_at_ms=now_ms() + expires * 1000)

    async def _check_blobs(self, record: pb.VersionRecord) -> None:
        refs = [b for a in record.artifacts for b in a.blobs]
        checked = await self.store.checked_sizes(record.run, [b.key for b in refs])
        refs = [b for b in refs if checked.get(b.key) != b.size]  # staged parts were found moments ago
        sizes = await asyncio.gather(*(self.blobs.stat(b.key) for b in refs))
        for ref, size in zip(refs, sizes, strict=True):
            if size is None:
                raise FailedPrecondition(
                    f"blob {ref.key!r} does not exist in {self.blobs.describe()}; upload it before committing"
                )
            if size != ref.size:
                raise FailedPrecondition(
                    f"blob {ref.key!r} has {size} bytes but the record declares {ref.size}; re-upload it"
                )

    async def _settle_staged(self, record: pb.VersionRecord) -> None:
        """The committed ``record``'s staged parts need no check any more, and the parts staged
        for its version that it does not name are orphans (GC deletes them)."""
        orphaned = await self.store.settle_staged(record.run, record.version,
                                                  [b.key for a in record.artifacts for b in a.blobs])
        if orphaned:
            log.info("staged parts no record names; garbage collection deletes them", orphaned=orphaned)

    async def CommitVersion(self, request: pb.CommitVersionRequest, context) -> pb.CommitVersionResponse:
        record = request.record
        check_name("record.run", record.run)
        structlog.contextvars.bind_contextvars(version=record.version)
        run = await self.store.get_run(record.run)
        validate.check_record(record, run)
        # Cheap checks first: a retry or a lost race needs no blob-store round trips.
        existing = await self.store.existing_record(record.run, record.version)
        found = (Found.NOTHING if existing is None
                 else Found.SAME if existing == canonical_record(record) else Found.DIFFERENT)
        outcome = decide_commit(record.version, run.head, run.head, found)
        if outcome is CommitOutcome.ALREADY_COMMITTED:
            stored = (await self.store.get_versions(record.run, [record.version]))[record.version]
            await self.store.await_replicas(record.run)  # a retry after a replica shortfall answers once they have it
            await self._settle_staged(stored)  # a retry: the first attempt's answer may have been lost
            return pb.CommitVersionResponse(record=stored, already_committed=True,  # and, as a first answer would:
                                            staged_parts_wanted=await self.store.staged_feeds(record.run) > 0)
        if outcome in COMMIT_ERRORS:
            raise commit_error(outcome, record.run, record.version, run.head)
        await self._check_blobs(record)
        if record.version == 1:  # an island that sees a version finds the run's model files too
            await model_files.check_stored(self.blobs, run)
        report, hint_feeds = await asyncio.gather(self.store.commit(record), self.store.staged_feeds(record.run))
        outcome = outcome_of_store(record.version, run.head, report)
        if outcome in COMMIT_ERRORS:
            raise commit_error(outcome, record.run, record.version, report.head)
        stored = pb.VersionRecord()
        stored.CopyFrom(record)
        stored.committed_at_ms = report.committed_at_ms
        await self._settle_staged(stored)  # committed now, or by a retry's first attempt
        if outcome is CommitOutcome.COMMITTED:
            self.metrics.record_commit(stored)
            log.info("version committed", artifacts=len(record.artifacts))
        return pb.CommitVersionResponse(record=stored, already_committed=outcome is CommitOutcome.ALREADY_COMMITTED,
                                        staged_parts_wanted=hint_feeds > 0)

    async def StagePart(self, request: pb.StagePartRequest, context) -> pb.StagePartResponse:
        check_name("run", request.run)
        run = await self._run_and_state(request.run)
        blob = request.blob
        anchor_file = bool(blob.name)  # noted for GC only: islands take patch parts, never anchor files
        if request.version <= run.head or (request.version < 2 and not anchor_file):
            raise FailedPrecondition(
                f"version {request.version} of run {request.run!r} cannot stage "
                f"{'an anchor file' if anchor_file else 'a patch part'}: the head is "
                f"{run.head}, so only versions after it are being published"
                + (" (and version 1 is an anchor, not a patch)" if request.version < 2 else "")
            )
        validate.check_blob_ref("blob", request.run, blob)
        if blob.size <= 0 or blob.url or (anchor_file and not blob.name.endswith(".safetensors")):
            raise InvalidArgument("a staged part has a positive size and no url; a named one is an anchor "
                                  "file (*.safetensors)")
        size = await self.blobs.stat(blob.key)
        if size != blob.size:
            raise FailedPrecondition(
                f"blob {blob.key!r} " + ("does not exist" if size is None else f"has {size} bytes, not {blob.size}")
                + f" in {self.blobs.describe()}; upload it before staging it"
            )
        staged = pb.StagedPart(version=request.version, base_version=request.version - 1,
                               blob=pb.BlobRef(key=blob.key, digest=blob.digest, size=blob.size))
        await self.store.publish_staged(request.run, request.version, blob.key, blob.size,
                                        None if anchor_file else pb.WatchEvent(staged=staged).SerializeToString())
        return pb.StagePartResponse(head=run.head)

    # -- reading ----------------------------------------------------------

    async def _run_and_state(self, run: str) -> pb.Run:
        check_name("run", run)
        return await self.store.get_run(run)

    async def GetVersion(self, request: pb.GetVersionRequest, context) -> pb.VersionRecord:
        run = await self._run_and_state(request.run)
        structlog.contextvars.bind_contextvars(version=request.version)
        if request.version < 1:
            raise InvalidArgument("version must be >= 1")
        if request.version > run.head:
            raise NotFound(f"version {request.version} of run {request.run!r} does not exist; the head is {run.head}")
        if request.version < run.oldest_available:
            raise OutOfRange(
                f"version {request.version} of run {request.run!r} was garbage collected; "
                f"the oldest available version is {run.oldest_available}"
            )
        found = await self.store.get_versions(request.run, [request.version])
        if request.version not in found:
            raise NotFound(f"version {request.version} of run {request.run!r} does not exist")
        return found[request.version]

    async def GetHead(self, request: pb.GetHeadRequest, context) -> pb.Head:
        check_name("run", request.run)
        await self.store.get_run(request.run)
        state = await self.store.run_state(request.run)
        return pb.Head(
            run=request.run, version=state.head, committed_at_ms=state.committed_at_ms, oldest_available=state.oldest
        )

    async def ListVersions(self, request: pb.ListVersionsRequest, context) -> pb.ListVersionsResponse:
        run = await self._run_and_state(request.run)
        size = validate.page_size(request.page_size)
        oldest = max(run.oldest_available, 1)
        first = request.from_version or oldest
        last = request.to_version or run.head
        if request.from_version and request.from_version < run.oldest_available:
            raise OutOfRange(
                f"from_version {request.from_version} was garbage collected; the oldest available version is {oldest}"
            )
        if request.to_version and request.from_version > request.to_version:
            raise InvalidArgument(f"from_version {request.from_version} is after to_version {request.to_version}")
        last = min(last, run.head)
        if request.page_token:
            try:
                first = int(request.page_token)
            except ValueError:
                raise InvalidArgument(f"page_token {request.page_token!r} is not one this board returned") from None
            if first < oldest:
                raise OutOfRange(f"page_token points below the oldest available version {oldest}; list again")
        if first > last:
            return pb.ListVersionsResponse()
        upto = min(last, first + size - 1)
        found = await self.store.get_versions(request.run, list(range(first, upto + 1)))
        versions: list[pb.VersionRecord] = []
        nbytes = 0
        for v in (v for v in range(first, upto + 1) if v in found):
            nbytes += found[v].ByteSize()
            if versions and nbytes > MAX_PAGE_BYTES:  # records of many tensors
                upto = v - 1  # a shorter page, well inside the message limit
                break
            versions.append(found[v])
        return pb.ListVersionsResponse(versions=versions, next_page_token=str(upto + 1) if upto < last else "")

    async def Watch(self, request: pb.WatchRequest, context) -> None:
        """Writes WatchEvent messages, or the feed's pre-serialized WatchEvent bytes (rpc_guard
        registers a serializer that passes bytes through), from a coroutine calling ``context.write``:
        with a thousand streams, every layer of async-generator resumption per event shows up."""
        write = context.write
        run = await self._run_and_state(request.run)
        interval_ms = request.progress_interval_ms or self.default_progress_ms
        if request.progress_interval_ms and request.progress_interval_ms < 100:
            raise InvalidArgument(f"progress_interval_ms {request.progress_interval_ms} is below the minimum of 100")
        oldest = run.oldest_available
        after = request.after_version
        if after == 0:
            after = max(oldest - 1, 0)
        elif oldest and after + 1 < oldest:
            raise OutOfRange(
                f"after_version {after} is below the retained history of run {request.run!r}: "
                f"the oldest available version is {oldest}; catch up from an anchor with PlanCatchUp"
            )
        if after > run.head:
            raise OutOfRange(f"after_version {after} is beyond the head ({run.head}) of run {request.run!r}")
        sub = await self.fanout.subscribe(request.run, interval_ms / 1000.0, staged=request.staged_parts)
        self.metrics.watch_streams.inc()
        last = after
        try:
            # History first (everything up to the feed's cursor is visible to XRANGE now).
            last = await self._replay(request.run, last, None, write)
            sub.wrote()
            while True:
                item = await sub.queue.get()
                if item is TICK:
                    sub.tick_pending = False
                    if sub.head > last:  # defence in depth: never sit idle behind the head
                        last = await self._replay(request.run, last, sub.head, write)
                    progress = pb.Progress(head=max(sub.head, last), server_time_ms=now_ms())
                    await write(pb.WatchEvent(progress=progress))
                elif isinstance(item, BaseException):
                    raise Unavailable(f"the board lost its Redis feed for run {request.run!r}; reconnect and resume")
                elif isinstance(item, StagedEvent):
                    if item.version > last:  # never a hint for a version this stream has sent
                        await write(await self.signed_events.event(item.payload) if request.presign else item.payload)
                elif item.version <= last:
                    continue
                elif item.version > last + 1:  # fill a hole from the durable log
                    last = await self._replay(request.run, last, item.version, write)
                else:  # serialized once by the feed for every watcher (and signed once for those asking)
                    await write(await self.signed_events.event(item.payload) if request.presign else item.payload)
                    last = item.version
                sub.wrote()
        finally:
            self.metrics.watch_streams.dec()
            self.fanout.unsubscribe(sub)

    async def _replay(self, run: str, last: int, upto: int | None, write) -> int:
        """Write versions after ``last`` (up to ``upto``, or all) from the durable log, each the
        one after the last written: GC may trim the log while a long replay waits on a slow
        client, and a stream that skipped the versions it trimmed would break its no-gap promise."""
        while upto is None or last < upto:
            count = 500 if upto is None else min(500, upto - last)
            batch = await self.store.events_after(run, last, count=count)
            for record in batch:
                if record.version != last + 1:
                    raise OutOfRange(
                        f"version {last + 1} of run {run!r} was garbage collected while this stream replayed it; "
                        f"the oldest available version is {record.version}; catch up from an anchor with PlanCatchUp"
                    )
                await write(pb.WatchEvent(version=record))
                last = record.version
            if len(batch) < count:
                break
        return last

    # -- catch-up ---------------------------------------------------------

    async def PlanCatchUp(self, request: pb.PlanCatchUpRequest, context) -> pb.CatchUpPlan:
        run = await self._run_and_state(request.run)
        expires = request.presign_expires_s or DEFAULT_PRESIGN_S
        if expires > MAX_PRESIGN_S:
            raise InvalidArgument(f"presign_expires_s {expires} is too long; at most {MAX_PRESIGN_S}")
        oldest = max(run.oldest_available, 1)
        target = request.want_version or run.head
        records: dict[int, VersionRecord] = {}
        artifacts: dict[int, VersionArtifacts] = {}
        hi = target if run.head and oldest <= target <= run.head else 0
        while hi >= oldest:  # from the target down, until no older start can be the cheapest
            lo = max(oldest, hi - PLAN_INDEX_CHUNK + 1)
            index = await self.store.get_index(request.run, lo, hi)
            records.update((v, convert.record_from_pb(rec)) for v, rec in index.items())
            artifacts.update((v, records[v].sizes()) for v in index)
            hi = lo - 1
            if not needs_older(request.have_version, target, artifacts, lo):
                break
        plan = plan_catch_up(request.have_version, request.want_version, run.head, oldest, artifacts)
        steps = []
        for step in plan.steps:
            rec = records[step.to_version]
            kind = ArtifactKind.ANCHOR if step.kind is StepKind.ANCHOR else ArtifactKind.PATCH
            blobs = [pb.BlobRef(key=b.key, digest=b.digest, size=b.size, name=b.name)
                     for a in rec.artifacts if a.kind is kind for b in a.blobs]
            steps.append(pb.PlanStep(kind=convert.step_artifact_kind(step.kind), from_version=step.from_version,
                                     to_version=step.to_version, blobs=blobs, root_digest=rec.root_digest))
        if request.presign:
            refs = [b for s in steps for b in s.blobs]
            urls = await asyncio.gather(*(self.blobs.presign_get(b.key, expires) for b in refs))
            for ref, url in zip(refs, urls, strict=True):
                ref.url = url or ""
        return pb.CatchUpPlan(run=request.run, from_version=plan.from_version, to_version=plan.to_version,
                              steps=steps, total_bytes=plan.total_bytes)

    # -- fleet ------------------------------------------------------------

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        status = request.status
        check_name("status.island_id", status.island_id)
        check_name("status.run", status.run)
        if status.state == pb.ISLAND_STATE_EXPIRED:
            raise InvalidArgument("status.state EXPIRED is set by the board, never sent")
        if status.state not in pb.IslandState.values() or status.state == pb.ISLAND_STATE_UNSPECIFIED:
            raise InvalidArgument("status.state must be STARTING, CATCHING_UP, READY, ERROR or DRAINING")
        lease = request.lease_s or 30
        if lease > 600:
            raise InvalidArgument(f"lease_s {lease} is too long; between 1 and 600")
        run = await self.store.get_run(status.run)
        expires = await self.store.heartbeat(status, lease)
        self.heartbeat_runs.add(status.run)
        return pb.HeartbeatResponse(head=run.head, lease_expires_at_ms=expires)

    async def island_infos(self, run: str) -> tuple[list[pb.IslandInfo], int]:
        """Islands of a run with lag and EXPIRED state; also refreshes the islands gauge."""
        now = now_ms()
        rows = await self.store.islands(run, forget_before_ms=now - EXPIRED_VISIBLE_MS)
        head = (await self.store.run_state(run)).head
        infos = []
        counts: dict[int, int] = {}
        for row in rows:
            status = pb.IslandStatus()
            status.CopyFrom(row.status)
            if row.lease_expires_at_ms < now:
                status.state = pb.ISLAND_STATE_EXPIRED
            counts[status.state] = counts.get(status.state, 0) + 1
            infos.append(pb.IslandInfo(status=status, lag=lag(head, status.version),
                                       last_seen_ms=row.last_seen_ms, lease_expires_at_ms=row.lease_expires_at_ms))
        self.metrics.set_islands(run, counts)
        return infos, head

    async def ListIslands(self, request: pb.ListIslandsRequest, context) -> pb.ListIslandsResponse:
        await self._run_and_state(request.run)
        infos, head = await self.island_infos(request.run)
        return pb.ListIslandsResponse(islands=infos, head=head)

    # -- trajectories -----------------------------------------------------

    async def ReportTrajectories(self, request: pb.ReportTrajectoriesRequest, context) -> pb.ReportTrajectoriesResponse:
        records = request.records
        if not records:
            return pb.ReportTrajectoriesResponse(accepted=0)
        run = validate.check_trajectories(records)
        await self.store.get_run(run)
        payloads = [rec.SerializeToString() for rec in records]
        await self.store.add_trajectories(run, payloads, self.trajectory_maxlen)
        self.metrics.trajectories.labels(run).inc(len(payloads))
        return pb.ReportTrajectoriesResponse(accepted=len(payloads))

    async def ConsumeTrajectories(self, request: pb.ConsumeTrajectoriesRequest, context) -> pb.ConsumeTrajectoriesResponse:
        check_name("run", request.run)
        check_name("group", request.group)
        check_name("consumer", request.consumer)
        if request.max_records > MAX_TRAJECTORY_BATCH:
            raise InvalidArgument(f"max_records {request.max_records} is too large; at most {MAX_TRAJECTORY_BATCH}")
        if request.block_ms > MAX_BLOCK_MS:
            raise InvalidArgument(f"block_ms {request.block_ms} is too long; at most {MAX_BLOCK_MS}")
        count = request.max_records or 1000
        await self.store.get_run(request.run)
        await self.store.ensure_group(request.run, request.group)
        entries: list[tuple[bytes, dict]] = []
        if request.redeliver_after_ms:
            entries = await self.store.autoclaim(request.run, request.group, request.consumer,
                                                 request.redeliver_after_ms, min(count, CONSUME_CHUNK))
        size = sum(len(fields[b"r"]) for _, fields in entries)
        block = None if entries else request.block_ms  # only the first read waits
        while len(entries) < count and size < MAX_PAGE_BYTES:  # what is read is handed out: stop in time
            chunk = await self.store.read_group(request.run, request.group, request.consumer,
                                                min(count - len(entries), CONSUME_CHUNK), block)
            entries += chunk
            size += sum(len(fields[b"r"]) for _, fields in chunk)
            if len(chunk) < CONSUME_CHUNK:
                break
            block = None
        head = (await self.store.run_state(request.run)).head
        out: list[pb.ConsumedTrajectory] = []
        dropped: list[bytes] = []
        bound = request.max_staleness if request.HasField("max_staleness") else None
        for entry_id, fields in entries:
            record = pb.TrajectoryRecord.FromString(fields[b"r"])
            staleness = lag(head, record.version)
            if bound is not None and staleness > bound:
                dropped.append(entry_id)
                continue
            out.append(pb.ConsumedTrajectory(id=entry_id.decode(), record=record, staleness=staleness))
        if dropped:
            await self.store.ack(request.run, request.group, dropped)
        return pb.ConsumeTrajectoriesResponse(records=out, dropped_stale=len(dropped), head=head)

    async def AckTrajectories(self, request: pb.AckTrajectoriesRequest, context) -> pb.AckTrajectoriesResponse:
        check_name("run", request.run)
        check_name("group", request.group)
        for i, entry_id in enumerate(request.ids):
            if not validate.is_stream_id(entry_id):
                raise InvalidArgument(f"ids[{i}] {entry_id!r} is not a stream entry id from ConsumeTrajectories")
        await self.store.get_run(request.run)
        return pb.AckTrajectoriesResponse(acked=await self.store.ack(request.run, request.group, list(request.ids)))

    # -- administration ---------------------------------------------------

    async def CollectGarbage(self, request: pb.CollectGarbageRequest, context) -> pb.CollectGarbageResponse:
        run = await self._run_and_state(request.run)
        done = await gcmod.collect_garbage(  # gc.py: plan and execute
            self.store, self.blobs, run, keep_anchors=request.keep_anchors or run.retention.keep_anchors or 2,
            keep_versions=run.retention.keep_versions or 64, staged_grace_s=self.staged_grace_s,
            dry_run=request.dry_run, now_ms=now_ms())
        await self.collect_stale_uploads(request.run, dry_run=request.dry_run,  # abandoned multipart uploads
                                         keep_done_s=self.staged_grace_s)
        if not request.dry_run:
            self.metrics.gc_freed_bytes.inc(done.freed_bytes)
            log.info("garbage collected", deleted=len(done.delete), freed_bytes=done.freed_bytes,
                     oldest_available=done.oldest_available)
        return pb.CollectGarbageResponse(deleted_keys=[k for k, _ in done.delete], freed_bytes=done.freed_bytes,
                                         oldest_available=done.oldest_available,
                                         staged_parts_collected=done.staged_parts_collected,
                                         abandoned_blobs_collected=done.abandoned_blobs_collected)

    async def CreateToken(self, request: pb.CreateTokenRequest, context) -> pb.CreateTokenResponse:
        token_id, token = await self.auth.create(request.name, request.role)
        log.info("token created", token_id=token_id, role=request.role)
        return pb.CreateTokenResponse(token_id=token_id, token=token)

    async def RevokeToken(self, request: pb.RevokeTokenRequest, context) -> pb.RevokeTokenResponse:
        if not request.token_id:
            raise InvalidArgument("token_id is empty")
        stored = await self.auth.revoke(request.token_id)
        log.info("token revoked", token_id=request.token_id, was_stored=stored)
        return pb.RevokeTokenResponse(was_stored=stored)
