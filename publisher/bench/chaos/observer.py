"""The bench's own eyes: the board's versions, each island's state, each island's checkpoint on disk.

- ``Observer`` watches the run through the ``observer`` links (never faulted) and records every
  committed version with its root digest as an ``observer`` acknowledgement.
- ``IslandStates`` polls each sidecar's ``/weftboard/status`` (the version it holds, whether it
  is ready, its trajectory reporter's counters).
- ``audit_checkpoint`` reads the version an island's ``current`` link names and hashes its
  safetensors files: the root must be the record's root, whatever happened to the island.

Invariants: nothing here changes the system; a read that races a pruned directory is skipped,
not reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from safetensors.torch import load_file

from weftboard.board.client import BoardClient
from weftboard.cuda.digest import root_digest, tensor_digest
from weftboard.proto.errors import WeftboardError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.bench.chaos.cluster import RUN, Cluster, Island
from weftboard.publisher.bench.chaos.history import Ack, Audit, History

Clock = Callable[[], float]


class Observer:
    def __init__(self, cluster: Cluster, history: History, clock: Clock) -> None:
        self.client = BoardClient(cluster.boards_for("observer"), cluster.token, timeout_s=10)
        self.history = history
        self.clock = clock
        self.records: dict[int, pb.VersionRecord] = {}
        self.head = 0
        self.layout: list[tuple[str, str, list[int]]] = []
        self._changed = asyncio.Condition()

    async def run(self) -> None:
        while True:
            try:
                async for event in self.client.watch(RUN, after_version=self.head, max_backoff_s=1.0):
                    if event.WhichOneof("event") == "version":
                        await self._seen(event.version)
            except (WeftboardError, asyncio.TimeoutError) as exc:
                self.history.event(self.clock(), "observer_error", f"{type(exc).__name__}: {exc}"[:300])
                await asyncio.sleep(1.0)

    async def _seen(self, record: pb.VersionRecord) -> None:
        t = self.clock()
        version = record.version
        self.records[version] = record
        anchor = any(a.kind == pb.ARTIFACT_KIND_ANCHOR for a in record.artifacts)
        self.history.acks.append(Ack(round(t, 3), version, record.root_digest, "observer"))
        self.history.event(t, "commit", f"v{version} {'anchor' if anchor else 'patch'} root {record.root_digest[:16]}")
        async with self._changed:
            self.head = max(self.head, version)
            self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Until ``predicate()`` holds after a commit seen (False on timeout)."""
        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(predicate)
        try:
            await asyncio.wait_for(wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def record(self, version: int) -> pb.VersionRecord | None:
        if version not in self.records:
            with contextlib.suppress(WeftboardError):
                self.records[version] = await self.client.get_version(RUN, version)
        return self.records.get(version)

    async def load_layout(self) -> None:
        run = await self.client.get_run(RUN)
        self.layout = [(t.name, t.dtype, list(t.shape)) for t in run.layout.tensors]

    async def final_history(self) -> dict[int, str]:
        return {r.version: r.root_digest async for r in self.client.iter_versions(RUN)}

    async def close(self) -> None:
        await self.client.close()


@dataclass
class IslandState:
    held: int = 0
    head: int = 0
    ready: bool = False
    reachable: bool = False
    trajectories: dict | None = None
    at: float = 0.0


class IslandStates:
    """Each sidecar's ``/weftboard/status``, polled."""

    def __init__(self, cluster: Cluster, clock: Clock, every_s: float = 0.5) -> None:
        self.cluster = cluster
        self.clock = clock
        self.every_s = every_s
        self.states = {i.island_id: IslandState() for i in cluster.islands}

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.gather(*(self._poll(session, island) for island in self.cluster.islands))
                await asyncio.sleep(self.every_s)

    async def _poll(self, session: aiohttp.ClientSession, island: Island) -> None:
        state = self.states[island.island_id]
        if island.url is None or not island.sidecar.alive():
            state.reachable = state.ready = False
            return
        try:
            async with session.get(island.url + "/weftboard/status", timeout=aiohttp.ClientTimeout(total=2)) as r:
                body = await r.json()
            state.held, state.head, state.ready = int(body["held"]), int(body["head"]), bool(body["ready"])
            state.trajectories = body.get("trajectories")
            state.reachable = True
            state.at = self.clock()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
            state.reachable = state.ready = False

    async def wait_held(self, island_id: str, version: int, timeout_s: float) -> float | None:
        """Seconds until ``island_id`` holds ``version`` or later and is ready (None: not in time)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            state = self.states[island_id]
            if state.reachable and state.ready and state.held >= version:
                return time.monotonic() - start
            await asyncio.sleep(0.2)
        return None


def _checkpoint_root(directory: Path, layout: list[tuple[str, str, list[int]]]) -> str:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return root_digest([(name, dtype, shape, tensor_digest(tensors[name])) for name, dtype, shape in layout])


async def audit_checkpoint(island: Island, observer: Observer, history: History, when: str) -> Audit | None:
    """Hash the version ``current`` names and record it against the board's record (None: nothing to read)."""
    current = island.checkpoint / "current"
    try:
        target = os.readlink(current)
    except OSError:
        return None
    name = Path(target).name
    head, _, _ = name.partition("-")
    if not head.startswith("v") or not head[1:].isdigit():
        return None
    version = int(head[1:])
    record = await observer.record(version)
    if record is None or not observer.layout:
        return None
    try:
        root = await asyncio.to_thread(_checkpoint_root, island.checkpoint / target, observer.layout)
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        root = f"unreadable: {type(exc).__name__}: {exc}"[:200]
    with contextlib.suppress(OSError):
        if os.readlink(current) != target:
            return None  # a newer version was swapped in (and this one maybe pruned) while it was read
    audit = Audit(round(observer.clock(), 3), island.island_id, version, root, record.root_digest, when)
    history.audits.append(audit)
    if root != record.root_digest:
        history.event(audit.t, "audit_mismatch", f"{island.island_id} v{version} ({when}): {root} != {record.root_digest}")
    return audit
