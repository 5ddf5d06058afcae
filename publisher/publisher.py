"""The trainer-side publisher: one version per ``publish``, committed in the background.

Called from an ordinary synchronous training loop::

    with Publisher("127.0.0.1:50051", "my-run", token=T) as pub:
        for step in ...:
            optimizer.step()
            pub.publish(model, step=step)

A version goes through these stages, in publish order:

1. read (``publish``, or in the background once ``attach``-ed): project the master weights
   and fold them into the served view (``served_view.py``, ``fold.py``);
2. snapshot (the read thread): finish the streams the read scanned, shipping staged parts
   (``parts.py``; during the read by default), hash the changed tensors, write an anchor's files;
3. commit (an asyncio loop on its own thread): encode the rest, upload, commit (``commit.py``).

Invariants:
- The served view always equals the newest published version; only the read changes it,
  and everything that reads it for a version runs before the next read (one read thread).
- Versions are consecutive and committed in order; a failure that cannot be retried poisons the
  publisher (every later ``publish`` raises it, every uncommitted version's handle fails with it):
  a gap would break the chain islands follow. ``close(flush=False)`` commits nothing after it
  returns, and fails the handle of every version not committed with ``Aborted`` (``pipeline.py``).
- Backpressure: at most ``max_pending`` versions are between ``publish`` and their commit.
  ``"wait"`` blocks the trainer until one commits; ``"skip"`` merges the new version into the
  newest queued one that is not uploading yet (``deltas.py``), so the chain stays bitwise exact.
- A publisher on a run with versions resumes from its head (``resume.py``) and anchors if
  it cannot rebuild the head's view exactly.
- A publisher never closed (garbage, or the interpreter exits first) is closed by its finalizer
  without waiting (``_abandon``): nothing more commits, its loop and pools stop, and the work dir
  it created (anchor files) is removed.
- A ``publish`` that waits for room in the pipeline says so at INFO after ``WAIT_LOG_S`` and
  again every ``WAIT_LOG_EVERY_S`` while it waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import torch

from weftboard.board.blobs import transfer
from weftboard.board.blobs.transfer import DEFAULT_PART_BYTES, FAST_RECONNECT, Uploader
from weftboard.board.channel import TlsConfig, client_tls
from weftboard.board.client import BoardClient
from weftboard.cuda.anchors import DEFAULT_SHARD_BYTES
from weftboard.cuda.codec import ENCODINGS
from weftboard.cuda.formats import Projector, ServedFormatSpec
from weftboard.proto.domain import check_name
from weftboard.proto.errors import FailedPrecondition, InvalidArgument
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher import resume
from weftboard.publisher.commit import commit_job, encode_streams, upload_and_stage
from weftboard.publisher.job import RECENT_VERSIONS, Job, PublishHandle, job_of_read
from weftboard.publisher.metrics import PublisherMetrics
from weftboard.publisher.model_files import collect_model_files, open_run
from weftboard.publisher.parts import SUGGESTED_PART_BYTES, FinishAhead, PartCutter
from weftboard.publisher.pipeline import Pipeline
from weftboard.publisher.policy import AnchorLedger, AnchorPolicy, AnchorReason
from weftboard.publisher.served_view import (
    ServedView,
    master_state,
    release_free_memory,
)

__all__ = ["Publisher", "PublishHandle"]

log = structlog.get_logger("weftboard.publisher")


def _abandon(run: str, jobs: Pipeline, loop: asyncio.AbstractEventLoop, pools: tuple[concurrent.futures.Executor, ...],
             work_dir: Path | None, metrics: PublisherMetrics) -> None:
    """Close a publisher that was not closed, without waiting (its finalizer; it must not hold
    the publisher): the versions not committed are aborted, the loop, pools and metrics endpoint
    stop, and its own work dir is removed."""
    log.info("closing a publisher that was not closed", run=run)
    metrics.stop()
    jobs.close()
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)
    if work_dir is not None:
        shutil.rmtree(work_dir, ignore_errors=True)


class Publisher:
    #: A ``publish`` waiting for room in the pipeline logs after this many seconds, then every
    #: ``WAIT_LOG_EVERY_S`` while it still waits.
    WAIT_LOG_S = 5.0
    WAIT_LOG_EVERY_S = 30.0

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
        parts_during_read: bool = True,
        upload_part_bytes: int = DEFAULT_PART_BYTES,  # without blob_store: larger blobs go up in parts of this
        upload_min_bytes_per_s: float | None = None,  # the slowest upload rate a PUT's limit allows (None: 2 MiB/s)
        tls: TlsConfig | bool | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        server_name: str | None = None,
        model_files: Any = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        self.run = check_name("run", run)
        self._upload_kw = transfer.uploader_options(part_bytes=upload_part_bytes, min_bytes_per_s=upload_min_bytes_per_s)
        self.model_files = collect_model_files(self.run, model_files)  # config, tokenizer: publisher/model_files.py
        # TLS to the board (board/channel.py); the files are read here, so a missing one fails now, named
        self._tls = client_tls(tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, server_name=server_name)
        if on_backpressure not in ("wait", "skip"):
            raise InvalidArgument(f"on_backpressure must be 'wait' or 'skip', not {on_backpressure!r}")
        if max_pending < 1:
            raise InvalidArgument(f"max_pending must be >= 1, got {max_pending}")
        if encoding not in ENCODINGS:
            raise InvalidArgument(f"unknown patch encoding {encoding!r}; expected one of {ENCODINGS}")
        if part_bytes is not None and part_bytes < 0:
            raise InvalidArgument(f"part_bytes must be >= 0 (0: one patch blob, nothing staged; None: "
                                  f"parts while islands ask for them), got {part_bytes}")
        if isinstance(board, str):
            self._address, self._token = board, token
        else:  # a BoardClient lives on its creator's loop: open our own to the same board
            self._address, self._token = board.address, token or board.token
            self._tls = self._tls or getattr(board, "tls", None)
        self.spec = served_format if served_format is not None else ServedFormatSpec("bf16")
        self.projector = Projector(self.spec)
        self.blob_store = blob_store
        self.policy = AnchorPolicy(anchor_every, anchor_patch_fraction)
        self.max_pending = max_pending
        self.on_backpressure = on_backpressure
        self.shard_bytes = shard_bytes
        self.encoding = encoding
        self.timeout_s = timeout_s
        self.part_bytes = part_bytes
        self.parts_during_read = parts_during_read  # or after the read, bulk first (parts.FinishAhead)
        self._parts_wanted = False  # the board's word at the last commit (for part_bytes=None)
        self.run_labels = dict(run_labels or {})
        self._resume_state = resume_state
        self._own_work_dir = work_dir is None
        self.work_dir = Path(tempfile.mkdtemp(prefix="weftboard-pub-")) if work_dir is None else Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)

        self._snapshot_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weftboard-snapshot")
        self._hash_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="weftboard-hash")
        # Deltas the read could not encode itself are encoded here, beside the snapshot
        # stage: encoding needs only the deltas, and just the container waits for the root.
        self._encode_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weftboard-encode")
        # The served view (written by the read, in publish order on the snapshot thread).
        self.view = ServedView(self.run, self.projector, encoding, self._hash_pool)
        self._kind = pb.RUN_KIND_UNSPECIFIED
        self._next_version = 0
        self._resumed_head = 0
        self.anchors = AnchorLedger(self.policy)  # guarded by _cond

        self._cond = threading.Condition()
        self._jobs = Pipeline(self.run, self._cond)  # the versions between publish and commit (pipeline.py)
        self._last_read: tuple[threading.Event | None, PublishHandle | None] = (None, None)
        self._async_read = False
        self._hooks: list[Any] = []
        # Per-version telemetry, of the newest RECENT_VERSIONS versions only (job.py).
        self.blocked_s: deque[float] = deque(maxlen=RECENT_VERSIONS)
        self.committed: deque[pb.VersionRecord] = deque(maxlen=RECENT_VERSIONS)
        self.commit_latency_s: deque[float] = deque(maxlen=RECENT_VERSIONS)
        self.timings: deque[dict[str, float]] = deque(maxlen=RECENT_VERSIONS)  # read, digest, encode, upload, commit s
        self.metrics = PublisherMetrics(self.run, self.pending)  # Prometheus, served with metrics_port (metrics.py)
        if metrics_port is not None:
            self.metrics.serve(metrics_port, metrics_host)

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"weftboard-publisher-{run}", daemon=True)
        self._thread.start()
        self._wake: asyncio.Event | None = None
        self._staging: set[asyncio.Future] = set()  # StagePart calls in flight (held so they are not collected)
        self._client: BoardClient | None = None
        self._uploader: Uploader | None = None
        self._worker: asyncio.Task | None = None
        self._finalizer = weakref.finalize(
            self, _abandon, self.run, self._jobs, self._loop, (self._snapshot_pool, self._hash_pool, self._encode_pool),
            self.work_dir if self._own_work_dir else None, self.metrics)

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
        return self._jobs.pending()

    def connect(self, model_or_state: Any = None, *, kind: int = pb.RUN_KIND_WEIGHTS) -> None:
        """Create or open the run (and resume from its head); ``publish`` calls it lazily."""
        if self._kind != pb.RUN_KIND_UNSPECIFIED:
            return
        master = master_state(model_or_state) if model_or_state is not None else None
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
            self._jobs.check()

        self._hooks.append(optimizer.register_step_pre_hook(wait_for_read))
        self._async_read = True

    def publish(self, model_or_state: Any, *, step: int = 0, labels: Mapping[str, str] | None = None) -> PublishHandle:
        """Publish the model's current weights as the next version.

        Returns once the weights have been read into the served view (projection and a
        fused diff), or at once when an optimizer is attached (see ``attach``); encoding,
        hashing, uploads and the commit always happen in the background.
        """
        t0 = time.perf_counter()
        self._jobs.check()
        self.wait_read()
        master = master_state(model_or_state)
        if self._kind == pb.RUN_KIND_UNSPECIFIED:
            self._call(self._connect(master, pb.RUN_KIND_WEIGHTS))
        if self._kind != pb.RUN_KIND_WEIGHTS:
            raise FailedPrecondition(f"run {self.run} is a LoRA adapter run: use publish_adapter()")
        target = self._reserve_slot()
        try:
            self._jobs.check()
        except BaseException as exc:  # failed since: the target left the queue, so only this call can fail it
            if target is not None:
                self._jobs.fail(exc, [target])
            raise
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if target is not None:
            version = target.version
            for h in target.handles:
                h.coalesced = True
        else:
            version = self._next_version
            self._next_version += 1
        handle = PublishHandle(version, step, fut, coalesced=False)
        read_done = threading.Event()
        self._jobs.start()
        self._last_read = (read_done, handle)
        self._snapshot_pool.submit(self._read_and_snapshot, master, version, step, dict(labels or {}), target, fut,
                                   handle, t0, read_done)
        self.blocked_s.append(0.0)
        if not self._async_read:
            read_done.wait()
            self._jobs.check()
        blocked = time.perf_counter() - t0
        handle.blocked_s += blocked
        self.blocked_s[-1] += blocked
        return handle

    def wait_read(self) -> None:
        """Wait until the last published weights have been read (they may change after)."""
        event, _ = self._last_read
        if event is not None:
            event.wait()

    def publish_adapter(self, state_dict: Mapping[str, torch.Tensor], *, step: int = 0,
                        labels: Mapping[str, str] | None = None) -> PublishHandle:
        """Publish a LoRA adapter whole (a run of kind RUN_KIND_LORA_ADAPTER: anchors only)."""
        t0 = time.perf_counter()
        self._jobs.check()
        master = master_state(state_dict)
        if self._kind == pb.RUN_KIND_UNSPECIFIED:
            self._call(self._connect(master, pb.RUN_KIND_LORA_ADAPTER))
        if self._kind != pb.RUN_KIND_LORA_ADAPTER:
            raise FailedPrecondition(f"run {self.run} holds full weights: use publish()")
        self.view.check_layout(self.projector.layout(master))
        self._reserve_slot(allow_skip=False)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        version = self._next_version
        self._next_version += 1
        stored = self.projector.project(master, anchor=True)
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in stored.items()}
        job = Job(version, step, dict(labels or {}), True, AnchorReason.ADAPTER, None, [fut], t0, adapter_tensors=tensors)
        job.touched = set(tensors)
        self._jobs.start()
        self._snapshot_pool.submit(self._snapshot, job)
        handle = PublishHandle(version, step, fut, blocked_s=time.perf_counter() - t0)
        self.blocked_s.append(handle.blocked_s)
        return handle

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every published version is committed (raises a pipeline failure)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self.pending() or self._jobs.failure is not None, timeout):
                raise TimeoutError(f"publisher flush timed out with {self.pending()} versions pending")
        self._jobs.check()

    def close(self, flush: bool = True) -> None:
        if self._jobs.closed:
            return
        try:
            if flush and self._jobs.failure is None:
                self.flush()
        finally:
            self._jobs.close()  # nothing is queued or taken from here on; the versions left queued are aborted
            for hook in self._hooks:
                hook.remove()
            if self._client is not None:
                with contextlib.suppress(Exception):  # closing is best effort once the work is done
                    asyncio.run_coroutine_threadsafe(self._close_client(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._jobs.fail(None, [self._jobs.inflight] if self._jobs.inflight else [])  # a worker that did not end
            self._snapshot_pool.shutdown(wait=True)
            self._hash_pool.shutdown(wait=True)
            self._encode_pool.shutdown(wait=True)
            self.metrics.stop()
            if self._own_work_dir:
                shutil.rmtree(self.work_dir, ignore_errors=True)
            self._finalizer.detach()

    async def _close_client(self) -> None:
        """End the commit worker (a commit in flight is aborted) and the hints for versions that are
        committed or never will be, then the client."""
        tasks = [self._worker, *self._staging]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(self._uploader.close(), self._client.close())

    # -- connect / resume ---------------------------------------------------------------

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _connect(self, master: dict[str, torch.Tensor] | None, kind: int) -> None:
        if self._client is None:
            self._client = BoardClient(self._address, self._token, tls=self._tls, timeout_s=self.timeout_s,
                                       options=FAST_RECONNECT)
            self._uploader = Uploader(self.run, self._client, self.blob_store, **self._upload_kw)
            self._wake = asyncio.Event()
            self._worker = asyncio.create_task(self._commit_worker())
        if master is None:
            raise InvalidArgument("connect() needs the model or state dict to know the run's layout")
        layout = self.projector.layout(master)
        run = await open_run(self._client, self._uploader, pb.Run(
            run=self.run, kind=kind, served_format=self.spec.to_proto(), labels=self.run_labels,
            layout=pb.Layout(tensors=[pb.TensorSpec(name=n, dtype=d, shape=list(s)) for n, d, s in layout])),
            self.model_files)
        self.view.layout = [(t.name, t.dtype, tuple(t.shape)) for t in run.layout.tensors]
        self.view.check_layout(layout)
        self.anchors.anchor_bytes = self.view.stored_bytes()
        head = await self._client.get_head(self.run)
        self._next_version = head.version + 1
        self._resumed_head = head.version
        self._kind = kind
        if head.version > 0 and kind == pb.RUN_KIND_WEIGHTS:
            await self._resume(head.version, master)

    async def _resume(self, head: int, master: dict[str, torch.Tensor]) -> None:
        """Rebuild the served view at ``head`` so the next version can carry a patch."""
        record = await self._client.get_version(self.run, head)
        self.anchors.last_anchor, self.anchors.patch_bytes_since_anchor = await resume.last_anchor(
            self._client, self.run, head, self.policy.anchor_every)
        if self._resume_state is not None:
            got = await resume.view_from_state(master_state(self._resume_state), self.projector, self.view.layout, record)
            self.view.reset(*(got or (None, {})))
            if got is not None:
                log.info("resumed from a given state dict", run=self.run, head=head)
            return
        device = next((t.device for t in master.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
        self.view.reset(*await resume.view_from_run(self._client, self.run, record, self.view.layout, device,
                                                    blob_store=self.blob_store, work_dir=self.work_dir))
        log.info("resumed from the head", run=self.run, head=head, anchor=self.anchors.last_anchor)

    # -- the trainer's side: room in the pipeline ----------------------------------------

    def _reserve_slot(self, allow_skip: bool = True) -> Job | None:
        """Wait for room in the pipeline; under "skip", take the newest queued job to merge into.
        A long wait is logged (``WAIT_LOG_S``, then every ``WAIT_LOG_EVERY_S``)."""
        start = time.monotonic()
        next_log = start + self.WAIT_LOG_S
        with self._cond:
            while True:
                if (now := time.monotonic()) >= next_log:
                    log.info("publish waits for a pending version to commit", run=self.run,
                             pending=self.pending(), max_pending=self.max_pending, waited_s=round(now - start, 1))
                    next_log = now + self.WAIT_LOG_EVERY_S
                self._jobs.check()
                if self.pending() < self.max_pending:
                    return None
                if allow_skip and self.on_backpressure == "skip" and not self._jobs.snapshotting:
                    # Never wait on an upload: merge into the queued version, or queue behind
                    # the one uploading (at most one queued at a time).
                    if (queue := self._jobs.queue) and not queue[-1].started:
                        return queue.pop()
                    if not queue:
                        return None
                self._cond.wait(min(1.0, max(0.01, next_log - time.monotonic())))

    # -- stages 1 and 2: read and snapshot (the snapshot thread, in publish order) --------

    def _read_and_snapshot(self, master: dict[str, torch.Tensor], version: int, step: int, labels: dict[str, str],
                           target: Job | None, fut: concurrent.futures.Future, handle: PublishHandle, t0: float,
                           read_done: threading.Event) -> None:
        """Read the weights into the view, finish what the read scanned, then snapshot the job.

        ``target``: the queued job this version is merged into ("skip"), or None. Whatever fails
        before the job reaches ``_snapshot`` fails this version and the target (``_fail_read``)
        before ``read_done`` is set, so a ``publish`` whose read failed raises it.
        """
        t_read = time.perf_counter()
        try:
            reason = self._decide(version, target)
            if target is not None and target.fused:
                # Merging works on deltas: recover the target's from its streams while the view
                # still holds the target's version.
                target.deltas = self.view.deltas_of(target.fused, target.deltas or {})
                target.fused = {}
            # Encode in the read itself (one pass over old and new bits), unless this read is
            # merged into a queued version or the patch uses another encoding.
            scan = target is None and self.encoding in ("default", "context", "compact")
            compact = scan and self.encoding == "compact"  # encoded in the finish below
            cutter = self._cutter(version) if scan else None
            # Parts ship during the read, each tensor finished once folded (compact: after it).
            ahead = (FinishAhead(cutter, self.view.encode_scanned)
                     if cutter is not None and not compact and self.parts_during_read else None)
            folded = self.view.fold(master, anchor=bool(reason), scan=scan,
                                    on_scanned=ahead.add if ahead is not None else None)
            handle.read_s = read_s = time.perf_counter() - t_read
            read_done.set()
            del master
            t_finish = time.perf_counter()
            # Streams of the tensors the read scanned (the view still holds this version). The changed
            # tensors are hashed on two threads: beside the finish, or after it when it ships parts
            # (far islands wait for the parts; only the commit needs the hashes).
            hashing = self.view.hash_changed(folded) if folded is not None and cutter is None else {}
            deltas, fused = (self.view.finish(folded, cutter, compact, ahead.streams() if ahead is not None else None)
                             if folded is not None else (None, {}))
            if cutter is not None:
                hashing = self.view.hash_changed(folded)
            hashed = {n: f.result() for n, f in hashing.items()}
            release_free_memory()  # after the read: the trainer does not wait for it
            if target is not None and target.anchor_dir is not None:
                shutil.rmtree(target.anchor_dir, ignore_errors=True)
            job = job_of_read(version, step, labels, reason, deltas, fused, fut, handle, t0, target,
                              cutter.parts if cutter is not None else [])
            job.timings.update(read_s=read_s, finish_s=time.perf_counter() - t_finish)
            if job.deltas is not None:
                # Hashed beside the finish: the cache holds the view's current digests.
                self.view.digests.update(hashed)
                job.touched -= hashed.keys()
                job.est_patch_bytes = self.anchors.estimate(job.changed)
            else:
                job.touched = set(self.view.tensors or ())
            with self._cond:
                replaced = target.est_patch_bytes if target is not None and not target.anchor else 0
                self.anchors.read(version, anchor=job.anchor, estimate=job.est_patch_bytes, replaced_estimate=replaced)
            self.view.has_base = True
            if job.has_patch:
                if job.deltas:
                    job.streams = self._encode_pool.submit(encode_streams, job, self.view.names(), self.encoding)
                else:  # every tensor was encoded during the read
                    job.streams = concurrent.futures.Future()
                    job.streams.set_result([job.fused[n] for n in self.view.names()])
            log.debug("read", run=self.run, version=version, anchor=job.anchor, coalesced=target is not None,
                      read_s=round(time.perf_counter() - t0, 4))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            self._fail_read(exc, Job(version, step, labels, False, AnchorReason.NONE, None, [fut], t0), target)
            return
        finally:
            read_done.set()  # after a failure is recorded
        self._snapshot(job)
        try:
            self.view.catch_up_previous(folded or {})  # on this thread: before the next read
        except BaseException as exc:  # noqa: BLE001 - the view no longer equals the newest version
            self._jobs.fail(exc, [])

    def _decide(self, version: int, target: Job | None) -> AnchorReason:
        if target is not None and target.anchor:
            return target.reason
        with self._cond:
            return self.anchors.decide(version, has_base=self.view.tensors is not None and self.view.has_base)

    def _cutter(self, version: int) -> PartCutter | None:
        """Staged parts of the version being read now, uploaded and staged on the publisher's
        loop; None for one patch blob (the first patch, or ``part_bytes`` 0 or unasked)."""
        wanted = SUGGESTED_PART_BYTES if self._parts_wanted else 0
        part_bytes = self.part_bytes if self.part_bytes is not None else wanted
        if not part_bytes or version < 2 or self.view.tensors is None:
            return None
        assert self._uploader is not None and self._client is not None

        def ship(data: bytes) -> concurrent.futures.Future:
            return asyncio.run_coroutine_threadsafe(upload_and_stage(
                version, data, run=self.run, client=self._client, uploader=self._uploader, staging=self._staging,
            ), self._loop)

        return PartCutter(version, self.encoding, part_bytes, ship)

    def _snapshot(self, job: Job) -> None:
        """Digests, root and anchor files of the job, then queue it for its commit, or fail it if
        the publisher has failed or closed (``Pipeline.fail``)."""
        try:
            self.view.snapshot(job, self.work_dir, self.shard_bytes)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter below
            self._jobs.fail(exc, [job], snapshotted=1)
            return
        job.timings["queued_s"] = time.perf_counter() - job.t_publish
        if not self._jobs.enqueue(job):
            self._jobs.fail(None, [job], snapshotted=1)
        elif self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _fail_read(self, exc: BaseException, job: Job, target: Job | None) -> None:
        """A read (or the streams after it) failed: its waiters and a merge target's get the error."""
        self._jobs.fail(exc, [job] + ([target] if target is not None else []), snapshotted=1)

    # -- stage 3: commit (the publisher's event loop, in version order) --------------------

    async def _commit_worker(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (job := self._jobs.take()) is not None:
                try:
                    record = await self._commit(job)
                except BaseException as exc:  # noqa: BLE001
                    closing = isinstance(exc, asyncio.CancelledError) and self._jobs.closed  # close(flush=False)
                    self._jobs.fail(None if closing else exc, [job])  # and the queued jobs; a close's: Aborted
                    if closing:
                        raise
                    break
                finally:
                    self._jobs.finished()
                for f in job.futures:
                    if not f.done():
                        f.set_result(record)

    async def _commit(self, job: Job) -> pb.VersionRecord:
        assert self._uploader is not None and self._client is not None
        done = await commit_job(job, run=self.run, layout=self.view.layout, client=self._client,
                                uploader=self._uploader, encode_pool=self._encode_pool, encoding=self.encoding)
        self._parts_wanted = done.staged_parts_wanted
        if job.anchor_dir is not None:
            shutil.rmtree(job.anchor_dir, ignore_errors=True)
        with self._cond:
            self.anchors.committed(job.version, anchor=job.anchor, estimate=job.est_patch_bytes,
                                   patch_bytes=done.patch_bytes, changed_elements=done.changed_elements)
        job.deltas, job.fused = None, {}  # the patch is committed: its deltas and streams are garbage now
        release_free_memory()
        self.committed.append(done.record)
        self.commit_latency_s.append(time.perf_counter() - job.t_publish)
        self.timings.append(dict(job.timings, version=job.version))
        self.metrics.record_commit(done.record, job, self.commit_latency_s[-1])
        return done.record
