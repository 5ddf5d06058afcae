"""The trainer-side publisher: served view -> sparse delta -> patch/anchor -> blob store -> commit.

Called from an ordinary synchronous training loop::

    with Publisher("127.0.0.1:50051", "my-run", token=T) as pub:
        for step in ...:
            optimizer.step()
            pub.publish(model, step=step)

Invariants:
- The publisher keeps ONE served view (on the model's device). Each master tensor is
  projected (large elementwise casts chunk by chunk through a reused buffer; an fp32 master
  served as bf16 on the CPU is cast inside the scan itself, ``scan_tiles(cast=True)``) and
  folded into that view in one pass that also records the transition, so the view always equals
  the newest published version. On CPU views in the default encoding that pass *encodes*
  as it compares (``tile_codec`` scans: Rice-coded gaps and symbols; in the context
  encoding, ``context_codec`` scans for bf16 and fp16 tensors, whose class bounds come from
  the view before it is folded), and only the rANS pass and the container are left for
  later; elsewhere it keeps deltas
  (``diff_and_update_``, Triton on CUDA). That read is all
  the trainer waits for; with ``attach(optimizer)`` it even overlaps the next forward and
  backward pass, and only the optimizer's next ``step()`` waits for it (``blocked_s``).
- Everything else runs in the background, in publish order: a single *read/snapshot*
  thread (read the weights, then finish the scanned streams while two threads hash the
  changed tensors, write the anchor file: whatever reads the view, before the next read
  changes it), then an asyncio loop on its own
  thread for the *upload* stage (encode what is left, upload, commit), which needs only
  the deltas and streams. With parts (``part_bytes``; by default while the board's last
  commit said some island asks for staged parts, which islands do when their blob store is
  far), every ``part_bytes`` of streams finished become a patch part that is uploaded and
  staged on the board at once (``parts``), so far islands download during the finish; the
  commit names those parts (and one more with the tensors the read could not encode itself,
  if any). Merging a version into the next (``"skip"``) works on deltas: the queued
  version's streams are decoded back to deltas against the view first (context streams with
  the changes whose class the fold moved, which their scans recorded).
- Versions are consecutive and committed in order; a failure that cannot be retried
  poisons the publisher (every later ``publish`` raises it), because a gap would break
  the chain islands follow.
- Backpressure: at most ``max_pending`` versions are between ``publish`` and their commit.
  ``"wait"`` blocks the trainer until one commits; ``"skip"`` replaces the newest queued,
  not yet uploading version by the new one, with a delta merged to span both (from the
  last version that was committed or is uploading), so the chain stays bitwise exact.
- A new publisher on a run with versions resumes from the head: it rebuilds its view from
  the newest anchor and the patches after it (verified against the head's root digest),
  or takes a state dict the caller vouches for, and anchors if its projection differs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import xxhash

from weftboard.proto.domain import check_name, format_digest
from weftboard.proto.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    WeftboardError,
)
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.anchors import (
    DEFAULT_SHARD_BYTES,
    WrittenFile,
    write_checkpoint,
)
from weftboard.publisher.parts import SUGGESTED_PART_BYTES, PartCutter, staged_names
from weftboard.publisher.policy import AnchorPolicy, AnchorReason, decide_anchor
from weftboard.publisher.uploader import FAST_RECONNECT, Uploader, with_retries

log = structlog.get_logger("weftboard.publisher")

_ESTIMATE_BYTES_PER_CHANGE = 1.5



@dataclass
class PublishHandle:
    """The future of one published version; ``result()`` is its committed record."""

    version: int
    step: int
    _future: concurrent.futures.Future = field(repr=False)
    blocked_s: float = 0.0
    read_s: float = 0.0  # how long the projection + diff took (in the background when attached)
    coalesced: bool = False  # replaced by a newer publish under "skip" (same version number)

    def result(self, timeout: float | None = None) -> pb.VersionRecord:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()


@dataclass
class _Job:
    version: int
    step: int
    labels: dict[str, str]
    anchor: bool
    reason: AnchorReason
    # served name -> TensorDelta, for tensors the read did not encode itself (``fused``); None
    # when the version has no patch (no base)
    deltas: dict[str, Any] | None
    futures: list[concurrent.futures.Future]
    t_publish: float
    adapter_tensors: dict[str, torch.Tensor] | None = None
    touched: set[str] = field(default_factory=set)
    digests: dict[str, str] = field(default_factory=dict)
    root: str = ""
    anchor_files: list[WrittenFile] = field(default_factory=list)
    anchor_dir: Path | None = None
    started: bool = False
    est_patch_bytes: int = 0
    handles: list[PublishHandle] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    streams: concurrent.futures.Future | None = None  # the patch's encoded streams, started at read time
    fused: dict[str, Any] = field(default_factory=dict)  # served name -> EncodedTensor, encoded during the read
    changed: dict[str, int] = field(default_factory=dict)  # served name -> changed elements in the patch
    parts: list[tuple[list[str], concurrent.futures.Future]] = field(default_factory=list)  # staged: (names, BlobRef)


def _state_dict(model_or_state: Any) -> dict[str, torch.Tensor]:
    if isinstance(model_or_state, torch.nn.Module):
        return {k: v.detach() for k, v in model_or_state.state_dict().items()}
    if isinstance(model_or_state, Mapping):
        return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in model_or_state.items()}
    raise InvalidArgument(f"publish() takes an nn.Module or a state dict, not {type(model_or_state).__name__}")


def _token_of(client: Any) -> str | None:
    for key, value in getattr(client, "_metadata", ()):
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


class Publisher:
    def __init__(
        self,
        board: Any,
        run: str,
        *,
        token: str | None = None,
        served_format: Any = None,
        blob_store: Any = None,
        anchor_every: int = 50,
        anchor_patch_fraction: float = 0.5,
        max_pending: int = 2,
        on_backpressure: str = "wait",
        work_dir: Path | str | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        resume_state: Any = None,
        run_labels: Mapping[str, str] | None = None,
        encoding: str = "default",
        timeout_s: float = 30.0,
        part_bytes: int | None = None,
    ) -> None:
        from weftboard.cuda.formats import Projector, ServedFormatSpec

        self.run = check_name("run", run)
        if on_backpressure not in ("wait", "skip"):
            raise InvalidArgument(f"on_backpressure must be 'wait' or 'skip', not {on_backpressure!r}")
        if max_pending < 1:
            raise InvalidArgument(f"max_pending must be >= 1, got {max_pending}")
        if isinstance(board, str):
            self._address, self._token = board, token
        else:  # a BoardClient lives on its creator's loop: open our own to the same board
            self._address, self._token = board.address, token or _token_of(board)
        self.spec = served_format if served_format is not None else ServedFormatSpec("bf16")
        self.projector = Projector(self.spec)
        self.blob_store = blob_store
        self.policy = AnchorPolicy(anchor_every, anchor_patch_fraction)
        self.max_pending = max_pending
        self.on_backpressure = on_backpressure
        self.shard_bytes = shard_bytes
        from weftboard.cuda.codec import ENCODINGS

        if encoding not in ENCODINGS:
            raise InvalidArgument(f"unknown patch encoding {encoding!r}; expected one of {ENCODINGS}")
        self.encoding = encoding
        self.timeout_s = timeout_s
        if part_bytes is not None and part_bytes < 0:
            raise InvalidArgument(f"part_bytes must be >= 0 (0: one patch blob, nothing staged; None: "
                                  f"parts while islands ask for them), got {part_bytes}")
        self.part_bytes = part_bytes
        self._parts_wanted = False  # the board's word at the last commit (for part_bytes=None)
        self.run_labels = dict(run_labels or {})
        self._resume_state = resume_state
        self._own_work_dir = work_dir is None
        self.work_dir = Path(tempfile.mkdtemp(prefix="weftboard-pub-")) if work_dir is None else Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)

        # Served view state (touched by the trainer thread in publish, and by the snapshot stage).
        self._view: dict[str, torch.Tensor] | None = None
        self._layout: list[tuple[str, str, tuple[int, ...]]] = []
        self._digest_cache: dict[str, str] = {}
        self._has_base = False
        self._kind = pb.RUN_KIND_UNSPECIFIED
        self._next_version = 0
        self._resumed_head = 0
        self._last_anchor = 0
        self._patch_bytes_since_anchor = 0  # committed or estimated patch bytes after _last_anchor
        self._last_patch_bytes = 0
        self._bytes_per_change = _ESTIMATE_BYTES_PER_CHANGE
        self._anchor_bytes = 0

        # Pipeline state, guarded by _cond.
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._snapshotting = 0
        self._inflight: _Job | None = None
        self._last_read: tuple[threading.Event | None, PublishHandle | None] = (None, None)
        self._scratch: dict = {}
        self._async_read = False
        self._hooks: list[Any] = []
        self._failure: BaseException | None = None
        self._closed = False
        self.blocked_s: list[float] = []
        self.committed: list[pb.VersionRecord] = []
        self.commit_latency_s: list[float] = []
        self.timings: list[dict[str, float]] = []  # per committed version: read, digest, encode, upload, commit seconds

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"weftboard-publisher-{run}", daemon=True)
        self._thread.start()
        self._snapshot_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weftboard-snapshot")
        self._hash_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="weftboard-hash")
        # Deltas the read could not encode itself are encoded here, beside the snapshot
        # stage: encoding needs only the deltas, and just the container waits for the root.
        self._encode_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weftboard-encode")
        self._wake: asyncio.Event | None = None
        self._staging: set[asyncio.Future] = set()  # StagePart calls in flight (held so they are not collected)
        self._client = None
        self._uploader: Uploader | None = None
        self._worker: concurrent.futures.Future | None = None

    # -- public API --------------------------------------------------------------------

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        self.close(flush=exc_type is None)

    @property
    def head(self) -> int:
        """The newest version committed by this publisher, or the head it resumed from."""
        return self.committed[-1].version if self.committed else self._resumed_head

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._snapshotting + (1 if self._inflight else 0)

    def connect(self, model_or_state: Any = None, *, kind: int = pb.RUN_KIND_WEIGHTS) -> None:
        """Create or open the run (and resume from its head); ``publish`` calls it lazily."""
        if self._kind != pb.RUN_KIND_UNSPECIFIED:
            return
        master = _state_dict(model_or_state) if model_or_state is not None else None
        self._call(self._connect(master, kind))

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Let ``publish`` return before the weights are read.

        With an optimizer attached, projection and diff run in the background while the
        trainer computes its next forward and backward pass (which do not change the
        weights); a pre-step hook makes the optimizer's next ``step()`` wait until that
        read is done, and that wait counts as blocked time. Only attach when nothing but
        this optimizer changes the weights between publishes.
        """
        def wait_for_read(*_: Any) -> None:
            event, handle = self._last_read
            if event is not None and not event.is_set():
                t = time.perf_counter()
                event.wait()
                waited = time.perf_counter() - t
                if handle is not None:
                    handle.blocked_s += waited
                    self.blocked_s[-1] += waited
            self._raise_if_failed()

        self._hooks.append(optimizer.register_step_pre_hook(wait_for_read))
        self._async_read = True

    def publish(self, model_or_state: Any, *, step: int = 0, labels: Mapping[str, str] | None = None) -> PublishHandle:
        """Publish the model's current weights as the next version.

        Returns once the weights have been read into the served view (projection and a
        fused diff), or at once when an optimizer is attached (see ``attach``); encoding,
        hashing, uploads and the commit always happen in the background.
        """
        t0 = time.perf_counter()
        self._raise_if_failed()
        self.wait_read()
        master = _state_dict(model_or_state)
        if self._kind == pb.RUN_KIND_UNSPECIFIED:
            self._call(self._connect(master, pb.RUN_KIND_WEIGHTS))
        if self._kind != pb.RUN_KIND_WEIGHTS:
            raise FailedPrecondition(f"run {self.run} is a LoRA adapter run: use publish()")
        target = self._reserve_slot()
        self._raise_if_failed()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if target is not None:
            version = target.version
        else:
            version = self._next_version
            self._next_version += 1
        handle = PublishHandle(version, step, fut, coalesced=False)
        if target is not None:
            for h in target.handles:
                h.coalesced = True
        read_done = threading.Event()
        with self._cond:
            self._snapshotting += 1
        self._last_read = (read_done, handle)
        self._snapshot_pool.submit(self._read_and_snapshot, master, version, step, dict(labels or {}), target, fut, handle, t0, read_done)
        self.blocked_s.append(0.0)
        if not self._async_read:
            read_done.wait()
            self._raise_if_failed()
        blocked = time.perf_counter() - t0
        handle.blocked_s += blocked
        self.blocked_s[-1] += blocked
        return handle

    def wait_read(self) -> None:
        """Wait until the last published weights have been read (they may change after)."""
        event, _ = self._last_read
        if event is not None:
            event.wait()

    def _read_and_snapshot(self, master: dict[str, torch.Tensor], version: int, step: int, labels: dict[str, str],
                           target: _Job | None, fut: concurrent.futures.Future, handle: PublishHandle, t0: float,
                           read_done: threading.Event) -> None:
        """Background, in publish order: read the weights into the view, then snapshot the job."""
        t_read = time.perf_counter()
        try:
            reason = self._decide(version, target)
            if target is not None and target.fused:
                # Merging works on deltas: recover the target's from its streams while the view
                # still holds the target's version.
                target.deltas = dict(target.deltas or {}, **self._deltas_of(target.fused))
                target.fused = {}
            # Encode in the read itself (one pass over old and new bits), unless this read is
            # merged into a queued version or the patch uses another encoding.
            scan = target is None and self.encoding in ("default", "context")
            folded = self._project_and_diff(master, anchor=bool(reason), scan=scan)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            read_done.set()
            self._fail_read(exc, _Job(version, step, labels, False, AnchorReason.NONE, None, [fut], t0), target)
            return
        handle.read_s = time.perf_counter() - t_read
        read_s = handle.read_s
        read_done.set()
        del master
        t_finish = time.perf_counter()
        try:  # streams of the tensors the read scanned; the view still holds this version
            part_bytes = self._part_bytes()
            cutter = (PartCutter(version, self.encoding, part_bytes, self._ship_part(version))
                      if scan and part_bytes and version > 1 and folded is not None else None)
            # The changed tensors are hashed on two threads (hashing inside the read would keep
            # the trainer waiting longer: measured 25 ms more per 106M parameters): beside the
            # finish, or after it when it ships parts, whose downloads are what far islands
            # wait for (the hashes are needed only by the commit, after the last part).
            hashing = self._hash_changed(folded) if folded is not None and cutter is None else {}
            deltas, fused = self._finish_read(folded, cutter) if folded is not None else (None, {})
            if cutter is not None:
                hashing = self._hash_changed(folded)
            hashed = {n: f.result() for n, f in hashing.items()}
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            self._fail_read(exc, _Job(version, step, labels, False, AnchorReason.NONE, None, [fut], t0), target)
            return
        _release_free_memory()  # after the read: the trainer does not wait for it
        if target is not None:
            from weftboard.publisher.deltas import merge_deltas

            if target.deltas is not None and deltas is not None:
                deltas = {n: merge_deltas(target.deltas[n], d) for n, d in deltas.items()}
            else:
                deltas = None
            if target.anchor and not reason:
                reason = target.reason
            if target.anchor_dir is not None:
                shutil.rmtree(target.anchor_dir, ignore_errors=True)
            job = _Job(version, step, labels, bool(reason), reason, deltas, target.futures + [fut], target.t_publish)
            job.handles = target.handles + [handle]
            job.touched = set(target.touched)
        else:
            job = _Job(version, step, labels, bool(reason), reason, deltas, [fut], t0)
            job.handles = [handle]
            job.parts = cutter.parts if cutter is not None else []
        job.timings["read_s"] = read_s
        job.timings["finish_s"] = time.perf_counter() - t_finish
        if deltas is not None:
            job.fused = fused
            job.changed = {n: int(d.positions.numel()) for n, d in deltas.items()}
            job.changed.update((n, e.changed) for n, e in fused.items())
            job.touched |= {n for n, c in job.changed.items() if c}
            # Hashed beside the finish: the cache holds the view's current digests.
            self._digest_cache.update(hashed)
            job.touched -= hashed.keys()
            job.est_patch_bytes = int(sum(job.changed.values()) * self._bytes_per_change) + 64 * len(job.changed)
        else:
            job.touched = set(self._view or ())
        with self._cond:  # policy bookkeeping at decision time (commits correct the estimate)
            if target is not None and not target.anchor:
                self._patch_bytes_since_anchor -= target.est_patch_bytes
            if job.anchor:
                self._last_anchor, self._patch_bytes_since_anchor = version, 0
            else:
                self._patch_bytes_since_anchor += job.est_patch_bytes
                self._last_patch_bytes = job.est_patch_bytes
        self._has_base = True
        if job.deltas is not None and job.version > 1:
            if job.deltas:
                job.streams = self._encode_pool.submit(self._encode_streams, job)
            else:  # every tensor was encoded during the read
                job.streams = concurrent.futures.Future()
                job.streams.set_result([job.fused[n] for n in self._layout_names()])
        log.debug("read", run=self.run, version=version, anchor=job.anchor, coalesced=target is not None,
                  read_s=round(time.perf_counter() - t0, 4))
        self._snapshot(job)

    def _fail_read(self, exc: BaseException, job: _Job, target: _Job | None) -> None:
        """A read (or the streams after it) failed: its waiters and a merge target's get the error."""
        self._fail(exc, [job] + ([target] if target is not None else []))
        with self._cond:
            self._snapshotting -= 1
            self._cond.notify_all()

    def publish_adapter(self, state_dict: Mapping[str, torch.Tensor], *, step: int = 0, labels: Mapping[str, str] | None = None) -> PublishHandle:
        """Publish a LoRA adapter whole (a run of kind RUN_KIND_LORA_ADAPTER: anchors only)."""
        t0 = time.perf_counter()
        self._raise_if_failed()
        master = _state_dict(state_dict)
        if self._kind == pb.RUN_KIND_UNSPECIFIED:
            self._call(self._connect(master, pb.RUN_KIND_LORA_ADAPTER))
        if self._kind != pb.RUN_KIND_LORA_ADAPTER:
            raise FailedPrecondition(f"run {self.run} holds full weights: use publish()")
        self._check_layout(self.projector.layout(master))
        self._reserve_slot(allow_skip=False)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        version = self._next_version
        self._next_version += 1
        stored = self.projector.project(master, anchor=True)
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in stored.items()}
        job = _Job(version, step, dict(labels or {}), True, AnchorReason.ADAPTER, None, [fut], t0, adapter_tensors=tensors)
        job.touched = set(tensors)
        with self._cond:
            self._snapshotting += 1
        self._snapshot_pool.submit(self._snapshot, job)
        handle = PublishHandle(version, step, fut, blocked_s=time.perf_counter() - t0)
        self.blocked_s.append(handle.blocked_s)
        return handle

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every published version is committed (raises a pipeline failure)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._snapshotting or self._inflight) and self._failure is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"publisher flush timed out with {self.pending()} versions pending")
                self._cond.wait(left)
        self._raise_if_failed()

    def close(self, flush: bool = True) -> None:
        if self._closed:
            return
        try:
            if flush and self._failure is None:
                self.flush()
        finally:
            self._closed = True
            for hook in self._hooks:
                hook.remove()
            if self._worker is not None:
                self._worker.cancel()
            if self._client is not None:
                try:
                    asyncio.run_coroutine_threadsafe(self._close_client(), self._loop).result(10)
                except Exception:  # closing is best effort once the work is done
                    pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._snapshot_pool.shutdown(wait=True)
            self._hash_pool.shutdown(wait=True)
            self._encode_pool.shutdown(wait=True)
            if self._own_work_dir:
                shutil.rmtree(self.work_dir, ignore_errors=True)

    async def _close_client(self) -> None:
        for task in list(self._staging):  # hints for versions that are committed or never will be
            task.cancel()
        await asyncio.gather(*self._staging, return_exceptions=True)
        await self._client.close()

    # -- connect / resume ---------------------------------------------------------------

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _connect(self, master: dict[str, torch.Tensor] | None, kind: int) -> None:
        from weftboard.board.client import BoardClient

        if self._client is None:
            self._client = BoardClient(self._address, self._token, timeout_s=self.timeout_s, options=FAST_RECONNECT)
            self._uploader = Uploader(self.run, self._client, self.blob_store)
            self._wake = asyncio.Event()
            self._worker = asyncio.run_coroutine_threadsafe(self._upload_worker(), self._loop)
        if master is None:
            raise InvalidArgument("connect() needs the model or state dict to know the run's layout")
        layout = self.projector.layout(master)
        try:
            run = await with_retries("GetRun", lambda: self._client.get_run(self.run))
        except NotFound:
            run = await with_retries("CreateRun", lambda: self._client.create_run(pb.Run(
                run=self.run,
                kind=kind,
                served_format=self.spec.to_proto(),
                layout=pb.Layout(tensors=[pb.TensorSpec(name=n, dtype=d, shape=list(s)) for n, d, s in layout]),
                labels=self.run_labels,
            )))
        if run.kind != kind:
            raise FailedPrecondition(
                f"run {self.run} is of kind {pb.RunKind.Name(run.kind)}, but this call publishes {pb.RunKind.Name(kind)}"
            )
        self._layout = [(t.name, t.dtype, tuple(t.shape)) for t in run.layout.tensors]
        self._check_layout(layout)
        self._anchor_bytes = sum(_nbytes(d, s) for _, d, s in self._layout)
        head = await self._client.get_head(self.run)
        self._next_version = head.version + 1
        self._resumed_head = head.version
        self._kind = kind
        if head.version > 0 and kind == pb.RUN_KIND_WEIGHTS:
            await self._resume(head.version, master)

    def _check_layout(self, layout: list[tuple[str, str, tuple[int, ...]]]) -> None:
        ours = [(n, d, tuple(s)) for n, d, s in layout]
        if ours == self._layout:
            return
        theirs = {n: (d, s) for n, d, s in self._layout}
        mine = {n: (d, s) for n, d, s in ours}
        details = []
        for n in sorted(set(theirs) | set(mine)):
            if theirs.get(n) != mine.get(n):
                details.append(f"{n}: run has {theirs.get(n, 'nothing')}, model gives {mine.get(n, 'nothing')}")
        if not details:
            details.append("same tensors in a different order")
        raise FailedPrecondition(
            f"the model's served layout differs from run {self.run}'s layout ({len(details)} differences; first: "
            + "; ".join(details[:3]) + "). Publish it to a new run."
        )

    async def _resume(self, head: int, master: dict[str, torch.Tensor]) -> None:
        """Rebuild the kept view at ``head`` so the next version can carry a patch."""
        from weftboard.cuda.digest import root_digest, tensor_digest

        record = await self._client.get_version(self.run, head)
        await self._find_last_anchor(head)
        device = next((t.device for t in master.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
        if self._resume_state is not None:
            view = {n: t.detach().clone().contiguous() for n, t in
                    self.projector.project(_state_dict(self._resume_state), anchor=False).items()}
            digests = {n: await asyncio.to_thread(tensor_digest, t) for n, t in view.items()}
            root = root_digest([(n, d, list(s), digests[n]) for n, d, s in self._layout])
            if root != record.root_digest:
                log.warning("resume state differs from the head; the next version carries an anchor",
                            run=self.run, head=head)
                self._view, self._digest_cache, self._has_base = None, {}, False
                return
            self._view, self._digest_cache, self._has_base = view, digests, True
            self.projector.resume_from(view)
            log.info("resumed from a given state dict", run=self.run, head=head)
            return
        from weftboard.subscriber.live_tensors import LiveTensorsDestination
        from weftboard.subscriber.subscriber import Subscriber

        view = {n: torch.empty(s, dtype=getattr(torch, d), device=device) for n, d, s in self._layout}
        dest = LiveTensorsDestination(view)
        cache = self.work_dir / "resume-cache"
        sub = Subscriber(self._client, self.run, dest, island_id=f"publisher-resume-{self.run}"[:64],
                         blob_store=self.blob_store, cache_dir=cache, heartbeat=False)
        await sub.sync_to(head)
        shutil.rmtree(cache, ignore_errors=True)
        self._view = view
        self._digest_cache = {d.name: d.digest for d in record.tensor_digests}
        self._has_base = True
        self.projector.resume_from(view)
        log.info("resumed from the head", run=self.run, head=head, anchor=self._last_anchor)

    async def _find_last_anchor(self, head: int) -> None:
        start = max(1, head - self.policy.anchor_every)
        since = 0
        last = 0
        async for rec in self._client.iter_versions(self.run, from_version=start, to_version=head):
            if any(a.kind == pb.ARTIFACT_KIND_ANCHOR for a in rec.artifacts):
                last, since = rec.version, 0
            else:
                since += rec.stats.patch_bytes
        self._last_anchor = last if last else max(0, head - self.policy.anchor_every)
        self._patch_bytes_since_anchor = since

    # -- the blocking part ---------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise FailedPrecondition("the publisher is closed")

    def _reserve_slot(self, allow_skip: bool = True) -> _Job | None:
        """Wait for room in the pipeline; under "skip", take the newest queued job to merge into."""
        with self._cond:
            while True:
                if self._failure is not None:
                    raise self._failure
                pending = len(self._queue) + self._snapshotting + (1 if self._inflight else 0)
                if pending < self.max_pending:
                    return None
                if allow_skip and self.on_backpressure == "skip" and not self._snapshotting:
                    # Never wait on an upload: merge into the queued version, or queue behind
                    # the one uploading (at most one queued at a time).
                    if self._queue and not self._queue[-1].started:
                        return self._queue.pop()
                    if not self._queue:
                        return None
                self._cond.wait(1.0)

    def _decide(self, version: int, target: _Job | None) -> AnchorReason:
        since = self._patch_bytes_since_anchor + self._last_patch_bytes
        last = self._last_anchor
        if target is not None and target.anchor:
            return target.reason
        return decide_anchor(
            self.policy,
            version=version,
            last_anchor_version=last,
            patch_bytes_since_anchor=since,
            anchor_bytes=self._anchor_bytes,
            has_base=self._view is not None and self._has_base,
        ).reason

    def _project_and_diff(self, master: dict[str, torch.Tensor], *, anchor: bool, scan: bool = False) -> dict[str, Any] | None:
        """Project every master tensor and fold it into the kept view; per served tensor its
        delta or (``scan``, CPU views) its tile scans, or None without a base."""

        if self._view is None:
            view: dict[str, torch.Tensor] = {}
            for name, t in master.items():
                for sname, st in self.projector.project_tensor(name, t, anchor=True).items():
                    if st.data_ptr() == t.data_ptr():  # the projection aliases the trainer's tensor
                        st = st.clone()
                    view[sname] = st.contiguous()
            self._check_layout([(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in view.items()])
            self._view = view
            self._digest_cache = {}
            return None
        deltas: dict[str, Any] = {}
        for name, t in master.items():
            prev = self._view.get(name)
            if self._is_elementwise(name, t, prev):
                deltas[name] = _chunked_cast_fold_(prev, t, self._scratch, self._tensor_scan(prev, scan))
                continue
            for sname, st in self.projector.project_tensor(name, t, anchor=anchor).items():
                prev = self._view.get(sname)
                if prev is None or prev.shape != st.shape or prev.dtype != st.dtype:
                    raise FailedPrecondition(
                        f"tensor {sname!r} projects to {tuple(st.shape)} {st.dtype}, but the run's layout has "
                        f"{None if prev is None else (tuple(prev.shape), prev.dtype)}"
                    )
                deltas[sname] = _fold_pieces_(prev, st.contiguous(), self._scratch, self._tensor_scan(prev, scan),
                                              len(st.reshape(-1)))
        self._scratch.clear()
        if len(deltas) != len(self._view):
            missing = sorted(set(self._view) - set(deltas))[:3]
            raise FailedPrecondition(f"the model no longer produces served tensors {missing} of run {self.run}")
        return deltas

    def _tensor_scan(self, prev: torch.Tensor | None, scan: bool) -> _TensorScan | None:
        return _TensorScan.for_tensor(self.encoding, prev) if scan and prev is not None else None

    def _finish_read(self, folded: dict[str, Any], cutter: PartCutter | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(deltas, streams) from what the read produced: scanned tensors get their streams
        here, while the view still holds the version they lead to, which is also what a
        tensor whose mode is not sparse needs to recover its delta. Each stream goes to
        ``cutter`` as soon as it is finished, the tensors with the most changes first: the bulk
        of the bytes ships (and starts down the islands' links) early, and what is left for the
        last part, cut after the last stream and so just before the commit, is small."""
        from weftboard.cuda.codec import (
            delta_from_scans,
            encoded_from_scans,
            scans_changed,
        )
        from weftboard.cuda.diff import TensorDelta
        from weftboard.cuda.jit import serial_kernels

        assert self._view is not None
        scanned = [(n, item) for n, item in folded.items() if not isinstance(item, TensorDelta)]
        if cutter is not None:
            scanned.sort(key=lambda entry: -scans_changed(entry[1]))

        def finish(entry: tuple[str, list]) -> Any:
            name, scans = entry
            view = self._view[name]
            return encoded_from_scans(name, view.dtype, view.numel(), scans)

        deltas = {n: d for n, d in folded.items() if isinstance(d, TensorDelta)}
        fused: dict[str, Any] = {}
        # One thread, and its kernels serial: this runs while the trainer's next step uses
        # the cores, where each parallel region waited at its barrier for a thread parked
        # behind the trainer's (bench sync --wan, the count patched in one process: the finish
        # stage 0.36-0.38 s a version with two threads, 0.23-0.28 s with one; uncontended, the
        # codec bench's 55M-parameter update finishes in 18-19 ms with one thread or two).
        with serial_kernels():
            for (name, scans), enc in zip(scanned, map(finish, scanned)):
                if enc is None:
                    deltas[name] = delta_from_scans(scans, self._view[name])
                else:
                    fused[name] = enc
                    if cutter is not None:
                        cutter.add(enc)
        if cutter is not None:
            cutter.flush()
        return deltas, fused

    def _part_bytes(self) -> int:
        """Streams per staged part for the version being read now (0: one patch blob)."""
        if self.part_bytes is not None:
            return self.part_bytes
        return SUGGESTED_PART_BYTES if self._parts_wanted else 0

    def _ship_part(self, version: int) -> Any:
        """``PartCutter``'s ``ship`` for ``version``: upload and stage on the publisher's loop."""
        def ship(data: bytes) -> concurrent.futures.Future:
            return asyncio.run_coroutine_threadsafe(self._upload_and_stage(version, data), self._loop)

        return ship

    async def _upload_and_stage(self, version: int, data: bytes) -> pb.BlobRef:
        """Upload one patch part, then tell the board's watchers. The part's ref (which the
        commit waits for) is ready once the hint went out, or after ``_STAGE_WAIT_S``: a hint
        is worth nothing after the commit (the board no longer relays it), and a commit that
        follows it finds the part already checked. A refused or failed StagePart only means
        islands fetch the part after the commit."""
        assert self._uploader is not None and self._client is not None
        digest = format_digest(xxhash.xxh3_128(data).digest())
        key = await self._uploader.upload(digest, len(data), data=data, skip_existing=False)
        ref = pb.BlobRef(key=key, digest=digest, size=len(data))

        async def stage() -> None:
            try:
                await self._client.stage_part(self.run, version, ref)
            except WeftboardError as exc:
                log.info("patch part not staged; islands fetch it after the commit", run=self.run, version=version,
                         error=str(exc))

        task = asyncio.ensure_future(stage())
        self._staging.add(task)
        task.add_done_callback(self._staging.discard)
        await asyncio.wait({task}, timeout=_STAGE_WAIT_S)  # not cancelled when slower: close() does that
        return ref

    def _hash_changed(self, folded: dict[str, Any]) -> dict[str, concurrent.futures.Future]:
        """Start hashing (two threads) every view tensor the read changed or never hashed."""
        from weftboard.cuda.diff import TensorDelta
        from weftboard.cuda.digest import tensor_digest

        assert self._view is not None
        view = self._view

        def changed(item: Any) -> int:
            from weftboard.cuda.codec import scans_changed

            return item.changed if isinstance(item, TensorDelta) else scans_changed(item)

        return {n: self._hash_pool.submit(tensor_digest, view[n]) for n, item in folded.items()
                if changed(item) or n not in self._digest_cache}

    def _deltas_of(self, fused: dict[str, Any]) -> dict[str, Any]:
        """The deltas of streams encoded during a read, while the view holds their version."""
        from weftboard.cuda.codec import delta_from_encoded

        assert self._view is not None
        return {n: delta_from_encoded(e, self._view[n]) for n, e in fused.items()}

    def _is_elementwise(self, name: str, master: torch.Tensor, prev: torch.Tensor | None) -> bool:
        """Whether this tensor's stored form is a plain elementwise cast of the master (so it can
        be projected in chunks without a full-size temporary)."""
        if prev is None or not master.is_contiguous() or master.device != prev.device:
            return False
        plan = self.projector.plan(name, tuple(master.shape), master.dtype)
        return (len(plan) == 1 and plan[0][0] == name and tuple(plan[0][2]) == tuple(master.shape)
                and plan[0][1] == str(prev.dtype).removeprefix("torch.") and prev.is_contiguous())

    # -- background: snapshot stage (reads the view) -----------------------------------------

    def _snapshot(self, job: _Job) -> None:
        from weftboard.cuda.digest import root_digest, tensor_digest

        try:
            tensors = job.adapter_tensors if job.adapter_tensors is not None else self._view
            assert tensors is not None
            cache = {} if job.adapter_tensors is not None else self._digest_cache
            t_snap = time.perf_counter()
            todo = [n for n in self._layout_names() if n in job.touched or n not in cache]
            # xxh3 releases the GIL: hash the touched tensors on two threads.
            for name, digest in zip(todo, self._hash_pool.map(lambda n: tensor_digest(tensors[n]), todo)):
                cache[name] = digest
            job.timings["digest_s"] = time.perf_counter() - t_snap
            job.digests = {n: cache[n] for n in self._layout_names()}
            job.root = root_digest([(n, d, list(s), job.digests[n]) for n, d, s in self._layout])
            if job.anchor:
                job.anchor_dir = self.work_dir / f"anchor-v{job.version}-{time.monotonic_ns()}"
                job.anchor_files = write_checkpoint(
                    job.anchor_dir,
                    [(n, tensors[n]) for n in self._layout_names()],
                    shard_bytes=self.shard_bytes,
                    metadata={"format": "pt", "weftboard_run": self.run, "weftboard_version": str(job.version)},
                )
            if job.adapter_tensors is not None:
                job.adapter_tensors = None
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter below
            self._fail(exc, [job])
            with self._cond:
                self._snapshotting -= 1
                self._cond.notify_all()
            return
        job.timings["queued_s"] = time.perf_counter() - job.t_publish
        with self._cond:
            self._snapshotting -= 1
            self._queue.append(job)
            self._cond.notify_all()
        if self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _layout_names(self) -> list[str]:
        return [n for n, _, _ in self._layout]

    # -- background: upload stage (encode, upload, commit) ----------------------------------

    async def _upload_worker(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                with self._cond:
                    if not self._queue or self._failure is not None:
                        break
                    job = self._queue.popleft()
                    job.started = True
                    self._inflight = job
                try:
                    record = await self._process(job)
                except BaseException as exc:  # noqa: BLE001
                    self._fail(exc, [job])
                    with self._cond:
                        self._inflight = None
                        failed = list(self._queue)
                        self._queue.clear()
                        self._cond.notify_all()
                    self._fail(exc, failed)
                    break
                with self._cond:
                    self._inflight = None
                    self._cond.notify_all()
                for f in job.futures:
                    if not f.done():
                        f.set_result(record)

    async def _process(self, job: _Job) -> pb.VersionRecord:
        assert self._uploader is not None and self._client is not None
        artifacts: list[pb.Artifact] = []
        patch_bytes = anchor_bytes = 0
        uploads = []
        if job.deltas is not None and job.version > 1:
            from weftboard.cuda.codec import assemble_patch

            t_wait = time.perf_counter()
            if job.streams is None:
                job.streams = self._encode_pool.submit(self._encode_streams, job)
            streams = await asyncio.wrap_future(job.streams)
            staged_refs = [await asyncio.wrap_future(f) for _, f in job.parts]
            staged = staged_names(job.parts)
            rest = [s for s in streams if s.name not in staged]
            data = b""
            if rest or not staged_refs:  # the last part: every tensor not staged, and the root
                data = (await asyncio.to_thread(
                    assemble_patch, rest,
                    base_version=job.version - 1, target_version=job.version, target_root=job.root, encoding=self.encoding,
                )).data
            job.timings["encode_wait_s"] = time.perf_counter() - t_wait
            patch_refs = list(staged_refs)
            patch_bytes = sum(r.size for r in staged_refs) + len(data)
            if data:
                digest = format_digest(xxhash.xxh3_128(data).digest())
                uploads.append(self._uploader.upload(digest, len(data), data=data))
                patch_refs.append(pb.BlobRef(digest=digest, size=len(data)))
        else:
            patch_refs = []
        for wf in job.anchor_files:
            uploads.append(self._uploader.upload(wf.digest, wf.size, path=wf.path))
            anchor_bytes += wf.size
        t_up = time.perf_counter()
        keys = await asyncio.gather(*uploads)
        job.timings["upload_s"] = time.perf_counter() - t_up
        unstaged = len(keys) - len(job.anchor_files)  # 1 when the last patch part was uploaded here
        if patch_refs:
            if unstaged:
                patch_refs[-1].key = keys[0]
            artifacts.append(pb.Artifact(kind=pb.ARTIFACT_KIND_PATCH, base_version=job.version - 1, blobs=patch_refs))
        if job.anchor_files:
            shard_keys = keys[unstaged:]
            artifacts.append(pb.Artifact(kind=pb.ARTIFACT_KIND_ANCHOR, base_version=0, blobs=[
                pb.BlobRef(key=k, digest=wf.digest, size=wf.size, name=wf.name) for k, wf in zip(shard_keys, job.anchor_files)
            ]))
        record = pb.VersionRecord(
            run=self.run,
            version=job.version,
            parent=job.version - 1,
            tensor_digests=[pb.TensorDigest(name=n, digest=job.digests[n]) for n in self._layout_names()],
            root_digest=job.root,
            artifacts=artifacts,
            stats=self._stats(job, patch_bytes, anchor_bytes),
            step=job.step,
            labels=job.labels,
            created_at_ms=int(time.time() * 1000),
        )
        t_commit = time.perf_counter()
        response = await with_retries(f"commit of version {job.version}", lambda: self._client.commit_version(record))
        job.timings["commit_s"] = time.perf_counter() - t_commit
        self._parts_wanted = response.staged_parts_wanted
        job.timings["committed_s"] = time.perf_counter() - job.t_publish
        if job.anchor_dir is not None:
            shutil.rmtree(job.anchor_dir, ignore_errors=True)
        # Policy bookkeeping: the real patch size replaces the estimate made at publish.
        with self._cond:
            if not job.anchor and job.version > self._last_anchor:
                self._patch_bytes_since_anchor += patch_bytes - job.est_patch_bytes
            if patch_bytes:
                self._last_patch_bytes = patch_bytes
            changed = record.stats.changed_elements
            if changed and patch_bytes:
                self._bytes_per_change = max(patch_bytes / changed, 0.1)
        job.deltas, job.fused = None, {}  # the patch is committed: its deltas and streams are garbage now
        _release_free_memory()
        self.committed.append(response.record)
        self.commit_latency_s.append(time.perf_counter() - job.t_publish)
        log.info("committed", run=self.run, version=job.version, patch_bytes=patch_bytes, anchor_bytes=anchor_bytes,
                 density=round(record.stats.density, 6), anchor=job.anchor, reason=job.reason.value,
                 latency_s=round(time.perf_counter() - job.t_publish, 3),
                 **{k: round(v, 4) for k, v in job.timings.items()})
        self.timings.append(dict(job.timings, version=job.version))
        return response.record

    def _encode_streams(self, job: _Job) -> list[Any]:
        """Background (encode pool): the patch's per-tensor streams, from the job's deltas."""
        from weftboard.cuda.codec import encode_streams

        t_enc = time.perf_counter()
        assert job.deltas is not None
        deltas = job.deltas
        names = self._layout_names()
        encoded = dict(job.fused)
        todo = [n for n in names if n not in encoded]
        encoded.update(zip(todo, encode_streams([(n, deltas[n]) for n in todo], encoding=self.encoding)))
        streams = [encoded[n] for n in names]
        job.timings["encode_s"] = time.perf_counter() - t_enc
        return streams

    def _stats(self, job: _Job, patch_bytes: int, anchor_bytes: int) -> pb.VersionStats:
        from weftboard.cuda.formats import is_scale_tensor

        tensors = []
        changed_total = total = scale_changed = 0
        for name, _dtype, shape in self._layout:
            numel = _numel(shape)
            if job.deltas is not None and job.version > 1:
                changed = job.changed[name]
            else:
                changed = numel
            total += numel
            changed_total += changed
            if is_scale_tensor(name):
                scale_changed += changed
            if changed:
                tensors.append(pb.TensorStats(name=name, changed=changed, numel=numel))
        return pb.VersionStats(
            changed_elements=changed_total,
            total_elements=total,
            density=changed_total / total if total else 0.0,
            patch_bytes=patch_bytes,
            anchor_bytes=anchor_bytes,
            tensors=tensors,
            scale_changed_elements=scale_changed,
        )

    def _fail(self, exc: BaseException, jobs: list[_Job]) -> None:
        if not isinstance(exc, WeftboardError):
            wrapped: BaseException = FailedPrecondition(f"publishing failed: {type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
        else:
            wrapped = exc
        with self._cond:
            if self._failure is None:
                self._failure = wrapped
                log.error("publisher failed; later versions cannot be published", run=self.run, error=str(exc))
            self._cond.notify_all()
        for job in jobs:
            for f in job.futures:
                if not f.done():
                    f.set_exception(wrapped)


_CAST_CHUNK = 1 << 22  # elements; a multiple of torch's parallel grain, so casts are identical to whole-tensor casts


def _release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, and the trainer
    process would carry the publisher's transient buffers as resident memory)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None
# How long a staged part's commit waits for its StagePart call (normally a few milliseconds).
_STAGE_WAIT_S = 1.0


@dataclass(frozen=True)
class _TensorScan:
    """How a read encodes one CPU tensor while it folds it in: the ``sparse`` tile scan, or
    (context encoding, 16-bit floats) the ``context`` scan, whose class thresholds come from
    the old view before the first piece is folded."""

    thresholds: np.ndarray | None = None

    @staticmethod
    def for_tensor(encoding: str, prev: torch.Tensor) -> _TensorScan:
        from weftboard.cuda import context_codec
        from weftboard.cuda.diff import bits_view, unsigned_np

        if encoding == "context" and context_codec.supports(prev.dtype) and prev.device.type == "cpu":
            thresholds = context_codec.choose_thresholds(unsigned_np(bits_view(prev)).reshape(-1), prev.dtype)
            if thresholds.size:
                return _TensorScan(thresholds)
        return _TensorScan()

    def piece(self, view: np.ndarray, new: np.ndarray, scratch: dict, cast: bool = False) -> Any:
        """Scan and fold one piece (whole tiles)."""
        from weftboard.cuda import context_codec, tile_codec
        from weftboard.cuda.codec import CODEC_TILE

        if self.thresholds is None:
            return tile_codec.scan_tiles(view, new, CODEC_TILE, scratch, update=True, cast=cast)
        return context_codec.scan_tiles(view, new, self.thresholds, CODEC_TILE, scratch, update=True, cast=cast)

    def tensor(self, pieces: list) -> Any:
        """The scans of a tensor's pieces, as ``codec.encoded_from_scans`` takes them."""
        from weftboard.cuda import context_codec

        return pieces if self.thresholds is None else context_codec.ContextScans(self.thresholds, pieces)


def _chunked_cast_fold_(prev: torch.Tensor, master: torch.Tensor, scratch: dict, scan: _TensorScan | None = None) -> Any:
    """Cast ``master`` to ``prev``'s dtype chunk by chunk, folding each chunk into ``prev``;
    what changed (see ``_fold_pieces_``).

    Peak extra memory is one chunk instead of a full projected tensor (embeddings and LM
    heads are a quarter of a small model each).
    """
    flat_m = master.detach().reshape(-1)
    key = (prev.dtype, prev.device)
    buf = scratch.get(key)
    if buf is None:
        buf = scratch[key] = torch.empty(_CAST_CHUNK, dtype=prev.dtype, device=prev.device)

    def cast(start: int, end: int) -> torch.Tensor:
        chunk = buf[: end - start]
        chunk.copy_(flat_m[start:end])  # the same cast kernel as .to(), into a reused buffer
        return chunk

    cast_scan = None
    if scan is not None and prev.dtype == torch.bfloat16 and flat_m.dtype == torch.float32 \
            and prev.device.type == "cpu" and flat_m.device.type == "cpu":
        # The common case (fp32 master, bf16 served, on the CPU) casts as it scans: the cast
        # is never written out and read back. Tiles the fused cast leaves alone (a NaN or a
        # subnormal) come back as overflowed and go through ``cast`` above.
        src = flat_m.view(torch.int32).numpy().view(np.uint32)

        def cast_scan(view: np.ndarray, start: int, end: int) -> Any:
            return scan.piece(view, src[start:end], scratch, cast=True)

    # Small tensors too go through the reused buffer: no fresh pages to fault in.
    return _fold_pieces_(prev, None, scratch, scan, flat_m.numel(), source=cast, cast_scan=cast_scan)


def _fold_pieces_(prev: torch.Tensor, new: torch.Tensor | None, scratch: dict, scan: _TensorScan | None, n: int, *,
                  source: Any = None, cast_scan: Any = None) -> Any:
    """Fold ``new`` (or the pieces ``source(start, end)`` gives) into ``prev``, ``_CAST_CHUNK``
    elements at a time; returns the TensorDelta, or (``scan`` on CPU) the tensor's tile scans.
    ``cast_scan(view, start, end)``, when given, scans and folds a piece without ``source``
    (``tile_codec.scan_tiles`` with ``cast``); ``source`` then serves only the tiles it left.

    A scan encodes a piece in the same read that compares it and folds it (no copy); tiles
    too dense for the scan's scratch are left alone by it and diffed instead, and then the
    tensor's scans are turned back into deltas (from the folded view) so the caller gets one
    exact delta for the tensor.
    """
    import dataclasses

    from weftboard.cuda.codec import CODEC_TILE, delta_from_scans
    from weftboard.cuda.diff import (
        TensorDelta,
        bits_view,
        diff_and_update_,
        unsigned_np,
    )

    assert _CAST_CHUNK % CODEC_TILE == 0  # pieces start on tile boundaries
    flat_p = prev.reshape(-1)
    flat_n = None if new is None else new.reshape(-1)

    def piece_of(start: int, end: int) -> torch.Tensor:
        return source(start, end) if source is not None else flat_n[start:end]

    scan = scan if prev.device.type == "cpu" else None
    parts: list[tuple[int, Any]] = []
    for start in range(0, max(n, 1), _CAST_CHUNK):
        end = min(start + _CAST_CHUNK, n)
        view = flat_p[start:end]
        if scan is not None and cast_scan is not None:
            piece = None
            sc = cast_scan(unsigned_np(bits_view(view)), start, end)
        else:
            piece = piece_of(start, end)
            if scan is None:
                parts.append((start, diff_and_update_(view, piece)))
                continue
            sc = scan.piece(unsigned_np(bits_view(view)), unsigned_np(bits_view(piece)), scratch)
        if not sc.overflowed.size:
            parts.append((start, sc))
            continue
        if piece is None:
            piece = piece_of(start, end)
        # The scanned tiles are folded: their delta comes back from the view. The others
        # are untouched: diff them.
        scanned = delta_from_scans(scan.tensor([dataclasses.replace(sc, overflowed=np.empty(0, np.int64))]), view)
        pieces = [(0, scanned)]
        for t in sc.overflowed.tolist():
            lo, hi = t * CODEC_TILE, min((t + 1) * CODEC_TILE, end - start)
            pieces.append((lo, diff_and_update_(view[lo:hi], piece[lo:hi])))
        parts.append((start, _join_deltas(pieces, end - start, prev.dtype)))
    if scan is not None and all(not isinstance(item, TensorDelta) for _, item in parts):
        return scan.tensor([item for _, item in parts])
    deltas = [(start, item if isinstance(item, TensorDelta) else
               delta_from_scans(scan.tensor([item]), flat_p[start:start + _CAST_CHUNK]))
              for start, item in parts]
    if len(deltas) == 1:
        return deltas[0][1]
    return _join_deltas(deltas, n, prev.dtype)


def _join_deltas(parts: list[tuple[int, Any]], numel: int, dtype: torch.dtype) -> Any:
    """One delta from deltas of disjoint ranges (each ``(offset, delta)``), positions ascending."""
    from weftboard.cuda.diff import TensorDelta

    positions = torch.cat([d.positions + offset for offset, d in parts])
    order = torch.argsort(positions)
    return TensorDelta(
        positions=positions[order],
        old_bits=torch.cat([d.old_bits for _, d in parts])[order],
        new_bits=torch.cat([d.new_bits for _, d in parts])[order],
        numel=numel,
        dtype=dtype,
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return _numel(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
