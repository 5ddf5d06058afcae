"""End to end: a trainer publishes real AdamW steps; three islands follow, bitwise.

Real board, real Redis, real SeaweedFS. Island A is an in-process subscriber on live
tensors (direct S3 credentials); island B is a real ``weftboard subscribe`` process on a
checkpoint directory using presigned URLs, SIGKILLed in the middle of an apply and
restarted; island C joins late and must start from an anchor. The trainer keeps its own
served view of every version; every island must equal it at every version it reports.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import hang_in_apply
import pytest
from pubsubkit import (
    WARM_KERNELS,
    Trainer,
    bits_equal,
    first_difference,
    island_and_trainer_tokens,
    zeros_like_layout,
)
from safetensors.torch import load_file

from weftboard.board.client import BoardClient
from weftboard.cuda.digest import root_digest, tensor_digest
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.bench.island_processes import IslandProcess, IslandSpec
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.live_tensors import LiveTensorsDestination
from weftboard.subscriber.subscriber import Subscriber

pytestmark = [pytest.mark.slow, *WARM_KERNELS]


def _root_of(view: dict) -> str:
    return root_digest([(n, str(t.dtype).removeprefix("torch."), list(t.shape), tensor_digest(t)) for n, t in view.items()])


def _checkpoint(dir: Path) -> dict:
    out: dict = {}
    for f in sorted((dir / "checkpoint" / "current").glob("*.safetensors")):
        out.update(load_file(f))
    return out


class InProcessIsland:
    def __init__(self, client: BoardClient, run: str, name: str, like: dict, tmp: Path, store) -> None:
        self.dest = LiveTensorsDestination(zeros_like_layout(like))
        self.sub = Subscriber(client, run, self.dest, island_id=name, blob_store=store, cache_dir=tmp / name, heartbeat_s=1)
        self.seen: dict[int, dict] = {}
        self.sub.add_listener(lambda v: self.seen.__setitem__(v, {k: t.clone() for k, t in self.dest.tensors.items()}))
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.sub.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


async def test_three_islands_follow_bitwise_with_crash_and_late_joiner(board_factory, s3_server, s3_store, tmp_path: Path) -> None:
    board = await board_factory(blobs=s3_store)
    run = "e2e"
    island_token, pub_token = await island_and_trainer_tokens(board.address, board.admin_token)
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}
    pub = Publisher(board.address, run, token=pub_token, blob_store=s3_store, anchor_every=3, anchor_patch_fraction=10.0)

    async def publish() -> int:
        def go() -> int:
            trainer.step()
            h = pub.publish(trainer.model, step=trainer.step_no)
            views[h.version] = trainer.served()
            h.result(60)
            return h.version
        return await asyncio.to_thread(go)

    client = BoardClient(board.address, island_token)
    a = b = c = None
    try:
        # Version 1 exists before the islands start (the run and its layout must exist).
        assert await publish() == 1
        a = InProcessIsland(client, run, "island-a", views[1], tmp_path, s3_store)
        a.start()
        spec_b = IslandSpec("island-b", tmp_path / "island-b", board.address, run, token=island_token,
                            prefix=hang_in_apply.prefix(2, 120))  # presigned URLs: no S3 credentials
        b = IslandProcess(spec_b)
        await b.start()
        await b.wait_version(1, 60)  # an anchor load: no hang there
        await a.sub.wait_for_version(1, 30)

        # Version 2 is a patch: B hangs inside the apply (written aside, not swapped); kill it there.
        assert await publish() == 2
        versions_dir = spec_b.dir / "checkpoint" / "versions"
        for _ in range(600):
            if list(versions_dir.glob(".tmp-v2-*")):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"island B never started applying version 2; log: {b.log_tail()}")
        await asyncio.sleep(0.5)
        b.kill(signal.SIGKILL)
        await b.stop()
        assert b.proc.returncode == -signal.SIGKILL
        assert bits_equal(_checkpoint(spec_b.dir), views[1]), "a killed apply must leave the old version intact"

        for v in range(3, 7):
            assert await publish() == v

        # C joins late: the board plans it from the newest anchor (version 4), not from 1.
        plan = await client.plan_catch_up(run, have_version=0, want_version=0)
        assert plan.steps[0].kind == pb.ARTIFACT_KIND_ANCHOR and plan.steps[0].to_version == 4
        c = InProcessIsland(client, run, "island-c", views[1], tmp_path, s3_store)
        c.start()
        await c.sub.wait_for_version(6, 60)
        assert min(c.seen) == 4

        # B restarts: it re-verifies version 1 on disk and catches up.
        b2 = IslandProcess(IslandSpec("island-b", spec_b.dir, board.address, run, token=island_token))
        await b2.start()
        started = await b2.wait_event(lambda e: e.get("event") == "started", 60)
        assert started["held"] == 1
        for v in (7, 8):
            assert await publish() == v
        await b2.wait_version(8, 90)
        await a.sub.wait_for_version(8, 60)
        await c.sub.wait_for_version(8, 60)

        # Everything any island reported equals the trainer's own view of that version.
        for island in (a, c):
            assert island.seen, "no version reported"
            for v, seen in island.seen.items():
                assert bits_equal(seen, views[v]), f"{island.sub.island_id} v{v}: {first_difference(seen, views[v])}"
        assert sorted(a.seen) == list(range(1, 9))
        assert set(b2.applied()) | set(b.applied()) >= {1, 8}
        records = {r.version: r async for r in client.iter_versions(run)}
        for v in set(b.applied()) | set(b2.applied()):
            assert records[v].root_digest == _root_of(views[v])  # what B verified is the trainer's view
        assert bits_equal(_checkpoint(spec_b.dir), views[8]), first_difference(_checkpoint(spec_b.dir), views[8])

        # An island holds a version a moment before its READY report lands (the report is sent
        # after the swap), so the fleet view is read until it settles.
        async with BoardClient(board.address, board.admin_token) as reader:
            for _ in range(100):
                fleet = await reader.list_islands(run)
                states = {i.status.island_id: (i.status.version, i.status.state) for i in fleet.islands}
                if all(states.get(i) == (8, pb.ISLAND_STATE_READY) for i in ("island-a", "island-c")):
                    break
                await asyncio.sleep(0.1)
        assert states["island-a"] == (8, pb.ISLAND_STATE_READY)
        assert states["island-c"] == (8, pb.ISLAND_STATE_READY)
        await b2.stop()
        assert b2.proc.returncode == 0  # SIGTERM: clean exit
    finally:
        for island in (a, c):
            if island is not None:
                await island.stop()
        for proc in (b, locals().get("b2")):
            if proc is not None:
                await proc.stop()
        await asyncio.to_thread(pub.close, False)
        await client.close()
