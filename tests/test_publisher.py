"""The publisher against a real board (real Redis, real blob store): records, anchors,
backpressure (wait and skip), restart, presigned uploads, adapters, layout checks.

The publisher is a synchronous API with its own background loop; the board runs on the
test's loop, so every publisher call goes through ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
import structlog
import torch
from pubsubkit import WARM_KERNELS, Trainer, bits_equal, follow_each
from safetensors.torch import load_file

from weftboard.board.blobs import LocalDirBlobStore
from weftboard.board.client import BoardClient
from weftboard.cuda.codec import read_patch_info
from weftboard.proto.errors import Aborted, FailedPrecondition
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.commit import commit_job
from weftboard.publisher.job import job_of_read
from weftboard.publisher.publisher import Publisher
from weftboard.publisher.served_view import ServedView

pytestmark = WARM_KERNELS


async def _records(client: BoardClient, run: str) -> list[pb.VersionRecord]:
    return [r async for r in client.iter_versions(run)]


def _kinds(rec: pb.VersionRecord) -> set[str]:
    return {"anchor" if a.kind == pb.ARTIFACT_KIND_ANCHOR else "patch" for a in rec.artifacts}


async def test_publish_versions_anchors_and_patches_bitwise(board, local_store, tmp_path: Path) -> None:
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}

    def train() -> list[float]:
        with Publisher(board.address, "r1", token=board.admin_token, blob_store=local_store,
                       anchor_every=3, anchor_patch_fraction=10.0) as pub:
            for _ in range(7):
                trainer.step()
                h = pub.publish(trainer.model, step=trainer.step_no, labels={"note": "t"})
                views[h.version] = trainer.served()
            pub.flush()
            return pub.blocked_s

    blocked = await asyncio.to_thread(train)
    assert len(blocked) == 7
    async with BoardClient(board.address, board.admin_token) as client:
        recs = await _records(client, "r1")
        assert [r.version for r in recs] == list(range(1, 8))
        assert [sorted(_kinds(r)) for r in recs] == [
            ["anchor"], ["patch"], ["patch"], ["anchor", "patch"], ["patch"], ["patch"], ["anchor", "patch"]]
        for r in recs[1:]:
            assert 0 < r.stats.changed_elements < r.stats.total_elements
            assert r.stats.patch_bytes > 0 and r.step == r.version and r.labels["note"] == "t"
            assert abs(r.stats.density - r.stats.changed_elements / r.stats.total_elements) < 1e-12
            assert sum(t.changed for t in r.stats.tensors) == r.stats.changed_elements
            # each changed tensor names the coder that carried it, as the patch header says
            patch = next(a for a in r.artifacts if a.kind == pb.ARTIFACT_KIND_PATCH)
            written = {t.name: (t.mode, t.stream_bytes) for b in patch.blobs
                       for t in read_patch_info(await local_store.get_bytes(b.key)).tensors if t.changed}
            assert {t.name: (t.coder, t.stream_bytes) for t in r.stats.tensors} == written
            assert all(t.coder and t.stream_bytes > 0 for t in r.stats.tensors)
        # Anchors are plain HF safetensors checkpoints.
        anchor = next(a for a in recs[3].artifacts if a.kind == pb.ARTIFACT_KIND_ANCHOR)
        assert [b.name for b in anchor.blobs] == ["model.safetensors"]
        path = tmp_path / "anchor.safetensors"
        path.write_bytes(await local_store.get_bytes(anchor.blobs[0].key))
        assert bits_equal(load_file(path), views[4])
        await follow_each(client, "r1", local_store, tmp_path, views)


async def test_patch_fraction_triggers_anchor_and_shards(board, local_store, tmp_path: Path) -> None:
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}

    def train() -> None:
        with Publisher(board.address, "r2", token=board.admin_token, blob_store=local_store,
                       anchor_every=1000, anchor_patch_fraction=0.05, shard_bytes=400_000) as pub:
            for _ in range(4):
                trainer.step()
                views[pub.publish(trainer.model, step=trainer.step_no).version] = trainer.served()

    await asyncio.to_thread(train)
    async with BoardClient(board.address, board.admin_token) as client:
        recs = await _records(client, "r2")
        anchors = [r.version for r in recs if "anchor" in _kinds(r)]
        assert anchors[0] == 1 and len(anchors) >= 2  # patches add up past 5% of an anchor quickly
        shard_names = [b.name for a in recs[0].artifacts for b in a.blobs]
        assert len(shard_names) > 1 and shard_names[0].startswith("model-00001-of-")
        await follow_each(client, "r2", local_store, tmp_path, views)


class SlowStore(LocalDirBlobStore):
    """A real local blob store whose writes take a while: uploads fall behind the trainer."""

    def __init__(self, root: Path, delay_s: float) -> None:
        super().__init__(root)
        self.delay_s = delay_s

    async def put_bytes(self, key: str, data: bytes) -> int:
        await asyncio.sleep(self.delay_s)
        return await super().put_bytes(key, data)

    async def put_file(self, key: str, path) -> int:
        await asyncio.sleep(self.delay_s)
        return await super().put_file(key, path)


@pytest.mark.parametrize("mode,encoding", [("wait", "default"), ("skip", "default"), ("wait", "context"),
                                           ("skip", "context"), ("wait", "compact"), ("skip", "compact")])
async def test_backpressure(board_factory, tmp_path: Path, mode: str, encoding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under "skip", merges recover the queued version's delta from its streams: for context
    streams, through the classes its fold changed; for compact streams, from the scans they carry."""
    store = SlowStore(tmp_path / "blobs", delay_s=0.4)
    board = await board_factory(blobs=store)
    trainer = Trainer(lr=1e-4 if encoding == "default" else 1e-6)  # context streams pay off on sparse steps
    views: dict[int, dict] = {}
    handles = []
    recovered: list[int] = []  # streams turned back into deltas to merge a queued version
    deltas_of = ServedView.deltas_of
    monkeypatch.setattr(ServedView, "deltas_of", lambda self, fused, known: recovered.append(len(set(fused) - set(known)))
                        or deltas_of(self, fused, known))

    def train() -> None:
        with Publisher(board.address, f"bp-{mode}", token=board.admin_token, blob_store=store, encoding=encoding,
                       max_pending=1, on_backpressure=mode, anchor_every=1000, anchor_patch_fraction=100.0) as pub:
            for _ in range(6):
                trainer.step()
                h = pub.publish(trainer.model, step=trainer.step_no)
                handles.append(h)
                views[h.version] = trainer.served()  # the newest publish of a version wins
            pub.flush()

    await asyncio.to_thread(train)
    versions = [h.version for h in handles]
    records = [h.result(5) for h in handles]
    assert all(r.version == h.version for r, h in zip(records, handles))
    if mode == "wait":
        assert versions == [1, 2, 3, 4, 5, 6]
        assert max(h.blocked_s for h in handles[1:]) >= 0.2  # the trainer really waited for uploads
        assert not recovered  # no merges, so no streams turned back into deltas
    else:
        assert versions[-1] < 6  # some publishes were coalesced into a spanning patch
        assert versions == sorted(versions) and set(versions) == set(range(1, versions[-1] + 1))
        assert any(records[i].step != handles[i].step for i in range(len(handles)))
        assert recovered and all(n > 0 for n in recovered)  # merges started from encoded streams
    async with BoardClient(board.address, board.admin_token) as client:
        await follow_each(client, f"bp-{mode}", store, tmp_path, views)
        modes = set()
        for rec in await _records(client, f"bp-{mode}"):
            for a in rec.artifacts:
                if a.kind == pb.ARTIFACT_KIND_PATCH:
                    info = read_patch_info(await store.get_bytes(a.blobs[0].key))
                    assert info.encoding == encoding
                    modes |= {t.mode for t in info.tensors}
        if mode == "wait":  # (merged versions are encoded from deltas, in the default modes)
            assert ("context" in modes) == (encoding == "context"), modes
            assert ("context_huffman" in modes) == (encoding == "compact"), modes


