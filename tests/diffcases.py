"""Old/new tensor pairs for the diff and apply tests: random bits, mutations (mostly +-1 unit
in the last place, some far jumps) and adversarial cases (signed zeros, NaN payloads, infinities,
empty, dense, odd sizes, a misaligned view). Shared by the interpreter tests
(``test_diff_apply.py``) and the device tests (``test_triton_cuda.py``); it sets nothing in the
environment, so importing it does not choose Triton's interpreter."""

from __future__ import annotations

import torch

from weftboard.cuda.diff import DIFF_TILE, bits_view, diff_tensor


def random_bits(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    width = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=gen).view(dtype)


def mutate(t: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    out = t.clone()
    b = bits_view(out)
    n = b.numel()
    if n == 0 or density <= 0:
        return out
    mask = torch.rand(n, generator=gen) < density
    # +-1 ulp mostly, some far jumps
    step = torch.randint(-2, 3, (n,), generator=gen)
    step[step == 0] = 1
    far = torch.rand(n, generator=gen) < 0.05
    wide = b.to(torch.int64) + step + far * 1000
    b[mask] = wide[mask].to(b.dtype) if b.dtype != torch.uint8 else (wide[mask] % 256).to(torch.uint8)
    return out


def adversarial_pairs() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    cases = []
    z = torch.zeros(1000)
    cases.append(("pos-neg-zero", z, -z))
    nan = torch.full((513,), float("nan"))
    cases.append(("same-nan", nan, nan.clone()))
    other_nan = nan.clone()
    other_nan.view(torch.int32)[::3] |= 1  # a different NaN payload is a change
    cases.append(("nan-payload", nan, other_nan))
    inf = torch.tensor([float("inf"), -float("inf"), 1.0, 0.0] * 100)
    cases.append(("inf-flip", inf, -inf))
    base = random_bits(DIFF_TILE * 2 + 5, torch.bfloat16, gen)
    cases.append(("all-changed", base, (bits_view(base) ^ 0x5555).view(torch.bfloat16)))
    cases.append(("none-changed", base, base.clone()))
    cases.append(("empty", torch.empty(0, dtype=torch.bfloat16), torch.empty(0, dtype=torch.bfloat16)))
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    cases.append(("single", one, -one))
    odd = random_bits(7, torch.float8_e4m3fn, gen)
    cases.append(("odd-fp8", odd, mutate(odd, 0.5, gen)))
    # dense first tile, sparse second (both compaction strategies), last element changed
    t = random_bits(DIFF_TILE * 2 + 3, torch.bfloat16, gen)
    u = mutate(t, 0.0, gen)
    bits_view(u)[: DIFF_TILE // 2] ^= 1
    bits_view(u)[DIFF_TILE + 17] ^= 0x8000
    bits_view(u)[-1] ^= 1
    cases.append(("mixed-tiles", t, u))
    # a misaligned view: storage offset of one element, so no 64-bit word view exists
    big = random_bits(1001, torch.bfloat16, gen)
    big2 = mutate(big, 0.1, gen)
    cases.append(("misaligned", big[1:], big2[1:]))
    return cases


def triton_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    cases = [c for c in adversarial_pairs() if c[1].numel() <= 20_000]
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.uint8, torch.float64):
        for density in (0.01, 0.3):  # 0.3 overflows the kernel's per-block stage, 0.01 does not
            old = random_bits(9_001, dtype, gen)
            cases.append((f"{dtype}-{density}", old, mutate(old, density, gen)))
    return cases


def placed(t: torch.Tensor, device: str) -> torch.Tensor:
    """A copy of ``t`` on ``device`` with the same storage offset, so a misaligned view stays
    misaligned (the kernels' loads are specialized on alignment)."""
    base = torch.empty(t.numel() + t.storage_offset(), dtype=t.dtype, device=device)
    view = base[t.storage_offset():]
    view.copy_(t)
    return view


def check_triton_diff(tk, old: torch.Tensor, new: torch.Tensor, device: str) -> None:
    """``tk.diff_cuda`` of the pair placed on ``device`` (CPU tensors for the interpreter)
    against the CPU path, plain and then with ``update`` (which must leave old equal to new)."""
    old, new = old.contiguous(), new.contiguous()
    ref = diff_tensor(old, new)
    on_old, on_new = placed(old, device), placed(new, device)
    got = tk.diff_cuda(on_old, on_new)
    assert got.positions.device == on_old.device
    for field in ("positions", "old_bits", "new_bits"):
        assert torch.equal(getattr(got, field).cpu(), getattr(ref, field)), field
    upd = tk.diff_cuda(on_old, on_new, update=True)
    assert torch.equal(upd.positions.cpu(), ref.positions) and torch.equal(upd.old_bits.cpu(), ref.old_bits)
    assert torch.equal(bits_view(on_old).cpu(), bits_view(new))


def check_triton_apply(tk, old: torch.Tensor, new: torch.Tensor, device: str) -> None:
    """``tk.apply_diff_cuda_`` then ``tk.scatter_cuda_`` on the pair's old tensor placed on
    ``device``: new bits after the apply (the old ones saved), old bits after the scatter."""
    ref = diff_tensor(old, new)
    tb = bits_view(placed(old, device))
    positions, old_bits = ref.positions.to(device), ref.old_bits.to(device)
    diffs = (ref.new_bits.to(torch.int64) - ref.old_bits.to(torch.int64)).to(ref.new_bits.dtype).to(device)
    saved = torch.empty_like(old_bits)
    tk.apply_diff_cuda_(tb, positions, diffs, saved)
    assert torch.equal(tb.cpu(), bits_view(new))
    assert torch.equal(saved.cpu(), ref.old_bits)
    tk.scatter_cuda_(tb, positions, saved)
    assert torch.equal(tb.cpu(), bits_view(old))
