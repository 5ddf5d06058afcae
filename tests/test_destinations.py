"""Destinations: checkpoint directory (atomic, verified on restart) and live tensors (revert)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weftboard.cuda.anchors import write_checkpoint
from weftboard.cuda.digest import root_digest, tensor_digest
from weftboard.proto.errors import ApplyError, CorruptData, DigestMismatch
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.destination import TensorEntry, VersionTarget
from weftboard.subscriber.live_tensors import LiveTensorsDestination


def _view(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(64, 16, generator=g) * 0.02).bfloat16(),
        "layers.0.w": (torch.randn(32, 16, generator=g) * 0.02).bfloat16(),
        "norm.weight": torch.ones(16).bfloat16(),
        "scale": torch.rand(4, generator=g),
    }


def _step(view: dict[str, torch.Tensor], seed: int, frac: float = 0.05) -> dict[str, torch.Tensor]:
    """A sparse change: a few elements move by one ulp (int bits +1), like a real update."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in view.items():
        bits = t.clone().view(torch.int16 if t.element_size() == 2 else torch.int32).reshape(-1)
        mask = torch.rand(bits.numel(), generator=g) < frac
        bits[mask] += 1
        out[n] = bits.view(t.dtype).reshape(t.shape)
    return out


def _target(view: dict[str, torch.Tensor], version: int) -> VersionTarget:
    layout = [TensorEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in view.items()]
    digests = {n: tensor_digest(t) for n, t in view.items()}
    root = root_digest([(e.name, e.dtype, list(e.shape), digests[e.name]) for e in layout])
    return VersionTarget(version=version, root_digest=root, tensor_digests=digests, layout=layout)


def _anchor(tmp: Path, view: dict[str, torch.Tensor], shard_bytes: int = 1 << 30) -> list[Path]:
    return [w.path for w in write_checkpoint(tmp, list(view.items()), shard_bytes=shard_bytes)]


def _patch(tmp: Path, old: dict, new: dict, base: int, target: VersionTarget) -> Path:
    from weftboard.cuda.codec import encode_patch

    enc = encode_patch([(n, old[n], new[n]) for n in old], base_version=base, target_version=target.version,
                       target_root=target.root_digest)
    path = tmp / f"p{target.version}.patch"
    path.write_bytes(enc.data)
    return path


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.uint8), b[n].contiguous().view(torch.uint8)) for n in a)


