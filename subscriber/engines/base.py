"""The EngineAdapter port: how the island drives an inference engine's weights.

The sidecar owns the engine's weight version; an adapter is the only thing that talks
to the engine about weights. Two ways in: load a whole checkpoint directory (any engine)
or apply a patch to the live tensors in place (engines whose tensors live in our
process). Around either, the engine is paused: ``drain`` (no request runs across the
change) or ``in_place`` (running requests stop between two steps and continue on the new
weights afterwards).

Invariants:
- ``served_version()`` changes only after a load/apply returned successfully; a failure
  raises ``ApplyError`` and leaves it where it was.
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


class ActivationMode(str, Enum):
    DRAIN = "drain"        # wait for in-flight requests, hold new ones, then change weights
    IN_PLACE = "in_place"  # change weights between two decoding steps of running requests


class EngineAdapter(abc.ABC):
    """One engine's weight-update surface."""

    kind: str = "abstract"
    #: True when ``live_tensors()`` returns the engine's own weights, which the subscriber
    #: then patches in place (between ``pause`` and ``resume``).
    supports_patch: bool = False

    def __init__(self) -> None:
        self._version = 0

    def served_version(self) -> int:
        """The version the engine's weights hold now (0 before the first load)."""
        return self._version

    def mark_served(self, version: int) -> None:
        """Record that the engine's weights now hold ``version`` (after a verified change)."""
        self._version = version

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

    @abc.abstractmethod
    async def health(self) -> bool:
        """Whether the engine answers its health endpoint."""

    async def close(self) -> None:
        """Release connections."""


def make_adapter(kind: str, engine_url: str | None = None, *, engine: Any = None, **options: Any) -> EngineAdapter:
    """The adapter for ``--engine kind`` (reference|vllm|sglang)."""
    if kind == "reference":
        from weftboard.subscriber.engines.reference import (
            ReferenceAdapter,
            ReferenceHttpAdapter,
        )

        if engine is not None:
            return ReferenceAdapter(engine)
        if not engine_url:
            raise InvalidArgument("--engine reference needs an in-process engine or --engine-url")
        return ReferenceHttpAdapter(engine_url, **options)
    if not engine_url:
        raise InvalidArgument(f"--engine {kind} needs --engine-url (where the engine serves HTTP)")
    if kind == "vllm":
        from weftboard.subscriber.engines.vllm import VllmAdapter

        return VllmAdapter(engine_url, **options)
    if kind == "sglang":
        from weftboard.subscriber.engines.sglang import SglangAdapter

        return SglangAdapter(engine_url, **options)
    raise InvalidArgument(f"unknown engine {kind!r}: use reference, vllm or sglang")


def require_mode(mode: ActivationMode | str) -> ActivationMode:
    try:
        return ActivationMode(mode)
    except ValueError:
        raise InvalidArgument(f"unknown activation mode {mode!r}: use 'drain' or 'in_place'") from None
