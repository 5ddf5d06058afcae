"""A Destination that drives an engine through its adapter, under the admission gate.

The subscriber downloads and verifies blobs while the island keeps serving; only the
activation (the moment weights change) goes through the gate and pauses the engine.
Two shapes, picked from the adapter:
- in-process engines (``adapter.live_tensors()``): ``inner`` is a live-tensor
  destination over the engine's own tensors; the patch is applied to them in place,
  between ``adapter.pause`` and ``adapter.resume``;
- engines in their own process (vLLM, SGLang, the reference engine over HTTP): ``inner``
  is a checkpoint-directory destination; the new checkpoint is written and verified
  aside while serving (and the adapter stages the patch: ``prepare_patch``), then the engine
  is paused and takes the version: a patch in place where its adapter can (``activate_patch``;
  vLLM's worker extension), else the folder whole.

Invariants:
- ``held_version()`` is the version the engine serves (``adapter.served_version()``), 0 once
  the scrub quarantined it (``quarantine``) or the adapter can no longer vouch for the
  engine's weights (``adapter.unverified``), until the next activation.
- A failed activation raises (``ApplyError`` and friends). Where the adapter still vouches for
  the previous version, the engine and ``held_version()`` stay on it and the island state is
  marked in error (the sidecar's readiness and the subscriber's heartbeat report it). Where it
  does not (a change half done and not undone, or never answered), the island state is
  withdrawn like a quarantine: ``held_version()`` and ``state.held`` are 0, the sidecar admits
  no request, the subscriber reports holding nothing and plans from nothing. The next success
  clears either.
- A failed ``resume`` is not a failed change: the activation's outcome stands (``held_version()``
  is what the adapter vouches for), but the engine holds every request, so the island state is
  withdrawn (``paused`` says why; the sidecar answers 503 at once instead of letting requests
  hang) while a task retries ``resume`` with backoff. Once it resumes, the island serves
  ``held_version()`` again unless something else withdrew it meanwhile (unverified weights, a
  quarantine). The next activation, and ``close``, end the task.
- For checkpoint engines a checkpoint already written by an earlier attempt is not
  rewritten: a retry only repeats the activation. For an anchor (the subscriber's last
  resort) that holds only once the folder's copy re-hashes to the target (``verify_held``,
  on a worker thread): a damaged copy of the held version is rebuilt from the anchor's
  shards before the engine loads it, never reloaded as it is.
- It does not apply while a patch arrives (``capabilities``): the engine would stay paused
  for the whole download, or serve a checkpoint the fetcher has not verified yet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, cast

import structlog

from weftboard.proto.errors import ApplyError, WeftboardError
from weftboard.proto.records import BlobRef
from weftboard.subscriber.admission import AdmissionGate, VersionState
from weftboard.subscriber.arriving import ArrivingBytes
from weftboard.subscriber.cancel import cancel_and_wait
from weftboard.subscriber.destination import (
    Capabilities,
    Destination,
    HoldsModelFiles,
    Scrubbable,
    VersionTarget,
)
from weftboard.subscriber.engines.base import EngineAdapter
from weftboard.subscriber.metrics import IslandMetrics

log = structlog.get_logger(__name__)

#: first and longest wait between two tries to resume an engine left paused
RESUME_RETRY_S = 0.5
RESUME_RETRY_MAX_S = 15.0


class HoldsTarget(Protocol):
    """What the checkpoint folder of an engine in its own process also does (``CheckpointDirDestination``)."""

    async def held_target(self) -> VersionTarget | None:
        """The stored record of the held version (read off the event loop), else None."""
        ...


class EngineDestination:
    def __init__(
        self,
        adapter: EngineAdapter,
        gate: AdmissionGate,
        state: VersionState,
        inner: Destination,
        *,
        checkpoint_dir: Path | None = None,
        metrics: IslandMetrics | None = None,
    ) -> None:
        self.adapter = adapter
        self.gate = gate
        self.state = state
        self.inner = inner
        # in process: ``inner`` holds the engine's own tensors (``adapter.live_tensors()``)
        self.in_process = adapter.live_tensors() is not None
        # an engine in its own process starts from the checkpoint folder: it keeps the run's model files
        self.capabilities = Capabilities(applies_while_arriving=False, weights_in_memory=self.in_process,
                                         activates_engine=True,
                                         holds_model_files=inner.capabilities.holds_model_files)
        if not self.in_process and checkpoint_dir is None:
            raise ValueError("an engine in its own process needs the checkpoint directory the inner destination writes")
        self.checkpoint_dir = checkpoint_dir
        self._quarantined = False  # the scrub found the served weights damaged; until the next activation
        self.metrics = metrics
        #: why the engine is left paused (its ``resume`` failed; ``_keep_resuming`` retries), else None
        self.paused: str | None = None
        self._resumer: asyncio.Task | None = None

    def held_version(self) -> int:
        return 0 if self._quarantined else self.adapter.served_version()

    async def load_anchor(self, shards: Sequence[Path], target: VersionTarget) -> None:
        if self.in_process:
            await self._activate_in_process(target.version, lambda: self.inner.load_anchor(shards, target))
        else:
            if not await self._holds_intact(target):
                await self.inner.load_anchor(shards, target)
            assert self.checkpoint_dir is not None
            checkpoint_dir = self.checkpoint_dir
            await self._activate(target.version, lambda: self.adapter.load_version(checkpoint_dir, target))

    async def _holds_intact(self, target: VersionTarget) -> bool:
        """Whether the checkpoint folder holds ``target`` and its copy re-hashes to it (the
        inner ``verify_held``: a worker thread), so an anchor need not rebuild it."""
        if self.inner.held_version() != target.version:
            return False
        try:
            return await cast(Scrubbable, self.inner).verify_held(target)
        except WeftboardError as exc:  # CorruptData: the copy is damaged; the anchor rebuilds it
            log.warning("the held checkpoint does not verify; rebuilding it from the anchor",
                        version=target.version, error=str(exc))
            return False

    async def apply_patch(self, patch: Path, target: VersionTarget) -> None:
        if self.in_process:
            await self._activate_in_process(target.version, lambda: self.inner.apply_patch(patch, target))
        else:
            if self.inner.held_version() != target.version:
                await self.inner.apply_patch(patch, target)
            assert self.checkpoint_dir is not None
            checkpoint_dir = self.checkpoint_dir
            try:
                await self.adapter.prepare_patch(patch, target)  # while the engine still serves
            except (WeftboardError, OSError) as exc:  # activate_patch then applies it whole, or fails loudly
                log.warning("staging the patch in the engine failed", version=target.version, error=str(exc))
            await self._activate(target.version,
                                 lambda: self._patch_engine(patch, target, checkpoint_dir))

    async def missing_model_files(self, files: Sequence[BlobRef]) -> list[str]:
        """The checkpoint folder's (``HoldsModelFiles``; only with ``capabilities.holds_model_files``)."""
        return await cast(HoldsModelFiles, self.inner).missing_model_files(files)

    async def hold_model_files(self, files: Sequence[BlobRef], fetched: Mapping[str, Path]) -> None:
        await cast(HoldsModelFiles, self.inner).hold_model_files(files, fetched)

    async def apply_patch_arriving(self, parts: Sequence[ArrivingBytes], target: VersionTarget) -> None:
        raise ApplyError(f"the {self.adapter.kind} engine destination does not apply a patch while it arrives")

    async def close(self) -> None:
        await self._stop_resuming()
        await self.inner.close()

    async def verify_held(self, target: VersionTarget) -> bool:
        """The scrub (``scrub.py``): the inner destination's copy re-hashed (in process: the
        engine's own tensors; else the checkpoint folder it loaded)."""
        if self.held_version() != target.version:
            return False
        return await cast(Scrubbable, self.inner).verify_held(target)

    async def quarantine(self, version: int, reason: str) -> bool:
        """Stop serving ``version`` (found damaged): under the gate (no request admitted, those
        that may not see a change drained), the inner copy is quarantined and the island holds
        nothing (readiness 503 with the reason) until the next activation."""
        async with self.gate.activation():
            if self.held_version() != version:
                return False
            await cast(Scrubbable, self.inner).quarantine(version, reason)
            self._quarantined = True
            await self.state.withdraw(f"version {version} quarantined: {reason}")
        log.error("served version quarantined; the island serves nothing until it is fetched again",
                  version=version, engine=self.adapter.kind)
        return True

    async def activate_held(self) -> int:
        """After a restart: make the engine serve the verified checkpoint already on disk
        (engines in their own process only), so the island resumes without a download. It goes in
        as a version (``adapter.load_version`` with the folder's stored record: vLLM's workers
        verify and bind it, and a full reload reties a tied head), never as a bare reload."""
        held = self.inner.held_version()
        if self.in_process or held == 0 or held == self.adapter.served_version():
            return self.held_version()
        target = await cast(HoldsTarget, self.inner).held_target()  # the folder's version now
        if target is None or target.version == self.adapter.served_version():
            return self.held_version()
        assert self.checkpoint_dir is not None
        checkpoint_dir = self.checkpoint_dir
        await self._activate(target.version, lambda: self.adapter.load_version(checkpoint_dir, target))
        return self.held_version()

    async def engine_lost(self, reason: str) -> None:
        """The engine restarted (back on its start-up weights) or stopped answering: it serves no
        version the island vouches for. The island is withdrawn until a version is activated
        again (``activate_held`` reloads the verified folder). Not under the gate: the requests
        in flight on a lost engine would only hold the withdrawal back."""
        self.adapter.mark_unverified(reason)
        log.error("the engine no longer serves the verified version; the island serves nothing until it "
                  "is loaded again", engine=self.adapter.kind, reason=reason)
        await self.state.withdraw(f"the {self.adapter.kind} engine lost its verified weights: {reason}")

    async def _activate_in_process(self, version: int, change: Callable[[], Awaitable[None]]) -> None:
        """Apply and verify in place (the inner destination) while the engine is paused."""
        async def change_and_mark() -> None:
            await change()
            self.adapter.mark_served(version)

        await self._activate(version, change_and_mark)

    async def _patch_engine(self, patch: Path, target: VersionTarget, checkpoint_dir: Path) -> None:
        """The engine takes the verified patch in place where its adapter can, else the folder whole."""
        how = await self.adapter.activate_patch(patch, target, checkpoint_dir)
        log.debug("engine updated", version=target.version, engine=self.adapter.kind, how=how)

    async def _activate(self, version: int, change: Callable[[], Awaitable[None]]) -> None:
        """Pause the engine, make the change, record the held version, resume: the only
        window in which the engine does not serve. A failed change is recorded and re-raised; a
        failed resume is not the change's failure (``_resume``)."""
        closed = time.perf_counter()
        async with self.gate.activation():
            await self._stop_resuming()  # this activation resumes the engine itself
            try:
                try:
                    await self.adapter.pause(self.gate.mode)
                    await change()
                    await self.state.set_held(version)
                    self._quarantined = False
                finally:
                    await self._resume(version)
            except (WeftboardError, OSError) as exc:
                await self._failed(version, exc)
                raise
            except BaseException as exc:  # cancelled: only weights left unknown need recording
                if self.adapter.unverified is not None:
                    await self._failed(version, exc)
                raise
        if self.metrics is not None:  # the gate was closed: drain, pause, change, resume
            self.metrics.activated(time.perf_counter() - closed)
        await self._succeeded(version)

    async def _failed(self, version: int, exc: BaseException) -> None:
        """Record a failed activation: the island in error, and withdrawn (nothing admitted, held 0)
        when the adapter no longer vouches for the engine's weights."""
        message = f"activation of version {version} failed on the {self.adapter.kind} engine: {exc}"
        if self.adapter.unverified is None:
            log.error("activation failed; still serving the previous version", version=version,
                      serving=self.held_version(), error=str(exc))
            await self.state.set_error(message)
            return
        log.error("activation failed and left the engine on weights nobody vouches for; the island serves "
                  "nothing until a verified version is loaded", version=version, error=str(exc),
                  unverified=self.adapter.unverified)
        await self.state.withdraw(f"{message}; its weights are no verified version any more")

    async def _resume(self, version: int) -> None:
        """Resume the engine after the activation of ``version`` (done or failed). If it does not
        resume, the engine holds every request: the island is withdrawn (503 at once, not a hang
        until the engine timeout) and ``_keep_resuming`` retries until it does."""
        try:
            await self.adapter.resume()
        except (WeftboardError, OSError) as exc:
            self.paused = (f"the {self.adapter.kind} engine did not resume after the activation of version "
                           f"{version} and holds every request: {exc}")
            log.error("the engine did not resume; the island admits nothing while it retries", version=version,
                      held=self.held_version(), error=str(exc))
            await self.state.withdraw(self.paused)
            self._resumer = asyncio.create_task(self._keep_resuming(), name=f"resume-{self.adapter.kind}")

    async def _keep_resuming(self) -> None:
        """Retry ``adapter.resume()`` with backoff until the engine resumes; then the island serves
        what the adapter vouches for again (still nothing when it vouches for nothing)."""
        delay = RESUME_RETRY_S
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESUME_RETRY_MAX_S)
            try:
                await self.adapter.resume()
            except (WeftboardError, OSError) as exc:
                log.warning("the engine still does not resume", error=str(exc), retry_in_s=delay)
                continue
            break
        paused, self.paused = self.paused, None
        held = self.held_version()
        log.info("the engine resumed", held=held)
        if held > 0 and self.state.withdrawn == paused:  # withdrawn only for the pause: serve again
            await self.state.set_held(held)
            if self.state.error == paused:
                await self.state.set_error(None)

    async def _stop_resuming(self) -> None:
        if self._resumer is not None:
            await cancel_and_wait([self._resumer])
            self._resumer = None

    async def _succeeded(self, version: int) -> None:
        if self.state.error is not None and self.paused is None:  # paused: in error until it resumes
            await self.state.set_error(None)
        log.info("activated", version=version, engine=self.adapter.kind, mode=self.gate.mode.value)
