"""``weftboard bench board``: fan-out latency to many watchers, commit rate, trajectory ingest.

Set-up (all loopback, all real):
- one ``redis-server`` started by the bench;
- ONE board process: ``weftboard serve`` as a subprocess (its own interpreter, its own
  CPU), with a local-directory blob store shared with the bench;
- the load generators live in this process: ``watchers`` Watch streams multiplexed over
  ``channels`` gRPC channels, a publisher, and ``reporters`` concurrent trajectory
  reporters.

Phases, each measured on its own:
1. fan-out: commit ``commits`` versions one at a time; for each, the delay from the start
   of the CommitVersion call to the arrival of that version on *every* watcher. The next
   commit starts once all watchers have it (or after a timeout, counted as misses).
2. commit rate: back-to-back commits with every watcher still attached.
3. trajectory ingest: ``reporters`` tasks send ``batch``-record ReportTrajectories calls
   for ``traj_seconds``; records accepted per second.
4. history: p99 latency of ListVersions (one page of up to 100 versions).

The result dict is what ``--json`` prints as the last line. Latencies are measured here,
in the load-generating process, so they include its own scheduling delays: an upper bound
on what the board itself adds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from weftboard.board.blobs import LocalDirBlobStore
from weftboard.board.client import BoardClient
from weftboard.board.embedded import free_port, start_redis
from weftboard.proto.domain import blob_key, format_digest
from weftboard.proto.v1 import board_pb2 as pb

TARGET_FANOUT_P99_MS = 250.0
TARGET_TRAJ_PER_S = 20_000.0
LAYOUT = (("w.0", "bfloat16", (64, 64)), ("w.1", "bfloat16", (64,)))


@dataclass(frozen=True)
class BenchParams:
    watchers: int = 1000
    commits: int = 30
    channels: int = 8
    reporters: int = 8
    traj_seconds: float = 5.0
    batch: int = 500
    rate_commits: int = 100
    history_calls: int = 200
    delivery_timeout_s: float = 10.0


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of a process so far (Linux /proc), to show who was busy."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


# ---------------------------------------------------------------------------
# Records with real blobs
# ---------------------------------------------------------------------------


class Publisher:
    """Writes a version's blobs to the board's blob dir and builds its record."""

    def __init__(self, blob_dir: Path, run: str):
        self.blobs = LocalDirBlobStore(blob_dir)
        self.run = run

    async def record(self, version: int):
        def digest(data: bytes) -> str:
            return format_digest(xxhash.xxh3_128_digest(data))

        async def upload(data: bytes, name: str = "") -> pb.BlobRef:
            d = digest(data)
            key = blob_key(self.run, d)
            await self.blobs.put_bytes(key, data)
            return pb.BlobRef(key=key, digest=d, size=len(data), name=name)

        if version == 1:
            artifact = pb.Artifact(kind=pb.ARTIFACT_KIND_ANCHOR, blobs=[await upload(os.urandom(8192), "model.safetensors")])
        else:
            artifact = pb.Artifact(kind=pb.ARTIFACT_KIND_PATCH, base_version=version - 1,
                                   blobs=[await upload(os.urandom(96))])
        return pb.VersionRecord(
            run=self.run,
            version=version,
            parent=version - 1,
            tensor_digests=[pb.TensorDigest(name=n, digest=digest(os.urandom(8))) for n, _, _ in LAYOUT],
            root_digest=digest(os.urandom(8)),
            artifacts=[artifact],
            stats=pb.VersionStats(changed_elements=40, total_elements=4160, density=40 / 4160),
            step=version,
        )

    def run_message(self):
        return pb.Run(
            run=self.run,
            kind=pb.RUN_KIND_WEIGHTS,
            served_format=pb.ServedFormat(kind=pb.FORMAT_KIND_BF16),
            layout=pb.Layout(tensors=[pb.TensorSpec(name=n, dtype=d, shape=s) for n, d, s in LAYOUT]),
        )


# ---------------------------------------------------------------------------
# The board process
# ---------------------------------------------------------------------------


class BoardProcess:
    """``weftboard serve`` in a subprocess, on a given Redis and blob store (``blob_args``:
    ``--blob-dir DIR``, or the ``--s3-*`` flags)."""

    def __init__(self, workdir: Path, redis_url: str, blob_args: list[str], admin_token: str):
        self.address = f"127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("WEFTBOARD_")}
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "board.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weftboard.board.cli", "serve", "--listen", self.address,
             "--redis-url", redis_url, *blob_args, "--admin-token", admin_token,
             "--data-dir", str(workdir / "data"), "--log-level", "WARNING", "--log-json"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    async def wait_ready(self, client, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the board exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                await client.wait_ready(timeout_s=1.0)
                return
            except Exception:  # noqa: BLE001 - still starting
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the board did not become ready in {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


# ---------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------


class Watchers:
    """Many Watch streams over a few channels; records when each version arrives."""

    def __init__(self, clients: list, run: str, count: int):
        self.clients = clients
        self.run = run
        self.count = count
        self.arrivals: dict[int, list[float]] = {}
        self.events: dict[int, asyncio.Event] = {}
        self.tasks: list[asyncio.Task] = []
        self.errors: list[BaseException] = []

    def expect(self, version: int) -> asyncio.Event:
        self.arrivals.setdefault(version, [])
        return self.events.setdefault(version, asyncio.Event())

    def start(self) -> None:
        for i in range(self.count):
            client = self.clients[i % len(self.clients)]
            self.tasks.append(asyncio.create_task(self._watch(client)))

    async def _watch(self, client) -> None:
        try:
            async for event in client.watch(self.run, after_version=0, progress_interval_ms=5000):
                if event.WhichOneof("event") != "version":
                    continue
                now = time.perf_counter()
                version = event.version.version
                arrivals = self.arrivals.setdefault(version, [])
                arrivals.append(now)
                if len(arrivals) == self.count:
                    self.expect(version).set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported, not fatal to the others
            self.errors.append(exc)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _open(watchers: Watchers, count: int, timeout_s: float = 60.0) -> None:
    """Start the streams; they are open once each has replayed version 1 from history."""
    ready = watchers.expect(1)
    watchers.start()
    try:
        await asyncio.wait_for(ready.wait(), timeout_s)
    except asyncio.TimeoutError:
        got = len(watchers.arrivals.get(1, []))
        raise RuntimeError(
            f"only {got} of {count} watch streams opened in {timeout_s:.0f} s; errors: {watchers.errors[:3]}"
        ) from None


async def _fanout(control, publisher: Publisher, watchers: Watchers, version: int, commits: int,
                  params: BenchParams) -> tuple[list[float], list[float], int, int]:
    """Commit one version at a time; delay from commit start to arrival on every watcher."""
    latencies_ms: list[float] = []
    per_commit_max: list[float] = []
    misses = 0
    for _ in range(commits):
        version += 1
        record = await publisher.record(version)
        done = watchers.expect(version)
        await asyncio.sleep(0.05)  # let the previous fan-out settle completely
        start = time.perf_counter()
        await control.commit_version(record)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), params.delivery_timeout_s)
        arrivals = watchers.arrivals[version]
        misses += watchers.count - len(arrivals)
        samples = [(t - start) * 1000 for t in arrivals]
        latencies_ms += samples
        per_commit_max.append(max(samples) if samples else float("inf"))
    return latencies_ms, per_commit_max, misses, version


async def _commit_rate(control, publisher: Publisher, watchers: Watchers, version: int, commits: int) -> tuple[float, int]:
    """Back-to-back commits; returns (commits per second, new head). Waits for the fan-out to drain."""
    records = [await publisher.record(v) for v in range(version + 1, version + 1 + commits)]
    last_done = watchers.expect(records[-1].version)
    start = time.perf_counter()
    for record in records:
        await control.commit_version(record)
    rate = len(records) / (time.perf_counter() - start)
    await asyncio.wait_for(last_done.wait(), 60)
    return rate, records[-1].version


def _cpu_line(phase: str, board_pid: int, before: tuple[float, float, float]) -> str:
    wall = time.perf_counter() - before[2]
    board_cpu = cpu_seconds(board_pid) - before[0]
    gen_cpu = cpu_seconds(os.getpid()) - before[1]
    return (f"  cpu during {phase}: board {board_cpu / wall * 100:.0f}% of a core, "
            f"load generator {gen_cpu / wall * 100:.0f}% of a core ({wall:.1f} s)")


async def _bench(params: BenchParams, log: Callable[[str], None], workdir: Path) -> dict:

    redis = await asyncio.to_thread(start_redis, workdir / "redis")
    admin = "bench-admin-" + secrets.token_hex(16)
    blob_dir = workdir / "blobs"
    board = BoardProcess(workdir, redis.url, ["--blob-dir", str(blob_dir)], admin)
    clients: list[BoardClient] = []
    try:
        control = BoardClient(board.address, admin, timeout_s=30)
        clients.append(control)
        await board.wait_ready(control)
        log(f"board: one process (pid {board.proc.pid}) at {board.address}; redis {redis.url}; "
            f"load generators in this process (pid {os.getpid()}); {os.cpu_count()} CPUs")
        run = "bench"
        publisher = Publisher(blob_dir, run)
        await control.create_run(publisher.run_message())
        await control.commit_version(await publisher.record(1))
        watch_clients = [BoardClient(board.address, admin, timeout_s=30) for _ in range(max(1, params.channels))]
        clients += watch_clients

        # -- 0. baseline: the same measurements with a single watcher -------------
        base_pub = Publisher(blob_dir, "bench-baseline")
        await control.create_run(base_pub.run_message())
        await control.commit_version(await base_pub.record(1))
        lone = Watchers(watch_clients[:1], "bench-baseline", 1)
        await _open(lone, 1)
        base_lat, _, _, base_version = await _fanout(control, base_pub, lone, 1, max(5, params.commits // 2), params)
        base_rate, _ = await _commit_rate(control, base_pub, lone, base_version, max(10, params.rate_commits // 2))
        await lone.stop()
        base_p50, base_p99 = percentile(base_lat, 50), percentile(base_lat, 99)
        log(f"baseline, 1 watcher: commit-to-delivery p50 {base_p50:.1f} ms, p99 {base_p99:.1f} ms; "
            f"{base_rate:.0f} commits/s back to back")

        # -- 1. fan-out ---------------------------------------------------------
        watchers = Watchers(watch_clients, run, params.watchers)
        t0 = time.perf_counter()
        await _open(watchers, params.watchers)
        log(f"{params.watchers} watch streams open over {len(watch_clients)} channels in {time.perf_counter() - t0:.1f} s")
        cpu0 = (cpu_seconds(board.proc.pid), cpu_seconds(os.getpid()), time.perf_counter())
        latencies_ms, per_commit_max, misses, version = await _fanout(
            control, publisher, watchers, 1, params.commits, params)
        fanout_p50 = percentile(latencies_ms, 50)
        fanout_p99 = percentile(latencies_ms, 99)
        log(f"fan-out over {params.commits} commits x {params.watchers} watchers: p50 {fanout_p50:.1f} ms, "
            f"p99 {fanout_p99:.1f} ms, last watcher (median over commits) {statistics.median(per_commit_max):.1f} ms, "
            f"missed {misses}; p99 is {fanout_p99 / base_p99:.1f}x the single-watcher p99")
        log(_cpu_line("fan-out", board.proc.pid, cpu0))

        # -- 2. commit rate (watchers still attached) ---------------------------
        cpu0 = (cpu_seconds(board.proc.pid), cpu_seconds(os.getpid()), time.perf_counter())
        commits_per_s, version = await _commit_rate(control, publisher, watchers, version, params.rate_commits)
        log(f"commit rate: {params.rate_commits} back-to-back commits = {commits_per_s:.0f}/s with "
            f"{params.watchers} watchers attached ({commits_per_s / base_rate:.2f}x the single-watcher rate)")
        log(_cpu_line("commit rate", board.proc.pid, cpu0))

        # -- 3. trajectory ingest ----------------------------------------------
        batch = pb.ReportTrajectoriesRequest(records=[
            pb.TrajectoryRecord(
                run=run, island_id=f"island-{i % 16}", version=version, request_id=f"req-{i}",
                prompt_tokens=512, completion_tokens=1024, logprob_sum=-321.5, logprob_min=-9.25,
                reward=0.5, replay_ref=f"{run}/replay/{i}", latency_ms=812.0, created_at_ms=int(time.time() * 1000),
            )
            for i in range(params.batch)
        ])
        traj_clients = [BoardClient(board.address, admin, timeout_s=30) for _ in range(max(1, min(params.reporters, 4)))]
        clients += traj_clients
        accepted = 0
        calls: list[float] = []
        deadline = time.perf_counter() + params.traj_seconds

        async def reporter(client: BoardClient) -> None:
            nonlocal accepted
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                response = await client.report_trajectories(batch.records)
                calls.append((time.perf_counter() - t) * 1000)
                accepted += response.accepted

        cpu0 = (cpu_seconds(board.proc.pid), cpu_seconds(os.getpid()), time.perf_counter())
        start = time.perf_counter()
        await asyncio.gather(*(reporter(traj_clients[i % len(traj_clients)]) for i in range(params.reporters)))
        traj_s = time.perf_counter() - start
        traj_per_s = accepted / traj_s
        log(f"trajectory ingest: {accepted:,} records in {traj_s:.2f} s = {traj_per_s:,.0f} records/s "
            f"({params.reporters} reporters, {params.batch}-record batches, call p99 {percentile(calls, 99):.1f} ms)")
        log(_cpu_line("trajectories", board.proc.pid, cpu0))

        # -- 4. history reads ---------------------------------------------------
        history_ms: list[float] = []
        for i in range(params.history_calls):
            start_v = 1 + (i * 7) % max(1, version - 100)
            t = time.perf_counter()
            page = await control.list_versions(run, from_version=start_v, page_size=100)
            history_ms.append((time.perf_counter() - t) * 1000)
            assert page.versions, "ListVersions returned an empty page"
        history_p99 = percentile(history_ms, 99)
        log(f"history: {params.history_calls} ListVersions pages of up to 100 versions: "
            f"p50 {percentile(history_ms, 50):.1f} ms, p99 {history_p99:.1f} ms")

        await watchers.stop()
        if watchers.errors:
            log(f"watch errors: {len(watchers.errors)} (first: {watchers.errors[0]!r})")
        return {
            "watchers": params.watchers,
            "fanout_p50_ms": round(fanout_p50, 2),
            "fanout_p99_ms": round(fanout_p99, 2),
            "fanout_missed": misses,
            "commits_per_s": round(commits_per_s, 1),
            "traj_records_per_s": round(traj_per_s, 1),
            "history_p99_ms": round(history_p99, 2),
            "fanout_p99_target_ms": TARGET_FANOUT_P99_MS,
            "traj_target_per_s": TARGET_TRAJ_PER_S,
            "fanout_p99_vs_target": round(fanout_p99 / TARGET_FANOUT_P99_MS, 3),
            "baseline_fanout_p99_ms": round(base_p99, 2),
            "fanout_p99_vs_baseline": round(fanout_p99 / base_p99, 2),
            "baseline_commits_per_s": round(base_rate, 1),
            "commits_vs_baseline": round(commits_per_s / base_rate, 3),
            "traj_vs_target": round(traj_per_s / TARGET_TRAJ_PER_S, 3),
            "board_processes": 1,
            "cpus": os.cpu_count(),
        }
    finally:
        for client in clients:
            await client.close()
        await asyncio.to_thread(board.stop)
        await asyncio.to_thread(redis.stop)


def run_bench(params: BenchParams, log: Callable[[str], None] = print) -> dict:
    """Run every phase in a temporary directory; returns the result dict."""
    workdir = Path(tempfile.mkdtemp(prefix="weftboard-bench-board-"))
    try:
        result = asyncio.run(_bench(params, log, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    verdict = []
    verdict.append(f"fan-out p99 {result['fanout_p99_ms']:.1f} ms vs target {TARGET_FANOUT_P99_MS:.0f} ms: "
                   f"{'OK' if result['fanout_p99_ms'] < TARGET_FANOUT_P99_MS else 'MISSED'}")
    verdict.append(f"trajectory ingest {result['traj_records_per_s']:,.0f}/s vs target {TARGET_TRAJ_PER_S:,.0f}/s: "
                   f"{'OK' if result['traj_records_per_s'] >= TARGET_TRAJ_PER_S else 'MISSED'}")
    for line in verdict:
        log(line)
    return result