@pytest.mark.parametrize("encoding", ["default", "compact"])
async def test_restart_resumes_from_head(board, local_store, tmp_path: Path, encoding: str) -> None:
    """A new publisher process rebuilds its view from the board (and, compact, its copy of the
    previous bits: the next patch is coded against them)."""
    trainer = Trainer(lr=1e-4 if encoding == "default" else 1e-6)
    views: dict[int, dict] = {}
    run = f"rs-{encoding}"

    def session(n: int, **kw: Any) -> None:
        with Publisher(board.address, run, token=board.admin_token, blob_store=local_store, anchor_every=1000,
                       anchor_patch_fraction=100.0, encoding=encoding, **kw) as pub:
            for _ in range(n):
                trainer.step()
                views[pub.publish(trainer.model, step=trainer.step_no).version] = trainer.served()

    await asyncio.to_thread(session, 3)
    await asyncio.to_thread(session, 2)  # a new process: rebuilds its view from the board
    snapshot = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    await asyncio.to_thread(session, 1, resume_state=snapshot)  # vouches for the head: verified, no anchor
    await asyncio.to_thread(session, 1, resume_state={k: v + 1.0 for k, v in snapshot.items()})  # wrong: anchors
    async with BoardClient(board.address, board.admin_token) as client:
        recs = await _records(client, run)
        assert [sorted(_kinds(r)) for r in recs] == [["anchor"], ["patch"], ["patch"], ["patch"], ["patch"], ["patch"], ["anchor"]]
        await follow_each(client, run, local_store, tmp_path, views)
        if encoding == "compact":  # every patch, the ones right after a restart too, coded against the kept bits
            for rec in recs[1:6]:
                (key,) = [a.blobs[0].key for a in rec.artifacts if a.kind == pb.ARTIFACT_KIND_PATCH]
                modes = {t.mode for t in read_patch_info(await local_store.get_bytes(key)).tensors}
                assert "context_huffman" in modes, (rec.version, modes)


