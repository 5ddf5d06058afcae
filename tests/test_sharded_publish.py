"""Sharded publishing with real process groups: FSDP2 ``fully_shard`` on gloo (CPU), a small
transformer, AdamW steps; islands follow bitwise the full state dict each job gathers itself
(``full_tensor``), across a world-size change and a rank killed mid-publish (in a version
that anchors and patches: its staged part and its anchor file are both collected by GC).

Real board, Redis and blob store; every rank is a process of its own (torch.multiprocessing).
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from boardkit import make_record, make_run, upload
from distkit import run_ranks
from pubsubkit import WARM_KERNELS, TinyLM, follow_each

from weftboard.board.blobs.localdir import LocalDirBlobStore
from weftboard.board.client import BoardClient
from weftboard.board.embedded import free_port
from weftboard.cuda.codec import read_patch_info
from weftboard.cuda.formats import ServedFormatSpec
from weftboard.proto import errors
from weftboard.proto.errors import InvalidArgument
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.sharded import ShardedPublisher, Slice
from weftboard.publisher.sharded_layout import RankHeader, TensorEntry, plan_slices

pytestmark = WARM_KERNELS

MODEL = {"vocab": 64, "d": 32, "hidden": 64, "layers": 2}


def _job(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """One rank of a training job: FSDP2 model, AdamW steps, one version per step."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415  (child process only)
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = Path(cfg["out"])
    model = TinyLM(seed=0, **MODEL)
    if cfg.get("load"):
        model.load_state_dict(torch.load(cfg["load"]))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(cfg["seed"])
    pub = ShardedPublisher(cfg["board"], "sharded", token=cfg["token"], blob_store=LocalDirBlobStore(cfg["blobs"]),
                           collective_timeout_s=cfg.get("timeout_s", 60), work_dir=out / f"work-{rank}",
                           anchor_every=cfg.get("anchor_every", 50), metrics_port=0 if cfg.get("metrics") else None)
    if rank == cfg.get("kill_rank"):
        def die(version: int, result: Any) -> None:
            if version == cfg["kill_at"]:
                (out / "killed.json").write_text(json.dumps({"part": result.part, "anchor": result.anchor}))
                os._exit(3)
        pub.before_gather = die
    report: dict[str, Any] = {"versions": [], "error": None}
    try:
        for step in range(cfg["steps"]):
            tokens = torch.randint(0, MODEL["vocab"], (4, 12), generator=gen)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, MODEL["vocab"]), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            full = {n: t.full_tensor() for n, t in model.state_dict().items()}  # gathered independently
            handle = pub.publish(model, step=step)
            if rank == 0:
                torch.save({n: t.to(torch.bfloat16) for n, t in full.items()}, out / f"view-{handle.version}.pt")
                torch.save(full, out / "state.pt")
            report["versions"].append(handle.result(120).version)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(exc).__name__}: {exc}"
    if cfg.get("metrics"):  # what this rank's metrics say after its versions (rank 0 serves them)
        scraped = (urllib.request.urlopen(f"http://127.0.0.1:{pub.metrics.port}/metrics", timeout=10).read().decode()
                   if pub.metrics.port is not None else "")
        (out / f"metrics-{rank}.txt").write_text(scraped)
    (out / f"report-{rank}.json").write_text(json.dumps(report))
    if report["error"] is None:
        pub.close()
        dist.destroy_process_group()
    os._exit(0)  # a dead peer can hang the process group's teardown


def _spawn(world: int, cfg: dict[str, Any], deadline_s: float = 150.0) -> list[int | None]:
    """Run one job of ``world`` ranks; their exit codes (no rank outlives the board: ``run_ranks``)."""
    cfg = dict(cfg, port=free_port())
    return run_ranks(_job, world, (world, cfg), deadline_s=deadline_s,
                     describe=lambda: f"reports: {_reports(Path(cfg['out']), world)}")


def _reports(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"report-{r}.json").read_text()) for r in range(world) if (out / f"report-{r}.json").exists()]


