"""``weftboard bench publish``: sharded publishing (every rank its slices) vs a gather to rank 0.

What it runs, all on this machine: Redis, a board on a local-directory blob store, and N rank
processes of one ``torch.distributed`` gloo job holding a stack of linear layers (>= 100M
parameters by default), each weight split by rows across ranks (``Slice``: no rank holds a
full weight). Each version, every rank moves its slices as an optimizer step would, then:

- sharded: every rank calls ``ShardedPublisher.publish`` on its slices (run ``bench-sharded``);
  its blocking time (the snapshot) and the bytes it uploaded are recorded per rank;
- baseline: the slices are gathered to rank 0 (``dist.gather``), which publishes the full state
  dict with a single-process ``Publisher`` (run ``bench-gather``); its blocking time is the
  gather plus the publish call, on rank 0, the rank every other rank waits for.

``bitwise_ok``: every version of both runs committed with the same root digest, which is over
the full logical served tensors, so the sharded run serves bitwise what the gathered one does.
The first version (run creation, anchors) is not measured: the figures are patch versions.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from weftboard.board.blobs.localdir import LocalDirBlobStore
from weftboard.board.embedded import free_port, start_redis
from weftboard.board.process import BoardConfig, start_board
from weftboard.cuda.warmup import warm_up_kernels
from weftboard.publisher.publisher import Publisher
from weftboard.publisher.sharded import ShardedPublisher, Slice

SHARDED_RUN, GATHER_RUN = "bench-sharded", "bench-gather"


def _layers(params: int, width: int) -> int:
    return max(1, -(-params // (width * width)))


def _rank_main(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """One rank: its row slices of every layer, ``versions`` steps, both ways of publishing."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    width, layers, versions = cfg["width"], cfg["layers"], cfg["versions"]
    rows = [width // world + (r < width % world) for r in range(world)]
    offset = sum(rows[:rank])
    gen = torch.Generator().manual_seed(1000 + rank)
    local = [torch.randn(rows[rank], width, generator=gen) * 0.02 for _ in range(layers)]
    store = LocalDirBlobStore(cfg["blobs"])
    sharded = ShardedPublisher(cfg["board"], SHARDED_RUN, token=cfg["token"], blob_store=store,
                               anchor_every=10_000, work_dir=Path(cfg["work"]) / f"sharded-{rank}")
    single = (Publisher(cfg["board"], GATHER_RUN, token=cfg["token"], blob_store=store, anchor_every=10_000,
                        work_dir=Path(cfg["work"]) / "single") if rank == 0 else None)
    out: dict[str, Any] = {"rank": rank, "sharded_blocked_s": [], "gather_blocked_s": [], "sharded_bytes": [],
                           "gather_bytes": [], "roots_equal": []}
    try:
        for step in range(versions):
            for t in local:  # an optimizer step's worth of change: small, dense
                t.add_(torch.randn(t.shape, generator=gen), alpha=1e-4)
            state = {f"layers.{i}.weight": Slice(t, (width, width), (offset, 0)) for i, t in enumerate(local)}
            handle = sharded.publish(state, step=step)
            sharded_record = handle.result(cfg["timeout_s"])
            out["sharded_blocked_s"].append(handle.blocked_s)
            out["sharded_bytes"].append(sharded.uploaded_bytes[-1])
            dist.barrier()
            t0 = time.perf_counter()
            gathered: list[torch.Tensor] = []
            for t in local:
                parts = [torch.empty(r, width) for r in rows] if rank == 0 else None
                dist.gather(t, parts, dst=0)
                if rank == 0:
                    gathered.append(torch.cat(parts))
            if single is not None:
                h = single.publish({f"layers.{i}.weight": t for i, t in enumerate(gathered)}, step=step)
                out["gather_blocked_s"].append(time.perf_counter() - t0)
                record = h.result(cfg["timeout_s"])
                out["gather_bytes"].append(record.stats.patch_bytes + record.stats.anchor_bytes)
                out["roots_equal"].append(record.root_digest == sharded_record.root_digest)
            else:
                out["gather_blocked_s"].append(time.perf_counter() - t0)
            del gathered
            dist.barrier()
        sharded.close()
        if single is not None:
            single.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out["error"] = f"{type(exc).__name__}: {exc}"
    Path(cfg["work"], f"rank-{rank}.json").write_text(json.dumps(out))
    os._exit(0)  # a failed peer can hang the process group's teardown


async def run_bench(ranks: int, params: int, width: int, versions: int, work_dir: Path | None,
                    timeout_s: float) -> dict[str, Any]:
    root = Path(work_dir or tempfile.mkdtemp(prefix="weftboard-bench-publish-"))
    root.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(warm_up_kernels, ("bf16",), ("default",))  # compiled once, not inside a rank's timing
    redis = await asyncio.to_thread(start_redis, root / "redis")
    token = "bench-admin-" + os.urandom(12).hex()
    blobs = root / "blobs"
    board = await start_board(BoardConfig(listen="127.0.0.1:0", redis_url=redis.url, admin_token=token),
                              blobs=LocalDirBlobStore(blobs))
    layers = _layers(params, width)
    cfg = {"port": free_port(), "board": board.address, "token": token, "blobs": str(blobs), "work": str(root),
           "width": width, "layers": layers, "versions": versions + 1, "timeout_s": timeout_s}
    try:
        ctx = mp.spawn(_rank_main, args=(ranks, cfg), nprocs=ranks, join=False)
        deadline = time.monotonic() + timeout_s * (versions + 2)
        for p in ctx.processes:
            await asyncio.to_thread(p.join, max(1.0, deadline - time.monotonic()))
        alive = [p for p in ctx.processes if p.is_alive()]
        for p in alive:
            p.kill()
        if alive:
            raise TimeoutError(f"bench publish: {len(alive)} rank(s) still running after {timeout_s * (versions + 2):.0f}s")
        reports = [json.loads((root / f"rank-{r}.json").read_text()) for r in range(ranks)
                   if (root / f"rank-{r}.json").exists()]
    finally:
        await board.stop()
        redis.stop()
        if work_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    errors = [f"rank {r['rank']}: {r['error']}" for r in reports if r.get("error")]
    if len(reports) != ranks or errors:
        raise RuntimeError(f"bench publish failed: {len(reports)} of {ranks} ranks reported; {'; '.join(errors)}")
    measured = slice(1, None)  # version 1 opens the runs and anchors

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs[measured])

    per_rank_blocked = [mean(r["sharded_blocked_s"]) for r in reports]
    rank0 = reports[0]
    return {
        "ranks": ranks,
        "params": layers * width * width,
        "versions": versions,
        "bitwise_ok": bool(rank0["roots_equal"]) and all(rank0["roots_equal"]),
        "blocked_s_per_version_per_rank": [round(b, 4) for b in per_rank_blocked],
        "blocked_s_per_version_max_rank": round(max(per_rank_blocked), 4),
        "uploaded_bytes_per_version_per_rank": [int(mean(r["sharded_bytes"])) for r in reports],
        "gather_then_publish_blocked_s": round(mean(rank0["gather_blocked_s"]), 4),
        "gather_then_publish_uploaded_bytes_rank0": int(mean(rank0["gather_bytes"])),
        "anchor_uploaded_bytes_per_rank": [r["sharded_bytes"][0] for r in reports],
        "baseline": "dist.gather of every slice to rank 0, then Publisher.publish of the full state dict there",
    }


def main_cli(ranks: int, params: int, width: int, versions: int, json_out: bool, work_dir: Path | None,
             timeout_s: float) -> dict[str, Any]:
    result = asyncio.run(run_bench(ranks, params, width, versions, work_dir, timeout_s))
    if not json_out:
        for k, v in result.items():
            print(f"{k:40s} {v}", file=sys.stderr)
    print(json.dumps(result))
    return result