async def test_presigned_mode_without_credentials(board_factory, s3_store, tmp_path: Path) -> None:
    board = await board_factory(blobs=s3_store)
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}

    def train() -> None:
        with Publisher(board.address, "ps", token=board.admin_token, blob_store=None) as pub:
            for _ in range(3):
                trainer.step()
                views[pub.publish(trainer.model, step=trainer.step_no).version] = trainer.served()

    await asyncio.to_thread(train)
    async with BoardClient(board.address, board.admin_token) as client:
        assert (await client.get_head("ps")).version == 3
        await follow_each(client, "ps", None, tmp_path, views, presigned=True)


async def test_layout_mismatch_is_refused(board, local_store) -> None:
    def go() -> None:
        with Publisher(board.address, "lm", token=board.admin_token, blob_store=local_store) as pub:
            pub.publish(Trainer().model, step=1)
        with Publisher(board.address, "lm", token=board.admin_token, blob_store=local_store) as pub:
            pub.publish(Trainer(d=64).model, step=2)

    with pytest.raises(FailedPrecondition, match="layout differs"):
        await asyncio.to_thread(go)


async def test_lora_adapter_versions_are_whole(board, local_store, tmp_path: Path) -> None:
    from weftboard.cuda.formats import ServedFormatSpec

    g = torch.Generator().manual_seed(0)
    adapters = [{"layers.0.q.lora_A": torch.randn(8, 64, generator=g), "layers.0.q.lora_B": torch.randn(64, 8, generator=g).bfloat16()}
                for _ in range(3)]

    def go() -> None:
        with Publisher(board.address, "lora", token=board.admin_token, blob_store=local_store,
                       served_format=ServedFormatSpec("raw")) as pub:
            for i, a in enumerate(adapters):
                assert pub.publish_adapter(a, step=i).version == i + 1

    await asyncio.to_thread(go)
    async with BoardClient(board.address, board.admin_token) as client:
        run = await client.get_run("lora")
        assert run.kind == pb.RUN_KIND_LORA_ADAPTER
        recs = await _records(client, "lora")
        assert [sorted(_kinds(r)) for r in recs] == [["anchor"]] * 3
        views = {i + 1: {k: v.clone() for k, v in a.items()} for i, a in enumerate(adapters)}
        await follow_each(client, "lora", local_store, tmp_path, views)


