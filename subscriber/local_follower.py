"""``weftboard subscribe``'s process: a ``Subscriber`` following a run into a local destination.

The destination is a checkpoint directory (``dir``: for an engine that loads it, or any
reader of HF checkpoints) or live tensors in this process (``memory``). For an island that
serves an engine behind the version-aware sidecar, see ``engine_island``.

Invariants:
- On start the destination re-verifies what it holds (the checkpoint directory re-hashes
  ``current``), so a follower restarted after a crash resumes only from verified bits.
- SIGTERM and SIGINT end the follow loop cleanly: the current step either completes (its
  swap is atomic) or leaves nothing behind, a last heartbeat says DRAINING, and the
  process exits 0.
- Blobs come from S3 directly, else from a local blob directory the board also uses (a board
  serving no blob URLs, ``--blob-http-port -1``, on the same filesystem), else through the URLs
  the board presigns (``cfg.blobs``: ``blob_source.py``).
- The island directory is made before anything is opened, so a directory that cannot be made
  raises ``OSError`` with nothing left to close.
- With ``events=True`` every verified version is printed to stdout as one JSON line
  (``{"event": "applied", "version": N, "t": <unix time>, ...}``) for benchmarks and tests.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from weftboard.board.blobs.transfer import FAST_RECONNECT
from weftboard.board.client import BoardClient, TlsConfig
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.subscriber.blob_source import PRESIGNED, IslandBlobSettings
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.destination import Destination
from weftboard.subscriber.live_tensors import LiveTensorsDestination
from weftboard.subscriber.metrics import IslandMetrics
from weftboard.subscriber.progress import ProgressReporter
from weftboard.subscriber.subscriber import Subscriber

log = structlog.get_logger("weftboard.subscriber")


@dataclass
class LocalFollowerConfig:
    board: str
    run: str
    dir: Path
    token: str | None = None
    island_id: str = "island"
    region: str = "local"
    blobs: IslandBlobSettings = PRESIGNED  # S3, the board's blob directory, or presigned URLs
    destination: str = "dir"  # "dir": checkpoint directory; "memory": live tensors in this process
    heartbeat_s: float = 5.0
    lease_s: int = 15
    events: bool = False
    exit_at_version: int = 0  # > 0: exit 0 once this version is held (benchmarks, tests)
    progress: bool | None = None  # None: rich on a terminal
    tls: TlsConfig | None = None  # None: plaintext to the board (board/channel.py)
    metrics_port: int | None = None  # Prometheus /metrics on this port (0 picks one); None: not served
    metrics_host: str = "127.0.0.1"


def _emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def _destination(cfg: LocalFollowerConfig, client: BoardClient) -> Destination:
    if cfg.destination == "dir":
        # its start re-hashes the checkpoint on disk: not on the loop
        return await asyncio.to_thread(CheckpointDirDestination, cfg.dir / "checkpoint")
    if cfg.destination == "memory":
        run = await client.get_run(cfg.run)
        return LiveTensorsDestination(
            {t.name: torch.zeros(tuple(t.shape), dtype=getattr(torch, t.dtype)) for t in run.layout.tensors}
        )
    raise ValueError(f"--destination must be 'dir' or 'memory', not {cfg.destination!r}")


async def run_local_follower(cfg: LocalFollowerConfig) -> int:
    """Follow until SIGTERM/SIGINT (or ``exit_at_version``); the exit code."""
    cfg.dir.mkdir(parents=True, exist_ok=True)
    store = cfg.blobs.open()
    client = BoardClient(cfg.board, cfg.token, tls=cfg.tls, options=FAST_RECONNECT)
    progress = ProgressReporter(rich=cfg.progress) if cfg.progress is not False else None
    metrics = IslandMetrics(cfg.run)
    try:
        dest = await _destination(cfg, client)
        sub = Subscriber(client, cfg.run, dest, island_id=cfg.island_id, region=cfg.region, blob_store=store,
                         cache_dir=cfg.dir / "cache", heartbeat_s=cfg.heartbeat_s, lease_s=cfg.lease_s, progress=progress,
                         metrics=metrics)
        metrics_port = None if cfg.metrics_port is None else await metrics.serve(cfg.metrics_host, cfg.metrics_port)
        if metrics_port is not None:
            log.info("serving metrics", url=f"http://{cfg.metrics_host}:{metrics_port}/metrics")
        log.info("island starting", island=cfg.island_id, run=cfg.run, board=cfg.board, held=sub.held_version,
                 destination=cfg.destination, blobs=store.describe() if store else "presigned")
        if cfg.events:
            _emit({"event": "started", "island": cfg.island_id, "held": sub.held_version, "t": time.time(),
                   "metrics_port": metrics_port})
        done = asyncio.Event()

        def on_version(version: int) -> None:
            if cfg.events:
                _emit({"event": "applied", "island": cfg.island_id, "version": version, "t": time.time(),
                       **sub.timings.get(version, {})})
            if cfg.exit_at_version and version >= cfg.exit_at_version:
                done.set()

        sub.add_listener(on_version)
        if cfg.exit_at_version and sub.held_version >= cfg.exit_at_version:
            done.set()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        follow = asyncio.ensure_future(sub.run())
        stop = asyncio.ensure_future(done.wait())
        await asyncio.wait({follow, stop}, return_when=asyncio.FIRST_COMPLETED)
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)
        if follow.done() and not follow.cancelled() and follow.exception() is not None:
            raise follow.exception()
        sub.state = pb.ISLAND_STATE_DRAINING
        await sub.heartbeat()
        log.info("island stopped", island=cfg.island_id, held=sub.held_version)
        return 0
    finally:
        await metrics.stop()
        if progress is not None:
            progress.close()
        await client.close()
        if store is not None:
            await store.close()
