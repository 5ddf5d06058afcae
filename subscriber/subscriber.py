"""The island-side follower (``Subscriber``): one forward path per version, in this order.

0. model files: once, the run's config and tokenizer files into a destination that keeps
   them (``_hold_model_files``, ``model_files.hold_model_files``).
1. watch: follow the run's events on the board (``run``, ``_follow``); staged-part hints
   start downloads early.
2. plan: the steps from the held version (``sync_to``: the watch event's own one-patch plan,
   or the board's ``PlanCatchUp``).
3. fetch: every blob of a step into the cache, size and digest verified
   (``downloads.Downloads``, ``fetch.Fetcher``).
4. verify: the step's target from its version record, which the plan must agree with
   (``_step_target``).
5. apply: the destination applies the step and verifies the result against the target
   (``destination.Destination``).
6. activate: the destination holds the version; the subscriber announces it (``_activated``).
Where the destination's ``capabilities`` allow, 3 to 6 of a one-patch step overlap
(``_execute_arriving``): tensors are applied as their bytes arrive.

Invariants:
- The subscriber's ``held_version`` is the destination's: a version whose root it verified.
- Steps of a plan are applied strictly in order; later steps download while earlier ones
  apply, bounded by ``parallel`` concurrent transfers.
- Staged parts (hints sent while a version is still being encoded) are asked for only from a
  far blob store (``Fetcher.far``; with presigned URLs without one). Nothing of them is used
  before the version commits, and then only the parts its record names; older ones are dropped
  once a version is held. A download is never started twice: the plan's step takes it over.
- A bad blob or a failed apply is never served. Recovery is: refetch with a fresh plan, then
  a plan from nothing (an anchor); each failure is logged and heartbeated as ERROR. Only when
  all three fail does ``sync_to`` raise. A step whose bytes proved bad or missing (CorruptData,
  NotFound, OSError) has its cached blobs dropped; those of steps not applied otherwise (the
  engine failed: ApplyError) stay cached (``Downloads.keep``) for a retry, whose fetch re-hashes them,
  until applied, a plan executes without them, or ``run()`` ends.
- ``run()`` never misses a version: it watches from the held version and, when that falls
  out of retained history (OUT_OF_RANGE), catches up from an anchor and watches again.
- ``run()`` ends only on an error that retrying cannot cure (``FATAL_ERRORS``) or a bug;
  the board or the store away, slow or failing, and a full disk are retried with a growing
  delay while the held version stays served.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from weftboard.proto.errors import (
    AlreadyExists,
    ApplyError,
    CorruptData,
    DigestMismatch,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    Unauthenticated,
    UrlExpired,
    WeftboardError,
)
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.subscriber.destination import Destination, TensorEntry, VersionTarget
from weftboard.subscriber.downloads import Download, Downloads
from weftboard.subscriber.fetch import Fetcher, cache_path
from weftboard.subscriber.metrics import IslandMetrics
from weftboard.subscriber.model_files import hold_model_files

log = structlog.get_logger("weftboard.subscriber")

# A step failing with one of these is retried (refetch, then an anchor): its blobs were bad or
# gone, its presigned URLs expired, or the disk refused a write (OSError) and may not next time.
_RECOVERABLE = (CorruptData, ApplyError, NotFound, UrlExpired, OSError)
_BAD_BYTES = (CorruptData, NotFound, OSError)  # a step failing so may have a damaged or missing blob
# What ends ``run()``: following again cannot cure a refused token or a request the board calls
# invalid; retrying them would only hide a misconfiguration (UrlExpired is retried before these).
FATAL_ERRORS = (Unauthenticated, PermissionDenied, InvalidArgument, AlreadyExists)
RETRY_MAX_S = 30.0


def retry_delay_s(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failure in a row: 1, 2, 4 ... up to RETRY_MAX_S,
    so islands do not meet an outage of the board with a retry every second (``run`` draws
    each wait between 3/4 of this and all of it, so that they do not retry in step either)."""
    return min(RETRY_MAX_S, 2.0 ** (max(failures, 1) - 1))


