"""A restarting publisher catches its served view up with the run's head.

Two ways: a state dict the caller vouches for (``view_from_state``: kept only if its root
digest equals the head's), or following the run like an island (``view_from_run``: the newest
anchor and the patches after it, through ``weftboard.subscriber``, which verifies every
version against its digests). ``last_anchor`` recovers the anchor policy's counters.

Invariants:
- A view returned here equals the head version bit for bit (digest-checked); otherwise the
  caller gets None and the next version carries an anchor.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import structlog
import torch

from weftboard.cuda.digest import root_digest, tensor_digest
from weftboard.cuda.formats import Projector
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.served_view import LayoutEntry
from weftboard.subscriber.live_tensors import LiveTensorsDestination
from weftboard.subscriber.subscriber import Subscriber

log = structlog.get_logger("weftboard.publisher")


async def last_anchor(client: Any, run: str, head: int, anchor_every: int) -> tuple[int, int]:
    """(the newest anchor version at or below ``head``, patch bytes committed after it),
    looking back at most ``anchor_every`` versions and never below the oldest version garbage
    collection left (the board refuses a listing from there with OUT_OF_RANGE)."""
    oldest = (await client.get_head(run)).oldest_available
    start = max(1, head - anchor_every, oldest)
    last = since = 0
    async for rec in client.iter_versions(run, from_version=start, to_version=head):
        if any(a.kind == pb.ARTIFACT_KIND_ANCHOR for a in rec.artifacts):
            last, since = rec.version, 0
        else:
            since += rec.stats.patch_bytes
    return (last if last else max(0, head - anchor_every)), since


async def view_from_state(state: dict[str, torch.Tensor], projector: Projector, layout: list[LayoutEntry],
                          head: pb.VersionRecord) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """The served view of ``state`` and its digests, if it is the head version; else None."""
    view = {n: t.detach().clone().contiguous() for n, t in projector.project(state, anchor=False).items()}
    digests = {n: await asyncio.to_thread(tensor_digest, t) for n, t in view.items()}
    if root_digest([(n, d, list(s), digests[n]) for n, d, s in layout]) != head.root_digest:
        log.warning("resume state differs from the head; the next version carries an anchor",
                    run=head.run, head=head.version)
        return None
    return view, digests


async def view_from_run(client: Any, run: str, head: pb.VersionRecord, layout: list[LayoutEntry],
                        device: torch.device, *, blob_store: Any, work_dir: Path) -> tuple[dict[str, torch.Tensor],
                                                                                        dict[str, str]]:
    """The head version's served view on ``device``, followed like an island, and its digests."""
    view = {n: torch.empty(s, dtype=getattr(torch, d), device=device) for n, d, s in layout}
    cache = work_dir / "resume-cache"
    destination = LiveTensorsDestination(view)
    sub = Subscriber(client, run, destination, island_id=f"publisher-resume-{run}"[:64],
                     blob_store=blob_store, cache_dir=cache, heartbeat=False)
    try:
        await sub.sync_to(head.version)
    finally:
        await destination.close()
    shutil.rmtree(cache, ignore_errors=True)
    return view, {d.name: d.digest for d in head.tensor_digests}
