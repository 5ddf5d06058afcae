"""Publishing from a sharded ``torch.distributed`` job: every rank publishes what it holds.

Each rank calls ``ShardedPublisher.publish(model)`` after the same optimizer step. A rank holds
``DTensor`` slices (FSDP2's ``fully_shard``: ``Shard`` placements; ``Replicate`` dims are
replicas), ``Slice`` objects (Megatron-style per-rank slices with a declared offset), or whole
tensors (replicated). One version goes through these stages:

1. snapshot (``publish``, the only blocking part): each rank projects the slices it sends to
   the served format (a copy); its cost is ``blocked_s``;
2. exchange (a background thread, on a process group of the publisher's own): every tensor has
   one owner rank (``sharded_layout.plan_slices``); ranks send their served slices to the
   owners, point to point, so each rank receives about 1/N of the served model, never all of it;
3. each owner diffs its tensors against the previous version, encodes their streams into one
   patch part, hashes them whole, writes an anchor file of them when the version anchors, and
   uploads the part (``StagePart``) and the file;
4. rank 0 gathers every rank's part, digests and anchor file, computes the root over the full
   layout and commits one record naming all parts; the outcome is broadcast to every rank.

Invariants:
- Digests are over the full logical tensors and the patch holds each tensor's stream once
  (in its owner's part), so a version is the same to an island whatever the sharding: a run
  may move between 1 and N ranks, or another sharding, between versions (the first version of
  a new publisher is an anchor, as no rank holds the previous view of the tensors it owns).
- A version becomes visible only when every rank's parts and files are durable: rank 0 commits
  after the gather. A rank that dies mid-version makes the others' collectives time out: nothing
  is committed and the publisher fails; its staged parts become orphans, deleted by GC once the
  version is committed by a later job.
- Every rank computes the same ``SlicePlan`` from the same gathered headers, so a bad layout
  (ranks that disagree, overlapping or missing slices, a world size change mid-version) raises
  the same ``InvalidArgument`` on every rank, before anything is uploaded.
- The served format is elementwise (a cast: bf16, fp16, raw), so a slice projects on its own;
  another format is refused when the publisher is made.
- Each rank stages its anchor file (``StagePart`` with the file's name) before the gather, so
  the file of a rank that dies mid-version is an orphan GC deletes too; the file's metadata
  names its version, so no other version's record can name its key.
- Each version pairs one training step on every rank: every rank's header carries its step and
  a version whose ranks disagree on it is refused on every rank (``plan_slices``). A rank whose
  ``publish`` raises once its version is numbered (a failed snapshot, a changed state dict)
  re-raises to its trainer, marks the publisher failed and still joins that version's header
  exchange with the error, so every rank fails the version at that exchange (no rank waits
  out the collective timeout) and every later publish raises: ranks never drift a step apart.
- Every rank records its committed versions in its own ``PublisherMetrics`` (the record is
  broadcast to all); with ``metrics_port``, rank 0 serves them. Without ``blob_store``, a blob
  over ``upload_part_bytes`` goes up as a presigned multipart upload, as for ``Publisher``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from weftboard.board.blobs.transfer import (
    DEFAULT_PART_BYTES,
    FAST_RECONNECT,
    Uploader,
    uploader_options,
    with_retries,
)
from weftboard.board.channel import TlsConfig, client_tls
from weftboard.board.client import BoardClient
from weftboard.cuda import codec
from weftboard.cuda.anchors import write_safetensors
from weftboard.cuda.diff import diff_tensor
from weftboard.cuda.digest import root_digest, tensor_digest
from weftboard.cuda.formats import Projector, ServedFormatSpec
from weftboard.proto.domain import check_name
from weftboard.proto.errors import FailedPrecondition, InvalidArgument, WeftboardError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.commit import upload_and_note, upload_and_stage
from weftboard.publisher.job import RECENT_VERSIONS, PublishHandle
from weftboard.publisher.metrics import PublisherMetrics
from weftboard.publisher.model_files import collect_model_files, open_run
from weftboard.publisher.model_state import module_state
from weftboard.publisher.sharded_exchange import exchange_slices
from weftboard.publisher.sharded_layout import (
    RankHeader,
    SlicePlan,
    TensorEntry,
    plan_slices,
)

__all__ = ["ELEMENTWISE_KINDS", "ShardedPublisher", "Slice"]

#: The served formats a slice projects to on its own (a cast, no scales).
ELEMENTWISE_KINDS = ("bf16", "fp16", "raw")

log = structlog.get_logger("weftboard.publisher")


@dataclass(frozen=True)
class Slice:
    """A per-rank slice (Megatron-style tensor parallelism): ``local`` sits at ``offset`` inside
    a logical tensor of ``shape``. Pass it in the state dict in place of the tensor."""

    local: torch.Tensor
    shape: tuple[int, ...]
    offset: tuple[int, ...]


@dataclass
class RankResult:
    """What one rank contributes to a version (gathered on rank 0)."""

    digests: dict[str, str]
    changed: dict[str, int]
    part: tuple[str, str, int] | None = None  # (key, digest, size) of its staged patch part
    coders: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (stream mode, stream bytes)
    anchor: tuple[str, str, str, int] | None = None  # (name, key, digest, size) of its anchor file
    error: str | None = None


def _held(name: str, value: Any) -> tuple[torch.Tensor, tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """(local tensor, logical shape, box or None for the whole tensor) of one state-dict value."""
    if isinstance(value, Slice):
        return value.local.detach(), tuple(value.shape), (tuple(value.offset), tuple(value.local.shape))
    if isinstance(value, DTensor):
        if any(isinstance(p, Partial) for p in value.placements):
            raise InvalidArgument(f"{name!r} is a DTensor with a Partial placement: reduce it before publishing")
        shape = tuple(value.shape)
        if all(p.is_replicate() for p in value.placements):
            return value.to_local().detach(), shape, None
        (chunk,) = value.__create_chunk_list__()
        return value.to_local().detach(), shape, (tuple(chunk.offsets), tuple(chunk.sizes))
    if isinstance(value, torch.Tensor):
        return value.detach(), tuple(value.shape), None
    raise InvalidArgument(f"{name!r}: publish() takes tensors, DTensors or Slice objects, not {type(value).__name__}")


def _held_state(model_or_state: Any) -> dict[str, tuple]:
    """Each tensor's (local part, full shape, its place); a module's weights as ``module_state``
    reads them (wrappers removed, tied weights once), a state dict as given."""
    state = module_state(model_or_state) if isinstance(model_or_state, torch.nn.Module) else model_or_state
    if not isinstance(state, Mapping):
        raise InvalidArgument(f"publish() takes an nn.Module or a state dict, not {type(state).__name__}")
    return {name: _held(name, value) for name, value in state.items()}


class ShardedPublisher:
    """One per rank; every rank of ``group`` calls each method in the same order.

    ``collective_timeout_s``: how long a rank waits for the others at each exchange and gather
    (a rank that died makes the others fail after it). TLS and upload options (``upload_part_bytes``,
    ``upload_min_bytes_per_s``) as ``Publisher``'s."""

    def __init__(self, board: str, run: str, *, token: str | None = None, served_format: Any = None,
                 blob_store: Any = None, anchor_every: int = 50, max_pending: int = 2,
                 encoding: str = "default", work_dir: Path | str | None = None,
                 collective_timeout_s: float = 300.0, model_files: Any = None, timeout_s: float = 30.0,
                 group: dist.ProcessGroup | None = None, tls: TlsConfig | bool | None = None,
                 tls_ca: str | Path | None = None, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, server_name: str | None = None,
                 upload_part_bytes: int = DEFAULT_PART_BYTES, upload_min_bytes_per_s: float | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> None:
        if encoding not in codec.ENCODINGS:
            raise InvalidArgument(f"unknown patch encoding {encoding!r}; expected one of {codec.ENCODINGS}")
        self._upload_kw = uploader_options(part_bytes=upload_part_bytes, min_bytes_per_s=upload_min_bytes_per_s)
        self.spec = served_format if served_format is not None else ServedFormatSpec("bf16")
        if not isinstance(self.spec, ServedFormatSpec) or self.spec.kind not in ELEMENTWISE_KINDS:
            raise InvalidArgument(f"sharded publishing needs an elementwise served format ({', '.join(ELEMENTWISE_KINDS)}), "
                                  f"not {self.spec!r}: fp8 and 4-bit formats scale a whole tensor or block, "
                                  "which no rank's slice holds")
        if not dist.is_initialized():
            raise FailedPrecondition("ShardedPublisher needs torch.distributed initialised (init_process_group)")
        self.run = check_name("run", run)
        self.address, self.token = board, token
        self._tls = client_tls(tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, server_name=server_name)
        self.projector = Projector(self.spec)
        self.blob_store = blob_store
        self.anchor_every = anchor_every
        self.encoding = encoding
        self.timeout_s = timeout_s
        self.model_files = collect_model_files(self.run, model_files)
        # The publisher's own gloo group: its collectives run on a background thread beside
        # the trainer's own (NCCL or gloo) collectives, which must not interleave with them.
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self.group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=collective_timeout_s))
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.work_dir = Path(work_dir) if work_dir is not None else None
        self.plan: SlicePlan | None = None
        self._entries: tuple[TensorEntry, ...] = ()
        self._prev: dict[str, torch.Tensor] | None = None  # the owned tensors at the last version
        self._last_anchor = 0
        self._next_version = 0
        self._slots = threading.Semaphore(max_pending)
        self._pending = 0  # versions published and not yet committed (or failed)
        self.metrics = PublisherMetrics(self.run, lambda: self._pending)  # every rank records; rank 0 serves
        if metrics_port is not None and self.rank == 0:
            self.metrics.serve(metrics_port, metrics_host)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weftboard-sharded")
        self._failure: BaseException | None = None
        self._failed_at: float = math.inf  # the earliest version that failed (on this rank or collectively)
        self._fail_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weftboard-sharded-loop", daemon=True)
        self._thread.start()
        self._client: BoardClient | None = None
        self._uploader: Uploader | None = None
        self._staging: set[asyncio.Future] = set()
        # per version, of the newest RECENT_VERSIONS only (job.py)
        self.blocked_s: deque[float] = deque(maxlen=RECENT_VERSIONS)
        self.uploaded_bytes: deque[int] = deque(maxlen=RECENT_VERSIONS)  # this rank's part and anchor file
        self.committed: deque[pb.VersionRecord] = deque(maxlen=RECENT_VERSIONS)  # rank 0 only
        self.before_gather: Callable[[int, RankResult], None] | None = None  # test hook: version, this rank's result

    # -- public API ------------------------------------------------------------------------

    def __enter__(self) -> ShardedPublisher:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close(flush=exc_type is None)

    def connect(self, model_or_state: Any) -> None:
        """Plan the slices with every rank and create or open the run (collective; ``publish``
        calls it on the first version)."""
        self._raise_if_failed()
        if self.plan is None:
            self._setup(_held_state(model_or_state))

    def publish(self, model_or_state: Any, *, step: int = 0) -> PublishHandle:
        """Snapshot this rank's slices and publish them as the next version (collective).

        If the snapshot raises, the error is re-raised here, the publisher is failed and this
        rank still joins the version's exchange with the error, which fails it on every rank."""
        t0 = time.perf_counter()
        self._raise_if_failed()
        held = None
        if self.plan is None:
            held = _held_state(model_or_state)
            self._setup(held)
        self._slots.acquire()
        try:
            self._raise_if_failed()
        except BaseException:
            self._slots.release()
            raise
        version = self._next_version  # numbered on every rank alike, even if this publish fails
        self._next_version += 1
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending += 1
        try:
            snapshot = self._snapshot(held if held is not None else _held_state(model_or_state))
        except BaseException as exc:
            error = f"rank {self.rank}'s publish of version {version} (step {step}) failed: {type(exc).__name__}: {exc}"
            self._fail(FailedPrecondition(f"{error}; the sharded publisher cannot publish later versions"), version)
            self._pool.submit(self._publish_version, version, step, {}, fut, t0, 0.0, error)
            raise
        blocked = time.perf_counter() - t0
        self.blocked_s.append(blocked)
        self._pool.submit(self._publish_version, version, step, snapshot, fut, t0, blocked)
        return PublishHandle(version, step, fut, coalesced=False, blocked_s=blocked)

    def flush(self) -> None:
        """Wait until every version published so far is committed (or raise the failure)."""
        self._pool.submit(lambda: None).result()
        self._raise_if_failed()

    def close(self, flush: bool = True) -> None:
        try:
            if flush and self._failure is None:
                self.flush()
        finally:
            self._pool.shutdown(wait=True)
            if self._client is not None:
                try:
                    self._call(self._close_client(), 10)
                except (WeftboardError, TimeoutError, OSError) as exc:
                    log.info("closing the board client failed", error=str(exc))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self.metrics.stop()

    # -- setup: the plan, the run ---------------------------------------------------------

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _close_client(self) -> None:
        for task in list(self._staging):
            task.cancel()
        await asyncio.gather(*self._staging, return_exceptions=True)
        await asyncio.gather(self._uploader.close(), self._client.close())  # its presigned PUTs' connections too

    def _setup(self, held: dict[str, tuple]) -> None:
        """Plan the slices with every rank and open the run (collective, on the first publish)."""
        entries = []
        for name, (local, shape, box) in held.items():
            stored = self.projector.plan(name, shape, local.dtype)  # one tensor, as ELEMENTWISE_KINDS project
            entries.append(TensorEntry(name, stored[0][1], shape, box,
                                       torch.empty((), dtype=getattr(torch, stored[0][1])).element_size()))
        self._entries = tuple(entries)
        headers: list[Any] = [None] * self.world
        dist.all_gather_object(headers, RankHeader(self.rank, self.world, -1, self._entries), group=self.group)
        plan = plan_slices(headers)
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                outcome[0] = ("ok", self._call(self._open(held)))
            except BaseException as exc:  # noqa: BLE001 - every rank raises it
                outcome[0] = ("error", exc)
        else:
            self._call(self._connect())
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        kind, value = outcome[0]
        if kind == "error":
            raise value if isinstance(value, WeftboardError) else FailedPrecondition(f"opening the run failed: {value}")
        self._next_version = value + 1
        self.plan = plan

    async def _connect(self) -> None:
        if self._client is None:
            self._client = BoardClient(self.address, self.token, tls=self._tls, timeout_s=self.timeout_s,
                                       options=FAST_RECONNECT)
            self._uploader = Uploader(self.run, self._client, self.blob_store, **self._upload_kw)

    async def _open(self, held: dict[str, tuple]) -> int:
        """Rank 0: create or open the run; returns its head."""
        await self._connect()
        meta = {n: torch.empty(shape, dtype=local.dtype, device="meta") for n, (local, shape, _) in held.items()}
        layout = self.projector.layout(meta)
        run = await open_run(self._client, self._uploader, pb.Run(
            run=self.run, kind=pb.RUN_KIND_WEIGHTS, served_format=self.spec.to_proto(),
            layout=pb.Layout(tensors=[pb.TensorSpec(name=n, dtype=d, shape=list(s)) for n, d, s in layout])),
            self.model_files)
        theirs = [(t.name, t.dtype, tuple(t.shape)) for t in run.layout.tensors]
        if theirs != [(n, d, tuple(s)) for n, d, s in layout]:
            raise FailedPrecondition(f"the model's served layout differs from run {self.run}'s layout; "
                                     f"publish it to a new run")
        return (await self._client.get_head(self.run)).version

    # -- stage 1: the snapshot (blocking) ---------------------------------------------------

    def _snapshot(self, held: dict[str, tuple]) -> dict[str, torch.Tensor]:
        """Served copies of what this rank sends or owns whole. ``held`` names the tensors of the
        first version, in any order, each with the same shape and box (else ``InvalidArgument``)."""
        assert self.plan is not None
        known = [e.name for e in self._entries]
        if set(held) != set(known):
            added, missing = sorted(set(held) - set(known)), sorted(set(known) - set(held))
            raise InvalidArgument(f"this rank's state dict names other tensors than the first version of this "
                                  f"publisher (added: {added}, missing: {missing}): a new layout needs a new run "
                                  f"and a new ShardedPublisher")
        entries = tuple(TensorEntry(e.name, e.dtype, held[e.name][1], held[e.name][2], e.itemsize)
                        for e in self._entries)
        if entries != self._entries:
            raise InvalidArgument("this rank's slices changed since the first version of this publisher: "
                                  "a new sharding needs a new ShardedPublisher")
        out: dict[str, torch.Tensor] = {}
        for t in self.plan.tensors:
            local = held[t.name][0]
            if (t.owner == self.rank and t.whole_on_owner) or any(r == self.rank for r, _ in t.slices):
                out[t.name] = self.projector.project_tensor(t.name, local, anchor=True)[t.name]
        return out

    # -- stages 2-4 (the background thread, in version order) --------------------------------

    def _publish_version(self, version: int, step: int, snapshot: dict[str, torch.Tensor],
                         fut: concurrent.futures.Future, t_publish: float, blocked_s: float,
                         error: str | None = None) -> None:
        """One version's stages 2-4; ``error``: this rank's publish of it failed (it joins the
        header exchange only, so every rank fails the version). A version after one that failed
        joins nothing: every rank failed that one at the same collective."""
        try:
            if self._failure is not None and version > self._failed_at:
                raise self._failure
            record = self._collective_version(version, step, snapshot, error)
            anchor = any(a.kind == pb.ARTIFACT_KIND_ANCHOR for a in record.artifacts)
            self.metrics.record_version(record, anchor=anchor, blocked_s=blocked_s, snapshot_s=blocked_s,
                                        latency_s=time.perf_counter() - t_publish)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter and every later publish
            wrapped = exc if isinstance(exc, WeftboardError) else FailedPrecondition(
                f"sharded publishing of version {version} failed: {type(exc).__name__}: {exc}")
            if self._fail(wrapped, version):
                log.error("sharded publisher failed; later versions cannot be published", run=self.run,
                          version=version, rank=self.rank, error=str(exc))
            fut.set_exception(wrapped)
        else:
            fut.set_result(record)
        finally:
            self._pending -= 1
            self._slots.release()

    def _collective_version(self, version: int, step: int, snapshot: dict[str, torch.Tensor],
                            error: str | None = None) -> Any:
        assert self.plan is not None
        due = self._prev is None or version - self._last_anchor >= self.anchor_every
        headers: list[Any] = [None] * self.world
        dist.all_gather_object(headers, (RankHeader(self.rank, self.world, version, self._entries, step), due, error),
                               group=self.group)
        # the same checks on every rank, so every rank raises alike
        errors = [e for _, _, e in headers if e is not None]
        if errors:
            raise FailedPrecondition(f"version {version} was not committed: {'; '.join(errors)}")
        plan_slices([h for h, _, _ in headers])
        anchor = any(d for _, d, _ in headers)
        owned = exchange_slices(self.plan, self.rank, snapshot, self.group)
        result = self._encode_and_upload(version, owned, anchor)
        if self.before_gather is not None:
            self.before_gather(version, result)
        gathered: list[Any] = [None] * self.world if self.rank == 0 else None
        dist.gather_object(result, gathered, dst=0, group=self.group)
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                # protobuf messages do not pickle across processes here: their bytes do
                outcome[0] = ("ok", self._call(self._commit(version, step, gathered, anchor)).SerializeToString())
            except BaseException as exc:  # noqa: BLE001 - broadcast to every rank
                outcome[0] = ("error", str(exc))
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        kind, value = outcome[0]
        if kind == "error":
            raise FailedPrecondition(f"version {version} was not committed: {value}")
        record = pb.VersionRecord.FromString(value)
        self._prev = owned
        if anchor:
            self._last_anchor = version
        return record

    def _encode_and_upload(self, version: int, owned: dict[str, torch.Tensor], anchor: bool) -> RankResult:
        """This rank's part, digests and anchor file for its owned tensors."""
        try:
            prev = self._prev
            has_patch = prev is not None and version > 1
            result = RankResult(digests={}, changed={})
            uploaded = 0
            if has_patch and owned:
                deltas = [(n, diff_tensor(prev[n], t)) for n, t in owned.items()]
                result.changed = {n: d.changed for n, d in deltas}
                streams = codec.encode_streams(deltas, encoding=self.encoding, targets=owned)
                result.coders = {s.name: (s.mode, int(s.stream.size)) for s in streams}
                data = codec.assemble_patch(streams, base_version=version - 1, target_version=version,
                                            target_root="", encoding=self.encoding).data
                ref = self._call(upload_and_stage(version, data, run=self.run, client=self._client,
                                                  uploader=self._uploader, staging=self._staging))
                result.part = (ref.key, ref.digest, ref.size)
                uploaded += ref.size
            result.digests = {n: tensor_digest(t) for n, t in owned.items()}
            if anchor and owned:
                result.anchor = self._write_anchor(version, owned)
                uploaded += result.anchor[3]
            self.uploaded_bytes.append(uploaded)
            return result
        except BaseException as exc:  # noqa: BLE001 - gathered on rank 0, which fails the version everywhere
            return RankResult({}, {}, error=f"rank {self.rank}: {type(exc).__name__}: {exc}")

    def _write_anchor(self, version: int, owned: dict[str, torch.Tensor]) -> tuple[str, str, str, int]:
        name = f"model-{self.rank + 1:05d}-of-{self.world:05d}.safetensors"
        directory = self.work_dir or Path(f"/tmp/weftboard-sharded-{self.run}-r{self.rank}")
        written = write_safetensors(directory / f"v{version}" / name, list(owned.items()),
                                    {"format": "pt", "weftboard_run": self.run, "weftboard_version": str(version)})
        try:  # noted once up, so GC deletes it if this version commits without it
            key = self._call(upload_and_note(written, version, run=self.run, client=self._client,
                                             uploader=self._uploader))
        finally:
            written.path.unlink(missing_ok=True)
        return (name, key, written.digest, written.size)

    async def _commit(self, version: int, step: int, results: list[RankResult], anchor: bool) -> pb.VersionRecord:
        errors = [r.error for r in results if r.error]
        if errors:
            raise FailedPrecondition("; ".join(errors))
        assert self.plan is not None
        digests = {n: d for r in results for n, d in r.digests.items()}
        changed = {n: c for r in results for n, c in r.changed.items()}
        coders = {n: c for r in results for n, c in r.coders.items()}
        layout = [(t.name, t.dtype, list(t.shape)) for t in self.plan.tensors]
        artifacts = []
        parts = [pb.BlobRef(key=r.part[0], digest=r.part[1], size=r.part[2]) for r in results if r.part]
        if parts:
            artifacts.append(pb.Artifact(kind=pb.ARTIFACT_KIND_PATCH, base_version=version - 1, blobs=parts))
        files = [pb.BlobRef(key=r.anchor[1], digest=r.anchor[2], size=r.anchor[3], name=r.anchor[0])
                 for r in results if r.anchor]
        if anchor:
            artifacts.append(pb.Artifact(kind=pb.ARTIFACT_KIND_ANCHOR, base_version=0, blobs=files))
        numels = {n: math.prod(s) for n, _, s in layout}
        total_changed = sum(changed.values()) if parts else sum(numels.values())
        total = sum(numels.values())
        patch_bytes = sum(p.size for p in parts)
        record = pb.VersionRecord(
            run=self.run, version=version, parent=version - 1,
            tensor_digests=[pb.TensorDigest(name=n, digest=digests[n]) for n, _, _ in layout],
            root_digest=root_digest([(n, d, s, digests[n]) for n, d, s in layout]),
            artifacts=artifacts, step=step, created_at_ms=int(time.time() * 1000),
            stats=pb.VersionStats(
                changed_elements=total_changed, total_elements=total, density=total_changed / total if total else 0.0,
                patch_bytes=patch_bytes, anchor_bytes=sum(f.size for f in files),
                tensors=_tensor_stats([n for n, _, _ in layout], numels, changed, coders, patched=bool(parts))))
        response = await with_retries(f"commit of version {version}", lambda: self._client.commit_version(record))
        self.committed.append(response.record)
        log.info("committed a sharded version", run=self.run, version=version, ranks=self.world,
                 parts=len(parts), patch_bytes=patch_bytes, anchor=anchor)
        return response.record

    def _fail(self, exc: BaseException, version: int) -> bool:
        """Mark the publisher failed at ``version`` (the earliest failed version wins); whether
        this is its first failure."""
        with self._fail_lock:
            self._failed_at = min(self._failed_at, version)
            first = self._failure is None
            if first:
                self._failure = exc
            return first

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure


def _tensor_stats(names: list[str], numels: dict[str, int], changed: dict[str, int],
                  coders: dict[str, tuple[str, int]], *, patched: bool) -> list[pb.TensorStats]:
    """A version's per-tensor statistics: with a patch, the tensors it changed, each with its
    coder and stream bytes; without one (an anchor), every tensor as wholly changed."""
    stats = []
    for n in names:
        count = changed.get(n, numels[n]) if patched else numels[n]
        if patched and not count:
            continue
        coder, stream_bytes = coders.get(n, ("", 0))
        stats.append(pb.TensorStats(name=n, changed=count, numel=numels[n], coder=coder, stream_bytes=stream_bytes))
    return stats
