"""``weftboard bench board --replicas N``: fan-out through several board replicas on a Redis Cluster,
with one replica killed mid-run.

Set-up (all loopback, all real):
- a Redis Cluster of three masters (``redis_cluster.start_cluster``);
- N board processes (``weftboard serve`` subprocesses) on it, sharing one local blob directory;
- ``processes`` load-generating processes holding ``watchers`` Watch streams spread evenly
  over the replicas (each client lists every replica, starting at its own); they report when
  all their watchers have a version, with the arrival times;
- in this process: the publisher, whose client starts at the replica that will be killed.

Phases:
1. fan-out: commit ``commits`` versions one at a time; per version, the delay from the start of
   CommitVersion to its arrival on each watcher (p50/p99 over every delivery) and on the last
   one. Before commit ``commits // 2`` the first replica is killed with SIGKILL: its watchers
   and the publisher move to another replica and resume by version. That one commit measures
   failover, not fan-out: its deliveries wait for a third of the fleet to notice the loss,
   reconnect and replay. It is reported on its own (``failover_last_delivery_ms``) and in
   ``fanout_p99_with_failover_ms``; ``fanout_p50_ms``/``fanout_p99_ms`` are over every other
   commit, before and after the kill (the survivors then carry the whole fleet).
2. commit rate: ``rate_commits`` back-to-back commits with every watcher attached.
3. count: every watcher must have seen every version exactly once, in order; what it did not
   see is ``missed_events``, what it saw again ``duplicate_events``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import structlog

from weftboard.board.bench.bench_board import BoardProcess, Publisher, percentile
from weftboard.board.bench.redis_cluster import start_cluster
from weftboard.board.client import BoardClient
from weftboard.proto.errors import Unavailable
from weftboard.proto.v1 import board_pb2 as pb

TARGET_FANOUT_P99_MS = 500.0


@dataclass(frozen=True)
class ReplicaParams:
    replicas: int = 3
    watchers: int = 4000
    commits: int = 40
    channels_per_replica: int = 4
    rate_commits: int = 100
    processes: int = 2  # load-generating processes holding the watchers
    delivery_timeout_s: float = 10.0


class Fleet:
    """The watchers of one load-generating process: every watcher's versions, and when each
    version reached each watcher (``time.perf_counter``: the system-wide monotonic clock on
    Linux, so arrival times compare across processes)."""

    def __init__(self, count: int, on_complete: Callable[[int, list[float]], None]) -> None:
        self.count = count
        self.on_complete = on_complete
        self.seen: list[list[int]] = [[] for _ in range(count)]
        self.arrivals: dict[int, list[float]] = {}
        self.tasks: list[asyncio.Task] = []
        self.errors: list[BaseException] = []

    def start(self, clients: list[BoardClient], run: str, offset: int) -> None:
        for i in range(self.count):
            client = clients[(i + offset) % len(clients)]
            self.tasks.append(asyncio.create_task(self._watch(client, run, self.seen[i])))

    async def _watch(self, client: BoardClient, run: str, seen: list[int]) -> None:
        try:
            async for event in client.watch(run, progress_interval_ms=5000, max_backoff_s=1.0):
                if event.WhichOneof("event") != "version":
                    continue
                version = event.version.version
                seen.append(version)
                arrivals = self.arrivals.setdefault(version, [])
                arrivals.append(time.perf_counter())
                if len(arrivals) == self.count:
                    self.on_complete(version, self.arrivals.pop(version))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - counted as misses, reported
            self.errors.append(exc)

    def missed_and_duplicates(self, head: int) -> tuple[int, int, int]:
        """(versions a watcher never saw, versions it saw again, watchers that saw them out of order)."""
        missed = duplicates = disorder = 0
        for seen in self.seen:
            distinct = set(seen)
            missed += head - len(distinct & set(range(1, head + 1)))
            duplicates += len(seen) - len(distinct)
            disorder += seen != sorted(seen)
        return missed, duplicates, disorder

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _quiet_logs() -> None:
    """Warnings only: a thousand watchers moving to another replica would log a line each."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def watcher_process(conn: Connection, addresses: list[str], token: str, run: str, count: int, offset: int,
                    channels_per_replica: int) -> None:
    """A load-generating process: ``count`` watchers; sends ("open",), ("done", version, arrivals)
    per version all its watchers have, and on ("stop", head) the counts, then exits."""
    _quiet_logs()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fleet = Fleet(count, lambda version, arrivals: conn.send(("done", version, arrivals)))
        replicas = len(addresses)
        clients = [BoardClient(addresses[r:] + addresses[:r], token, timeout_s=30)
                   for _ in range(channels_per_replica) for r in range(replicas)]
        fleet.start(clients, run, offset)
        command = await loop.run_in_executor(None, conn.recv)
        missed, duplicates, disorder = fleet.missed_and_duplicates(command[1])
        await fleet.stop()
        conn.send(("counts", missed, duplicates, disorder, len(fleet.errors), repr(fleet.errors[:1])))
        for client in clients:
            await client.close()

    asyncio.run(main())


