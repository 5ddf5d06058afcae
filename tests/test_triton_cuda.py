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

from weftboard.cuda.diff import bits_view, diff_tensor

from diffcases import mutate, random_bits, triton_cases

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


def _on_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the device with the same storage offset (a misaligned view stays misaligned)."""
    if t.storage_offset() == 0:
        return t.cuda()
    base = torch.empty(t.numel() + t.storage_offset(), dtype=t.dtype, device="cuda")
    view = base[t.storage_offset():]
    view.copy_(t)
    return view


@pytest.mark.parametrize("case", triton_cases(), ids=lambda c: c[0])
def test_cuda_diff_matches_cpu(tk, case) -> None:
    _, old, new = case
    old, new = old.contiguous(), new.contiguous()
    ref = diff_tensor(old, new)
    d_old, d_new = _on_device(old), _on_device(new)
    got = tk.diff_cuda(d_old, d_new)
    assert got.positions.is_cuda
    assert torch.equal(got.positions.cpu(), ref.positions)
    assert torch.equal(got.old_bits.cpu(), ref.old_bits)
    assert torch.equal(got.new_bits.cpu(), ref.new_bits)
    upd = tk.diff_cuda(d_old, d_new, update=True)  # writes new into d_old where they differ
    assert torch.equal(upd.positions.cpu(), ref.positions) and torch.equal(upd.old_bits.cpu(), ref.old_bits)
    assert torch.equal(bits_view(d_old).cpu(), bits_view(new))


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


@pytest.mark.parametrize("case", triton_cases()[-6:], ids=lambda c: c[0])
def test_cuda_apply_and_scatter_match_cpu(tk, case) -> None:
    _, old, new = case
    ref = diff_tensor(old, new)
    target = old.cuda()
    tb = bits_view(target)
    positions, old_bits = ref.positions.cuda(), ref.old_bits.cuda()
    diffs = (ref.new_bits.to(torch.int64) - ref.old_bits.to(torch.int64)).to(ref.new_bits.dtype).cuda()
    saved = torch.empty_like(old_bits)
    tk.apply_diff_cuda_(tb, positions, diffs, saved)
    assert torch.equal(tb.cpu(), bits_view(new))
    assert torch.equal(saved, old_bits)
    tk.scatter_cuda_(tb, positions, saved)
    assert torch.equal(tb.cpu(), bits_view(old))


def test_cuda_patch_round_trip(tk) -> None:
    """A patch encoded on the CPU applies to device tensors (decode on CPU threads, the Triton
    apply on the device) bitwise, and reverts."""
    from weftboard.cuda.codec import apply_patch_, encode_patch

    gen = torch.Generator().manual_seed(3)
    old = {f"t{i}": random_bits(n, dtype, gen)
           for i, (n, dtype) in enumerate([(70_000, torch.bfloat16), (5, torch.bfloat16), (9_001, torch.float8_e4m3fn),
                                           (4_096, torch.float32)])}
    new = {name: mutate(t, 0.02, gen) for name, t in old.items()}
    patch = encode_patch(((n, old[n], new[n]) for n in old), base_version=1, target_version=2,
                         target_root="xxh3-128:" + "0" * 32)
    target = {n: t.cuda() for n, t in old.items()}
    applied = apply_patch_(target, patch.data)
    assert all(torch.equal(bits_view(target[n]).cpu(), bits_view(new[n])) for n in old)
    applied.revert()
    assert all(torch.equal(bits_view(target[n]).cpu(), bits_view(old[n])) for n in old)
