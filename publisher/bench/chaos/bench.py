"""``weftboard bench chaos``: one run of the whole system under seeded faults, then its history checked.

Phases: start the system (``cluster``) and the bench's own parties (observer, request load,
trajectory consumer, samplers, a supervisor that restarts what crashes by itself); inject the
schedule (``schedule``, ``injector``) for ``duration_s``; settle (every fault healed, the trainer
publishes until an anchor and then stops, every island catches up, the consumer drains the
stream); read the board's final history and fleet; ``history.check``. The last stdout line is
the JSON. ``--duration 3600`` is the soak: the same run, longer; ``rss_growth_mb`` and
``fd_growth`` then say whether a process grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weftboard.cuda.warmup import warm_up_kernels
from weftboard.proto.errors import WeftboardError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.bench.chaos.cluster import (
    RUN,
    Cluster,
    ClusterConfig,
    SystemShape,
)
from weftboard.publisher.bench.chaos.history import Ack, History, check, failure_report
from weftboard.publisher.bench.chaos.injector import Injector, TrainerEvents
from weftboard.publisher.bench.chaos.observer import (
    IslandStates,
    Observer,
    audit_checkpoint,
)
from weftboard.publisher.bench.chaos.schedule import FaultKind, make_schedule
from weftboard.publisher.bench.chaos.workload import (
    ProcSampler,
    RequestLoad,
    StreamSampler,
    TrajectoryReader,
)

# How long each component may take to serve again after a fault (2 shared cores: a Python
# process with torch takes seconds just to start).
RECOVERY_BOUNDS_S = {"redis": 30.0, "s3": 60.0, "board": 60.0, "publisher": 120.0, "island": 120.0,
                     "consumer": 60.0}


@dataclass
class ChaosParams:
    duration_s: float = 300.0
    seed: int | None = None
    shape: SystemShape = field(default_factory=SystemShape)
    request_workers: int = 2
    request_interval_s: float = 0.3
    mean_gap_s: float = 6.0
    settle_timeout_s: float = 180.0
    work_dir: Path | None = None
    keep: bool = False


class _Run:
    """The state of one chaos run: the system, the parties, the history."""

    def __init__(self, params: ChaosParams, seed: int, root: Path, say: Callable[[str], None]) -> None:
        self.params = params
        self.seed = seed
        self.root = root
        self.say = say
        self.t0 = time.monotonic()
        self.history = History(seed)
        self.trainer = TrainerEvents()
        self.cluster = Cluster(ClusterConfig(root, seed, params.shape, log=say),
                               "chaos-admin-" + os.urandom(12).hex(), self._trainer_line)
        self.tasks: list[asyncio.Task] = []
        self.crashes: Counter[str] = Counter()
        self.locks: dict[str, asyncio.Lock] = {}  # one per process or link: a fault holds it while it acts

    def lock(self, name: str) -> asyncio.Lock:
        return self.locks.setdefault(name, asyncio.Lock())

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def _trainer_line(self, line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        kind, t = event.get("event"), round(self.clock(), 3)
        if kind == "publish":
            self.trainer.published[int(event["version"])] = t
        elif kind == "committed":
            version = int(event["version"])
            self.trainer.committed[version] = t
            self.trainer.incarnation_committed += 1
            self.history.acks.append(Ack(t, version, event["root"], "publisher"))
        elif kind in ("started", "failed", "stopped"):
            self.history.event(t, f"publisher_{kind}", json.dumps({k: v for k, v in event.items() if k != "t"}))
        asyncio.ensure_future(self.trainer.notify())

    # -- the supervisor: what dies by itself is restarted, and counted ---------------------

    def _components(self) -> list[tuple[str, Callable[[], bool], Callable[[], Any], Callable[[], str],
                                        Callable[[], bool], Callable[[], object]]]:
        """(name, alive, restart, log tail, whether the bench stopped it on purpose, exit code) of each process
        started so far."""
        c = self.cluster
        parts: list[tuple[str, Callable[[], bool], Callable[[], Any], Callable[[], str], Callable[[], bool],
                          Callable[[], object]]] = []
        if c.redis.child.incarnation:
            parts.append(("redis", c.redis.alive, c.restart_redis, c.redis.child.log_tail,
                          lambda: c.redis.child.expected_exit or c.redis.child.starting,
                          lambda: c.redis.child.returncode))
        if c.s3.incarnation:
            parts.append(("s3", c.s3.alive, c.restart_s3, lambda n=30: c.s3.proc.log_tail(n) if c.s3.proc else "",
                          lambda: c.s3.expected_exit or c.s3.starting,
                          lambda: c.s3.proc.process.returncode if c.s3.proc else None))
        children = [(c.trainer, c.trainer.start), *((b, lambda j=j: c.start_board(j)) for j, b in enumerate(c.boards)),
                    *((i.sidecar, lambda i=i: c.start_sidecar(i)) for i in c.islands),
                    *((i.engine, i.engine.start) for i in c.islands)]
        for child, restart in children:
            if child.incarnation:
                parts.append((child.name, child.alive, restart, child.log_tail,
                              lambda ch=child: ch.expected_exit or ch.starting, lambda ch=child: ch.returncode))
        return parts

    async def supervise(self) -> None:
        """Restart, and count, every process that exits by itself (what a fault kills is the fault's)."""
        while True:
            await asyncio.sleep(1.0)
            for name, alive, restart, tail, expected, code in self._components():
                lock = self.lock(name)
                if alive() or lock.locked() or expected():
                    continue
                async with lock:
                    self.crashes[name] += 1
                    last = [line for line in tail(3000).splitlines() if line.strip()][-3:]
                    self.history.event(self.clock(), "crash", f"{name} exited by itself with code {code()}: "
                                                              + " | ".join(line[:300] for line in last))
                    self.say(f"[{self.clock():6.0f}s] {name} exited by itself (code {code()}); restarting it")
                    try:
                        await restart()
                    except Exception as exc:  # noqa: BLE001 - recorded; tried again at the next round
                        self.history.event(self.clock(), "restart_failed", f"{name}: {type(exc).__name__}: {exc}"[:300])

    def processes(self) -> dict[str, tuple[int | None, int, float]]:
        c = self.cluster
        out: dict[str, tuple[int | None, int, float]] = {"bench": (os.getpid(), 1, self.t0)}
        out["redis"] = (c.redis.child.pid if c.redis.alive() else None, c.redis.child.incarnation, c.redis.child.started_at)
        out["s3"] = (c.s3.pid if c.s3.alive() else None, c.s3.incarnation, c.s3.started_at)
        for child in [c.trainer, *c.boards, *(i.sidecar for i in c.islands), *(i.engine for i in c.islands)]:
            out[child.name] = (child.pid if child.alive() else None, child.incarnation, child.started_at)
        return out

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        task.add_done_callback(self._party_ended)
        return task

    def _party_ended(self, task: asyncio.Task) -> None:
        """A party of the bench (load, consumer, observer...) must not end before the run: say why it did."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self.history.event(self.clock(), "bench_error", f"{task.get_coro().__qualname__}: {type(exc).__name__}: {exc}")
        self.say(f"BENCH ERROR in {task.get_coro().__qualname__}: {type(exc).__name__}: {exc}")


def _available_kinds(cluster: Cluster) -> tuple[list[FaultKind], list[str]]:
    kinds = list(FaultKind)
    skipped = []
    if not cluster.disk_full_possible:
        kinds.remove(FaultKind.DISK_FULL)
        skipped.append("disk_full (no tmpfs could be mounted for the islands: not root?)")
    return kinds, skipped


async def _settle(run: _Run, observer: Observer, states: IslandStates) -> None:
    """Heal, let the trainer publish past an anchor and stop, let islands and consumer catch up."""
    c, say, params = run.cluster, run.say, run.params
    for proxy in c.proxies.values():
        proxy.heal()
    mark = max(run.trainer.committed, default=0)
    anchored = await observer.wait_for(lambda: any(
        v > mark and any(a.kind == pb.ARTIFACT_KIND_ANCHOR for a in r.artifacts)
        for v, r in observer.records.items()), params.settle_timeout_s)
    say(f"settle: {'an anchor was committed' if anchored else 'NO anchor committed'} after the faults; stopping the trainer")
    await c.trainer.stop(grace_s=60)
    last = max(run.trainer.committed, default=0)
    await observer.wait_for(lambda: observer.head >= last, 30)
    head = observer.head
    waits = await asyncio.gather(*(states.wait_held(i, head, params.settle_timeout_s) for i in c.island_ids))
    say(f"settle: head v{head}; islands at it after {', '.join('never' if w is None else f'{w:.1f}s' for w in waits)}")


async def _drain(run: _Run, reader: TrajectoryReader, sampler: StreamSampler, timeout_s: float) -> None:
    await asyncio.sleep(3.0)  # the sidecars' reporters send what they queued (every 0.2 s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await sampler.sample()
        if set(run.history.reported) <= reader.delivered:
            return
        await asyncio.sleep(1.0)


async def _final_fleet(run: _Run, observer: Observer, head: int, timeout_s: float = 30.0) -> dict[str, int]:
    """Each island's version as the board's fleet view has it (once heartbeats carry the head)."""
    deadline = time.monotonic() + timeout_s
    versions: dict[str, int] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(WeftboardError):
            listed = await observer.client.list_islands(RUN)
            versions = {i.status.island_id: int(i.status.version) for i in listed.islands
                        if i.status.island_id in run.cluster.island_ids}
            if len(versions) == len(run.cluster.island_ids) and all(v == head for v in versions.values()):
                break
        await asyncio.sleep(1.0)
    return {i: versions.get(i, 0) for i in run.cluster.island_ids}


async def run_chaos(params: ChaosParams, say: Callable[[str], None]) -> tuple[dict[str, Any], list[str]]:
    """One chaos run; (the JSON result, failure lines: empty when every check passed)."""
    seed = params.seed if params.seed is not None else random.randrange(1 << 31)
    root = Path(params.work_dir or tempfile.mkdtemp(prefix="weftboard-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    say(f"seed {seed}; work dir {root}; warming the codec kernels")
    await asyncio.to_thread(warm_up_kernels, ("bf16",), ("default",))
    run = _Run(params, seed, root, say)
    c, history = run.cluster, run.history
    observer = reader = None
    failed_lines: list[str] = []
    clean = False  # the run finished and every check passed: its files need not be kept
    try:
        run.spawn(run.supervise())
        await c.start()
        if not await run.trainer.wait_for(lambda: bool(run.trainer.committed), 240):
            raise RuntimeError(f"the trainer committed nothing in 240s:\n{c.trainer.log_tail()}")
        observer = Observer(c, history, run.clock)
        await observer.load_layout()
        run.spawn(observer.run())
        await c.start_islands()
        states = IslandStates(c, run.clock)
        run.spawn(states.run())
        waits = await asyncio.gather(*(states.wait_held(i, 1, 300) for i in c.island_ids))
        if any(w is None for w in waits):
            raise RuntimeError("an island did not become ready in 300s:\n" +
                               "\n".join(i.sidecar.log_tail(1500) for i in c.islands))
        reader = TrajectoryReader(c, history, run.clock)
        sampler = StreamSampler(c, history, run.clock)
        procs = ProcSampler(run.processes, run.clock)
        injector = Injector(c, observer, states, reader, run.trainer, history, run.clock, seed,
                            recovery_wait_s=max(RECOVERY_BOUNDS_S.values()) + 30, locks=run.locks)
        load = run.spawn(RequestLoad(c, observer, states, history, run.clock, seed, workers=params.request_workers,
                                     interval_s=params.request_interval_s).run())
        for party in (reader.run(), sampler.run(), procs.run(), _audits(run, observer),
                      _progress(run, observer, states)):
            run.spawn(party)
        kinds, skipped = _available_kinds(c)
        schedule = make_schedule(seed, params.duration_s, kinds=kinds, islands=c.island_ids, replicas=params.shape.replicas,
                                 links=c.faultable_links(), mean_gap_s=params.mean_gap_s)
        say(f"system up (head v{observer.head}, islands ready); {len(schedule)} faults over {params.duration_s:.0f}s:")
        for fault in schedule:
            say(f"  {fault.describe()}")
        start = time.monotonic()
        faults: list[asyncio.Task] = []
        for fault in schedule:
            await asyncio.sleep(max(0.0, start + fault.at_s - time.monotonic()))
            faults.append(asyncio.ensure_future(injector.run(fault)))
        await asyncio.sleep(max(0.0, start + params.duration_s - time.monotonic()))
        faulted_s = time.monotonic() - start
        say(f"fault window over after {faulted_s:.0f}s; waiting for the faults in progress to heal")
        await asyncio.gather(*faults)
        await _settle(run, observer, states)
        load.cancel()
        await _drain(run, reader, sampler, 60.0)
        head = observer.head
        history.final_head = head
        history.final_versions = await observer.final_history()
        history.final_islands = await _final_fleet(run, observer, head)
        for island in c.islands:  # the head, bit for bit, on every island's disk (a torn one is flagged)
            audit = await audit_checkpoint(island, observer, history, "final")
            if audit is None or audit.version != head:
                history.final_islands[island.island_id] = 0 if audit is None else audit.version
        procs.sample()
        verdict = check(history, RECOVERY_BOUNDS_S)
        result = _result(run, verdict, schedule, skipped, procs, faulted_s)
        if not verdict.ok:
            failed_lines = failure_report(history, verdict)
        clean = verdict.ok
        return result, failed_lines
    finally:
        for task in run.tasks:
            task.cancel()
        await asyncio.gather(*run.tasks, return_exceptions=True)
        if observer is not None:
            await observer.close()
        if reader is not None:
            await reader.close()
        await c.stop()
        history.dump(root / "history.json")
        if params.work_dir is None and not params.keep and clean:
            shutil.rmtree(root, ignore_errors=True)
        else:
            say(f"history and logs kept in {root}")


async def _progress(run: _Run, observer: Observer, states: IslandStates, every_s: float = 30.0) -> None:
    """A line now and then: where the run is."""
    while True:
        await asyncio.sleep(every_s)
        held = ", ".join(f"{i} v{s.held}{'' if s.ready else ' (not ready)'}" for i, s in states.states.items())
        responses = run.history.responses
        run.say(f"[{run.clock():6.0f}s] head v{observer.head}; {held}; faults done {len(run.history.faults)}; "
                f"requests {len(responses)} ({sum(r.status == 200 for r in responses)} ok); "
                f"trajectories delivered {len(run.history.deliveries)}; crashes {dict(run.crashes)}")


async def _audits(run: _Run, observer: Observer, every_s: float = 3.0) -> None:
    """Each island's checkpoint on disk, hashed now and then."""
    while True:
        await asyncio.sleep(every_s)
        for island in run.cluster.islands:
            await audit_checkpoint(island, observer, run.history, "periodic")


def _result(run: _Run, verdict: Any, schedule: list, skipped: list[str], procs: ProcSampler,
            faulted_s: float) -> dict[str, Any]:
    history = run.history
    kinds = Counter(f.kind for f in history.faults)
    responses = history.responses
    ok = sum(r.status == 200 for r in responses)
    refused = sum(r.status == 409 for r in responses)
    max_recovery: dict[str, float | None] = {}
    for rec in history.recoveries:
        prev = max_recovery.get(rec.component, 0.0)
        max_recovery[rec.component] = None if rec.seconds is None or prev is None else max(prev, rec.seconds)
    rss, fds = procs.growth()
    counts = verdict.counts()
    return {
        "duration_s": round(faulted_s, 1),
        "seed": run.seed,
        "faults_injected": len(history.faults),
        "fault_kinds": dict(sorted(kinds.items())),
        "faults_scheduled": len(schedule),
        "skipped_kinds": skipped,
        **{k: counts[k] for k in ("versions_committed", "versions_lost", "conflicting_versions", "torn_activations",
                                  "wrong_version_responses", "trajectories_lost", "trajectories_duplicated",
                                  "trajectories_redelivered", "trajectories_unreported", "islands_behind",
                                  "recovery_exceeded")},
        "trajectories_reported": len(history.reported),
        "trajectories_delivered": len({d.request_id for d in history.deliveries}),
        "requests": len(responses),
        "requests_ok": ok,
        "requests_refused": refused,
        "requests_failed_ratio": round((len(responses) - ok - refused) / max(1, len(responses)), 4),
        "audits": len(history.audits),
        "proxy_connections": sum(p.accepted for p in run.cluster.proxies.values()),
        "proxy_resets": sum(p.resets for p in run.cluster.proxies.values()),
        "proxy_bytes": sum(p.bytes_forwarded for p in run.cluster.proxies.values()),
        "max_recovery_s": {k: (None if v is None else round(v, 2)) for k, v in sorted(max_recovery.items())},
        "recovery_bounds_s": RECOVERY_BOUNDS_S,
        "rss_growth_mb": rss,
        "fd_growth": fds,
        "unexpected_exits": dict(run.crashes),
        "appendfsync": run.params.shape.appendfsync,
        "ok": verdict.ok,
        "wall_s": round(run.clock(), 1),
        "cpus": os.cpu_count(),
    }


def main_cli(params: ChaosParams, json_out: bool) -> int:
    """Run it, print readable lines (stderr with ``--json``) and the JSON as the last stdout line."""
    out = sys.stderr if json_out else sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    async def main() -> tuple[dict[str, Any], list[str]]:
        # SIGTERM and Ctrl-C cancel the run, so its clean-up (processes, proxies, mounts) runs
        task = asyncio.ensure_future(run_chaos(params, say))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        return await task

    try:
        result, failed = asyncio.run(main())
    except asyncio.CancelledError:
        say("interrupted: every process, proxy and mount of the run was stopped")
        return 130
    if not json_out:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    for line in failed:
        print(line, file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1