async def test_fsdp2_ranks_publish_and_an_island_follows_bitwise_across_world_sizes_and_a_killed_rank(
        board, local_store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    base = {"board": board.address, "token": board.admin_token, "blobs": str(local_store.root), "out": str(out)}
    # job 1: 2 ranks, versions 1 (anchor), 2, 3 (patches in two parts)
    assert await asyncio.to_thread(_spawn, 2, dict(base, steps=3, seed=1, metrics=True)) == [0, 0]
    assert [r["versions"] for r in _reports(out, 2)] == [[1, 2, 3]] * 2
    scraped = (out / "metrics-0.txt").read_text()  # rank 0 serves its metrics; rank 1 serves none
    assert 'weftboard_publisher_version{run="sharded"} 3.0' in scraped
    assert 'weftboard_publisher_versions_total{kind="anchor",run="sharded"} 1.0' in scraped
    assert 'weftboard_publisher_versions_total{kind="patch",run="sharded"} 2.0' in scraped
    assert 'weftboard_publisher_pending{run="sharded"} 0.0' in scraped
    assert (out / "metrics-1.txt").read_text() == ""
    # job 2: 4 ranks from job 1's weights: version 4 (an anchor), 5, then rank 3 dies in version 6
    # (due to anchor: a patch part and an anchor file per rank)
    torch.save(torch.load(out / "state.pt"), tmp_path / "state-job1.pt")
    exits = await asyncio.to_thread(_spawn, 4, dict(base, steps=3, seed=2, load=str(tmp_path / "state-job1.pt"),
                                                   kill_rank=3, kill_at=6, timeout_s=20, anchor_every=2))
    assert exits == [0, 0, 0, 3]
    reports = _reports(out, 4)
    assert len(reports) == 3 and all(r["versions"] == [4, 5] and "version 6" in r["error"] for r in reports), reports
    killed = json.loads((out / "killed.json").read_text())
    killed_part, killed_anchor = killed["part"], killed["anchor"]
    assert killed_anchor[0] == "model-00004-of-00004.safetensors"
    async with BoardClient(board.address, board.admin_token) as client:
        assert (await client.get_head("sharded")).version == 5  # nothing of version 6 is visible
        assert await local_store.stat(killed_part[0]) == killed_part[2]  # its part was uploaded and staged
        assert await local_store.stat(killed_anchor[1]) == killed_anchor[3]  # so was its anchor file
        # job 3: 2 ranks again, from the weights job 2 had: version 6 (an anchor), 7
        torch.save(torch.load(out / "state.pt"), tmp_path / "state-job2.pt")
        assert await asyncio.to_thread(_spawn, 2, dict(base, steps=2, seed=3,
                                                       load=str(tmp_path / "state-job2.pt"))) == [0, 0]
        assert [r["versions"] for r in _reports(out, 2)] == [[6, 7]] * 2
        record = await client.get_version("sharded", 3)
        assert [a.kind for a in record.artifacts] and len(record.artifacts[0].blobs) == 2  # one part per rank
        written = {t.name: (t.mode, t.stream_bytes) for b in record.artifacts[0].blobs
                   for t in read_patch_info(await local_store.get_bytes(b.key)).tensors if t.changed}
        assert written and {t.name: (t.coder, t.stream_bytes) for t in record.stats.tensors} == written
        views = {v: torch.load(out / f"view-{v}.pt") for v in range(1, 8)}
        await follow_each(client, "sharded", local_store, tmp_path, views)
        await client.collect_garbage("sharded")
        assert await local_store.stat(killed_part[0]) is None  # the dead rank's part was collected
        assert await local_store.stat(killed_anchor[1]) is None  # and its anchor file


def _header(rank: int, world: int, version: int, *boxes: Any, shape: tuple[int, ...] = (4, 6)) -> RankHeader:
    return RankHeader(rank, world, version, tuple(TensorEntry(f"t{i}", "bfloat16", shape, b) for i, b in enumerate(boxes)))


def test_plan_refuses_bad_layouts_with_clear_errors() -> None:
    rows = [((0, 0), (2, 6)), ((2, 0), (2, 6))]
    plan = plan_slices([_header(0, 2, 1, rows[0], None), _header(1, 2, 1, rows[1], None)])
    assert [len(t.slices) for t in plan.tensors] == [2, 1]  # the replicated tensor is sent once
    assert plan.tensors[1].whole_on_owner
    with pytest.raises(InvalidArgument, match="overlapping slices of 't0'"):
        plan_slices([_header(0, 2, 1, ((0, 0), (3, 6))), _header(1, 2, 1, rows[1])])
    with pytest.raises(InvalidArgument, match="missing slices of 't0'.*cover 18 of its 24"):
        plan_slices([_header(0, 2, 1, ((0, 0), (1, 6))), _header(1, 2, 1, rows[1])])
    with pytest.raises(InvalidArgument, match="ranks disagree on the layout"):
        plan_slices([_header(0, 2, 1, rows[0]), _header(1, 2, 1, rows[1], shape=(5, 6))])
    with pytest.raises(InvalidArgument, match="world size changed mid-version"):
        plan_slices([_header(0, 2, 1, rows[0]), _header(1, 4, 1, rows[1])])
    with pytest.raises(InvalidArgument, match="ranks disagree on the version"):
        plan_slices([_header(0, 2, 1, rows[0]), _header(1, 2, 2, rows[1])])
    assert Slice(torch.zeros(2, 6), (4, 6), (2, 0)).offset == (2, 0)



def test_a_bad_upload_part_size_is_refused_when_the_publisher_is_made() -> None:
    with pytest.raises(InvalidArgument, match="part_bytes 1024 is out of range"):
        ShardedPublisher("127.0.0.1:1", "r", upload_part_bytes=1024)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "mxfp4", "nvfp4"])
