"""``weftboard bench sync``: publish-to-applied on every island, delta patches vs full checkpoints.

What it runs, all on this machine and one real S3 server (SeaweedFS started here):
- a trainer with fp32 master weights of a transformer-shaped model (>= 100M parameters by
  default) taking real AdamW steps (lr 3e-6, fused) on dense random gradients, the way an
  RL step moves weights: about 1% of the bf16 served bits change per step;
- the delta pipeline: a ``Publisher`` (bf16 served view, patches + an initial anchor) and
  N island daemons (``weftboard subscribe`` child processes, verified apply);
- the baseline: the same trainer steps shipped as a full safetensors checkpoint each time
  (write + upload to the same S3, every island downloads it and loads it with
  ``safetensors.torch.load_file``), N baseline island child processes.

Spans are from the trainer's publish call to the last island's "applied" (delta: verified
against the version's root digest) or "loaded" (baseline), using wall clocks of the same
machine. Beside them, each island's own span: ``island_sync_p50_s`` is the p50 over every
(island, version), and ``island_spread_p50_s`` the p50 over versions of the last island's
span minus the first's (with several islands on lossy links, the slowest sets the figure).
``bytes_ratio`` (full checkpoint bytes over patch bytes) is what ``speedup_p50`` would be if a
sync cost only its bytes on the link. The first version of the delta run (the anchor every
island starts from) is not a measured version: the measured ones are the steady state of
patches.

Memory: ``publisher_extra_memory_ratio`` is (peak RSS of this process while publishing -
RSS just before the publisher is created, with the model, its gradients and AdamW state
already allocated and the optimizer fused so it makes no temporaries) / bytes of one
served view; RSS is sampled every 5 ms from /proc. ``publisher_tensor_memory_ratio`` is
the accounting view: (served view + the largest deltas + patch kept at once) / view.

WAN hook: each island's command line is ``prefix + python -m weftboard.board.cli
subscribe ...`` and its board and S3 addresses come from ``IslandNetwork``; the default is
loopback with no prefix (``LoopbackNetwork``). A WAN topology provides the same three things.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from weftboard.board.bench.bench_board import BoardProcess
from weftboard.board.blobs import S3BlobStore
from weftboard.board.client import BoardClient
from weftboard.board.embedded import start_redis, start_seaweedfs
from weftboard.board.process import BoardConfig, start_board
from weftboard.cuda.anchors import file_digest, write_checkpoint
from weftboard.cuda.warmup import warm_up_kernels
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.bench.island_processes import IslandProcess, IslandSpec
from weftboard.publisher.bench.trainer import BenchTrainer, TrainerCollector
from weftboard.publisher.bench.wan import WanUnavailable
from weftboard.publisher.bench.wan.bench import WAN_LOSS, WanNetwork, skipped_line
from weftboard.publisher.publisher import Publisher

RUN = "bench-sync"


# ---------------------------------------------------------------------------
# Island networking hook (loopback by default; the WAN simulation plugs in here)
# ---------------------------------------------------------------------------


class LoopbackNetwork:
    """Islands on this host: no command prefix, the real addresses."""

    def prefix(self, index: int) -> Sequence[str]:
        return ()

    def board_address(self, index: int, board: str) -> str:
        return board

    def s3_endpoint(self, index: int, endpoint: str) -> str:
        return endpoint

    def describe(self) -> dict[str, Any]:
        return {"network": "loopback"}


# ---------------------------------------------------------------------------
# Memory sampling
# ---------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

        self.paused = threading.Event()  # set while the bench itself allocates (its own checks)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.paused.is_set():
                self.peak = max(self.peak, _rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self.peak = _rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


# ---------------------------------------------------------------------------
# Baseline islands: download the full checkpoint and load it
# ---------------------------------------------------------------------------


FULL_RANGES = 8


def full_island_main(argv: Sequence[str]) -> int:
    """``python -m weftboard.publisher.bench.bench_sync full-island ENDPOINT ACCESS SECRET BUCKET DIR``.

    Reads ``KEY DIGEST`` per stdin line; downloads the object in ``FULL_RANGES`` parallel byte
    ranges (as a tuned client does: ``aws s3 cp`` runs 10 requests at once; one connection on a
    lossy long path is held far below the link rate), checks its xxh3-128 (the same
    guarantee the delta islands give: nothing unverified is served), loads it with
    safetensors and prints ``{"event": "loaded", "key": ..., "verified": ..., "t": ...}``.
    """
    endpoint, access, secret, bucket, directory = argv
    store = S3BlobStore(endpoint, access, secret, bucket, region="us-east-1")
    work = Path(directory)
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"event": "started", "t": time.time()}), flush=True)

    async def handle(key: str, digest: str) -> None:
        path = work / "model.safetensors"
        path.unlink(missing_ok=True)
        await store.download_to(key, path, ranges=FULL_RANGES)
        verified = file_digest(path) == digest
        n = 0
        if verified:
            tensors = load_file(path)
            n = sum(t.numel() for t in tensors.values())
            del tensors
        print(json.dumps({"event": "loaded", "key": key, "numel": n, "verified": verified, "t": time.time()}), flush=True)

    for line in sys.stdin:
        parts = line.split()
        if len(parts) != 2:
            break
        asyncio.run(handle(parts[0], parts[1]))
    return 0


class FullIsland:
    def __init__(self, index: int, prefix: Sequence[str], endpoint: str, server: Any, directory: Path) -> None:
        self.cmd = [*prefix, sys.executable, "-m", "weftboard.publisher.bench.bench_sync", "full-island",
                    endpoint, server.access_key, server.secret_key, server.bucket, str(directory)]
        self.proc: asyncio.subprocess.Process | None = None
        self.events: asyncio.Queue = asyncio.Queue()
        self.log = directory.parent / f"full-{index}.log"

    async def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(*self.cmd, stdin=asyncio.subprocess.PIPE,
                                                             stdout=asyncio.subprocess.PIPE, stderr=log)
        await self.next_event(120)

    async def next_event(self, timeout_s: float) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
            if not line:
                raise RuntimeError(f"baseline island exited; log: {self.log.read_text()[-2000:]}")
            try:
                return json.loads(line)
            except ValueError:
                continue

    async def load(self, key: str, digest: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(f"{key} {digest}\n".encode())
        await self.proc.stdin.drain()

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                self.proc.stdin.write(b"\n")
                await self.proc.stdin.drain()
                await asyncio.wait_for(self.proc.wait(), 10)
            except (OSError, asyncio.TimeoutError):
                self.proc.kill()
                await self.proc.wait()


# ---------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------


@dataclass
class BenchConfig:
    params: int = 110_000_000
    islands: int = 3
    versions: int = 5
    lr: float = 3e-6
    warm_steps: int = 30
    destination: str = "memory"
    work_dir: Path | None = None
    trainer_gc: str = "manual"  # TrainerCollector mode
    encoding: str = "default"  # the publisher's patch encoding
    part_bytes: int | None = None  # the publisher's staged patch parts (0: none; None: while islands ask)
    board_process: bool = False  # the board in its own process (default: on the bench's event loop)
    presigned: bool = False  # islands without S3 credentials, reading through the board's presigned URLs
    network: Any = None  # an IslandNetwork (LoopbackNetwork by default)
    log: Any = None  # callable(str) for human-readable progress lines


class _BoardChild:
    """``weftboard serve`` as a child process, with the interface of ``start_board``'s handle."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self.address = proc.address

    async def stop(self) -> None:
        await asyncio.to_thread(self.proc.stop)