async def test_attached_optimizer_reads_in_background_bitwise(board, local_store, tmp_path: Path) -> None:
    """publish() returns before the weights are read; the optimizer's next step waits for the read."""
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}

    def train() -> list:
        with Publisher(board.address, "att", token=board.admin_token, blob_store=local_store) as pub:
            pub.attach(trainer.opt)
            handles = []
            for _ in range(5):
                trainer.step()  # the pre-step hook waits for the previous read
                h = pub.publish(trainer.model, step=trainer.step_no)
                views[h.version] = trainer.served()
                handles.append(h)
            pub.flush()
            return handles

    handles = await asyncio.to_thread(train)
    assert [h.version for h in handles] == [1, 2, 3, 4, 5]
    assert all(h.blocked_s >= 0 for h in handles)
    async with BoardClient(board.address, board.admin_token) as client:
        await follow_each(client, "att", local_store, tmp_path, views)


async def test_fp8_served_format_with_fixed_scales(board, local_store, tmp_path: Path) -> None:
    """An fp8 run: the islands' bits equal an independent projection with the same anchors."""
    from weftboard.cuda.formats import Projector, ServedFormatSpec, is_scale_tensor

    spec = ServedFormatSpec("fp8_e4m3", scale_granularity="block128", scale_policy="fixed")
    trainer = Trainer(lr=1e-4, d=128, hidden=256)
    reference = Projector(spec)
    views: dict[int, dict] = {}

    def train() -> None:
        with Publisher(board.address, "f8", token=board.admin_token, blob_store=local_store, served_format=spec,
                       anchor_every=3, anchor_patch_fraction=100.0) as pub:
            for _ in range(4):
                trainer.step()
                h = pub.publish(trainer.model, step=trainer.step_no)
                state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
                views[h.version] = reference.project(state, anchor=h.version in (1, 4))
            pub.flush()

    await asyncio.to_thread(train)
    async with BoardClient(board.address, board.admin_token) as client:
        run = await client.get_run("f8")
        assert any(t.dtype == "float8_e4m3fn" for t in run.layout.tensors)
        assert any(is_scale_tensor(t.name) for t in run.layout.tensors)
        await follow_each(client, "f8", local_store, tmp_path, views)


def _scan_for(encoding: str | None, prev: torch.Tensor):
    from weftboard.publisher.fold import TensorScan as _TensorScan

    return None if encoding is None else _TensorScan.for_tensor(encoding, prev)


