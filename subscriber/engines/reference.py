"""Adapters for the reference engine: in-process (patched in place) and over HTTP.

In process, the adapter reaches the engine's bf16 tensors directly: a patch is applied
to them in place between two decoding steps (the engine's ``step_lock``), which is how a
real engine's CUDA graphs stay valid. Over HTTP (the engine in its own process) it loads
checkpoint directories through the engine's ``/admin/*`` endpoints.

Invariant: a failed apply or load leaves the engine's tensors on the previous version
(the patch handle is reverted; a checkpoint is validated whole before any tensor is
overwritten) and ``served_version()`` unchanged; over HTTP, a load the engine never answered
(timed out while it may still be loading) leaves no version vouched for (``mark_unverified``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.engines.base import (
    ActivationMode,
    EngineAdapter,
    require_mode,
)
from weftboard.subscriber.engines.http import HttpEngineAdapter
from weftboard.subscriber.reference_engine.engine import ReferenceEngine


class ReferenceAdapter(EngineAdapter):
    """The reference engine living in this process."""

    kind = "reference"

    def __init__(self, engine: ReferenceEngine) -> None:
        super().__init__()
        self.engine = engine
        self._version = engine.version

    def mark_served(self, version: int) -> None:
        super().mark_served(version)
        self.engine.version = version

    async def pause(self, mode: ActivationMode) -> None:
        await self.engine.pause(require_mode(mode).value)

    async def resume(self) -> None:
        await self.engine.resume()

    async def load_checkpoint(self, directory: Path, version: int) -> None:
        if not self.engine.paused:
            raise ApplyError("pause the reference engine before loading a checkpoint")
        try:
            await asyncio.to_thread(self.engine.load_checkpoint_dir, Path(directory))
        except OSError as exc:
            raise ApplyError(f"cannot read checkpoint {directory}: {exc}") from exc
        self.mark_served(version)

    def live_tensors(self) -> Mapping[str, Any]:
        return self.engine.tensors

    async def health(self) -> bool:
        return True


class ReferenceHttpAdapter(HttpEngineAdapter):
    """The reference engine in its own process (``python -m weftboard.subscriber.reference_engine.openai_api``)."""

    kind = "reference"

    async def pause(self, mode: ActivationMode) -> None:
        await self.call("POST", "/admin/pause", json={"mode": require_mode(mode).value})

    async def resume(self) -> None:
        await self.call("POST", "/admin/resume", json={})

    async def load_checkpoint(self, directory: Path, version: int) -> None:
        # the engine validates a checkpoint whole before it overwrites a tensor: an error answer
        # leaves the previous version; no answer leaves none vouched for (``change_weights``)
        await self.change_weights("POST", "/admin/load_checkpoint", json={"path": str(directory), "version": version})
        self.mark_served(version)
