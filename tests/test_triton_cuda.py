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


@pytest.mark.parametrize("case", triton_cases()[-6:], ids=lambda c: c[0])
def test_cuda_apply_and_scatter_match_cpu(tk, case) -> None:
    check_triton_apply(tk, case[1], case[2], "cuda")


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