@pytest.mark.parametrize("encoding", [None, "default", "context"])
def test_chunked_cast_fold_equals_whole_tensor_path(encoding: str | None) -> None:
    """Large tensors are cast in chunks into a reused buffer: same view, same transition
    (deltas, or tile scans whose stream is the one-call encoder's; context scans also give
    their delta back from the folded view, through the classes the fold changed)."""
    from weftboard.cuda import codec, context_codec
    from weftboard.cuda import tile_encode as tile_codec
    from weftboard.cuda.diff import diff_and_update_
    from weftboard.publisher.fold import CAST_CHUNK as _CAST_CHUNK
    from weftboard.publisher.fold import chunked_cast_fold_ as _chunked_cast_fold_

    g = torch.Generator().manual_seed(3)
    n = _CAST_CHUNK + 12_345  # two chunks, the second one ragged
    master = torch.randn(n, generator=g) * 0.02
    master[:4] = torch.tensor([float("inf"), -float("inf"), -0.0, 3e38])
    prev = (master + torch.randn(n, generator=g) * 1e-4).to(torch.bfloat16)
    a, b = prev.clone(), prev.clone()
    scratch: dict = {}
    scan = _scan_for(encoding, a)
    d1 = _chunked_cast_fold_(a, master, scratch, scan)
    d2 = diff_and_update_(b, master.to(torch.bfloat16))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    if scan is not None:
        enc = codec.encoded_from_scans("w", torch.bfloat16, n, d1)
        old_bits, new_bits = (x.view(torch.int16).numpy().view(np.uint16) for x in (prev, b))
        if encoding == "context":
            assert isinstance(d1, context_codec.ContextScans) and len(d1.pieces) == 2
            assert enc is not None and enc.mode == "context" and enc.fixups[0].size
            whole = context_codec.encode_context(old_bits, new_bits, scan.thresholds, codec.CODEC_TILE)[1]
        else:
            assert isinstance(d1, list) and len(d1) == 2
            whole = tile_codec.encode_huffman(old_bits, new_bits, codec.CODEC_TILE)[1]
        assert enc is not None and np.array_equal(enc.stream, whole)
        d1 = codec.delta_from_scans(d1, a)
    assert torch.equal(d1.positions, d2.positions)
    assert torch.equal(d1.old_bits, d2.old_bits) and torch.equal(d1.new_bits, d2.new_bits)
    assert d1.numel == d2.numel and d1.dtype == d2.dtype and scratch
    small = prev[:1000].clone()
    _chunked_cast_fold_(small, master[:1000], scratch, _scan_for(encoding, small))
    assert torch.equal(small.view(torch.int16), master[:1000].to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("encoding", ["default", "context"])
def test_tiles_with_nan_or_subnormal_masters_are_cast_by_torch(encoding: str) -> None:
    """The fused bf16 cast leaves tiles holding a NaN or a subnormal to torch's cast (whose
    NaN bits differ between its vector and scalar paths): the view is torch's cast exactly."""
    from weftboard.cuda.codec import CODEC_TILE
    from weftboard.cuda.diff import TensorDelta, diff_tensor
    from weftboard.publisher.fold import CAST_CHUNK as _CAST_CHUNK
    from weftboard.publisher.fold import chunked_cast_fold_ as _chunked_cast_fold_

    g = torch.Generator().manual_seed(6)
    n = _CAST_CHUNK + 3 * CODEC_TILE + 17
    master = torch.randn(n, generator=g) * 0.02
    prev = (master + torch.randn(n, generator=g) * 1e-4).to(torch.bfloat16)
    for i, value in ((10, float("nan")), (CODEC_TILE + 1, 1e-40), (_CAST_CHUNK + 2 * CODEC_TILE + 5, -float("nan")),
                     (n - 1, -1e-39)):
        master[i] = value
    view = prev.clone()
    delta = _chunked_cast_fold_(view, master, {}, _scan_for(encoding, view))
    want = master.to(torch.bfloat16)
    ref = diff_tensor(prev, want)
    assert torch.equal(view.view(torch.int16), want.view(torch.int16))
    assert isinstance(delta, TensorDelta)
    assert torch.equal(delta.positions, ref.positions)
    assert torch.equal(delta.old_bits, ref.old_bits) and torch.equal(delta.new_bits, ref.new_bits)


@pytest.mark.parametrize("encoding", ["default"])  # context scans have room for any tile (only NaNs overflow)
def test_tiles_too_dense_to_scan_turn_the_tensor_into_one_delta(encoding: str) -> None:
    """Tiles that overflow the scan's scratch are diffed; the tiles and chunks scanned around
    them are recovered from the folded view, so the tensor still has one exact delta."""
    from weftboard.cuda.codec import CODEC_TILE
    from weftboard.cuda.diff import TensorDelta, diff_tensor
    from weftboard.publisher.fold import CAST_CHUNK as _CAST_CHUNK
    from weftboard.publisher.fold import chunked_cast_fold_ as _chunked_cast_fold_

    g = torch.Generator().manual_seed(4)
    n = 2 * _CAST_CHUNK + 99
    prev = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    master = prev.float() + torch.randn(n, generator=g) * 1e-4
    dense = slice(_CAST_CHUNK + 3 * CODEC_TILE + 5, _CAST_CHUNK + 6 * CODEC_TILE)  # far jumps (escapes) in 3 tiles
    master[dense] = -master[dense] * 3.0
    view = prev.clone()
    delta = _chunked_cast_fold_(view, master, {}, _scan_for(encoding, view))
    ref = diff_tensor(prev, master.to(torch.bfloat16))
    assert isinstance(delta, TensorDelta)
    assert torch.equal(delta.positions, ref.positions)
    assert torch.equal(delta.old_bits, ref.old_bits) and torch.equal(delta.new_bits, ref.new_bits)
    assert torch.equal(view.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))


