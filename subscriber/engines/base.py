"""The EngineAdapter port: how the island drives an inference engine's weights.

One adapter per engine, one module each (``reference``, ``vllm``, ``sglang``);
``engines.factory.make_adapter`` picks one by name. This module imports none of them.

The sidecar owns the engine's weight version; an adapter is the only thing that talks
to the engine about weights. Two ways in: load a whole checkpoint directory (any engine)
or apply a patch to the live tensors in place (engines whose tensors live in our
process). Around either, the engine is paused: ``drain`` (no request runs across the
change) or ``in_place`` (running requests stop between two steps and continue on the new
weights afterwards).

Invariants:
- ``served_version()`` changes only after a load/apply returned successfully; a failure
  raises ``ApplyError`` and leaves it where it was, except when the adapter can no longer
  vouch for the engine's weights (workers that did not put the old bytes back, a weight
  change the engine never answered and may still be running): then it is 0 and
  ``unverified`` says why (``mark_unverified``), until a later load succeeds (``mark_served``).
- ``load_checkpoint`` and in-place changes of ``live_tensors()`` happen only between
  ``pause`` and ``resume``.
- Every network call an adapter makes has an explicit timeout; an engine answering an
  error status or unreachable during a weight change raises ``ApplyError`` (the message
  carries the engine's answer) so the subscriber can report the island in error.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from weftboard.proto.errors import InvalidArgument
from weftboard.subscriber.destination import VersionTarget


class ActivationMode(str, Enum):
    DRAIN = "drain"        # wait for in-flight requests, hold new ones, then change weights
    IN_PLACE = "in_place"  # change weights between two decoding steps of running requests


class EngineAdapter(abc.ABC):
    """One engine's weight-update surface."""

    kind: str = "abstract"

    def __init__(self) -> None:
        self._version = 0
        #: why the engine's weights are no verified version (see ``mark_unverified``), else None
        self.unverified: str | None = None

    def served_version(self) -> int:
        """The version the engine's weights hold now (0 before the first load, and while ``unverified``)."""
        return self._version

    def mark_served(self, version: int) -> None:
        """Record that the engine's weights now hold ``version`` (after a verified change)."""
        self._version = version
        self.unverified = None

    def mark_unverified(self, reason: str) -> None:
        """Record that the engine's weights are no verified version any more (a change failed half-way
        and was not undone, or its outcome is unknown): ``served_version()`` is 0 until ``mark_served``."""
        self._version = 0
        self.unverified = reason

    @abc.abstractmethod
    async def pause(self, mode: ActivationMode) -> None:
        """Stop the engine from computing with its weights (see ``ActivationMode``)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Let paused requests continue and new ones start."""

    @abc.abstractmethod
    async def load_checkpoint(self, directory: Path, version: int) -> None:
        """Replace the weights by the HF safetensors checkpoint in ``directory``."""

    def live_tensors(self) -> Mapping[str, Any] | None:
        """The engine's own weight tensors when they live in this process, else None.

        This is the "apply a patch in place" path: the caller patches these tensors
        between ``pause`` and ``resume`` and then calls ``mark_served``."""
        return None

    async def load_version(self, directory: Path, target: VersionTarget) -> None:
        """Between ``pause`` and ``resume``: the verified folder of ``target`` whole. Adapters that
        keep the bytes for later patches in place override it; the default is ``load_checkpoint``."""
        await self.load_checkpoint(directory, target.version)

    async def prepare_patch(self, patch: Path, target: VersionTarget) -> bool:
        """While the engine serves, before ``pause``: get ready to take ``patch`` (adapters that
        apply in place stage it). Answers whether something was staged for ``activate_patch``."""
        return False

    async def activate_patch(self, patch: Path, target: VersionTarget, checkpoint_dir: Path) -> str:
        """Between ``pause`` and ``resume``: make the engine serve ``target``, given the verified
        ``patch`` from the version it serves and the verified folder ``checkpoint_dir`` that
        already holds ``target``. Engines that apply patches in place override this; the
        default loads the folder whole. Answers ``"in_place"`` or ``"full_load"``."""
        await self.load_checkpoint(checkpoint_dir, target.version)
        return "full_load"

    async def warm_up(self) -> float:
        """Prepare in-place updates while the engine serves (compile kernels), before the first
        one; the seconds it took (0 for engines with nothing to prepare)."""
        return 0.0

    @abc.abstractmethod
    async def health(self) -> bool:
        """Whether the engine answers its health endpoint."""

    async def close(self) -> None:  # noqa: B027 - optional: an adapter without connections keeps this
        """Release connections."""


def require_mode(mode: ActivationMode | str) -> ActivationMode:
    try:
        return ActivationMode(mode)
    except ValueError:
        raise InvalidArgument(f"unknown activation mode {mode!r}: use 'drain' or 'in_place'") from None