async def _board_process(workdir: Path, redis_url: str, s3: Any, token: str) -> _BoardChild:
    proc = BoardProcess(workdir, redis_url, ["--s3-endpoint", s3.endpoint, "--s3-access-key", s3.access_key,
                                             "--s3-secret-key", s3.secret_key, "--s3-bucket", s3.bucket,
                                             "--s3-insecure", "--s3-region", "us-east-1"], token)
    try:
        async with BoardClient(proc.address, token, timeout_s=30) as client:
            await proc.wait_ready(client)
    except BaseException:
        proc.stop()
        raise
    return _BoardChild(proc)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def _queue_drops(net: Any) -> int | None:
    """Packets the simulated links' rate limits dropped so far (None on loopback)."""
    return await asyncio.to_thread(net.queue_drops) if hasattr(net, "queue_drops") else None


async def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    say = cfg.log or (lambda s: print(s, file=sys.stderr, flush=True))
    net = cfg.network or LoopbackNetwork()
    root = Path(cfg.work_dir or tempfile.mkdtemp(prefix="weftboard-bench-sync-"))
    root.mkdir(parents=True, exist_ok=True)
    say(f"work dir {root}; starting redis and SeaweedFS")
    redis = await asyncio.to_thread(start_redis, root / "redis")
    s3 = await asyncio.to_thread(start_seaweedfs, root / "s3")
    store = S3BlobStore(s3.endpoint, s3.access_key, s3.secret_key, s3.bucket, region="us-east-1")
    token = "bench-admin-" + os.urandom(12).hex()
    if cfg.board_process:  # as deployed, though on this host one more process shares the cores
        board = await _board_process(root / "board", redis.url, s3, token)
    else:
        board = await start_board(BoardConfig(listen="127.0.0.1:0", redis_url=redis.url, admin_token=token,
                                              watch_progress_s=1.0), blobs=store)
    islands: list[IslandProcess] = []
    fulls: list[FullIsland] = []
    # The links' queue drops (None on loopback) when the measured versions start, when they
    # end, and after the baseline.
    drops_start = drops_deltas = drops_full = None
    pub = None
    collector: TrainerCollector | None = None
    try:
        if hasattr(net, "start"):  # --wan: the topology relays to ports that exist only now
            await net.start([board.address, s3.endpoint])
            say(f"islands behind simulated WAN links: {net.describe()}")
        say(f"building a {cfg.params / 1e6:.0f}M-parameter fp32 model")
        collector = TrainerCollector(cfg.trainer_gc)
        trainer = await asyncio.to_thread(BenchTrainer, cfg.params, cfg.lr, collector=collector)
        collector.start()
        say(f"{cfg.warm_steps} AdamW steps before publishing (an RL run is past its first steps)")
        for _ in range(max(1, cfg.warm_steps)):
            await asyncio.to_thread(trainer.step)
        view_bytes = trainer.numel * 2
        say(f"model: {trainer.numel:,} parameters, served view {view_bytes / 1e6:.0f} MB (bf16)")

        # One-time kernel compiles are not the publisher's memory or time.
        await asyncio.to_thread(warm_up_kernels, ("bf16",), (cfg.encoding,))
        rss0 = _rss_bytes()
        results: dict[int, dict[str, Any]] = {}
        with RssSampler() as sampler:
            pub = Publisher(board.address, RUN, token=token, blob_store=store, anchor_every=10_000,
                            anchor_patch_fraction=0.5, max_pending=2, work_dir=root / "publisher", encoding=cfg.encoding,
                            part_bytes=cfg.part_bytes)
            pub.attach(trainer.opt)  # publish returns at once; the next optimizer step waits for the read
            t0 = time.time()
            h1 = await asyncio.to_thread(pub.publish, trainer.state(), step=trainer.steps)
            await asyncio.to_thread(h1.result, 300)
            say(f"version 1 (anchor) committed in {time.time() - t0:.2f}s; starting {cfg.islands} islands")
            for i in range(cfg.islands):
                own = {} if cfg.presigned else {"s3_endpoint": net.s3_endpoint(i, s3.endpoint), "s3_access_key": s3.access_key,
                                                "s3_secret_key": s3.secret_key, "s3_bucket": s3.bucket}
                spec = IslandSpec(f"island-{i}", root / "islands" / f"island-{i}", net.board_address(i, board.address), RUN,
                                  token=token, destination=cfg.destination, prefix=net.prefix(i), **own)
                islands.append(IslandProcess(spec))
            await asyncio.gather(*(isl.start() for isl in islands))
            await asyncio.gather(*(isl.wait_version(1, 300) for isl in islands))
            say("islands hold version 1; one warm-up patch version (JIT compiles in every process), then measuring")
            roots_ok = True
            warmup_s = None
            # The trainer loop: publish, then at once the next step (its gradients overlap the
            # publisher's read; the optimizer step waits for the read: that wait is blocked time).
            await asyncio.to_thread(trainer.step)
            for i in range(cfg.versions + 1):
                if i == 1:
                    drops_start = await _queue_drops(net)
                sampler.paused.set()  # the bench's own check is not the publisher's memory
                expected_root = await asyncio.to_thread(trainer.served_root)  # one tensor at a time
                sampler.paused.clear()
                t_pub = time.time()
                handle = await asyncio.to_thread(pub.publish, trainer.state(), step=trainer.steps)
                await asyncio.to_thread(trainer.step)
                record = await asyncio.to_thread(handle.result, 300)
                await asyncio.gather(*(isl.wait_version(handle.version, 300) for isl in islands))
                applied = [isl.applied()[handle.version] for isl in islands]
                done = max(applied)
                roots_ok &= record.root_digest == expected_root
                if i == 0:
                    warmup_s = done - t_pub
                    say(f"v{handle.version} (warm-up): synced on {cfg.islands} islands in {warmup_s:.2f}s")
                    continue
                events = [isl.applied_event(handle.version) for isl in islands]
                results[handle.version] = {
                    "sync_s": done - t_pub,
                    "islands_s": [t - t_pub for t in applied],
                    "island_seen_s": statistics.fmean(e.get("seen", float("nan")) - t_pub for e in events),
                    "island_fetched_s": statistics.fmean(e.get("fetched_s", float("nan")) for e in events),
                    "island_apply_s": statistics.fmean(e.get("apply_s", float("nan")) for e in events), "blocked_s": handle.blocked_s, "read_s": handle.read_s,
                    "patch_bytes": record.stats.patch_bytes,
                    "parts": sum(len(a.blobs) for a in record.artifacts if a.kind == pb.ARTIFACT_KIND_PATCH),
                    "density": record.stats.density, "changed": record.stats.changed_elements,
                }
                say(f"v{handle.version}: patch {record.stats.patch_bytes / 1e6:.2f} MB, density {record.stats.density:.4%}, "
                    f"blocked {handle.blocked_s:.3f}s, synced on {cfg.islands} islands in {done - t_pub:.2f}s "
                    f"(the first in {min(applied) - t_pub:.2f}s)")
            drops_deltas = await _queue_drops(net)
            await asyncio.to_thread(pub.close)
            stages = [t for t in pub.timings if t.get("version") in results]
        peak_extra = sampler.peak - rss0
        all_applied = all(all(v in isl.applied() for v in results) for isl in islands)
        for isl in islands:
            await isl.stop()

        # Baseline: full checkpoint every version, same S3, N islands download + load.
        say("baseline: full checkpoints")
        for i in range(cfg.islands):
            fulls.append(FullIsland(i, net.prefix(i), net.s3_endpoint(i, s3.endpoint), s3, root / "full" / f"island-{i}"))
        await asyncio.gather(*(f.start() for f in fulls))
        full_sync: list[float] = []
        full_upload: list[float] = []
        full_bytes = 0
        for v in range(cfg.versions):
            # The same loop shape: the checkpoint is written (the weights must not change
            # meanwhile), then upload and island loads overlap the next trainer step.
            t_pub = time.time()
            files = await asyncio.to_thread(
                write_checkpoint, root / "full-ckpt" / f"v{v}", list(trainer.served().items()), shard_bytes=1 << 40)
            key = f"{RUN}-full/v{v}.safetensors"

            async def ship(key: str = key, files: list = files) -> float:
                t_up = time.time()
                await store.put_file(key, files[0].path)
                full_upload.append(time.time() - t_up)
                await asyncio.gather(*(f.load(key, files[0].digest) for f in fulls))
                events = await asyncio.gather(*(f.next_event(600) for f in fulls))
                if not all(e.get("verified") for e in events):
                    raise RuntimeError(f"a baseline island could not verify {key}")
                return max(e["t"] for e in events)

            done, _ = await asyncio.gather(ship(), asyncio.to_thread(trainer.step))
            full_bytes = files[0].size
            full_sync.append(done - t_pub)
            files[0].path.unlink()
            say(f"full v{v}: {full_bytes / 1e6:.0f} MB, upload {full_upload[-1]:.2f}s, synced in {full_sync[-1]:.2f}s")
        drops_full = await _queue_drops(net)
    finally:
        for f in fulls:
            await f.stop()
        for isl in islands:
            await isl.stop()
        if collector is not None:
            collector.stop()
        if pub is not None:
            await asyncio.to_thread(pub.close, False)
        if hasattr(net, "close"):  # --wan: remove namespaces and relays
            await net.close()
        await board.stop()
        await store.close()
        s3.stop()
        redis.stop()
        if cfg.work_dir is None:  # our own temporary directory: servers' data, islands, checkpoints
            shutil.rmtree(root, ignore_errors=True)

    delta_sync = [r["sync_s"] for r in results.values()]
    island_sync = [t for r in results.values() for t in r["islands_s"]]
    spread = [max(r["islands_s"]) - min(r["islands_s"]) for r in results.values()]
    blocked = [r["blocked_s"] for r in results.values()]
    patch_bytes = [r["patch_bytes"] for r in results.values()]
    delta_p50 = _pct(delta_sync, 0.5)
    full_p50 = _pct(full_sync, 0.5)
    upload_p50 = _pct(full_upload, 0.5)
    blocked_mean = statistics.fmean(blocked) if blocked else float("nan")
    return {
        "params": trainer.numel,
        "encoding": cfg.encoding,
        "part_bytes": "auto" if cfg.part_bytes is None else cfg.part_bytes,
        "board": "own process" if cfg.board_process else "on the bench's event loop",
        "islands": cfg.islands,
        "island_blobs": "the board's presigned URLs" if cfg.presigned else "S3 with their own credentials",
        "versions": len(results),
        "island_destination": cfg.destination,
        **net.describe(),
        **({"wan_queue_drops": {"delta_versions": drops_deltas - drops_start, "full_checkpoints": drops_full - drops_deltas}}
           if drops_start is not None and drops_deltas is not None and drops_full is not None else {}),
        "density": statistics.fmean(r["density"] for r in results.values()) if results else 0.0,
        "delta_bytes_per_version": int(statistics.fmean(patch_bytes)) if patch_bytes else 0,
        "patch_parts_per_version": round(statistics.fmean(r["parts"] for r in results.values()), 2) if results else 0,
        "full_bytes_per_version": full_bytes,
        "delta_sync_p50_s": round(delta_p50, 4),
        "delta_sync_p99_s": round(_pct(delta_sync, 0.99), 4),
        "island_sync_p50_s": round(_pct(island_sync, 0.5), 4) if island_sync else None,
        "island_spread_p50_s": round(_pct(spread, 0.5), 4) if spread else None,
        "full_sync_p50_s": round(full_p50, 4),
        "full_upload_p50_s": round(upload_p50, 4),
        "speedup_p50": round(full_p50 / delta_p50, 2) if delta_p50 > 0 else None,
        # The physical limit of the speedup over a link that only moves bytes: full over patch bytes.
        "bytes_ratio": round(full_bytes / statistics.fmean(patch_bytes), 2) if patch_bytes and full_bytes else None,
        "warmup_sync_s": round(warmup_s, 4) if warmup_s is not None else None,
        "trainer_blocked_s_per_version": round(blocked_mean, 4),
        "blocked_over_full_upload": round(blocked_mean / upload_p50, 4) if upload_p50 > 0 else None,
        "publisher_stage_s": {k: round(statistics.fmean(t.get(k, 0.0) for t in stages), 4)
                              for k in ("read_s", "finish_s", "digest_s", "queued_s", "encode_s", "encode_wait_s", "upload_s",
                                        "commit_s", "committed_s")} if stages else {},
        # Mean over islands and versions: watch event seen (after the publish call), then fetch, then apply + verify.
        "island_stage_s": {k: round(statistics.fmean(r["island_" + k] for r in results.values()), 4)
                           for k in ("seen_s", "fetched_s", "apply_s")} if results else {},
        "publisher_read_s_per_version": round(statistics.fmean(r["read_s"] for r in results.values()), 4) if results else None,
        "publisher_extra_memory_ratio": round(peak_extra / view_bytes, 3),
        "trainer_gc": collector.describe(),
        "trainer_gc_s_per_step": round(collector.seconds / max(1, trainer.steps), 4),
        "baseline": "full safetensors written, uploaded to the same S3, downloaded (8 byte ranges at once), xxh3-verified and loaded by every island",
        "memory_method": "peak RSS while publishing minus RSS before the publisher (model, grads, fused AdamW state allocated), over one bf16 view",
        "bitwise_ok": bool(roots_ok and all_applied and results),
    }


