"""The port every island destination implements: where verified served weights live.

Implementations: a checkpoint directory in HF safetensors layout (replaced atomically),
live torch tensors updated in place, and an engine (through its adapter). The subscriber
drives them; the sidecar wraps them with its admission gate.

Invariants every implementation keeps:
- ``held_version()`` only ever names a version whose root digest was verified.
- A failed ``load_anchor``/``apply_patch`` (bad bytes, digest mismatch, crash in the
  middle) leaves the destination on its previous version, never on mixed weights, and
  raises (``DigestMismatch``, ``CorruptData`` or ``ApplyError``); nothing is swallowed.
- ``apply_patch`` requires ``held_version() == target.version - 1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


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


def require_parent(held: int, target: VersionTarget, where: str) -> None:
    """A patch applies only to the version right before its target."""
    if held != target.version - 1:
        from weftboard.proto.errors import ApplyError

        raise ApplyError(f"patch to version {target.version} needs version {target.version - 1}, {where} holds {held}")


def require_transition(base_version: int, target_version: int, target: VersionTarget) -> None:
    """A patch's own header must name the step the record asks for."""
    if target_version != target.version or base_version != target.version - 1:
        from weftboard.proto.errors import CorruptData

        raise CorruptData(
            f"patch goes from {base_version} to {target_version}, expected {target.version - 1} to {target.version}"
        )


class Destination(Protocol):
    def held_version(self) -> int:
        """The verified version held now; 0 when none."""
        ...

    async def load_anchor(self, shards: Sequence[Path], target: VersionTarget) -> None:
        """Replace the held weights by a full anchor checkpoint (safetensors shards)."""
        ...

    async def apply_patch(self, patch: Path, target: VersionTarget) -> None:
        """Apply a patch container from ``target.version - 1`` to ``target.version``."""
        ...
