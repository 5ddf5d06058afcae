"""Doing one scheduled fault to the real system, and timing the recovery it needs.

Each kind is one method: it injects (SIGKILL, a proxy mode, a full disk, flipped bytes), holds
for the fault's ``hold_s``, undoes what a supervisor or an operator would (restart the process on
the same data, heal the link, free the disk), then measures how long the affected component
takes to serve again, recorded as a ``Recovery``:

- redis, s3, a board: from the restart until it answers (PING, the bucket, a board RPC); after
  Redis or S3, the publisher too: until it commits again;
- the publisher: from its restart (or a healed link) until it commits a version;
- an island: from its restart (a healed link, a freed disk, a repaired path to its store) until
  it is ready and holds the head of that moment (for a corrupted blob: the damaged version);
- the consumer: from a healed link until a poll succeeds.

Invariants:
- One fault at a time per process or link (a lock per name): overlapping faults on different
  parts are allowed, on one part they queue.
- Every fault ends healed: a link in a ``finally``; what it killed is restarted until it is up
  (a restart that keeps failing is recorded, and the recovery counted as never).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from weftboard.board.client import BoardClient
from weftboard.proto.errors import WeftboardError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.bench.chaos.cluster import RUN, Cluster
from weftboard.publisher.bench.chaos.fault_proxy import Fault, FaultMode
from weftboard.publisher.bench.chaos.history import FaultRecord, History, Recovery
from weftboard.publisher.bench.chaos.observer import (
    IslandStates,
    Observer,
    audit_checkpoint,
)
from weftboard.publisher.bench.chaos.schedule import FaultKind, ScheduledFault
from weftboard.publisher.bench.chaos.workload import TrajectoryReader

Clock = Callable[[], float]
NET_MODES = {FaultKind.NET_LATENCY: FaultMode.LATENCY, FaultKind.NET_BANDWIDTH: FaultMode.BANDWIDTH,
             FaultKind.NET_RESET: FaultMode.RESET, FaultKind.NET_BLACKHOLE: FaultMode.BLACKHOLE,
             FaultKind.NET_HALF_OPEN: FaultMode.HALF_OPEN}


@dataclass
class TrainerEvents:
    """What the trainer process said on stdout: publishes and acknowledged commits, with times."""

    published: dict[int, float] = field(default_factory=dict)
    committed: dict[int, float] = field(default_factory=dict)
    incarnation_committed: int = 0  # commits acknowledged to the current incarnation
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def publish_span_s(self) -> float:
        """Median time from a publish to its commit, over recent versions."""
        spans = [self.committed[v] - t for v, t in list(self.published.items())[-30:] if v in self.committed]
        return statistics.median(spans) if spans else 0.3

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        async def wait() -> None:
            async with self.changed:
                await self.changed.wait_for(predicate)
        try:
            await asyncio.wait_for(wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False


def component_of(name: str) -> str:
    """The component a process belongs to: ``island-2`` is an ``island``, ``board-0`` a ``board``."""
    return name.split("-")[0] if name.startswith(("island-", "board-")) else name


class Injector:
    def __init__(self, cluster: Cluster, observer: Observer, states: IslandStates, reader: TrajectoryReader,
                 trainer: TrainerEvents, history: History, clock: Clock, seed: int, recovery_wait_s: float,
                 locks: dict[str, asyncio.Lock]) -> None:
        self.cluster = cluster
        self.observer = observer
        self.states = states
        self.reader = reader
        self.trainer = trainer
        self.history = history
        self.clock = clock
        self.rng = random.Random(f"{seed}-injector")
        self.recovery_wait_s = recovery_wait_s
        self.locks = locks  # shared with the supervisor: it leaves alone what a fault holds

    def lock(self, name: str) -> asyncio.Lock:
        return self.locks.setdefault(name, asyncio.Lock())

    def _recovered(self, who: str, fault: ScheduledFault, t: float, seconds: float | None) -> str:
        """Record how long ``who`` (a process name) took to serve again after ``fault``."""
        self.history.recoveries.append(Recovery(round(t, 3), component_of(who), f"{fault.kind.value} on {fault.target}",
                                                None if seconds is None else round(seconds, 3)))
        took = "never" if seconds is None else f"in {seconds:.2f}s"
        self.history.event(self.clock(), "recovered", f"{who} after {fault.kind.value} {took}")
        return took

    async def run(self, fault: ScheduledFault) -> None:
        if fault.kind in NET_MODES:
            names = sorted(p.name for p in self.cluster.links(fault.target))
        else:
            names = [fault.target]
        async with contextlib.AsyncExitStack() as stack:
            for name in names:
                await stack.enter_async_context(self.lock(name))
            t_start = self.clock()
            self.history.event(t_start, "fault", fault.describe())
            try:
                detail = await getattr(self, fault.kind.value)(fault)
            except Exception as exc:  # noqa: BLE001 - recorded; the run and its checks go on
                detail = f"the fault itself failed: {type(exc).__name__}: {exc}"
            self.history.faults.append(FaultRecord(fault.index, fault.kind.value, fault.target, round(t_start, 3),
                                                   round(self.clock(), 3), detail[:500]))
            self.history.event(self.clock(), "fault_done", f"#{fault.index} {fault.kind.value}: {detail}"[:500])

    # -- servers ----------------------------------------------------------------------------

    async def _restart_until_up(self, start: Callable, what: str) -> float | None:
        t = time.monotonic()
        while time.monotonic() - t < self.recovery_wait_s:
            try:
                await start()
                return time.monotonic() - t
            except Exception as exc:  # noqa: BLE001 - a restart that failed is retried, and recorded
                self.history.event(self.clock(), "restart_failed", f"{what}: {type(exc).__name__}: {exc}"[:300])
                await asyncio.sleep(1.0)
        return None

    async def redis_kill(self, fault: ScheduledFault) -> str:
        pid = self.cluster.redis.child.pid
        self.cluster.redis.kill()
        await self.cluster.redis.wait_dead()
        self.cluster.detach("redis")
        await asyncio.sleep(fault.hold_s)
        t = self.clock()
        took = self._recovered("redis", fault, t, await self._restart_until_up(self.cluster.restart_redis, "redis"))
        commits = await self._commits_resume(fault)
        return f"killed redis-server pid {pid}; restarted on its AOF, up {took}; commits again {commits}"

    async def s3_kill(self, fault: ScheduledFault) -> str:
        pid = self.cluster.s3.pid
        self.cluster.s3.kill()
        await self.cluster.s3.wait_dead()
        self.cluster.detach("s3")
        await asyncio.sleep(fault.hold_s)
        t = self.clock()
        took = self._recovered("s3", fault, t, await self._restart_until_up(self.cluster.restart_s3, "s3"))
        commits = await self._commits_resume(fault)
        return f"killed weed pid {pid}; restarted on its data, up {took}; commits again {commits}"

    async def _commits_resume(self, fault: ScheduledFault) -> str:
        """The system's recovery from a store's restart: until the publisher commits again."""
        t = self.clock()
        seconds = await self._client_recovery("publisher")
        return self._recovered("publisher", fault, t, seconds)

    async def board_kill(self, fault: ScheduledFault) -> str:
        j = int(fault.target.split("-")[1])
        board = self.cluster.boards[j]
        pid = board.pid
        board.kill(signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await board.wait(10)
        self.cluster.detach(fault.target)
        await asyncio.sleep(fault.hold_s)
        t = self.clock()
        took = self._recovered(fault.target, fault, t,
                               await self._restart_until_up(lambda: self.cluster.start_board(j), fault.target))
        return f"killed {fault.target} pid {pid}; restarted, serving {took}"

    # -- the publisher ----------------------------------------------------------------------

    async def publisher_kill(self, fault: ScheduledFault) -> str:
        trainer = self.cluster.trainer
        seen = set(self.trainer.published)
        if not await self.trainer.wait_for(lambda: set(self.trainer.published) - seen != set(), 30):
            return "no publish to interrupt within 30s"
        version = max(set(self.trainer.published) - seen)
        delay = fault.param * self.trainer.publish_span_s()
        await asyncio.sleep(delay)
        pid = trainer.pid
        trainer.kill(signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await trainer.wait(10)
        phase = "after its commit" if version in self.trainer.committed else "mid-publish, before its commit"
        await asyncio.sleep(fault.hold_s)
        self.cluster.trainer_resume = "state" if trainer.incarnation % 2 else "run"
        t = self.clock()
        began = time.monotonic()
        self.trainer.incarnation_committed = 0
        await trainer.start()
        ok = await self.trainer.wait_for(lambda: self.trainer.incarnation_committed > 0, self.recovery_wait_s)
        took = self._recovered("publisher", fault, t, time.monotonic() - began if ok else None)
        return (f"killed the trainer pid {pid} {delay:.3f}s into publishing v{version} ({phase}); restarted "
                f"(resume from {self.cluster.trainer_resume}), committing again {took}")

    # -- islands ----------------------------------------------------------------------------

    async def island_kill(self, fault: ScheduledFault) -> str:
        island = self.cluster.island(fault.target)
        head = self.observer.head
        await self.observer.wait_for(lambda: self.observer.head > head, 20)  # a commit: the island applies it now
        await asyncio.sleep(fault.param)
        state = self.states.states[island.island_id]
        pid, held = island.sidecar.pid, state.held
        island.sidecar.kill(signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await island.sidecar.wait(10)
        audit = await audit_checkpoint(island, self.observer, self.history, "after_kill")
        on_disk = "nothing on disk" if audit is None else (
            f"disk holds v{audit.version} {'intact' if audit.root == audit.expected else 'TORN'}")
        await asyncio.sleep(fault.hold_s)
        target = self.observer.head
        t = self.clock()
        await self.cluster.start_sidecar(island)
        took = self._recovered(island.island_id, fault, t,
                               await self.states.wait_held(island.island_id, target, self.recovery_wait_s))
        return (f"killed {island.island_id} pid {pid} {fault.param:.2f}s after v{head + 1} was committed "
                f"(it held v{held}); {on_disk}; back at v{target} {took}")

    async def disk_full(self, fault: ScheduledFault) -> str:
        island = self.cluster.island(fault.target)
        if not island.mounted:
            return "skipped: the island's directory is not on a tmpfs"
        filler = island.dir / "chaos-filler"
        head = self.observer.head
        written = await asyncio.to_thread(_fill, filler)
        free = os.statvfs(island.dir)
        self.history.event(self.clock(), "disk_full", f"{island.island_id}: wrote {written} B, "
                                                      f"{free.f_bavail * free.f_frsize} B left")
        await asyncio.sleep(fault.hold_s)
        # a full disk the island never writes to proves nothing: keep it full until a version came
        await self.observer.wait_for(lambda: self.observer.head > head, 30)
        filler.unlink(missing_ok=True)
        target = self.observer.head
        t = self.clock()
        took = self._recovered(island.island_id, fault, t,
                               await self.states.wait_held(island.island_id, target, self.recovery_wait_s))
        return (f"filled {island.island_id}'s disk ({written} B) while v{head + 1}..v{target} were committed; "
                f"at v{target} {took}")

    async def blob_corrupt(self, fault: ScheduledFault) -> str:
        """Hold the island off its store, flip bytes of the next patch in the store, let it fetch."""
        island = self.cluster.island(fault.target)
        links = self.cluster.links(f"{island.island_id}>s3")
        for link in links:
            link.set_fault(Fault(FaultMode.BLACKHOLE))
        try:
            head = self.observer.head
            found = await self.observer.wait_for(lambda: self._patch_after(head) is not None, 30)
            record = self._patch_after(head) if found else None
            if record is None:
                return "no patch committed within 30s to corrupt"
            key = next(b.key for a in record.artifacts if a.kind == pb.ARTIFACT_KIND_PATCH for b in a.blobs)
            offset = await self._flip(key)
            log_mark = island.sidecar.log_path.stat().st_size
            await asyncio.sleep(fault.hold_s)
        finally:
            for link in links:
                link.heal()
        t = self.clock()
        took = self._recovered(island.island_id, fault, t,
                               await self.states.wait_held(island.island_id, record.version, self.recovery_wait_s))
        with open(island.sidecar.log_path, "rb") as log:
            log.seek(log_mark)
            refused = b"digest" in log.read().lower()
        return (f"flipped 8 bytes at {offset} of v{record.version}'s patch {key} while {island.island_id} was off "
                f"its store; {'refused by digest' if refused else 'no digest refusal in its log'}; "
                f"at v{record.version} {took}")

    def _patch_after(self, head: int) -> pb.VersionRecord | None:
        for version in sorted(v for v in self.observer.records if v > head):
            record = self.observer.records[version]
            if any(a.kind == pb.ARTIFACT_KIND_PATCH and a.blobs for a in record.artifacts):
                return record
        return None

    async def _flip(self, key: str) -> int:
        deadline = time.monotonic() + self.recovery_wait_s
        while True:
            store = self.cluster.s3.store()
            try:
                data = bytearray(await store.get_bytes(key))
                offset = self.rng.randrange(max(1, len(data) - 8))
                for i in range(offset, min(len(data), offset + 8)):
                    data[i] ^= 0xA5
                await store.put_bytes(key, bytes(data))
                return offset
            except (WeftboardError, OSError, AssertionError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)  # the store is restarting (another fault)
            finally:
                await store.close()

    # -- links ------------------------------------------------------------------------------

    async def _network(self, fault: ScheduledFault) -> str:
        links = self.cluster.links(fault.target)
        mode = NET_MODES[fault.kind]
        spec = Fault(mode, delay_s=fault.param if mode == FaultMode.LATENCY else 0.0,
                     rate_bytes_s=fault.param if mode == FaultMode.BANDWIDTH else 0.0)
        for link in links:
            link.set_fault(spec)
        try:
            await asyncio.sleep(fault.hold_s)
        finally:
            for link in links:
                link.heal()
        client = fault.target.split(">")[0]
        t = self.clock()
        seconds = await self._client_recovery(client)
        took = self._recovered(client, fault, t, seconds)
        return f"{mode.value} on {', '.join(p.name for p in links)} for {fault.hold_s:.1f}s; {client} progressing {took}"

    net_latency = net_bandwidth = net_reset = net_blackhole = net_half_open = _network

    async def _client_recovery(self, client: str) -> float | None:
        began = time.monotonic()
        if client.startswith("island-"):
            return await self.states.wait_held(client, self.observer.head, self.recovery_wait_s)
        if client == "publisher":
            count = len(self.trainer.committed)
            ok = await self.trainer.wait_for(lambda: len(self.trainer.committed) > count, self.recovery_wait_s)
            return time.monotonic() - began if ok else None
        if client == "consumer":
            mark = self.clock()
            while time.monotonic() - began < self.recovery_wait_s:
                if self.reader.last_ok > mark:
                    return time.monotonic() - began
                await asyncio.sleep(0.1)
            return None
        j = int(client.split("-")[1])  # board-J: it answers a call that reads Redis
        async with BoardClient(self.cluster.board_addresses[j], self.cluster.token, timeout_s=2) as direct:
            while time.monotonic() - began < self.recovery_wait_s:
                try:
                    await direct.get_head(RUN)
                    return time.monotonic() - began
                except WeftboardError:
                    await asyncio.sleep(0.2)
        return None


def _fill(path: os.PathLike) -> int:
    """Write zeros until the file system is full (ENOSPC); the bytes written."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            block = b"\0" * size
            while True:
                try:
                    n = os.write(fd, block)
                except OSError:
                    break
                written += n
                if n < size:
                    break
    finally:
        os.close(fd)
    return written