def main_cli(params: int, islands: int, versions: int, destination: str, json_out: bool, work_dir: Path | None,
             wan: bool = False, wan_rate_mbit: float = 100.0, wan_rtt_ms: float = 40.0,
             wan_slow_start: bool = True, wan_loss: float = WAN_LOSS, warm_steps: int = 30, trainer_gc: str = "manual",
             encoding: str = "default", part_bytes: int | None = None, board_process: bool = False,
             presigned: bool = False) -> dict:
    cfg = BenchConfig(params=params, islands=islands, versions=versions, destination=destination, work_dir=work_dir,
                      warm_steps=warm_steps, trainer_gc=trainer_gc, encoding=encoding, part_bytes=part_bytes,
                      board_process=board_process, presigned=presigned)
    if wan:  # islands in network namespaces behind simulated WAN links (publisher/bench/wan)
        try:
            WanNetwork.check()
        except WanUnavailable as exc:
            print(f"skipping bench sync --wan: {exc}", file=sys.stderr)
            print(skipped_line(exc))
            return {"skipped": str(exc)}
        cfg.network = WanNetwork(islands, wan_rate_mbit, wan_rtt_ms, wan_slow_start, wan_loss)
    result = asyncio.run(run_bench(cfg))
    if not json_out:
        for k, v in result.items():
            print(f"{k:32s} {v}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "full-island":
        raise SystemExit(full_island_main(sys.argv[2:]))
    raise SystemExit("usage: python -m weftboard.publisher.bench.bench_sync full-island ENDPOINT ACCESS SECRET BUCKET DIR")
