"""The Triton kernels on a CUDA device, byte for byte against the CPU path.

The interpreter tests (``test_diff_apply.py``) check what the kernels compute, but the
interpreter ignores what only a GPU has: warps (``num_warps`` changes how a block's prefix sum is
split across threads), vectorized loads on aligned memory, the runtime's specializations. These
run the same adversarial and random pairs (every element width, stage overflow, a misaligned
view, ``update``) through the compiled kernels on the device. They skip without a CUDA device and
under ``TRITON_INTERPRET=1``; ``cuda/device_check.sh`` runs them on a lent GPU, in a process of
their own (``test_diff_apply.py`` turns the interpreter on when it is imported).
"""

from __future__ import annotations

import os

import pytest
import torch
from diffcases import (
    check_triton_apply,
    check_triton_diff,
    mutate,
    random_bits,
    triton_cases,
)

from weftboard.cuda.diff import bits_view, diff_tensor

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: the kernels would run in the interpreter, not on the device"),
]

SWEEP = (4, 8, 32)  # the other warps gpu_bench times, beside the launch's DIFF_WARPS


@pytest.fixture(scope="module")
def tk():
    from weftboard.cuda import triton_kernels

    return triton_kernels


@pytest.mark.parametrize("case", triton_cases(), ids=lambda c: c[0])
def test_cuda_diff_matches_cpu(tk, case) -> None:
    check_triton_diff(tk, case[1], case[2], "cuda")


@pytest.mark.parametrize("warps", SWEEP)
@pytest.mark.parametrize("density", [0.01, 0.3])  # 0.3 overflows a block's stage
def test_cuda_diff_gives_the_same_result_at_every_warps(tk, warps, density) -> None:
    gen = torch.Generator().manual_seed(warps)
    pairs = []
    for n in (3, 4096, 4097, 50_000):
        old = random_bits(n, torch.bfloat16, gen)
        pairs.append((old, mutate(old, density, gen)))
    got = tk.diff_many_cuda([(o.cuda(), n.cuda()) for o, n in pairs], warps=warps)
    for (old, new), d in zip(pairs, got):
        ref = diff_tensor(old, new)
        assert torch.equal(d.positions.cpu(), ref.positions) and torch.equal(d.new_bits.cpu(), ref.new_bits)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_kernels_launch_on_their_tensors_device_not_the_current_one(tk) -> None:
    """Triton launches on the current device: each launch is made on its tensors' device (an
    engine may hold several GPUs and leave device 0 current)."""
    gen = torch.Generator().manual_seed(5)
    old = random_bits(50_000, torch.bfloat16, gen)
    new = mutate(old, 0.05, gen)
    ref = diff_tensor(old, new)
    with torch.cuda.device(0):
        d = tk.diff_cuda(old.to("cuda:1"), new.to("cuda:1"))
        target = bits_view(old.to("cuda:1"))
        diffs = (bits_view(new.to("cuda:1"))[d.positions] - target[d.positions])
        tk.apply_diff_cuda_(target, d.positions, diffs, torch.empty_like(diffs))
    assert torch.equal(d.positions.cpu(), ref.positions) and torch.equal(target.cpu(), bits_view(new))


@pytest.mark.parametrize("case", triton_cases()[-6:], ids=lambda c: c[0])
def test_cuda_apply_and_scatter_match_cpu(tk, case) -> None:
    check_triton_apply(tk, case[1], case[2], "cuda")


def test_cuda_patch_round_trip(tk) -> None:
    """A patch encoded on the CPU applies to device tensors (decode on CPU threads, the Triton
    apply on the device) bitwise, and reverts."""
    gen = torch.Generator().manual_seed(3)
    old = {f"t{i}": random_bits(n, dtype, gen)
           for i, (n, dtype) in enumerate([(70_000, torch.bfloat16), (5, torch.bfloat16), (9_001, torch.float8_e4m3fn),
                                           (4_096, torch.float32)])}
    new = {name: mutate(t, 0.02, gen) for name, t in old.items()}
    _round_trip_on_device(old, new)


