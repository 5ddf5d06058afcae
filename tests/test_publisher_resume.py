"""A restarting publisher on a least-privilege token, after garbage collection.

The trainer's token has the PUBLISHER role only, and the board's garbage collection has moved
the run's oldest available version past the versions the publisher's anchor policy would
look back over: the new process must still rebuild its view from the board (bit for bit) and
carry on with patches.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from pubsubkit import Trainer, bits_equal

from weftboard.board.client import BoardClient
from weftboard.cuda.formats import Projector, ServedFormatSpec
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.live_tensors import LiveTensorsDestination
from weftboard.subscriber.subscriber import Subscriber

RUN = "resume-after-gc"


def _kinds(rec: pb.VersionRecord) -> list[str]:
    return sorted("anchor" if a.kind == pb.ARTIFACT_KIND_ANCHOR else "patch" for a in rec.artifacts)


async def test_a_publisher_token_resumes_after_gc_dropped_the_early_versions(board, local_store, tmp_path: Path) -> None:
    trainer = Trainer(lr=1e-4)
    spec = ServedFormatSpec("bf16")
    layout = Projector(spec).layout(trainer.model.state_dict())
    async with BoardClient(board.address, board.admin_token) as admin:
        token = (await admin.create_token("trainer", pb.ROLE_PUBLISHER)).token
        await admin.create_run(pb.Run(  # keeps one anchor and the versions after it
            run=RUN, kind=pb.RUN_KIND_WEIGHTS, served_format=spec.to_proto(),
            layout=pb.Layout(tensors=[pb.TensorSpec(name=n, dtype=d, shape=list(s)) for n, d, s in layout]),
            retention=pb.RetentionPolicy(keep_anchors=1, keep_versions=1)))
    views: dict[int, dict] = {}

    def session(n: int, anchor_every: int) -> None:
        with Publisher(board.address, RUN, token=token, blob_store=local_store, anchor_every=anchor_every,
                       anchor_patch_fraction=100.0, work_dir=tmp_path / "work") as pub:
            for _ in range(n):
                trainer.step()
                views[pub.publish(trainer.model, step=trainer.step_no).version] = trainer.served()

    await asyncio.to_thread(session, 7, 3)  # anchors at 1, 4 and 7
    async with BoardClient(board.address, board.admin_token) as admin:
        await admin.collect_garbage(RUN, keep_anchors=1)
        assert (await admin.get_head(RUN)).oldest_available == 7
    # A new process whose policy looks back 1000 versions, on the publisher token: it lists
    # from the oldest available version and follows the run from anchor 7.
    await asyncio.to_thread(session, 2, 1000)
    async with BoardClient(board.address, board.admin_token) as admin:
        recs = [await admin.get_version(RUN, v) for v in (7, 8, 9)]
        assert [_kinds(r) for r in recs] == [["anchor", "patch"], ["patch"], ["patch"]]  # resumed: no new anchor
        dest = LiveTensorsDestination({n: t.clone() for n, t in views[9].items()})
        sub = Subscriber(admin, RUN, dest, island_id="checker", blob_store=local_store,
                         cache_dir=tmp_path / "checker", heartbeat=False)
        for v in (7, 8, 9):
            assert await sub.sync_to(v) == v
            assert bits_equal(dest.tensors, views[v]), v
