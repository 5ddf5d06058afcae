"""The chaos bench's load and its bookkeeping: requests, the trajectory consumer, the board's stream.

- ``RequestLoad``: a few workers send seeded completions to the islands, each naming the
  versions it accepts (``min=N`` a little behind the head, or ``exact=N`` the island's held
  version), and record every answer with the versions it reports.
- ``TrajectoryReader``: a ``TrajectoryConsumer`` (through the ``consumer`` links) that records
  each delivered record and acknowledges it; records whose ack was lost come back after
  ``redeliver_after_ms`` and are counted as redelivered by the checker.
- ``StreamSampler``: reads the board's trajectory stream in Redis directly (not through a
  proxy), so the checker knows which records the board acknowledged, including any that a
  Redis restart would later lose.
- ``ProcSampler``: RSS and open descriptors of every long-lived process, per incarnation.

Invariant: request ids are unique in a run (``<seed>-<worker>-<n>``), so deduplication by id
is exact.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import xxhash

from weftboard.board.client import BoardClient
from weftboard.proto.errors import WeftboardError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.bench.chaos.cluster import RUN, Cluster
from weftboard.publisher.bench.chaos.history import Delivery, History, Response
from weftboard.publisher.bench.chaos.observer import IslandStates, Observer
from weftboard.publisher.bench.chaos.processes import ProcFigures, proc_figures
from weftboard.publisher.trajectories import Trajectory, TrajectoryConsumer

Clock = Callable[[], float]
PROMPTS = ("say ab:", "abc", "hello", "count:", "the end", "x y z")
TRAJECTORY_STREAM = f"wb:{{{RUN}}}:traj"


def record_content(record: pb.TrajectoryRecord) -> str:
    """What one request's record says (its id aside): equal for a redelivery, different for another answer."""
    return (f"{record.island_id}|{record.version}|{record.version_end}|{record.completion_tokens}|"
            f"{record.logprob_sum:.6f}")


class RequestLoad:
    def __init__(self, cluster: Cluster, observer: Observer, states: IslandStates, history: History, clock: Clock,
                 seed: int, *, workers: int = 2, interval_s: float = 0.25) -> None:
        self.cluster = cluster
        self.observer = observer
        self.states = states
        self.history = history
        self.clock = clock
        self.seed = seed
        self.workers = workers
        self.interval_s = interval_s

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._worker(session, k) for k in range(self.workers)))

    async def _worker(self, session: aiohttp.ClientSession, k: int) -> None:
        rng = random.Random(f"{self.seed}-load-{k}")
        n = 0
        while True:
            begun = time.monotonic()
            islands = [i for i in self.cluster.islands if i.url is not None and i.sidecar.alive()]
            if islands and self.observer.head:
                n += 1
                await self._one(session, rng.choice(islands), rng, f"{self.seed}-{k}-{n}")
            await asyncio.sleep(max(0.01, self.interval_s - (time.monotonic() - begun)))

    async def _one(self, session: aiohttp.ClientSession, island: Any, rng: random.Random, request_id: str) -> None:
        state = self.states.states[island.island_id]
        if rng.random() < 0.5:
            constraint, n = "min", max(1, self.observer.head - rng.randint(0, 3))
        else:
            constraint, n = "exact", state.held or self.observer.head
        p = rng.randrange(len(PROMPTS))
        body = {"prompt": PROMPTS[p], "max_tokens": 6, "seed": p, "temperature": 1.0, "logprobs": 1}
        headers = {"X-Weftboard-Version": f"{constraint}={n}", "X-Request-Id": request_id,
                   "X-Weftboard-Deadline-Ms": "3000"}
        t = self.clock()
        try:
            async with session.post(island.url + "/v1/completions", json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=15)) as r:
                status = r.status
                payload = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            self.history.responses.append(Response(round(t, 3), island.island_id, request_id, constraint, n, 0,
                                                   error=f"{type(exc).__name__}: {exc}"[:200]))
            return
        start = end = 0
        content = ""
        if status == 200 and isinstance(payload, dict):
            versions = payload.get("weftboard") or {}
            start, end = int(versions.get("version_start", 0)), int(versions.get("version_end", 0))
            choice = (payload.get("choices") or [{}])[0]
            content = xxhash.xxh3_64_hexdigest(json.dumps([choice.get("text"), choice.get("logprobs")]).encode())
        self.history.responses.append(Response(round(t, 3), island.island_id, request_id, constraint, n, status,
                                               start, end, f"p{p}", content,
                                               "" if status in (200, 409) else str(payload)[:200]))


