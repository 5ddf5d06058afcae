"""Diff and apply on raw bits: the CPU path against a plain torch reference, and the Triton
kernels (run by Triton's interpreter on CPU tensors) byte for byte against the CPU path."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch
from diffcases import (
    adversarial_pairs,
    check_triton_apply,
    check_triton_diff,
    mutate,
    random_bits,
    triton_cases,
)

from weftboard.cuda.diff import DIFF_TILE, apply_delta_, diff_and_update_, diff_tensor
from weftboard.cuda.tensor_bits import TensorDelta, bits_view, cpu_bits, unsigned_np
from weftboard.proto.errors import InvalidArgument

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.float64]


def _reference(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b = bits_view(old), bits_view(new)
    pos = torch.nonzero(a != b).flatten()
    return pos, a[pos], b[pos]


def _assert_delta(delta: TensorDelta, old: torch.Tensor, new: torch.Tensor) -> None:
    pos, o, n = _reference(old, new)
    assert delta.positions.dtype == torch.int64
    assert torch.equal(delta.positions, pos)
    assert torch.equal(delta.old_bits, o)
    assert torch.equal(delta.new_bits, n)
    assert delta.numel == old.numel() and delta.dtype == old.dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", [0.0, 0.001, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("n", [1, 9, DIFF_TILE + 1001])
def test_cpu_diff_matches_reference(dtype: torch.dtype, density: float, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    old = random_bits(n, dtype, gen)
    new = mutate(old, density, gen)
    _assert_delta(diff_tensor(old, new), old, new)


@pytest.mark.parametrize("case", adversarial_pairs(), ids=lambda c: c[0])
def test_cpu_diff_adversarial(case) -> None:
    _, old, new = case
    delta = diff_tensor(old, new)
    _assert_delta(delta, old, new)
    target = old.clone()
    apply_delta_(target, delta)
    assert torch.equal(bits_view(target), bits_view(new.contiguous()))


def test_float_compare_would_be_wrong_but_bits_are_right() -> None:
    old = torch.tensor([0.0, float("nan"), 1.0])
    new = torch.tensor([-0.0, float("nan"), 1.0])
    assert diff_tensor(old, new).positions.tolist() == [0]  # -0 is a change, the same NaN is not


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float32], ids=str)
def test_diff_and_update_makes_prev_new_in_place(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    old = random_bits(DIFF_TILE * 3 + 77, dtype, gen).reshape(-1, 1)
    new = mutate(old, 0.05, gen)
    prev = old.clone()
    ptr = prev.data_ptr()
    delta = diff_and_update_(prev, new)
    _assert_delta(delta, old, new)
    assert prev.data_ptr() == ptr
    assert torch.equal(bits_view(prev), bits_view(new))


def test_apply_delta_round_trip_and_shape_checks() -> None:
    gen = torch.Generator().manual_seed(4)
    old = random_bits(5000, torch.bfloat16, gen).reshape(50, 100)
    new = mutate(old, 0.1, gen)
    delta = diff_tensor(old, new)
    target = old.clone()
    apply_delta_(target, delta)
    assert torch.equal(bits_view(target), bits_view(new))
    with pytest.raises(InvalidArgument):
        apply_delta_(torch.zeros(10, dtype=torch.bfloat16), delta)
    with pytest.raises(InvalidArgument):
        diff_tensor(old, new.float())
    with pytest.raises(InvalidArgument):
        diff_tensor(old, new[:10])


@pytest.mark.parametrize("dtype", DTYPES + [torch.int8, torch.int64])
def test_cpu_bits_is_the_flat_unsigned_view_of_any_layout(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    t = random_bits(60, dtype, gen).reshape(6, 10)
    for view in (t, t.t(), t[:, 2:7], t.reshape(-1)[3], t.reshape(2, 3, 10)):
        got = cpu_bits(view)
        want = unsigned_np(bits_view(view.contiguous())).reshape(-1)
        assert got.ndim == 1 and got.dtype == want.dtype and got.dtype.kind == "u"
        assert got.tobytes() == want.tobytes()
    # a contiguous tensor is viewed, not copied: the encoder reads the caller's memory
    assert cpu_bits(t).ctypes.data == t.data_ptr()


def test_cpu_bits_takes_a_tensor_that_requires_grad() -> None:
    w = torch.randn(8, requires_grad=True)
    assert cpu_bits(w).tobytes() == w.detach().numpy().tobytes()


def test_cpu_bits_keeps_the_memory_alive_and_writes_through() -> None:
    t = torch.arange(100, dtype=torch.int16).to(torch.bfloat16)
    want = t.view(torch.int16).numpy().view("uint16").copy()
    bits = cpu_bits(t)
    bits[0] = 0x7FC0  # a NaN's bits: the array is the tensor's memory, not a copy of it
    assert t.view(torch.int16)[0].item() == 0x7FC0
    del t
    gc.collect()
    assert bits[1:].tobytes() == want[1:].tobytes()  # still readable: the array holds the tensor


def test_cpu_bits_of_an_empty_tensor_and_of_tensors_whose_memory_is_not_their_values() -> None:
    empty = cpu_bits(torch.empty(0, dtype=torch.bfloat16))
    assert empty.size == 0 and empty.dtype.name == "uint16"
    # A negative or conjugate view's memory holds the values before the sign or conjugation,
    # and a meta tensor has none: each is refused, never read as if it were plain elements.
    with pytest.raises(RuntimeError, match="negative bit"):
        cpu_bits(torch._neg_view(torch.ones(4)))
    with pytest.raises(RuntimeError, match="conjugate"):
        cpu_bits(torch.ones(4, dtype=torch.complex64).conj())
    with pytest.raises(TypeError, match="meta"):
        cpu_bits(torch.empty(4, device="meta"))
    with pytest.raises(InvalidArgument, match="width 16"):
        cpu_bits(torch.zeros(2, dtype=torch.complex128))


# ---------------------------------------------------------------------------
# Triton kernels (interpreter) against the CPU path
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tk():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET was not 1 when this module loaded; Triton kernels need a GPU otherwise")
    try:
        from weftboard.cuda import triton_kernels
    except Exception as exc:  # pragma: no cover - depends on the installation
        pytest.skip(f"triton cannot be imported: {exc}")
    return triton_kernels


@pytest.mark.parametrize("case", triton_cases(), ids=lambda c: c[0])
def test_triton_diff_matches_cpu(tk, case) -> None:
    check_triton_diff(tk, case[1], case[2], "cpu")


@pytest.mark.parametrize("case", triton_cases()[-6:], ids=lambda c: c[0])
def test_triton_apply_matches_cpu(tk, case) -> None:
    check_triton_apply(tk, case[1], case[2], "cpu")


def test_triton_batch_diff_one_sync(tk) -> None:
    gen = torch.Generator().manual_seed(5)
    pairs = []
    for n in (3, 4096, 4097, 12_000):
        old = random_bits(n, torch.bfloat16, gen)
        pairs.append((old, mutate(old, 0.2, gen)))
    for (old, new), got in zip(pairs, tk.diff_many_cuda(pairs)):
        assert torch.equal(got.positions, diff_tensor(old, new).positions)


def test_gpu_bench_dry_run_on_cpu(tk, capsys) -> None:
    """The GPU benchmark's whole code path (Triton kernels in the interpreter, codec round trip)."""
    from weftboard.cuda.bench import gpu_bench

    rc = gpu_bench.main(["--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate", "128", "--vocab", "100"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "torch ne+nonzero" in out and "index_copy_" in out
    # the launch's warps, then the sweep's others, each checked against the torch diff ("OK" below)
    assert [w for w in (4, 8, 16, 32) if f"diff, Triton (staged, {w} warps)" in out] == [4, 8, 16, 32]
    assert "decode+apply, Triton huffman (device)" in out and "copy_ of the same tensors" in out
    assert "encode, Triton huffman scan + host finish" in out and "triton huffman scan + host finish on its" in out
    assert out.count(": OK") == 6


@pytest.mark.parametrize("warps", ["3", "64", "4,x", "0"])
def test_gpu_bench_refuses_a_bad_warps_sweep(warps, capsys) -> None:
    from weftboard.cuda.bench import gpu_bench

    with pytest.raises(SystemExit) as exc:
        gpu_bench.main(["--device", "cpu", "--tiny", "--diff-warps", warps])
    assert exc.value.code == 2 and "--diff-warps" in capsys.readouterr().err


_REPO = Path(__file__).resolve().parent.parent
_DEVICE_CHECK = _REPO / "cuda" / "device_check.sh"


def _device_check(tmp_path: Path, python: str) -> tuple[subprocess.CompletedProcess, str]:
    """Runs the script with its temporary files in ``tmp_path/tmp``, and checks it left none there."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "DEVICE_CHECK_CPU": "1", "OUT": str(tmp_path / "out"), "PYTHON": python,
           "TMPDIR": str(scratch)}
    proc = subprocess.run(["bash", str(_DEVICE_CHECK)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=290)
    assert not any(scratch.iterdir()), sorted(p.name for p in scratch.iterdir())  # the shim is removed
    return proc, (tmp_path / "out" / "device_check.log").read_text()


def test_the_device_check_script_runs_every_step_from_the_checkout_alone(tmp_path) -> None:
    """The one call a GPU session spends its minutes on, dry-run on this CPU: weftboard.cuda
    imported from the checkout through the script's shim, both benchmark runs' bitwise checks
    passed, the CUDA tests collected, and its log where the device tool fetches files from."""
    proc, log = _device_check(tmp_path, sys.executable)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert log == proc.stdout  # everything printed is in the log that comes back
    shim = re.search(r"weftboard.cuda from \['([^']+)'\]", log)
    assert shim and shim.group(1).endswith("/weftboard/cuda") and Path(shim.group(1)) != _REPO / "cuda"
    assert log.count("check patch round trip + revert bitwise: OK") == 2
    assert log.count(": OK") == 12 and "FAILED" not in log
    assert re.search(r"(\d+) skipped", log), log[-2000:]  # no GPU here: the CUDA tests skip, but they ran
    assert "device_check: every step passed" in log


def test_the_device_check_script_fails_when_a_step_fails(tmp_path) -> None:
    proc, log = _device_check(tmp_path, str(tmp_path / "no-such-python"))
    assert proc.returncode == 1
    assert "skipping the full gpu_bench: the tiny run failed" in log
    assert "device_check: FAILED: machine (exit" in log and "FAILED: CUDA tests (exit" in log


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without a GPU")
def test_gpu_bench_says_clearly_when_there_is_no_gpu(capsys) -> None:
    from weftboard.cuda.bench import gpu_bench

    assert gpu_bench.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_bench_reports_each_loaded_kernel_form_and_survives_triton_internals_changing() -> None:
    """``kernel_resources`` reads Triton's caches of compiled kernels (no GPU here: stand-ins
    shaped like Triton 3's), and says "unavailable" instead of failing the bench when they
    are not there."""
    from types import SimpleNamespace

    from weftboard.cuda.bench import gpu_bench

    loaded = []

    def kernel(warps: int, regs: int, spills: int) -> SimpleNamespace:
        k = SimpleNamespace(metadata=SimpleNamespace(num_warps=warps), n_regs=regs, n_spills=spills)
        k._init_handles = lambda: loaded.append(warps)
        return k

    fn = SimpleNamespace(__name__="diff_stage_kernel",
                         device_caches={0: ({"a": kernel(16, 75, 0), "b": kernel(4, 255, 2)}, {}, None, None, None)})
    assert gpu_bench.kernel_resources(fn) == ["diff_stage_kernel: 16 warps, 75 registers, 0 spilled",
                                              "diff_stage_kernel: 4 warps, 255 registers, 2 spilled"]
    assert loaded == [16, 4]
    empty = SimpleNamespace(__name__="scatter_kernel", device_caches={})
    assert gpu_bench.kernel_resources(empty) == ["scatter_kernel: no compiled form"]
    interpreted = SimpleNamespace(__name__="apply_diff_kernel")  # no device_caches, as under TRITON_INTERPRET
    (line,) = gpu_bench.kernel_resources(interpreted)
    assert line.startswith("apply_diff_kernel: resources unavailable (AttributeError")
