"""The one protocol every island destination implements: where verified served weights live.

Implementations: ``checkpoint_dir.CheckpointDirDestination`` (an HF safetensors directory,
replaced atomically), ``live_tensors.LiveTensorsDestination`` (torch tensors updated in
place) and ``engine_destination.EngineDestination`` (an engine, through its adapter). What
each can do is declared in its ``capabilities``; the subscriber reads those, never probes.

Every change (``load_anchor``, ``apply_patch``, ``apply_patch_arriving``) runs the same three
phases, all or nothing: apply the change (aside, or in place), verify the result against the
``VersionTarget`` (every tensor digest and the root), activate it (``held_version()`` moves).

Invariants every implementation keeps:
- ``held_version()`` only ever names a version whose root digest was verified.
- A failed change (bad bytes, digest mismatch, crash in the middle) leaves the destination
  on its previous version, never on mixed weights, and raises (``DigestMismatch``,
  ``CorruptData`` or ``ApplyError``); nothing is swallowed.
- A patch requires ``held_version() == target.version - 1``.
- ``apply_patch_arriving`` works only where ``capabilities.applies_while_arriving``; elsewhere
  it raises ``ApplyError`` without touching anything.
- ``close()`` ends the worker threads a destination keeps (its owner calls it when it stops
  following: ``Subscriber.run``); the destination stays usable and makes them again.
- A destination that declares ``capabilities.holds_model_files`` (a checkpoint directory) also
  implements ``HoldsModelFiles``: it keeps the run's model files (config, tokenizer) beside the
  weights of every version it holds, each written only once its digest verified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from weftboard.proto.errors import ApplyError, CorruptData
from weftboard.proto.records import BlobRef
from weftboard.subscriber.arriving import ArrivingBytes


@dataclass(frozen=True)
class TensorEntry:
    """One stored tensor of the served layout."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class VersionTarget:
    """What applying a step must produce, taken from the version record."""

    version: int
    root_digest: str
    tensor_digests: Mapping[str, str]
    layout: Sequence[TensorEntry]
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What a destination can do, declared once by the implementation."""

    #: ``apply_patch_arriving`` works: tensors are patched while the patch's bytes download.
    applies_while_arriving: bool
    #: The held weights are tensors in this process's memory (else files on disk only).
    weights_in_memory: bool
    #: Activating a version changes what an engine serves (it pauses under the admission gate).
    activates_engine: bool
    #: It keeps the run's model files beside the weights (``HoldsModelFiles``).
    holds_model_files: bool = False


class Destination(Protocol):
    capabilities: Capabilities

    def held_version(self) -> int:
        """The verified version held now; 0 when none."""
        ...

    async def load_anchor(self, shards: Sequence[Path], target: VersionTarget) -> None:
        """Replace the held weights by a full anchor checkpoint (safetensors shards)."""
        ...

    async def apply_patch(self, patch: Path, target: VersionTarget) -> None:
        """Apply a patch container from ``target.version - 1`` to ``target.version``."""
        ...

    async def apply_patch_arriving(self, parts: Sequence[ArrivingBytes], target: VersionTarget) -> None:
        """Apply a patch while its parts download; the version is held only once the fetcher
        verified every part's digest and the result verified."""
        ...

    async def close(self) -> None:
        """End the worker threads this destination keeps (idle ones; it stays usable)."""
        ...


class HoldsModelFiles(Protocol):
    """What a destination with ``capabilities.holds_model_files`` also does. A model file is a
    ``BlobRef`` whose ``name`` is its path in the model folder (``proto.model_files``)."""

    async def missing_model_files(self, files: Sequence[BlobRef]) -> list[str]:
        """The names of ``files`` this destination holds no verified copy of."""
        ...

    async def hold_model_files(self, files: Sequence[BlobRef], fetched: Mapping[str, Path]) -> None:
        """Keep ``files`` (the run's model files) from now on, taking the missing ones from
        ``fetched`` (name -> a file the fetcher verified); each copy written is verified again."""
        ...


class Scrubbable(Protocol):
    """What a destination does for the island's scrub (``scrub.py``); the checkpoint directory,
    live tensors and the engine destination implement it."""

    def held_version(self) -> int: ...

    async def verify_held(self, target: VersionTarget) -> bool:
        """Re-hash every held tensor against ``target`` (off the event loop, no apply meanwhile):
        False when ``target.version`` is not held; ``CorruptData`` (``DigestMismatch``) when damaged."""
        ...

    async def quarantine(self, version: int, reason: str) -> bool:
        """Stop holding ``version``, found damaged for ``reason`` (``held_version()`` is 0 after);
        False when another version is held."""
        ...


def require_parent(held: int, target: VersionTarget, where: str) -> None:
    """A patch applies only to the version right before its target."""
    if held != target.version - 1:
        raise ApplyError(f"patch to version {target.version} needs version {target.version - 1}, {where} holds {held}")


def require_transition(base_version: int, target_version: int, target: VersionTarget) -> None:
    """A patch's own header must name the step the record asks for."""
    if target_version != target.version or base_version != target.version - 1:
        raise CorruptData(
            f"patch goes from {base_version} to {target_version}, expected {target.version - 1} to {target.version}"
        )
