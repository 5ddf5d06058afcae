"""A destination that keeps served weights in live torch tensors (CPU or GPU), in place.

For an engine in the same process: its weight tensors are handed over once and stay the
same objects forever (same storage, same device pointers), so CUDA graphs and anything
else holding them remain valid.

Invariants:
- A patch's headers, checksums and directories are checked before any byte is written, and
  ``apply_patch_`` undoes its own writes if a stream proves damaged mid-apply; after it is
  written, the tensors it touched are hashed and checked against the record, and a mismatch
  is undone with ``AppliedPatch.revert()`` before the error is raised: the held version's
  bytes are back, bit for bit.
- ``apply_patch_arriving`` writes tensors while the patch (its parts) downloads; the version
  is held only once every part's digest, the tensor digests and the root check out, and any failure
  (including a download that gives up or a cancelled step) reverts every write first.
- An anchor is verified in its files first (tensor digests and root), and only then copied
  into the live tensors with ``copy_``.
- ``held_version()`` names a verified version only; 0 until the first verified step, and
  again after the scrub found the tensors damaged (``quarantine``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, NoReturn

import structlog
import torch

from weftboard.cuda.anchors import map_safetensors
from weftboard.cuda.codec import apply_patch_, apply_patch_arriving_
from weftboard.cuda.digest import tensor_digest
from weftboard.proto.errors import ApplyError, CorruptData
from weftboard.subscriber.arriving import ArrivingApplier, ArrivingBytes
from weftboard.subscriber.cancel import thread_to_the_end
from weftboard.subscriber.destination import (
    Capabilities,
    VersionTarget,
    require_parent,
    require_transition,
)
from weftboard.subscriber.verify import check_layout, verify_tensors

log = structlog.get_logger("weftboard.subscriber")


class LiveTensorsDestination:
    capabilities = Capabilities(applies_while_arriving=True, weights_in_memory=True, activates_engine=False)

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, held_version: int = 0, digests: Mapping[str, str] | None = None) -> None:
        """``tensors`` are updated in place. ``held_version``/``digests`` only for tensors the
        caller has already verified (e.g. the publisher's own view)."""
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise ApplyError(f"tensor {name!r} is not contiguous; patches apply in place to contiguous storage")
        self.tensors = dict(tensors)
        self._held = held_version
        self._digests: dict[str, str] = dict(digests or {})
        self._lock = asyncio.Lock()
        self._arriving = ArrivingApplier()  # apply_patch_arriving's thread

    def held_version(self) -> int:
        return self._held

    def _holding(self, version: int) -> Callable[[dict[str, str]], None]:
        """What records a finished load or apply: its digests, and ``version`` as held."""
        def hold(digests: dict[str, str]) -> None:
            self._digests, self._held = digests, version
        return hold

    async def load_anchor(self, shards: Sequence[Path], target: VersionTarget) -> None:
        async with self._lock:
            await thread_to_the_end(self._load_anchor, list(shards), target, then=self._holding(target.version))

    def _load_anchor(self, shards: list[Path], target: VersionTarget) -> dict[str, str]:
        maps = []
        try:
            files: dict[str, torch.Tensor] = {}
            for path in shards:
                tensors, mm = map_safetensors(path, writable=False)
                maps.append(mm)
                dup = set(files) & set(tensors)
                if dup:
                    raise CorruptData(f"anchor shards repeat tensors {sorted(dup)[:3]}")
                files.update(tensors)
            digests = verify_tensors(files, target)  # the files, before touching live tensors
            check_layout(self.tensors, target)
            for name, src in files.items():
                self.tensors[name].copy_(src)
            files.clear()
            return digests
        finally:
            for mm in maps:
                with contextlib.suppress(BufferError):  # a view is still referenced; the GC closes it later
                    mm.close()

    async def apply_patch(self, patch: Path, target: VersionTarget) -> None:
        async with self._lock:
            require_parent(self._held, target, "the destination")
            await thread_to_the_end(self._apply, patch, target, then=self._holding(target.version))

    async def apply_patch_arriving(self, parts: Sequence[ArrivingBytes], target: VersionTarget) -> None:
        """Apply a patch while its parts download (each fills as bytes arrive; the fetcher marks
        it verified once its digest matched): each tensor is written and hashed as soon as
        its stream is here, and the version is held only after every part's digest, every
        tensor digest and the root check out; anything else is reverted and raised."""
        async with self._lock:
            require_parent(self._held, target, "the destination")
            digests = await self._arriving.run(parts, self._apply_arriving, parts, target,
                                               what=f"applying version {target.version}")
            self._digests, self._held = digests, target.version

    async def close(self) -> None:
        """End the apply thread of patches applied while they arrive (made again when needed)."""
        async with self._lock:
            await self._arriving.close()

    async def verify_held(self, target: VersionTarget) -> bool:
        """The scrub (``scrub.py``): every held tensor re-hashed against ``target``; False when
        another version is held, ``DigestMismatch`` when the tensors were damaged."""
        async with self._lock:
            if self._held != target.version:
                return False
            self._digests = await asyncio.to_thread(verify_tensors, self.tensors, target)
            return True

    async def quarantine(self, version: int, reason: str) -> bool:
        """Hold nothing from now on (``version`` was found damaged: the tensors are no verified
        version until an anchor is loaded into them); False when another version is held."""
        async with self._lock:
            if self._held != version:
                return False
            self._held, self._digests = 0, {}
            log.error("live tensors quarantined: they hold no verified version", version=version, reason=reason)
            return True

    def _apply_arriving(self, parts: Sequence[ArrivingBytes], target: VersionTarget) -> dict[str, str]:
        check_layout(self.tensors, target)
        with ThreadPoolExecutor(1, thread_name_prefix="weftboard-verify") as hasher:
            hashing: dict[str, Future] = {}

            def hash_soon(name: str) -> None:
                hashing[name] = hasher.submit(tensor_digest, self.tensors[name])

            applied = apply_patch_arriving_(self.tensors, parts, on_tensor=hash_soon)  # reverts itself on failure
            try:
                require_transition(applied.base_version, applied.target_version, target)
                fresh = {n: f.result() for n, f in hashing.items()}
                for blob in parts:
                    blob.wait_verified()  # each whole part hashed to its record
                return verify_tensors(self.tensors, target, rehash=(), cache={**self._digests, **fresh})
            except BaseException as exc:
                for f in hashing.values():
                    f.cancel()
                wait(list(hashing.values()))
                _reject(applied, target, exc)

    def _apply(self, patch: Path, target: VersionTarget) -> dict[str, str]:
        data = patch.read_bytes()
        check_layout(self.tensors, target)
        applied = apply_patch_(self.tensors, data)  # all or nothing: undoes itself on damage
        try:
            require_transition(applied.base_version, applied.target_version, target)
            touched = [n for n, c in applied.changed.items() if c]
            return verify_tensors(self.tensors, target, rehash=touched, cache=self._digests)
        except BaseException as exc:
            _reject(applied, target, exc)


def _reject(applied: Any, target: VersionTarget, exc: BaseException) -> NoReturn:
    """Undo a written patch whose result was refused, log it, and raise: the precise error
    as it is, anything unexpected as an ``ApplyError``."""
    applied.revert()
    log.error("patch result rejected and reverted", version=target.version, error=str(exc))
    if isinstance(exc, (CorruptData, ApplyError)) or not isinstance(exc, Exception):
        raise exc
    raise ApplyError(f"applying the patch to version {target.version} failed: {exc}") from exc