def _round_trip_on_device(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """A patch encoded on the CPU from ``old`` to ``new`` applies to device copies of ``old``
    bitwise (``apply_patch_``), and its revert gives ``old`` back."""
    from weftboard.cuda.codec import apply_patch_, encode_patch

    patch = encode_patch(((n, old[n], new[n]) for n in old), base_version=1, target_version=2,
                         target_root="xxh3-128:" + "0" * 32)
    target = {n: t.cuda() for n, t in old.items()}
    applied = apply_patch_(target, patch.data)
    assert all(torch.equal(bits_view(target[n]).cpu(), bits_view(new[n])) for n in old)
    applied.revert()
    assert all(torch.equal(bits_view(target[n]).cpu(), bits_view(old[n])) for n in old)


def _huffman_pair(n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``mutate``'s changes plus sign flips (escapes); none in the second 64 Ki elements."""
    old = random_bits(n, dtype, gen)
    new = mutate(old, 0.03, gen)
    b = bits_view(new)
    flip = torch.rand(n, generator=gen) < 0.003
    top = (torch.ones(1, dtype=torch.int64) << (8 * b.element_size() - 1)).to(b.dtype)  # the sign bit (wraps)
    b[flip] ^= top
    b[65536:131072] = bits_view(old)[65536:131072]
    return old, new


@pytest.mark.parametrize(("dtype", "tile"), [(torch.bfloat16, 4096), (torch.bfloat16, 65536), (torch.float32, 65536),
                                             (torch.int32, 4096), (torch.uint8, 65536), (torch.int8, 4096),
                                             (torch.float64, 65536)], ids=str)
def test_cuda_huffman_decode_matches_cpu_and_reverts(dtype, tile) -> None:
    """The device decoder (``triton_huffman``) gives the CPU decoder's bytes on a tensor of a
    few tiles of the codec's size, with escapes, empty tiles and a partial last tile, and takes
    them back out; a damaged stream is refused with the CPU path's message and undone."""
    from weftboard.cuda import decode, triton_huffman
    from weftboard.cuda.encode import _encode_huffman
    from weftboard.proto.errors import CorruptData

    gen = torch.Generator().manual_seed(tile + dtype.itemsize)
    old, new = _huffman_pair(300_001, dtype, gen)
    a, b = bits_view(old), bits_view(new)
    pos = torch.nonzero(a != b).flatten()
    udt = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}[a.element_size()]
    stream = _encode_huffman(pos.numpy(), a[pos].numpy().view(udt), b[pos].numpy().view(udt), a.numel(), tile)
    entry = {"name": "w", "mode": "huffman", "numel": a.numel(), "changed": pos.numel(), "tile": tile}
    sp = decode.parse_tile_stream(entry, stream, a.element_size())
    assert sp.esc.any() and (sp.ns == 0).any()
    cpu = old.clone()
    decode.apply_tile_stream_(cpu, entry, sp, 1)
    target = old.cuda()
    triton_huffman.apply_tile_stream_cuda_(target, entry, sp, 1)
    assert torch.equal(bits_view(target).cpu(), bits_view(cpu)) and torch.equal(bits_view(cpu), b)
    triton_huffman.apply_tile_stream_cuda_(target, entry, sp, -1)
    assert torch.equal(bits_view(target).cpu(), a)
    rice_at = int(sp.offs[sp.ns.size - 1])  # the last tile's Rice bits: every tile before it was written
    for at in range(rice_at, rice_at + int(sp.rice[-1])):
        raw = stream.copy()
        raw[at] ^= 0x41
        ref = old.clone()
        try:
            decode.apply_tile_stream_(ref, entry, decode.parse_tile_stream(entry, raw, a.element_size()), 1)
        except CorruptData as exc:
            msg = str(exc)
            break
    else:
        pytest.fail("no flip in the last tile's Rice bits is refused")
    with pytest.raises(CorruptData) as exc:
        triton_huffman.apply_tile_stream_cuda_(target, entry, decode.parse_tile_stream(entry, raw, a.element_size()), 1)
    assert str(exc.value) == msg and torch.equal(bits_view(target).cpu(), a)


def test_cuda_patch_applies_huffman_streams_on_the_device(tk, monkeypatch) -> None:
    """With ``WEFTBOARD_DEVICE_DECODE=1``, ``apply_patch_`` into CUDA tensors takes the device
    decoder for each huffman stream, and its revert too."""
    from weftboard.cuda import triton_huffman

    monkeypatch.setenv("WEFTBOARD_DEVICE_DECODE", "1")
    calls = []
    real = triton_huffman.apply_tile_stream_cuda_
    monkeypatch.setattr(triton_huffman, "apply_tile_stream_cuda_",
                        lambda target, entry, sp, sign: calls.append((entry["name"], sign)) or real(target, entry, sp, sign))
    gen = torch.Generator().manual_seed(5)
    old = {"a": random_bits(200_000, torch.bfloat16, gen), "b": random_bits(70_000, torch.float32, gen)}
    new = {name: mutate(t, 0.01, gen) for name, t in old.items()}
    _round_trip_on_device(old, new)
    assert sorted(calls) == [("a", -1), ("a", 1), ("b", -1), ("b", 1)]


def test_cuda_patch_decodes_on_cpu_threads_unless_asked(tk, monkeypatch) -> None:
    """By default (the device decoder not yet measured on a GPU) a CUDA destination gets
    CPU-decoded changes scattered by Triton, with the same bytes."""
    from weftboard.cuda import triton_huffman

    monkeypatch.delenv("WEFTBOARD_DEVICE_DECODE", raising=False)
    monkeypatch.setattr(triton_huffman, "apply_tile_stream_cuda_",
                        lambda *a: pytest.fail("the device decoder ran without WEFTBOARD_DEVICE_DECODE=1"))
    gen = torch.Generator().manual_seed(6)
    old = {"a": random_bits(100_000, torch.bfloat16, gen)}
    new = {name: mutate(t, 0.01, gen) for name, t in old.items()}
    _round_trip_on_device(old, new)


@pytest.mark.parametrize(("dtype", "tile"), [(torch.bfloat16, 4096), (torch.bfloat16, 65536), (torch.float32, 65536),
                                             (torch.int32, 4096), (torch.uint8, 65536), (torch.int8, 4096)], ids=str)
def test_cuda_huffman_scan_gives_the_cpu_encoders_stream(dtype, tile) -> None:
    """The device scan (``triton_huffman_scan``) plus the host finish give
    ``tile_encode.encode_huffman``'s bytes on a tensor of a few tiles of the codec's size, with
    escapes, empty tiles and a partial last tile; a tile of escapes past the CPU scan's scratch
    gives None as there; the stream applies back to ``new`` with the device decoder."""
    from weftboard.cuda import tile_encode, triton_huffman, triton_huffman_scan
    from weftboard.cuda.tensor_bits import cpu_bits

    gen = torch.Generator().manual_seed(tile + 3 * dtype.itemsize)
    old, new = _huffman_pair(300_001, dtype, gen)
    changed, stream = triton_huffman_scan.encode_huffman_cuda(old.cuda(), new.cuda(), tile)
    ref_changed, ref = tile_encode.encode_huffman(cpu_bits(old), cpu_bits(new), tile)
    assert changed == ref_changed > 0 and ref is not None and stream is not None
    assert stream.tobytes() == ref.tobytes()
    target = old.cuda()
    triton_huffman.apply_huffman_cuda_(target, stream, changed=changed, tile=tile)
    assert torch.equal(bits_view(target).cpu(), bits_view(new))
    if dtype.itemsize > 1:  # far jumps in every element of the second tile: escapes past its scratch
        b = bits_view(new)
        b[tile:2 * tile] ^= 1 << (8 * dtype.itemsize - 2)
        changed, stream = triton_huffman_scan.encode_huffman_cuda(old.cuda(), new.cuda(), tile)
        assert (changed, stream) == (tile_encode.encode_huffman(cpu_bits(old), cpu_bits(new), tile)[0], None)


@pytest.mark.parametrize("encoding", ["default", "compact", "context"])
def test_a_device_pair_is_encoded_as_the_same_pair_on_the_cpu(encoding: str) -> None:
    """``encode_patch`` of device tensors gives the container of the same tensors on the CPU, for
    every encoding (the context coders took only CPU pairs, a device pair fell back to huffman)."""
    from weftboard.cuda.codec import encode_patch

    gen = torch.Generator().manual_seed(5)
    old = (torch.randn(300_000, generator=gen) * 0.02).to(torch.bfloat16)
    new = (old.float() + torch.sign(torch.randn(300_000, generator=gen)) * 3e-6).to(torch.bfloat16)

    def encode(a: torch.Tensor, b: torch.Tensor) -> bytes:
        return bytes(encode_patch([("w", a, b)], base_version=1, target_version=2, target_root="",
                                  encoding=encoding).data)

    assert encode(old.cuda(), new.cuda()) == encode(old, new)


def test_a_non_contiguous_device_pair_is_diffed_as_on_the_cpu() -> None:
    gen = torch.Generator().manual_seed(6)
    base = random_bits(64 * 300, torch.bfloat16, gen).view(64, 300)
    changed = mutate(base.reshape(-1), 0.02, gen).view(64, 300)
    cpu = diff_tensor(base.t(), changed.t())
    dev = diff_tensor(base.cuda().t(), changed.cuda().t())
    assert torch.equal(dev.positions.cpu(), cpu.positions) and torch.equal(dev.new_bits.cpu(), cpu.new_bits)
