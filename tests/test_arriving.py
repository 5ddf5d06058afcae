"""Applying a patch while it downloads: the arrival buffer, the codec's arriving apply (any
arrival order, damage and failed downloads undone), and both destinations that can."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import pytest
import torch
from test_destinations import _anchor, _equal, _loaded, _step, _target, _view

from weftboard.cuda.codec import (
    apply_patch_,
    apply_patch_arriving_,
    encode_patch,
    read_patch_info,
)
from weftboard.proto.errors import (
    ApplyError,
    CorruptData,
    DigestMismatch,
    InvalidArgument,
    Unavailable,
)
from weftboard.subscriber.arriving import ArrivingBytes
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.live_tensors import LiveTensorsDestination


def test_spans_arrive_in_any_order_and_merge() -> None:
    blob = ArrivingBytes(100)
    blob.put(50, b"b" * 25)
    blob.put(10, b"a" * 20)
    assert blob.arrived() == 45
    assert blob.wait_any([(0, 10), (10, 30), (50, 75), (40, 60)], timeout_s=0) == [1, 2]
    blob.put(30, b"c" * 20)  # joins [10, 30) and [50, 75)
    assert blob._starts == [10] and blob._ends == [75]
    assert bytes(blob.wait(20, 60, timeout_s=0)) == b"a" * 10 + b"c" * 20 + b"b" * 10
    blob.put(10, b"a" * 20)  # a retried range: same bytes again
    assert blob.arrived() == 65
    with pytest.raises(Unavailable):
        blob.wait(0, 11, timeout_s=0.01)
    with pytest.raises(CorruptData, match="outside"):  # recoverable: the island retries, it does not stop
        blob.put(90, b"x" * 11)
    with pytest.raises(InvalidArgument):
        blob.verified()  # not everything is here
    blob.put(0, b"z" * 10)
    blob.put(75, b"y" * 25)
    blob.verified()
    blob.wait_verified(timeout_s=0)
    assert bytes(blob.wait(0, 100)) == b"z" * 10 + b"a" * 20 + b"c" * 20 + b"b" * 25 + b"y" * 25


def test_a_failed_download_wakes_every_waiter() -> None:
    blob = ArrivingBytes(10)
    raised: list[BaseException] = []

    def waiter() -> None:
        try:
            blob.wait(0, 10)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            raised.append(exc)

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    blob.fail(Unavailable("connection reset"))
    for t in threads:
        t.join(5)
    assert len(raised) == 3 and all(isinstance(e, Unavailable) for e in raised)
    with pytest.raises(Unavailable):
        blob.wait_verified()


def _patch_bytes(old: dict, new: dict, encoding: str = "default") -> bytes:
    return encode_patch([(n, old[n], new[n]) for n in old], base_version=1, target_version=2, target_root="xxh3-128:0",
                        encoding=encoding).data


def _feed(blob: ArrivingBytes, data: bytes, chunk: int, seed: int, *, fail_after: int | None = None,
          exc: BaseException | None = None) -> threading.Thread:
    """Deliver ``data`` in ``chunk``-byte pieces in a random order from another thread."""
    pieces = [(i, data[i:i + chunk]) for i in range(0, len(data), chunk)]
    random.Random(seed).shuffle(pieces)

    def run() -> None:
        for k, (at, piece) in enumerate(pieces):
            if fail_after is not None and k == fail_after:
                blob.fail(exc or Unavailable("the download gave up"))
                return
            blob.put(at, piece)
            time.sleep(0.001)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("seed,encoding", [(0, "default"), (1, "default"), (2, "default"), (3, "context")])
def test_arriving_apply_equals_the_whole_patch_apply_in_any_arrival_order(seed: int, encoding: str) -> None:
    old = _view(seed)
    new = _step(old, 100 + seed, frac=0.2)
    data = _patch_bytes(old, new, encoding)
    assert ("context" in {t.mode for t in read_patch_info(data).tensors}) == (encoding == "context")
    whole = {n: t.clone() for n, t in old.items()}
    apply_patch_(whole, data)
    live = {n: t.clone() for n, t in old.items()}
    blob = ArrivingBytes(len(data))
    seen: list[str] = []
    feeder = _feed(blob, data, chunk=37, seed=seed)
    applied = apply_patch_arriving_(live, [blob], on_tensor=seen.append, timeout_s=10)
    feeder.join()
    assert _equal(live, new) and _equal(whole, new)
    assert sorted(seen) == sorted(n for n, c in applied.changed.items() if c)
    applied.revert()
    assert _equal(live, old)


@pytest.mark.parametrize("encoding", ["default", "context", "compact"])
def test_arriving_apply_undoes_everything_on_a_damaged_stream_or_a_failed_download(encoding: str) -> None:
    old = _view(5)
    new = _step(old, 6, frac=0.2)
    data = _patch_bytes(old, new, encoding)
    damaged = bytearray(data)
    damaged[-3] ^= 0x40  # inside the last stream: earlier tensors are written by then
    live = {n: t.clone() for n, t in old.items()}
    blob = ArrivingBytes(len(data))
    written: list[str] = []
    feeder = _feed(blob, bytes(damaged), chunk=len(data), seed=0)
    with pytest.raises(CorruptData, match="xxh3-64"):
        apply_patch_arriving_(live, [blob], on_tensor=written.append, timeout_s=10)
    feeder.join()
    assert written and _equal(live, old)  # tensors had been written, and were put back

    blob = ArrivingBytes(len(data))
    feeder = _feed(blob, data, chunk=64, seed=3, fail_after=len(data) // 64 - 2)
    with pytest.raises(Unavailable, match="gave up"):
        apply_patch_arriving_(live, [blob], timeout_s=10)
    feeder.join()
    assert _equal(live, old)


def _part_bytes(old: dict, new: dict, groups: list[list[str]], encoding: str = "default", *,
                base: int = 1) -> list[bytes]:
    """A patch in parts, one per group of tensor names; only the last part knows the root."""
    return [encode_patch([(n, old[n], new[n]) for n in names], base_version=base, target_version=base + 1,
                         target_root="xxh3-128:0" if i == len(groups) - 1 else "", encoding=encoding).data
            for i, names in enumerate(groups)]


def _groups(names: list[str], k: int) -> list[list[str]]:
    return [names[i::k] for i in range(k)]


@pytest.mark.parametrize("seed,encoding", [(0, "default"), (1, "context"), (2, "compact")])
def test_a_patch_in_parts_applies_as_its_parts_arrive_and_joins_into_one_container(seed: int, encoding: str) -> None:
    from weftboard.cuda.codec import join_patches

    old = _view(seed)
    new = _step(old, 200 + seed, frac=0.2)
    parts = _part_bytes(old, new, _groups(sorted(old), 3), encoding)
    live = {n: t.clone() for n, t in old.items()}
    blobs = [ArrivingBytes(len(p)) for p in parts]
    feeders = [_feed(b, p, chunk=29, seed=seed + i) for i, (b, p) in enumerate(zip(blobs, parts))]  # all at once
    seen: list[str] = []
    applied = apply_patch_arriving_(live, blobs, on_tensor=seen.append, timeout_s=10)
    for f in feeders:
        f.join()
    assert _equal(live, new)
    assert sorted(applied.changed) == sorted(old) and applied.target_root == "xxh3-128:0"
    assert sorted(seen) == sorted(n for n, c in applied.changed.items() if c)
    applied.revert()
    assert _equal(live, old)
    joined = join_patches(parts)
    info = read_patch_info(joined)
    assert [t.name for t in info.tensors] == [n for g in _groups(sorted(old), 3) for n in g]
    assert info.target_root == "xxh3-128:0" and info.encoding == encoding
    apply_patch_(live, joined)
    assert _equal(live, new)


def test_a_part_that_arrives_first_is_applied_first_whatever_its_place_in_the_patch() -> None:
    """Parts download in parallel: the last part, all here, is written while the first one has
    not sent a byte (its header included), and a part that fails later undoes both."""
    old = _view(9)
    new = _step(old, 10, frac=0.2)
    groups = _groups(sorted(old), 2)
    parts = _part_bytes(old, new, groups)
    for fail in (False, True):
        live = {n: t.clone() for n, t in old.items()}
        blobs = [ArrivingBytes(len(p)) for p in parts]
        seen: list[str] = []
        outcome: list[Any] = []

        def apply() -> None:
            try:
                outcome.append(apply_patch_arriving_(live, blobs, on_tensor=seen.append, timeout_s=10))
            except BaseException as exc:  # noqa: BLE001 - asserted below
                outcome.append(exc)

        worker = threading.Thread(target=apply)
        worker.start()
        blobs[1].put(0, parts[1])
        deadline = time.monotonic() + 10
        while set(seen) != set(groups[1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(seen) == set(groups[1]), seen  # all of the second part, nothing of the first
        assert all(torch.equal(live[n], new[n]) for n in groups[1]) and all(torch.equal(live[n], old[n]) for n in groups[0])
        if fail:
            blobs[0].put(0, parts[0][:10])
            blobs[0].fail(Unavailable("the first part's download gave up"))
        else:
            blobs[0].put(0, parts[0])
        worker.join(10)
        if fail:
            assert isinstance(outcome[0], Unavailable) and _equal(live, old)
        else:
            assert _equal(live, new) and sorted(outcome[0].changed) == sorted(old)


def test_an_arriving_apply_gives_up_after_its_timeout_with_nothing_written() -> None:
    """One part all here, the other silent: written, then undone when the wait runs out."""
    old = _view(13)
    new = _step(old, 14, frac=0.2)
    parts = _part_bytes(old, new, _groups(sorted(old), 2))
    live = {n: t.clone() for n, t in old.items()}
    blobs = [ArrivingBytes(len(p)) for p in parts]
    blobs[1].put(0, parts[1])
    written: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="within 0.3 s"):
        apply_patch_arriving_(live, blobs, on_tensor=written.append, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5
    assert written and _equal(live, old)
    assert blobs[1].ready(0, len(parts[1])) and not blobs[0].ready(0, 1)
    blobs[0].fail(Unavailable("reset"))
    with pytest.raises(Unavailable, match="reset"):
        blobs[0].ready(0, 1)
    assert blobs[0].ready(0, 0)  # an empty span is always here


def test_parts_that_are_not_one_patch_are_refused_and_a_damaged_part_undoes_the_others() -> None:
    from weftboard.cuda.codec import join_patches

    old = _view(7)
    new = _step(old, 8, frac=0.2)
    names = sorted(old)
    parts = _part_bytes(old, new, _groups(names, 2))
    damaged = bytearray(parts[1])
    damaged[-3] ^= 0x40
    live = {n: t.clone() for n, t in old.items()}
    blobs = [ArrivingBytes(len(parts[0])), ArrivingBytes(len(damaged))]
    blobs[0].put(0, parts[0])
    blobs[1].put(0, bytes(damaged))
    written: list[str] = []
    with pytest.raises(CorruptData, match="xxh3-64"):
        apply_patch_arriving_(live, blobs, on_tensor=written.append, timeout_s=10)
    assert set(written) & set(_groups(names, 2)[0]) and _equal(live, old)  # the first part was written, then undone

    other_step = _part_bytes(old, new, _groups(names, 2), base=4)
    overlapping = _part_bytes(old, new, [names[:3], names[2:]])
    other_coder = _part_bytes(old, new, _groups(names, 2), "compact")
    for bad, match in (([parts[0], other_step[1]], "disagree"), (overlapping, "both hold"),
                       ([parts[0], other_coder[1]], "disagree on the encoding")):
        blobs = [ArrivingBytes(len(p)) for p in bad]
        for b, p in zip(blobs, bad):
            b.put(0, p)
        with pytest.raises(CorruptData, match=match):
            apply_patch_arriving_(live, blobs, timeout_s=10)
        assert _equal(live, old)
        with pytest.raises(CorruptData, match=match):
            join_patches(bad)
    with pytest.raises(InvalidArgument, match="at least one part"):
        join_patches([])
    with pytest.raises(InvalidArgument, match="at least one part"):
        apply_patch_arriving_(live, [], timeout_s=1)


async def _refuse_a_bad_blob_and_a_cancelled_download(dest: Any, data: bytes, target: Any) -> None:
    """What every destination that applies arriving bytes owes: with every byte here but the
    blob's digest found wrong, and when cancelled half-way through the download, it stays on
    its version (the callers check its bytes)."""
    blob = ArrivingBytes(len(data))
    blob.put(0, data)
    task = asyncio.ensure_future(dest.apply_patch_arriving([blob], target))
    await asyncio.sleep(0.2)
    assert not task.done()  # applied, waiting for the blob's verdict
    blob.fail(DigestMismatch("blob hashes to something else"))
    with pytest.raises(DigestMismatch):
        await task
    assert dest.held_version() == target.version - 1

    blob = ArrivingBytes(len(data))
    blob.put(0, data[: len(data) // 2])
    task = asyncio.ensure_future(dest.apply_patch_arriving([blob], target))
    await asyncio.sleep(0.2)
    task.cancel()  # the thread undoes its work before the destination's lock is let go
    with pytest.raises(asyncio.CancelledError):
        await task
    assert dest.held_version() == target.version - 1


async def test_live_tensors_hold_an_arriving_patch_only_after_the_blob_is_verified() -> None:
    v1 = _view(11)
    v2 = _step(v1, 12, frac=0.2)
    t1, t2 = _target(v1, 1), _target(v2, 2)
    data = encode_patch([(n, v1[n], v2[n]) for n in v1], base_version=1, target_version=2, target_root=t2.root_digest).data
    live = {n: t.clone() for n, t in v1.items()}
    dest = LiveTensorsDestination(live, held_version=1, digests=dict(t1.tensor_digests))

    await _refuse_a_bad_blob_and_a_cancelled_download(dest, data, t2)
    assert _equal(live, v1)

    # The wrong result (a patch to another v2) is caught by the tensor digests.
    wrong = _step(v1, 13, frac=0.2)
    bad = encode_patch([(n, v1[n], wrong[n]) for n in v1], base_version=1, target_version=2, target_root=t2.root_digest).data
    blob = ArrivingBytes(len(bad))
    blob.put(0, bad)
    blob.verified()
    with pytest.raises(DigestMismatch):
        await dest.apply_patch_arriving([blob], t2)
    assert dest.held_version() == 1 and _equal(live, v1)

    # And the good one, arriving in pieces, is held once verified.
    blob = ArrivingBytes(len(data))
    feeder = _feed(blob, data, chunk=101, seed=4)
    task = asyncio.ensure_future(dest.apply_patch_arriving([blob], t2))
    await asyncio.to_thread(feeder.join)
    await asyncio.sleep(0.05)
    assert not task.done()
    blob.verified()
    await task
    assert dest.held_version() == 2 and _equal(live, v2)

    with pytest.raises(ApplyError, match="destination holds 2"):
        await dest.apply_patch_arriving([ArrivingBytes(len(data))], t2)


async def test_checkpoint_dir_swaps_in_an_arriving_patch_only_after_the_blob_is_verified(tmp_path) -> None:
    v1 = _view(21)
    v2 = _step(v1, 22, frac=0.2)
    t1, t2 = _target(v1, 1), _target(v2, 2)
    data = encode_patch([(n, v1[n], v2[n]) for n in v1], base_version=1, target_version=2, target_root=t2.root_digest).data
    dest = CheckpointDirDestination(tmp_path / "ckpt")
    await dest.load_anchor(_anchor(tmp_path / "a", v1), t1)

    def leftovers() -> list:
        return list((tmp_path / "ckpt" / "versions").glob(".tmp-*"))

    await _refuse_a_bad_blob_and_a_cancelled_download(dest, data, t2)
    assert _equal(_loaded(tmp_path / "ckpt"), v1) and not leftovers()  # nothing written aside survives

    # Arriving in pieces, then verified: swapped in.
    blob = ArrivingBytes(len(data))
    feeder = _feed(blob, data, chunk=97, seed=8)
    task = asyncio.ensure_future(dest.apply_patch_arriving([blob], t2))
    await asyncio.to_thread(feeder.join)
    await asyncio.sleep(0.05)
    assert not task.done() and dest.held_version() == 1
    blob.verified()
    await task
    assert dest.held_version() == 2 and _equal(_loaded(tmp_path / "ckpt"), v2) and not leftovers()