def _loaded(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted((root / "current").glob("*.safetensors")):
        out.update(load_file(f))
    return out


async def test_checkpoint_dir_anchor_then_patches_sharded(tmp_path: Path) -> None:
    v1, dest_root = _view(1), tmp_path / "island"
    dest = CheckpointDirDestination(dest_root)
    assert dest.held_version() == 0
    await dest.load_anchor(_anchor(tmp_path / "a1", v1, shard_bytes=2048), _target(v1, 1))
    assert dest.held_version() == 1
    assert (dest_root / "current").is_symlink()
    assert (dest_root / "current" / "model.safetensors.index.json").exists()
    assert _equal(_loaded(dest_root), v1)
    prev = v1
    for v in (2, 3, 4):
        nxt = _step(prev, v)
        target = _target(nxt, v)
        await dest.apply_patch(_patch(tmp_path, prev, nxt, v - 1, target), target)
        assert dest.held_version() == v
        assert _equal(_loaded(dest_root), nxt)
        prev = nxt
    kept = sorted(p.name for p in (dest_root / "versions").iterdir())
    assert kept == ["v3", "v4"]  # pruned to keep=2
    # A restart re-verifies what current holds.
    again = CheckpointDirDestination(dest_root)
    assert again.held_version() == 4


async def test_checkpoint_dir_crash_between_write_and_swap_keeps_old_version(tmp_path: Path) -> None:
    v1, root = _view(3), tmp_path / "island"
    dest = CheckpointDirDestination(root)
    await dest.load_anchor(_anchor(tmp_path / "a", v1), _target(v1, 1))
    v2 = _step(v1, 9)
    t2 = _target(v2, 2)

    class Crash(BaseException):
        pass

    def crash(tmp: Path) -> None:
        assert any(tmp.iterdir())  # the new version was fully written aside...
        raise Crash()  # ...and the process dies before the swap

    dest.before_swap = crash
    with pytest.raises(Crash):
        await dest.apply_patch(_patch(tmp_path, v1, v2, 1, t2), t2)
    # A new process on the same directory: the old version, intact and verified.
    again = CheckpointDirDestination(root)
    assert again.held_version() == 1
    assert _equal(_loaded(root), v1)
    assert not list((root / "versions").glob(".tmp-*"))
    # And it can continue from there.
    await again.apply_patch(_patch(tmp_path, v1, v2, 1, t2), t2)
    assert again.held_version() == 2 and _equal(_loaded(root), v2)


async def test_checkpoint_dir_tampered_disk_is_not_trusted(tmp_path: Path) -> None:
    v1, root = _view(4), tmp_path / "island"
    dest = CheckpointDirDestination(root)
    await dest.load_anchor(_anchor(tmp_path / "a", v1), _target(v1, 1))
    f = root / "current" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x40
    f.write_bytes(bytes(raw))
    assert CheckpointDirDestination(root).held_version() == 0


async def test_checkpoint_dir_reloads_the_held_version_over_a_damaged_copy(tmp_path: Path) -> None:
    """The subscriber's last resort is a plan from an anchor, which may be the version held:
    when the held copy on disk is damaged (so no patch from it verifies), that anchor is
    loaded beside it and swapped in, and the damaged copy pruned; before, the reload was
    refused ("current already") on every attempt."""
    v1, root = _view(6), tmp_path / "island"
    dest = CheckpointDirDestination(root)
    await dest.load_anchor(_anchor(tmp_path / "a1", v1), _target(v1, 1))
    v2 = _step(v1, 2)
    t2 = _target(v2, 2)
    await dest.apply_patch(_patch(tmp_path, v1, v2, 1, t2), t2)
    f = root / "current" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x40  # in the last tensor, which every step below changes
    f.write_bytes(bytes(raw))
    v3 = _step(v2, 3, frac=0.5)
    t3 = _target(v3, 3)
    with pytest.raises(CorruptData):
        await dest.apply_patch(_patch(tmp_path, v2, v3, 2, t3), t3)
    assert dest.held_version() == 2
    await dest.load_anchor(_anchor(tmp_path / "a2", v2), t2)  # the held version, again
    assert dest.held_version() == 2 and _equal(_loaded(root), v2)
    reloaded = (root / "current").resolve().name
    assert reloaded.startswith("v2-") and sorted(p.name for p in (root / "versions").iterdir()) == ["v1", reloaded]
    await dest.apply_patch(_patch(tmp_path, v2, v3, 2, t3), t3)
    assert _equal(_loaded(root), v3) and sorted(p.name for p in (root / "versions").iterdir()) == [reloaded, "v3"]
    assert CheckpointDirDestination(root).held_version() == 3  # a restart verifies it


async def test_checkpoint_dir_start_removes_what_a_crash_left(tmp_path: Path) -> None:
    v1, root = _view(7), tmp_path / "island"
    await CheckpointDirDestination(root).load_anchor(_anchor(tmp_path / "a", v1), _target(v1, 1))
    (root / "versions" / ".tmp-v2-1-1").mkdir()  # a version being built aside
    (root / ".current-1-1").symlink_to("versions/.tmp-v2-1-1")  # and the swap's new link, never renamed
    again = CheckpointDirDestination(root)
    assert again.held_version() == 1 and _equal(_loaded(root), v1)
    assert sorted(p.name for p in root.iterdir()) == ["current", "versions"]
    assert [p.name for p in (root / "versions").iterdir()] == ["v1"]


async def test_checkpoint_dir_rejects_anchor_with_wrong_digest(tmp_path: Path) -> None:
    v1, root = _view(5), tmp_path / "island"
    dest = CheckpointDirDestination(root)
    target = _target(v1, 1)
    with pytest.raises(DigestMismatch):
        await dest.load_anchor(_anchor(tmp_path / "a", _step(v1, 1)), target)
    assert dest.held_version() == 0
    assert not (root / "current").exists()


async def test_live_tensors_apply_and_revert_on_bad_result(tmp_path: Path) -> None:
    v1 = _view(6)
    live = {n: torch.zeros_like(t) for n, t in v1.items()}
    pointers = {n: t.data_ptr() for n, t in live.items()}
    dest = LiveTensorsDestination(live)
    await dest.load_anchor(_anchor(tmp_path / "a", v1), _target(v1, 1))
    assert dest.held_version() == 1 and _equal(live, v1)
    v2 = _step(v1, 2)
    t2 = _target(v2, 2)
    await dest.apply_patch(_patch(tmp_path, v1, v2, 1, t2), t2)
    assert dest.held_version() == 2 and _equal(live, v2)
    assert {n: t.data_ptr() for n, t in live.items()} == pointers  # same storage: in place

    # A patch that decodes fine but produces the wrong bits (it encodes v3' while the
    # record names v3): applied, caught by the digest check, reverted bit for bit.
    v3 = _step(v2, 3)
    wrong = _step(v2, 33)
    t3 = _target(v3, 3)
    before = {n: t.clone() for n, t in live.items()}
    with pytest.raises(DigestMismatch):
        await dest.apply_patch(_patch(tmp_path, v2, wrong, 2, t3), t3)
    assert dest.held_version() == 2 and _equal(live, before)

    # Corrupted bytes: rejected before anything is written.
    good = _patch(tmp_path, v2, v3, 2, t3)
    raw = bytearray(good.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad = tmp_path / "bad.patch"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CorruptData):
        await dest.apply_patch(bad, t3)
    assert dest.held_version() == 2 and _equal(live, before)
    await dest.apply_patch(good, t3)
    assert _equal(live, v3)


async def test_live_tensors_refuse_out_of_order_patch_and_wrong_layout(tmp_path: Path) -> None:
    v1 = _view(7)
    dest = LiveTensorsDestination({n: torch.zeros_like(t) for n, t in v1.items()})
    v2 = _step(v1, 1)
    with pytest.raises(ApplyError):
        await dest.apply_patch(_patch(tmp_path, v1, v2, 1, _target(v2, 2)), _target(v2, 2))
    other = dict(v1)
    other["extra"] = torch.zeros(3).bfloat16()
    small = LiveTensorsDestination({n: torch.zeros_like(t) for n, t in v1.items()})
    with pytest.raises(ApplyError):
        await small.load_anchor(_anchor(tmp_path / "x", other), _target(other, 1))
    assert small.held_version() == 0


@pytest.mark.parametrize("kind", ["live", "checkpoint_dir"])
async def test_an_apply_cancelled_midway_keeps_the_lock_and_records_what_its_thread_did(tmp_path: Path,
                                                                                      kind: str) -> None:
    """A thread cannot be stopped: cancelled while its apply thread runs (here blocked reading
    the patch from a pipe), the destination lets the cancellation go on only once the thread
    ended, and records the version that thread finished; the lock is held until then, so no
    other apply or scrub runs beside it."""
    import asyncio
    import os

    v1 = _view(8)
    v2 = _step(v1, 9)
    t1, t2 = _target(v1, 1), _target(v2, 2)
    live = {n: torch.zeros_like(t) for n, t in v1.items()}
    dest = LiveTensorsDestination(live) if kind == "live" else CheckpointDirDestination(tmp_path / "island")
    await dest.load_anchor(_anchor(tmp_path / "a", v1), t1)
    data = _patch(tmp_path, v1, v2, 1, t2).read_bytes()
    pipe = tmp_path / "patch.fifo"
    os.mkfifo(pipe)  # reading it blocks until the test writes: the apply is caught midway

    def feed() -> None:
        with open(pipe, "wb") as out:
            out.write(data)

    applying = asyncio.ensure_future(dest.apply_patch(pipe, t2))
    fed = False
    try:
        await asyncio.sleep(0.2)  # the apply's thread is blocked reading the pipe
        applying.cancel()
        await asyncio.sleep(0.2)
        assert not applying.done()  # the cancellation waits for the thread
        scrub = asyncio.ensure_future(dest.verify_held(t1))
        await asyncio.sleep(0.1)
        assert not scrub.done()  # the lock is still held
        await asyncio.to_thread(feed)
        fed = True
        with pytest.raises(asyncio.CancelledError):
            await applying
        assert dest.held_version() == 2  # the thread finished version 2: it is recorded
        assert await scrub is False  # version 1 is no longer held
        assert await dest.verify_held(t2) is True
        assert _equal(live if kind == "live" else _loaded(tmp_path / "island"), v2)
    finally:
        if not fed:  # a failed check must not leave the thread blocked on the pipe
            await asyncio.to_thread(feed)
        await asyncio.gather(applying, return_exceptions=True)