class Generators:
    """The watcher processes, seen from the bench: when every watcher has a version."""

    def __init__(self, total: int, processes: int, addresses: list[str], token: str, run: str,
                 channels_per_replica: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.total = total
        self.arrivals: dict[int, list[float]] = {}
        self.done: dict[int, asyncio.Event] = {}
        self.counts: list[tuple] = []
        self.conns: list[Connection] = []
        self.procs = []
        self.loop = asyncio.get_running_loop()
        for i in range(processes):
            share = total // processes + (i < total % processes)
            parent, child = context.Pipe()
            proc = context.Process(target=watcher_process, daemon=True,
                                   args=(child, addresses, token, run, share, i, channels_per_replica))
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.readers = [asyncio.create_task(asyncio.to_thread(self._read, conn)) for conn in self.conns]

    def _read(self, conn: Connection) -> None:
        loop = self.loop
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if message[0] == "done":
                loop.call_soon_threadsafe(self._arrived, message[1], message[2])
            else:
                self.counts.append(message[1:])
                return

    def _arrived(self, version: int, arrivals: list[float]) -> None:
        got = self.arrivals.setdefault(version, [])
        got += arrivals
        if len(got) == self.total:
            self.expect(version).set()

    def expect(self, version: int) -> asyncio.Event:
        self.arrivals.setdefault(version, [])
        return self.done.setdefault(version, asyncio.Event())

    async def finish(self, head: int) -> tuple[int, int, int, int, str]:
        for conn in self.conns:
            conn.send(("stop", head))
        await asyncio.gather(*self.readers)
        for proc in self.procs:
            await asyncio.to_thread(proc.join, 20)
        return (sum(c[0] for c in self.counts), sum(c[1] for c in self.counts), sum(c[2] for c in self.counts),
                sum(c[3] for c in self.counts), next((c[4] for c in self.counts if c[3]), ""))

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()


async def _commit(client: BoardClient, record: pb.VersionRecord, timeout_s: float = 30.0) -> None:
    """CommitVersion, retried while no replica answers (a retried identical record is idempotent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.commit_version(record)
            return
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _bench(params: ReplicaParams, log: Callable[[str], None], workdir: Path) -> dict:
    cluster = await asyncio.to_thread(start_cluster, workdir / "redis", 3, 0)
    admin = "bench-admin-" + secrets.token_hex(16)
    blob_dir = workdir / "blobs"
    boards = [BoardProcess(workdir / f"board-{i}", cluster.url, ["--blob-dir", str(blob_dir)], admin)
              for i in range(params.replicas)]
    addresses = [b.address for b in boards]
    clients: list[BoardClient] = []
    fleet: Generators | None = None
    try:
        for board in boards:
            probe = BoardClient(board.address, admin)
            clients.append(probe)
            await board.wait_ready(probe)
        control = BoardClient(addresses, admin, timeout_s=30)  # starts at the replica that dies
        clients.append(control)
        log(f"{params.replicas} board processes on a 3-master Redis Cluster ({cluster.url}); "
            f"load generators in this process (pid {os.getpid()}); {os.cpu_count()} CPUs")
        run = "bench-replicas"
        publisher = Publisher(blob_dir, run)
        await control.create_run(publisher.run_message())
        await _commit(control, await publisher.record(1))
        fleet = Generators(params.watchers, params.processes, addresses, admin, run, params.channels_per_replica)
        opened = fleet.expect(1)
        t0 = time.perf_counter()
        await asyncio.wait_for(opened.wait(), 120)
        log(f"{params.watchers} watch streams open over {params.replicas} replicas in {time.perf_counter() - t0:.1f} s "
            f"({params.processes} load-generating processes)")

        # -- 1. fan-out, one replica killed half way ------------------------------
        latencies_ms: list[float] = []  # every delivery of every commit but the failover one
        failover_ms: list[float] = []  # the deliveries of the commit right after the kill
        last_ms: list[float] = []
        failover_last_ms = float("nan")
        version = 1
        for i in range(params.commits):
            version += 1
            record = await publisher.record(version)
            done = fleet.expect(version)
            await asyncio.sleep(0.05)  # let the previous fan-out settle
            killed_now = i == params.commits // 2
            if killed_now:
                boards[0].proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(boards[0].proc.wait, 10)
                log(f"killed replica {addresses[0]} (pid {boards[0].proc.pid}) before version {version}")
            start = time.perf_counter()
            await _commit(control, record)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), params.delivery_timeout_s)
            samples = [(t - start) * 1000 for t in fleet.arrivals[version]]
            samples += [float("inf")] * (params.watchers - len(samples))  # a delivery that never came
            if killed_now:
                failover_ms = samples
                failover_last_ms = max(samples)
            else:
                latencies_ms += samples
                last_ms.append(max(samples))
        p50, p99 = percentile(latencies_ms, 50), percentile(latencies_ms, 99)
        p99_with_failover = percentile(latencies_ms + failover_ms, 99)
        log(f"fan-out over {params.commits - 1} commits x {params.watchers} watchers: p50 {p50:.1f} ms, "
            f"p99 {p99:.1f} ms, last delivery median {percentile(last_ms, 50):.1f} ms; the commit after the kill "
            f"reached every watcher in {failover_last_ms:.0f} ms (p99 with it: {p99_with_failover:.1f} ms)")

        # -- 2. commit rate ----------------------------------------------------------
        records = [await publisher.record(v) for v in range(version + 1, version + 1 + params.rate_commits)]
        last_done = fleet.expect(records[-1].version)
        start = time.perf_counter()
        for record in records:
            await _commit(control, record)
        commits_per_s = len(records) / (time.perf_counter() - start)
        version = records[-1].version
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(last_done.wait(), 60)
        log(f"commit rate: {params.rate_commits} back-to-back commits = {commits_per_s:.0f}/s "
            f"with {params.watchers} watchers attached")

        # -- 3. every watcher saw every version once, in order ----------------------
        missed, duplicates, disorder, errors, first_error = await fleet.finish(version)
        log(f"missed {missed}, duplicates {duplicates}, out of order {disorder}; watch errors {errors} {first_error}")
        return {
            "replicas": params.replicas,
            "watchers": params.watchers,
            "redis": "cluster-3-masters",
            "fanout_p50_ms": round(p50, 2),
            "fanout_p99_ms": round(p99, 2),
            "fanout_p99_with_failover_ms": round(p99_with_failover, 2),
            "fanout_last_delivery_median_ms": round(percentile(last_ms, 50), 2),
            "failover_last_delivery_ms": round(failover_last_ms, 2),
            "commits_per_s": round(commits_per_s, 1),
            "missed_events": missed,
            "duplicate_events": duplicates,
            "out_of_order_watchers": disorder,
            "watch_errors": errors,
            "replica_killed": boards[0].proc.returncode is not None,
            "fanout_p99_target_ms": TARGET_FANOUT_P99_MS,
            "cpus": os.cpu_count(),
        }
    finally:
        if fleet is not None:
            fleet.kill()
        for client in clients:
            await client.close()
        for board in boards:
            await asyncio.to_thread(board.stop)
        await asyncio.to_thread(cluster.stop)


def run_replica_bench(params: ReplicaParams, log: Callable[[str], None] = print) -> dict:
    """Run the replica bench in a temporary directory; returns the result dict."""
    _quiet_logs()
    workdir = Path(tempfile.mkdtemp(prefix="weftboard-bench-replicas-"))
    try:
        result = asyncio.run(_bench(params, log, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ok = (result["fanout_p99_ms"] < TARGET_FANOUT_P99_MS and result["missed_events"] == 0
          and result["duplicate_events"] == 0 and result["replica_killed"]
          and result["failover_last_delivery_ms"] < params.delivery_timeout_s * 1000)
    log(f"fan-out p99 {result['fanout_p99_ms']:.1f} ms vs target {TARGET_FANOUT_P99_MS:.0f} ms, "
        f"missed {result['missed_events']}, duplicates {result['duplicate_events']}: {'OK' if ok else 'MISSED'}")
    return result
