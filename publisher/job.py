"""One published version on its way from the read to its commit (``Job``), and the trainer's
handle on it (``PublishHandle``).

Invariants:
- A job with a patch (``deltas`` not None) covers every served tensor exactly once: in
  ``fused`` (streams encoded during the read) or in ``deltas`` (encoded later).
- ``futures`` resolve with the committed record of ``version``; a job that a later publish
  was merged into (``on_backpressure="skip"``) carries the futures and handles of both.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weftboard.cuda.anchors import WrittenFile
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.deltas import merge_deltas
from weftboard.publisher.policy import AnchorReason

# Per-version telemetry a publisher keeps (its ``committed``, ``commit_latency_s``, ``timings``,
# ``blocked_s``): the most recent this many versions, so a run of millions of versions does
# not grow its trainer's memory.
RECENT_VERSIONS = 256


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
class Job:
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

    @property
    def has_patch(self) -> bool:
        """Whether this version carries a patch (it has a base, and is not the first)."""
        return self.deltas is not None and self.version > 1


def job_of_read(version: int, step: int, labels: dict[str, str], reason: AnchorReason, deltas: dict[str, Any] | None,
                fused: dict[str, Any], fut: concurrent.futures.Future, handle: PublishHandle, t_publish: float,
                target: Job | None, parts: list[tuple[list[str], concurrent.futures.Future]]) -> Job:
    """The job of one read: a new version, or (``target``) a queued version and this read merged
    into one whose patch spans both (its deltas; the target's staged parts are left unused)."""
    if target is not None:
        if target.deltas is not None and deltas is not None:
            deltas = {n: merge_deltas(target.deltas[n], d) for n, d in deltas.items()}
        else:
            deltas = None
        if target.anchor and not reason:
            reason = target.reason
        job = Job(version, step, labels, bool(reason), reason, deltas, target.futures + [fut], target.t_publish)
        job.handles = target.handles + [handle]
        job.touched = set(target.touched)
    else:
        job = Job(version, step, labels, bool(reason), reason, deltas, [fut], t_publish)
        job.handles = [handle]
        job.parts = parts
    if deltas is not None:
        job.fused = fused
        job.changed = {n: int(d.positions.numel()) for n, d in deltas.items()}
        job.changed.update((n, e.changed) for n, e in fused.items())
        job.touched |= {n for n, c in job.changed.items() if c}
    return job