def test_merge_deltas_spans_two_transitions() -> None:
    from weftboard.cuda.diff import diff_tensor
    from weftboard.publisher.deltas import merge_deltas

    g = torch.Generator().manual_seed(5)
    a = torch.randn(10_000, generator=g).bfloat16()
    b = a.clone()
    b[::7] = torch.randn(b[::7].shape, generator=g).bfloat16()
    c = b.clone()
    c[::11] = torch.randn(c[::11].shape, generator=g).bfloat16()
    c[::77] = a[::77]  # some positions go back to A's bits: they must drop out
    merged = merge_deltas(diff_tensor(a, b), diff_tensor(b, c))
    direct = diff_tensor(a, c)
    assert torch.equal(merged.positions, direct.positions)
    assert torch.equal(merged.old_bits, direct.old_bits) and torch.equal(merged.new_bits, direct.new_bits)


async def test_commit_retries_while_the_board_is_down(board, local_store, tmp_path: Path) -> None:
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}
    pub = Publisher(board.address, "down", token=board.admin_token, blob_store=local_store)
    try:
        def publish():
            trainer.step()
            h = pub.publish(trainer.model, step=trainer.step_no)
            views[h.version] = trainer.served()
            return h

        h1 = await asyncio.to_thread(publish)
        await asyncio.to_thread(h1.result, 30)
        await board.stop()
        h2 = await asyncio.to_thread(publish)  # uploads go straight to the store; the commit retries
        await asyncio.sleep(1.5)
        assert not h2.done()
        await board.restart()
        assert (await asyncio.to_thread(h2.result, 60)).version == 2
    finally:
        await asyncio.to_thread(pub.close, False)
    async with BoardClient(board.address, board.admin_token) as client:
        await follow_each(client, "down", local_store, tmp_path, views)


@pytest.mark.parametrize("late", ["snapshot", "merge"])
async def test_a_refused_commit_fails_the_versions_behind_it(board, local_store, monkeypatch: pytest.MonkeyPatch,
                                                              late: str) -> None:
    """Version 1's commit is refused (another publisher committed a different version 1 first)
    while version 2 is where the commit worker cannot reach it: still in its snapshot
    ("snapshot"), or taken out of the queue as version 3's merge target under "skip" ("merge").
    Version 2's handle fails with the refusal instead of waiting forever."""
    run = f"refused-{late}"
    ours, rival = Trainer(lr=1e-4), Trainer(lr=1e-4, seed=1)
    pub = Publisher(board.address, run, token=board.admin_token, blob_store=local_store,
                    max_pending=2 if late == "snapshot" else 1, on_backpressure="wait" if late == "snapshot" else "skip")
    handles: list[Any] = []
    committing, handed, gate = threading.Event(), threading.Event(), threading.Event()

    async def gated_commit(job: Any, **kw: Any) -> Any:  # version 1's commit waits for the gate
        if job.version == 1:
            committing.set()
            await asyncio.to_thread(gate.wait, 20)
        return await commit_job(job, **kw)

    def refuse_now() -> None:  # version 2 is out of the worker's reach: let version 1 be refused
        assert handed.wait(20)
        gate.set()
        with contextlib.suppress(Exception):
            handles[0].result(20)

    snapshot, reserve = ServedView.snapshot, Publisher._reserve_slot

    def snapshot_late(self: ServedView, job: Any, *args: Any) -> None:
        if job.version == 2 and late == "snapshot":
            refuse_now()
        snapshot(self, job, *args)

    def reserve_late(self: Publisher, *args: Any, **kw: Any) -> Any:
        target = reserve(self, *args, **kw)
        if target is not None:
            refuse_now()
        return target

    def publish() -> None:
        ours.step()
        handles.append(pub.publish(ours.model, step=ours.step_no))

    def rival_publishes() -> None:
        rival.step()
        with Publisher(board.address, run, token=board.admin_token, blob_store=local_store) as other:
            other.publish(rival.model, step=1).result(20)

    try:
        await asyncio.to_thread(pub.connect, ours.model)  # the head is 0: ours publishes version 1 next
        await asyncio.to_thread(rival_publishes)
        monkeypatch.setattr("weftboard.publisher.publisher.commit_job", gated_commit)
        monkeypatch.setattr(ServedView, "snapshot", snapshot_late)
        monkeypatch.setattr(Publisher, "_reserve_slot", reserve_late)
        await asyncio.to_thread(publish)
        assert await asyncio.to_thread(committing.wait, 20)  # version 1 is in flight, out of the queue
        await asyncio.to_thread(publish)
        handed.set()
        if late == "merge":  # takes queued version 2 as its target, then finds the publisher failed
            with pytest.raises(Aborted, match="version 1 .* lost a race"):
                await asyncio.to_thread(publish)
        assert [h.version for h in handles] == [1, 2]
        for h in handles:
            with pytest.raises(Aborted, match="version 1 .* lost a race"):
                await asyncio.to_thread(h.result, 20)
    finally:
        handed.set()
        gate.set()
        await asyncio.to_thread(pub.close, False)

