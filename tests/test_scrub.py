"""The island's scrub: what it serves is re-hashed against the version's record, and a damaged
version is quarantined (not served, readiness 503, its folder moved aside) and fetched again,
after which the island serves it bitwise again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from pubsubkit import WARM_KERNELS, Trainer, bits_equal
from test_destinations import _loaded
from test_trajectory_loop import Training, complete, island_of, ready

from weftboard.board.client import BoardClient
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.scrub import Scrubber
from weftboard.subscriber.subscriber import Subscriber

pytestmark = WARM_KERNELS


def _flip_a_bit(tensor: torch.Tensor) -> None:
    tensor.view(torch.int16).view(-1)[0] ^= 1


async def test_an_island_quarantines_damaged_live_weights_and_serves_again_after_the_refetch(
        board, local_store, tmp_path) -> None:
    training = Training(board, local_store, tmp_path)
    try:
        for _ in range(3):
            await training.publish()
        island = await island_of(board, local_store, tmp_path, "scrubbed", scrub_interval_s=0)
        try:
            await island.subscriber.wait_for_version(3, timeout_s=30)
            assert island.scrubber is not None
            assert await island.scrubber.scrub_once() is None  # intact: nothing to do
            assert (await ready(island.url))[0] == 200

            engine = island.engine
            _flip_a_bit(engine.tensors[sorted(engine.tensors)[0]])  # memory went bad under the engine
            assert await island.scrubber.scrub_once() == 3
            status, body = await ready(island.url)
            assert status == 503 and "quarantined" in body["reason"], body
            status, body = await complete(island.url, None, deadline_ms=50)  # nothing is served meanwhile
            assert status == 503 and body["held"] == 0 and "quarantined" in body["message"], body

            assert await island.scrubber.recover() == 3  # fetched again: an anchor and the patches after
            assert bits_equal(engine.tensors, training.views[3])
            assert (await ready(island.url))[0] == 200
            status, body = await complete(island.url, "exact=3")
            assert status == 200 and body["weftboard"]["version_start"] == 3
            assert await island.scrubber.scrub_once() is None
        finally:
            await island.stop()
    finally:
        await asyncio.to_thread(training.close)


async def test_a_damaged_checkpoint_on_disk_is_moved_aside_and_fetched_again(board, local_store, tmp_path: Path) -> None:
    trainer = Trainer(lr=1e-3)
    views: dict[int, dict] = {}

    def publish(n: int) -> None:
        with Publisher(board.address, "disk", token=board.admin_token, blob_store=local_store,
                       work_dir=tmp_path / "pub") as pub:
            for _ in range(n):
                trainer.step()
                views[pub.publish(trainer.model, step=trainer.step_no).version] = trainer.served()

    await asyncio.to_thread(publish, 3)
    async with BoardClient(board.address, board.admin_token) as client:
        root = tmp_path / "island"
        dest = CheckpointDirDestination(root)
        sub = Subscriber(client, "disk", dest, island_id="disk", blob_store=local_store, cache_dir=tmp_path / "cache",
                         heartbeat=False)
        assert await sub.sync_to() == 3
        scrubber = Scrubber(sub, interval_s=0)
        assert await scrubber.scrub_once() is None

        served = dest.current.resolve() / "model.safetensors"
        damaged = bytearray(served.read_bytes())
        damaged[-1] ^= 0x01  # a bit rots in the last tensor's bytes
        served.write_bytes(damaged)
        assert await scrubber.scrub_once() == 3
        assert dest.held_version() == 0 and not dest.current.exists()  # not served any more
        assert sub.state == pb.ISLAND_STATE_ERROR and "quarantined" in sub.message
        [aside] = list((root / "quarantine").iterdir())
        assert (aside / "model.safetensors").read_bytes() == bytes(damaged)  # kept for a look, not served

        assert await scrubber.recover() == 3
        assert bits_equal(_loaded(root), views[3])
        assert sub.state == pb.ISLAND_STATE_READY
        assert await scrubber.scrub_once() is None

        # On its schedule: the damage is found and repaired without anyone asking.
        applied: asyncio.Queue[int] = asyncio.Queue()
        sub.add_listener(applied.put_nowait)
        scrubbing = asyncio.ensure_future(Scrubber(sub, interval_s=0.05).run())
        try:
            served = dest.current.resolve() / "model.safetensors"
            damaged = bytearray(served.read_bytes())
            damaged[len(damaged) // 2] ^= 0x10
            served.write_bytes(damaged)
            while await asyncio.wait_for(applied.get(), 60) != 3:
                pass
            assert bits_equal(_loaded(root), views[3])
            assert len(list((root / "quarantine").iterdir())) == 2
        finally:
            scrubbing.cancel()
            await asyncio.gather(scrubbing, return_exceptions=True)