class TrajectoryReader:
    def __init__(self, cluster: Cluster, history: History, clock: Clock, *, redeliver_after_ms: int = 3000) -> None:
        self.client = BoardClient(cluster.boards_for("consumer"), cluster.token, timeout_s=10)
        self.consumer = TrajectoryConsumer(self.client, RUN, "chaos-trainer", "c0", block_ms=500, max_records=500,
                                           redeliver_after_ms=redeliver_after_ms)
        self.history = history
        self.clock = clock
        self.last_ok = 0.0
        self.delivered: set[str] = set()

    async def run(self) -> None:
        while True:
            try:
                batch: list[Trajectory] = await self.consumer.poll()
                t = round(self.clock(), 3)
                for item in batch:
                    self.history.deliveries.append(Delivery(t, item.request_id, record_content(item.record)))
                    self.delivered.add(item.request_id)
                await self.consumer.ack(batch)
                self.last_ok = self.clock()
            except (WeftboardError, asyncio.TimeoutError) as exc:
                self.history.event(self.clock(), "consumer_error", f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        await self.client.close()


class StreamSampler:
    def __init__(self, cluster: Cluster, history: History, clock: Clock, every_s: float = 1.0) -> None:
        self.cluster = cluster
        self.history = history
        self.clock = clock
        self.every_s = every_s
        self.last_id = "-"

    async def run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.every_s)

    async def sample(self) -> None:
        """Read what the stream gained since the last sample (nothing while Redis is down)."""
        host, port = self.cluster.redis.address
        client = aioredis.Redis(host=host, port=port, socket_timeout=3, socket_connect_timeout=1)
        try:
            while True:
                start = self.last_id if self.last_id == "-" else f"({self.last_id}"
                entries = await client.xrange(TRAJECTORY_STREAM, min=start, max="+", count=2000)
                t = round(self.clock(), 3)
                for entry_id, fields in entries:
                    record = pb.TrajectoryRecord.FromString(fields[b"r"])
                    self.history.reported.setdefault(record.request_id, t)
                    self.last_id = entry_id.decode()
                if len(entries) < 2000:
                    return
        except (aioredis.RedisError, OSError):
            return
        finally:
            await client.aclose()


@dataclass
class ProcTrack:
    incarnation: int
    first: ProcFigures | None = None
    last: ProcFigures | None = None
    peak_rss: int = 0
    incarnations: int = 0


class ProcSampler:
    """Every ``every_s``: RSS and descriptors of each process; the baseline of an incarnation is
    its first sample ``warm_s`` after it started (start-up allocations are not growth)."""

    def __init__(self, processes: Callable[[], dict[str, tuple[int | None, int, float]]], clock: Clock,
                 every_s: float = 5.0, warm_s: float = 10.0) -> None:
        self.processes = processes  # label -> (pid, incarnation, monotonic start)
        self.clock = clock
        self.every_s = every_s
        self.warm_s = warm_s
        self.tracks: dict[str, ProcTrack] = {}

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.every_s)

    def sample(self) -> None:
        now = time.monotonic()
        for label, (pid, incarnation, started) in self.processes().items():
            if pid is None or now - started < self.warm_s:
                continue
            figures = proc_figures(pid)
            if figures is None:
                continue
            track = self.tracks.get(label)
            if track is None or track.incarnation != incarnation:
                track = self.tracks[label] = ProcTrack(incarnation, incarnations=incarnation, first=figures)
            track.last = figures
            track.peak_rss = max(track.peak_rss, figures.rss_bytes)

    def growth(self) -> tuple[dict[str, float], dict[str, int]]:
        """Per process: RSS growth (MB) and descriptor growth of its current incarnation."""
        rss, fds = {}, {}
        for label, track in sorted(self.tracks.items()):
            if track.first is None or track.last is None:
                continue
            rss[label] = round((track.last.rss_bytes - track.first.rss_bytes) / 1e6, 2)
            fds[label] = track.last.fds - track.first.fds
        return rss, fds
