"""Worker threads end with their owner: once a subscriber stops following, no thread its
destination started (the apply thread of patches applied while they arrive) is left."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from pubsubkit import WARM_KERNELS, Trainer, bits_equal, zeros_like_layout

from weftboard.board.client import BoardClient
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.live_tensors import LiveTensorsDestination
from weftboard.subscriber.subscriber import Subscriber

pytestmark = WARM_KERNELS


def weftboard_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("weftboard-")}


@pytest.mark.parametrize("kind", ["checkpoint_dir", "live_tensors"])
async def test_a_stopped_subscriber_leaves_no_thread_behind(board, local_store, tmp_path: Path, kind: str) -> None:
    trainer = Trainer(lr=1e-3)
    views: dict[int, dict] = {}

    def publish() -> None:
        with Publisher(board.address, "threads", token=board.admin_token, blob_store=local_store,
                       anchor_every=1000, anchor_patch_fraction=100.0, work_dir=tmp_path / "pub") as pub:
            for _ in range(3):
                trainer.step()
                views[pub.publish(trainer.model, step=trainer.step_no).version] = trainer.served()

    await asyncio.to_thread(publish)
    before = weftboard_threads()  # the publisher's are gone with it
    local_store.first_byte_s = lambda: 0.04  # a far store: one-patch steps apply as their bytes arrive
    async with BoardClient(board.address, board.admin_token) as client:
        dest = (CheckpointDirDestination(tmp_path / "ckpt") if kind == "checkpoint_dir"
                else LiveTensorsDestination(zeros_like_layout(views[1])))
        sub = Subscriber(client, "threads", dest, island_id="threads", blob_store=local_store,
                         cache_dir=tmp_path / "cache", heartbeat=False)
        assert await sub.sync_to(1) == 1 and await sub.sync_to(2) == 2
        assert sub.timings[2].get("streamed") == 1.0  # applied while it arrived, on the apply thread
        assert any(t.name.startswith("weftboard-apply") for t in weftboard_threads() - before)
        following = asyncio.ensure_future(sub.run())
        assert await sub.wait_for_version(3, 60) == 3
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        assert weftboard_threads() - before == set()
        if kind == "live_tensors":
            assert bits_equal(dest.tensors, views[3])
        # the destination stays usable: a later step makes its thread again, and the next stop ends it
        assert await sub.sync_to(3) == 3