def test_a_served_format_with_scales_is_refused_when_the_publisher_is_made(kind: str) -> None:
    # no process group needed: the argument is checked first
    with pytest.raises(InvalidArgument, match=f"needs an elementwise served format.*{kind}"):
        ShardedPublisher("127.0.0.1:1", "r", served_format=ServedFormatSpec(kind))


async def test_a_staged_anchor_file_is_noted_never_relayed_and_collected_if_its_version_commits_without_it(
        board, local_store) -> None:
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("a"))
        dead = await upload(local_store, "a", b"anchor file of a rank that died", name="model-00002-of-00002.safetensors")
        assert (await client.stage_part("a", 1, dead)).head == 0  # version 1 anchors: its files may be staged
        with pytest.raises(errors.InvalidArgument, match=r"anchor file \(\*.safetensors\)"):
            await client.stage_part("a", 1, pb.BlobRef(key=dead.key, digest=dead.digest, size=dead.size,
                                                       name="config.json"))
        await client.commit_version(await make_record(local_store, "a", 1))  # names other files
        with pytest.raises(errors.FailedPrecondition, match="cannot stage an anchor file: the head is 1"):
            await client.stage_part("a", 1, dead)

        # A watcher asking for hints gets patch parts only: once it is known to listen, an anchor
        # file staged before a part would reach it first, were it relayed.
        events: asyncio.Queue = asyncio.Queue()

        async def watch() -> None:
            async for event in client.watch("a", after_version=1, staged_parts=True, progress_interval_ms=60000):
                events.put_nowait(event)

        watcher = asyncio.create_task(watch())
        anchor_file = await upload(local_store, "a", b"anchor file of version 2", name="model.safetensors")
        part = await upload(local_store, "a", b"a patch part of version 2")
        for _ in range(100):
            await client.stage_part("a", 2, anchor_file)
            await client.stage_part("a", 2, part)
            try:
                first = await asyncio.wait_for(events.get(), 0.2)
                break
            except asyncio.TimeoutError:
                continue  # the stream was not listening yet
        else:
            raise AssertionError("no staged-part hint reached the watcher")
        await client.stage_part("a", 2, anchor_file)
        await client.stage_part("a", 2, part)
        second = await asyncio.wait_for(events.get(), 10)
        assert [e.staged.blob.key for e in (first, second)] == [part.key] * 2
        watcher.cancel()

        record = await make_record(local_store, "a", 2)
        record.artifacts[0].ClearField("blobs")
        record.artifacts[0].blobs.append(part)
        await client.commit_version(record)  # version 2 without the staged anchor file
        done = await client.collect_garbage("a")
        assert {dead.key, anchor_file.key} <= set(done.deleted_keys)
        assert await local_store.stat(dead.key) is None and await local_store.stat(anchor_file.key) is None
        assert await local_store.stat(part.key) == part.size  # named by version 2: kept