def _pending_workers(pub: Publisher) -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks(pub._loop) if t.get_coro().__name__ == "_commit_worker"]


@pytest.mark.parametrize("stage", ["snapshot", "commit"])
async def test_close_without_flush_aborts_the_versions_not_committed(board, local_store, stage: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``close(flush=False)`` while version 1 is in its snapshot ("snapshot"), or while it commits
    with version 2 queued and version 3 in its snapshot ("commit"): close ends the commit worker,
    reports no publishing failure, commits nothing, and every handle fails with ``Aborted``
    instead of waiting forever."""
    run = f"closed-{stage}"
    trainer = Trainer(lr=1e-4)
    pub = Publisher(board.address, run, token=board.admin_token, blob_store=local_store, max_pending=3)
    last = 1 if stage == "snapshot" else 3
    committing, closing = threading.Event(), threading.Event()

    async def held_commit(job: Any, **kw: Any) -> Any:  # never commits: only close's cancellation ends it
        committing.set()
        await asyncio.sleep(120)
        return await commit_job(job, **kw)

    snapshot, close = ServedView.snapshot, Publisher.close

    def snapshot_late(self: ServedView, job: Any, *args: Any) -> None:
        if job.version == last:  # the snapshot ends once close has begun
            assert closing.wait(20)
            time.sleep(0.3)
        snapshot(self, job, *args)

    def closed(self: Publisher, flush: bool = True) -> None:
        closing.set()
        close(self, flush)

    def publish() -> Any:
        trainer.step()
        return pub.publish(trainer.model, step=trainer.step_no)

    monkeypatch.setattr("weftboard.publisher.publisher.commit_job", held_commit)
    monkeypatch.setattr(ServedView, "snapshot", snapshot_late)
    monkeypatch.setattr(Publisher, "close", closed)
    handles: list[Any] = []
    try:
        with structlog.testing.capture_logs() as logs:
            handles.append(await asyncio.to_thread(publish))
            if stage == "commit":
                assert await asyncio.to_thread(committing.wait, 20)
                handles += [await asyncio.to_thread(publish) for _ in range(2)]
            await asyncio.wait_for(asyncio.to_thread(pub.close, False), 60)
            assert _pending_workers(pub) == [], "close should end the commit worker"
            assert [h.version for h in handles] == list(range(1, last + 1))
            for h in handles:
                with pytest.raises(Aborted, match=f"closed before version {h.version} committed") as caught:
                    await asyncio.to_thread(h.result, 10)
                # only the version whose commit was under way may be on the board: its message says so
                assert ("may have reached the board" in str(caught.value)) == (stage == "commit" and h.version == 1)
        assert not [e for e in logs if e["event"].startswith("publisher failed")], "a close is not a failure"
        await asyncio.sleep(0.5)
        async with BoardClient(board.address, board.admin_token) as client:
            assert (await client.get_head(run)).version == 0
    finally:
        closing.set()
        await asyncio.to_thread(pub.close, False)


async def test_a_failure_between_the_read_and_the_queue_fails_the_version(board, local_store,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 2's read succeeds but making its job fails: its handle fails with that error
    instead of waiting forever, and the publisher is failed (the next publish raises it)."""
    trainer = Trainer(lr=1e-4)
    pub = Publisher(board.address, "no-job", token=board.admin_token, blob_store=local_store)

    def no_job(version: int, *args: Any) -> Any:
        if version == 2:
            raise RuntimeError("no job for version 2")
        return job_of_read(version, *args)

    monkeypatch.setattr("weftboard.publisher.publisher.job_of_read", no_job)

    def publish() -> Any:
        trainer.step()
        return pub.publish(trainer.model, step=trainer.step_no)

    try:
        assert (await asyncio.to_thread((await asyncio.to_thread(publish)).result, 30)).version == 1
        h2 = await asyncio.to_thread(publish)
        with pytest.raises(FailedPrecondition, match="RuntimeError: no job for version 2"):
            await asyncio.to_thread(h2.result, 10)
        with pytest.raises(FailedPrecondition, match="RuntimeError: no job for version 2"):
            await asyncio.wait_for(asyncio.to_thread(publish), 30)
    finally:
        await asyncio.to_thread(pub.close, False)


async def test_a_publish_whose_read_failed_raises(board, local_store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read of version 2 fails: ``publish`` raises it, however late the read thread records
    the failure (it is recorded before the read counts as done)."""
    trainer = Trainer(lr=1e-4)
    pub = Publisher(board.address, "bad-read", token=board.admin_token, blob_store=local_store)
    fold, fail_read = ServedView.fold, Publisher._fail_read
    reads: list[int] = []

    def bad_fold(self: ServedView, *args: Any, **kw: Any) -> Any:
        reads.append(1)
        if len(reads) == 2:
            raise RuntimeError("bad read")
        return fold(self, *args, **kw)

    def slow_fail_read(self: Publisher, *args: Any) -> None:  # a read thread descheduled before it records
        time.sleep(0.5)
        fail_read(self, *args)

    monkeypatch.setattr(ServedView, "fold", bad_fold)
    monkeypatch.setattr(Publisher, "_fail_read", slow_fail_read)

    def publish() -> Any:
        trainer.step()
        return pub.publish(trainer.model, step=trainer.step_no)

    try:
        assert (await asyncio.to_thread((await asyncio.to_thread(publish)).result, 30)).version == 1
        with pytest.raises(FailedPrecondition, match="RuntimeError: bad read"):
            await asyncio.wait_for(asyncio.to_thread(publish), 30)
    finally:
        await asyncio.to_thread(pub.close, False)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs numba's thread pool to have two threads or more")
async def test_streams_are_finished_with_serial_kernels_and_reads_stay_parallel(board, local_store,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A version's streams are finished while the trainer's next step runs: there the
    kernels run on the finishing thread alone (a parallel region would wait at its barrier
    for a thread parked behind the trainer's). The read, which the trainer waits for, keeps
    every thread, and the thread count comes back after each finish."""
    from weftboard.cuda import codec

    seen: dict[str, set[int]] = {"read": set(), "finish": set()}
    finish, project = codec.encoded_from_scans, ServedView.fold

    def finishing(*args: Any, **kwargs: Any) -> Any:
        seen["finish"].add(numba.get_num_threads())
        return finish(*args, **kwargs)

    def reading(self: ServedView, *args: Any, **kwargs: Any) -> Any:
        seen["read"].add(numba.get_num_threads())
        return project(self, *args, **kwargs)

    monkeypatch.setattr(codec, "encoded_from_scans", finishing)
    monkeypatch.setattr(ServedView, "fold", reading)
    trainer = Trainer(lr=1e-4)

    def train() -> None:
        with Publisher(board.address, "serial", token=board.admin_token, blob_store=local_store,
                       anchor_every=100) as pub:
            for _ in range(4):
                trainer.step()
                pub.publish(trainer.model, step=trainer.step_no)
            pub.flush()

    await asyncio.to_thread(train)
    assert seen["finish"] == {1}, "a version's streams should be finished with serial kernels"
    assert seen["read"] == {numba.config.NUMBA_NUM_THREADS}, "reads after a finish should get every thread back"