class Subscriber:
    """Follows one run into one destination (see the module docstring for the path)."""

    def __init__(
        self,
        client: Any,
        run: str,
        destination: Destination,
        *,
        island_id: str,
        region: str = "local",
        blob_store: Any = None,
        cache_dir: Path | str,
        heartbeat_s: float = 5.0,
        lease_s: int = 15,
        heartbeat: bool = True,
        parallel: int = 8,
        progress: Any = None,
        metrics: IslandMetrics | None = None,
    ) -> None:
        self.client = client
        self.run_name = run
        self.destination = destination
        self.island_id = island_id
        self.region = region
        self.blob_store = blob_store
        # ``parallel`` downloads at once: a version's staged parts all start as their hints come.
        self.metrics = metrics or IslandMetrics(run)  # the island's, shared with its sidecar (metrics.py)
        self.metrics.follow(self)
        self.fetcher = Fetcher(Path(cache_dir), blob_store, parallel=parallel, on_bytes=self.metrics.downloaded)
        self.downloads = Downloads(self.fetcher)  # staged parts by digest, and blobs kept for a retry
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s
        self._heartbeat_enabled = heartbeat
        self.progress = progress
        self._model_files_pending = destination.capabilities.holds_model_files  # until step 0 succeeded
        self.head = 0
        self.state = pb.ISLAND_STATE_STARTING
        self.message = ""
        self.version_changed = asyncio.Event()  # set on every change of held_version; clear it to wait again
        self._listeners: list[Callable[[int], Any]] = []
        self._cond = asyncio.Condition()
        self._layout: list[TensorEntry] | None = None
        self._sync_lock = asyncio.Lock()
        self._report_lock = asyncio.Lock()  # one status report in flight: the last sent is the newest
        self.applied_at: dict[int, float] = {}  # version -> time.time() when verified and held
        self._records: dict[int, pb.VersionRecord] = {}  # records already received (watch events)
        # version -> where its sync spent the time: "seen" (unix time the watch event arrived),
        # "fetched_s" (plan to blobs on disk), "apply_s" (apply + verify; for a patch applied
        # while it downloaded, "streamed", only what came after its last byte); for logs and benchmarks.
        self.timings: dict[int, dict[str, float]] = {}

    # -- observation ------------------------------------------------------------------

    @property
    def held_version(self) -> int:
        return self.destination.held_version()

    def add_listener(self, callback: Callable[[int], Any]) -> None:
        """``callback(version)`` after every verified step (sync or async callable)."""
        self._listeners.append(callback)

    async def wait_for_version(self, version: int, timeout_s: float | None = None) -> int:
        """Wait until the held version is at least ``version``; returns it."""
        async def wait() -> int:
            async with self._cond:
                await self._cond.wait_for(lambda: self.held_version >= version)
                return self.held_version

        return await asyncio.wait_for(wait(), timeout_s)

    async def _changed(self, version: int) -> None:
        self.applied_at[version] = time.time()
        self.downloads.drop_prefetched(upto=version)
        for old in [v for v in self.timings if v <= version - 64]:  # a follower runs for months
            del self.timings[old]
        self.version_changed.set()
        async with self._cond:
            self._cond.notify_all()
        for cb in self._listeners:
            result = cb(version)
            if asyncio.iscoroutine(result):
                await result

    # -- state reporting ----------------------------------------------------------------

    async def _set_state(self, state: int, message: str = "") -> None:
        changed = (state, message) != (self.state, self.message)
        self.state, self.message = state, message
        if changed and self._heartbeat_enabled:
            await self.heartbeat()

    def _set_state_soon(self, state: int, message: str = "") -> asyncio.Future:
        """Set the state now and report it in the background; await the result before the
        next report so the board sees reports in order."""
        changed = (state, message) != (self.state, self.message)
        self.state, self.message = state, message
        if changed and self._heartbeat_enabled:
            return asyncio.ensure_future(self.heartbeat())
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def heartbeat(self) -> None:
        """Report the held version and state. Reports go one at a time and each is built once
        its turn comes, so the board never ends on an older report that overtook a newer one
        (the periodic report and a state change racing)."""
        async with self._report_lock:
            status = pb.IslandStatus(
                island_id=self.island_id, run=self.run_name, region=self.region,
                version=self.held_version, state=self.state, message=self.message[:1000],
            )
            try:
                resp = await self.client.heartbeat(status, lease_s=self.lease_s)
                self.head = max(self.head, resp.head)
            except WeftboardError as exc:
                log.warning("heartbeat failed", island=self.island_id, error=str(exc))

    async def _heartbeat_loop(self) -> None:
        while True:
            await self.heartbeat()
            await asyncio.sleep(self.heartbeat_s)

    # -- 1. watch: follow the run's version events -------------------------------------------

    async def run(self) -> None:
        """Follow the run forever: catch up, then apply every new version as it is committed.

        Only an error that following again cannot cure ends it (``FATAL_ERRORS``: a token or a
        request the board refuses) or a bug; everything else (the board or the blob store away
        or slow, an internal error of the board, bad bytes, a full disk) is logged and retried
        after ``retry_delay_s``, the held version served meanwhile.
        """
        hb = asyncio.ensure_future(self._heartbeat_loop()) if self._heartbeat_enabled else None
        failures = 0
        try:
            while True:
                held = self.held_version
                try:
                    await self._follow()
                    failures = 0
                except (OutOfRange, FailedPrecondition) as exc:
                    log.warning("fell behind retained history or run empty; re-planning", island=self.island_id, error=str(exc))
                    await asyncio.sleep(0.5)
                except (WeftboardError, OSError) as exc:
                    if isinstance(exc, FATAL_ERRORS) and not isinstance(exc, UrlExpired):
                        raise  # (an expired URL passes: the next plan carries fresh ones)
                    failures = 1 if self.held_version > held else failures + 1
                    self.metrics.follow_retried()
                    delay = retry_delay_s(failures) * random.uniform(0.75, 1.0)
                    log.error("follow loop error; retrying", island=self.island_id, error=f"{type(exc).__name__}: {exc}",
                              failures=failures, retry_in_s=delay, held=self.held_version)
                    await asyncio.sleep(delay)
        finally:
            self.downloads.drop_prefetched(upto=1 << 62)
            if hb is not None:
                hb.cancel()
                await asyncio.gather(hb, return_exceptions=True)
            await self.destination.close()  # its worker threads end with the following
            await self.downloads.forget_kept(set())
            await self.fetcher.close()

    async def _follow(self) -> None:
        async with self._sync_lock:
            await self._hold_model_files()
        head = (await self.client.get_head(self.run_name)).version
        self.head = max(self.head, head)
        if head > self.held_version:
            await self.sync_to(head)
        elif self.held_version:
            await self._set_state(pb.ISLAND_STATE_READY)
        # Hints only pay for a far blob store (see Fetcher.far): sample its path first, and
        # watch again (returning to run) when the downloads since change the judgement.
        await self.fetcher.measure()
        hints = self.fetcher.far()
        watch = self.client.watch(self.run_name, after_version=self.held_version, progress_interval_ms=1000,
                                  staged_parts=hints, presign=self.blob_store is None)
        async with contextlib.aclosing(watch) as events:
            async for event in events:
                kind = event.WhichOneof("event")
                if kind == "staged":
                    self.downloads.prefetch(event.staged, self.held_version)
                elif kind == "version":
                    v = event.version.version
                    self.head = max(self.head, v)
                    if v > self.held_version:
                        self.timings.setdefault(v, {})["seen"] = time.time()
                        await self.sync_to(v, record=event.version)
                elif kind == "progress":
                    self.head = max(self.head, event.progress.head)
                    if self.head > self.held_version:
                        await self.sync_to(self.head)
                if self.fetcher.far() is not hints:
                    log.info("blob store distance judged anew; watching again", island=self.island_id,
                             far=not hints, first_byte_s=self.fetcher.first_byte_s())
                    return

    # -- 2. plan: the steps from the held version to the wanted one ---------------------------

    async def sync_to(self, want: int = 0, *, record: pb.VersionRecord | None = None) -> int:
        """Catch up to ``want`` (0: the head); returns the verified version held after.

        ``record``: the record of ``want`` when the caller has it (a watch event), so the
        common one-patch step needs no planning round trip.
        """
        async with self._sync_lock:
            await self._hold_model_files()
            errors: list[str] = []
            for attempt, from_nothing in ((1, False), (2, False), (3, True)):
                have = 0 if from_nothing else self.held_version
                plan = self._direct_plan(record) if attempt == 1 and record is not None else None
                if plan is None:
                    plan = await self.client.plan_catch_up(
                        self.run_name, have_version=have, want_version=want, presign=self.blob_store is None
                    )
                self.head = max(self.head, plan.to_version)
                if not plan.steps or (plan.to_version <= self.held_version and not from_nothing):
                    if self.state != pb.ISLAND_STATE_READY and self.held_version:
                        await self._set_state(pb.ISLAND_STATE_READY)
                    return self.held_version
                # The CATCHING_UP report travels while the step downloads (one round trip
                # less on the way to the new version); it is awaited before the next report.
                report = self._set_state_soon(pb.ISLAND_STATE_CATCHING_UP, f"to version {plan.to_version}")
                try:
                    await self._execute(plan)
                except _RECOVERABLE as exc:
                    self.metrics.step_failed(exc)
                    await report
                    errors.append(f"attempt {attempt}: {type(exc).__name__}: {exc}")
                    log.error(
                        "catch-up step failed; nothing of it is served",
                        island=self.island_id, run=self.run_name, attempt=attempt,
                        next="refetch" if attempt == 1 else "anchor" if attempt == 2 else "give up",
                        error=str(exc), held=self.held_version,
                    )
                    await self._set_state(pb.ISLAND_STATE_ERROR, f"{type(exc).__name__}: {exc}")
                    continue
                except BaseException:
                    report.cancel()
                    raise
                await report
                await self._set_state(pb.ISLAND_STATE_READY)
                return self.held_version
            message = "; ".join(errors)
            await self._set_state(pb.ISLAND_STATE_ERROR, message)
            raise ApplyError(f"island {self.island_id} could not reach version {want or 'head'}: {message}")

    async def _hold_model_files(self) -> None:
        """Step 0, until it succeeds once (the sync lock held): the run's model files into the
        destination; a file that does not verify is reported as ERROR and raised."""
        if not self._model_files_pending:
            return
        try:
            fetched = await hold_model_files(self.client, self.run_name, self.destination, self.fetcher,
                                             presign=self.blob_store is None)
        except CorruptData as exc:
            await self._set_state(pb.ISLAND_STATE_ERROR, f"model files: {type(exc).__name__}: {exc}")
            raise
        self._model_files_pending = False
        if fetched:
            log.info("model files fetched", island=self.island_id, run=self.run_name, files=fetched)

    def _direct_plan(self, record: pb.VersionRecord) -> pb.CatchUpPlan | None:
        """The one-patch plan a watch event describes (no PlanCatchUp round trip), when the island
        holds the parent and reads blobs with its own credentials or the event has their URLs."""
        held = self.held_version
        if held == 0 or record.version != held + 1:
            return None
        for a in record.artifacts:
            if (a.kind == pb.ARTIFACT_KIND_PATCH and a.base_version == held and a.blobs
                    and all(self.fetcher.can_read(b) for b in a.blobs)):
                self._records[record.version] = record
                return pb.CatchUpPlan(run=self.run_name, from_version=held, to_version=record.version, steps=[
                    pb.PlanStep(kind=pb.ARTIFACT_KIND_PATCH, from_version=held, to_version=record.version,
                                blobs=a.blobs, root_digest=record.root_digest)], total_bytes=sum(b.size for b in a.blobs))
        return None

    async def _execute(self, plan: pb.CatchUpPlan) -> None:
        """Steps 3 to 6 for every step of ``plan``, in order; later steps download (3) while
        earlier ones apply (5)."""
        steps = list(plan.steps)
        await self.downloads.forget_kept({b.digest for s in steps for b in s.blobs})
        if self.progress is not None:
            for s in steps:
                self.progress.begin(s.to_version, "anchor" if s.kind == pb.ARTIFACT_KIND_ANCHOR else "patch",
                                    sum(b.size for b in s.blobs), [cache_path(self.fetcher.cache_dir, b) for b in s.blobs])
        t_plan = time.perf_counter()
        if self._applies_while_arriving(steps):
            await self._execute_arriving(steps[0], t_plan)
            return
        fetches = [asyncio.ensure_future(self.downloads.fetch_step(s)) for s in steps]
        targets = [asyncio.ensure_future(self._step_target(s)) for s in steps]
        settled = 0  # steps applied, or whose blobs were dropped as bad; the rest keep theirs cached
        try:
            for step, fetch, target_f in zip(steps, fetches, targets, strict=True):
                try:
                    paths = await fetch  # 3. fetch
                    fetched_s = time.perf_counter() - t_plan
                    target = await target_f  # 4. verify
                    t0 = time.perf_counter()
                    await self._apply_step(step, paths, target)  # 5. apply, 6. activate
                except _BAD_BYTES:
                    settled += 1
                    await self.downloads.forget_step(step)
                    raise
                settled += 1
                await self.downloads.forget_step(step)
                await self._activated(step, fetched_s, time.perf_counter() - t0)
        finally:
            self.downloads.keep([b for s in steps[settled:] for b in s.blobs])  # verified, for a retry
            if self.progress is not None:
                for s in steps:
                    self.progress.end(s.to_version)
            for f in (*targets, *fetches):
                if not f.done():
                    f.cancel()
            await asyncio.gather(*targets, *fetches, return_exceptions=True)

    def _applies_while_arriving(self, steps: list[pb.PlanStep]) -> bool:
        """Whether this plan is applied while it downloads: one patch (the step a following
        island takes each version) from a far store into a destination that can. From a near
        store the download is too short to hide anything behind, and applying alongside it
        only makes the two contend."""
        return (len(steps) == 1 and steps[0].kind == pb.ARTIFACT_KIND_PATCH
                and self.destination.capabilities.applies_while_arriving and self.fetcher.far())

    # -- 3. fetch: every blob of a step into the cache, its digest verified (downloads.py) ----

    # -- 4. verify: what applying a step must produce -----------------------------------------

    async def _get_layout(self) -> list[TensorEntry]:
        if self._layout is None:
            run = await self.client.get_run(self.run_name)
            self._layout = [TensorEntry(t.name, t.dtype, tuple(t.shape)) for t in run.layout.tensors]
        return self._layout

    async def _step_target(self, step: pb.PlanStep) -> VersionTarget:
        """The target of ``step`` from its version record (root, tensor digests, layout); the
        plan and the record must agree on the root."""
        version = step.to_version
        record = self._records.pop(version, None) or await self.client.get_version(self.run_name, version)
        if record.root_digest != step.root_digest:
            raise CorruptData(f"plan step to {version} names root {step.root_digest}, the record {record.root_digest}")
        return VersionTarget(
            version=version,
            root_digest=record.root_digest,
            tensor_digests={d.name: d.digest for d in record.tensor_digests},
            layout=await self._get_layout(),
            labels=dict(record.labels),
        )

    # -- 5. apply and 6. activate: the destination changes, verifies the result, holds it -----

    async def _apply_step(self, step: pb.PlanStep, paths: list[Path], target: VersionTarget) -> None:
        if self.progress is not None:
            self.progress.applying(step.to_version)
        if step.kind == pb.ARTIFACT_KIND_ANCHOR:
            await self.destination.load_anchor(paths, target)
            return
        if len(paths) == 1:
            await self.destination.apply_patch(paths[0], target)
            return
        joined = await self.fetcher.join(step.to_version, paths)  # cancelled: no joined file is left
        try:
            await self.destination.apply_patch(joined, target)
        finally:
            joined.unlink(missing_ok=True)

    async def _execute_arriving(self, step: pb.PlanStep, t_plan: float) -> None:
        """Steps 3 to 6 of one patch step at once: tensors are applied as its parts' bytes
        arrive (staged parts may have arrived already); the destination holds the version only
        after the fetcher verified every part and it verified the result."""
        transfers = [self.downloads.for_ref(step.to_version, ref) for ref in step.blobs]
        parts = [d.bytes for d in transfers]
        fetching = asyncio.ensure_future(asyncio.gather(*(d.task for d in transfers)))
        if self.progress is not None:
            fetching.add_done_callback(lambda f: f.cancelled() or f.exception() or self.progress.applying(step.to_version))
        try:
            target = await self._step_target(step)
            await self.destination.apply_patch_arriving(parts, target)
            fetched_at = max(t for _, t in await fetching)
        except CorruptData as exc:
            # A stream failed its check: the parts' own digests tell whether one was damaged
            # after it was published (DigestMismatch, the precise report) or published so.
            await asyncio.wait([fetching])
            causes = [d.task.exception() for d in transfers if d.task.done() and not d.task.cancelled()]
            await self._drop_arriving(step, transfers, fetching)
            cause = next((c for c in causes if isinstance(c, DigestMismatch)), None)
            if cause is not None and cause is not exc:
                raise cause from exc
            raise
        except BaseException as exc:
            for blob in parts:
                blob.fail(exc if isinstance(exc, Exception) else ApplyError("the step was cancelled"))
            await self._drop_arriving(step, transfers, fetching)
            raise
        await self.downloads.forget_step(step)
        # apply_s: what the apply added after the last byte arrived (the rest overlapped it);
        # fetched_s is 0 when staged parts were all here before the version committed.
        await self._activated(step, max(fetched_at - t_plan, 0.0), time.perf_counter() - fetched_at, arriving=True)

    async def _drop_arriving(self, step: pb.PlanStep, transfers: list[Download], fetching: asyncio.Future) -> None:
        await self.downloads.drop(transfers, fetching)
        if self.progress is not None:
            self.progress.end(step.to_version)

    async def _activated(self, step: pb.PlanStep, fetched_s: float, apply_s: float, *, arriving: bool = False) -> None:
        """Record, log and announce a step the destination verified and holds (``apply_s``:
        see ``timings``)."""
        timing = {"fetched_s": fetched_s, "apply_s": apply_s}
        if arriving:
            timing["streamed"] = 1.0
        self.timings.setdefault(step.to_version, {}).update(timing)
        self.metrics.step_applied("anchor" if step.kind == pb.ARTIFACT_KIND_ANCHOR else "patch",
                                  sum(b.size for b in step.blobs), fetched_s, apply_s)
        log.info("version applied", island=self.island_id, run=self.run_name, version=step.to_version,
                 kind="anchor" if step.kind == pb.ARTIFACT_KIND_ANCHOR else "patch",
                 bytes=sum(b.size for b in step.blobs), fetched_s=round(fetched_s, 3), apply_s=round(apply_s, 3),
                 **({"streamed": True} if arriving else {}))
        if self.progress is not None:
            self.progress.end(step.to_version)
        await self._changed(step.to_version)
