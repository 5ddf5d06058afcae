"""The GPU path's Triton kernels compile for NVIDIA targets here, with no GPU, and fit in registers.

The interpreter tests (test_diff_apply.py) check what the kernels compute; these check that
Triton lowers them to cubins for A100 (sm_80) and H100/H200 (sm_90) as they are launched, and
that the launch configuration keeps every kernel out of local memory (no register spills).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from weftboard.cuda.bench import triton_compile as tc

# Not importorskip: importing triton here, at collection, would fix its interpreter setting
# before test_diff_apply.py sets TRITON_INTERPRET=1 when this module is collected first.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize(
    ("registers", "warps", "arch", "expected"),
    [
        (196, 4, 90, 0.125),  # 25 allocation units a warp: 10 warps fit, so 2 programs of 4
        (255, 8, 90, 0.125),  # 8192 registers a warp: one program of 8 warps
        (64, 16, 90, 0.5),  # 2048 a warp: 32 warps, 2 programs
        (32, 4, 80, 1.0),  # 1024 a warp: the 64-warp limit binds, 16 programs
        (16, 1, 90, 0.5),  # the 32-program limit binds before the warps do
        (64, 16, 86, 2 * 16 / 48),  # sm_86 holds 48 warps
    ],
)
def test_register_limited_occupancy_follows_cudas_allocation_rules(registers, warps, arch, expected) -> None:
    assert tc.register_limited_occupancy(registers, warps, tc.ARCHS[arch]) == pytest.approx(expected)


def test_an_argument_with_no_known_type_is_an_error_not_a_guess() -> None:
    param = SimpleNamespace
    fn = SimpleNamespace(__name__="_new_kernel", params=[param(name="t_ptr", is_constexpr=False),
                                                         param(name="weights_ptr", is_constexpr=False),
                                                         param(name="BLOCK", is_constexpr=True)])
    with pytest.raises(tc.CompileCheckError, match="weights_ptr"):
        tc._signature(fn, "i16")


def test_signature_types_pointers_by_role_and_marks_them_aligned() -> None:
    param = SimpleNamespace
    fn = SimpleNamespace(__name__="_k", params=[param(name="t_ptr", is_constexpr=False),
                                                param(name="pos_ptr", is_constexpr=False),
                                                param(name="n", is_constexpr=False),
                                                param(name="BLOCK", is_constexpr=True)])
    signature, attrs = tc._signature(fn, "u8")
    assert signature == {"t_ptr": "*u8", "pos_ptr": "*i64", "n": "i32", "BLOCK": "constexpr"}
    assert attrs == {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    assert tc._signature(fn, "u8", n_multiple_of_16=False)[1] == {(0,): [["tt.divisibility", 16]],
                                                                    (1,): [["tt.divisibility", 16]]}


def test_refuses_under_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(tc.CompileCheckError, match="TRITON_INTERPRET"):
        next(tc.compile_kernels((90,)))


def test_unknown_arch_is_refused_before_compiling(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(tc.CompileCheckError, match="arch 75"):
        next(tc.compile_kernels((90, 75)))


def test_every_kernel_compiles_for_a100_and_h100_without_spills() -> None:
    """A fresh process: test_diff_apply.py sets TRITON_INTERPRET=1 in this one before importing
    triton_kernels, and interpreter functions do not lower."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "weftboard.cuda.bench.triton_compile", "--arch", "80,90", "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    launched = {(r["kernel"], r["element"], r["variant"], r["n_multiple_of_16"], r["arch"]) for r in rows}
    expected = {(k, e, v, n16, a) for a in (80, 90) for e in tc.ELEMENTS for n16 in (True, False)
                for k, v in [("diff_stage_kernel", "UPDATE=False"), ("diff_stage_kernel", "UPDATE=True"),
                             ("diff_place_kernel", "UPDATE=False"), ("diff_place_kernel", "UPDATE=True"),
                             ("apply_diff_kernel", "-"), ("scatter_kernel", "-")]}
    assert launched == expected and len(rows) == len(expected)
    from weftboard.cuda import triton_kernels as tk

    for r in rows:
        want_warps = tk.DIFF_WARPS if r["kernel"].startswith("diff_") else tk.APPLY_WARPS
        assert r["warps"] == want_warps, r
        assert 0 < r["registers"] <= 255 and r["cubin_bytes"] > 0, r
        assert not r["spills"] and r["stack_bytes"] == 0 and r["local_bytes"] == 0, r
        assert r["occupancy"] >= 0.25, r


def test_the_table_reports_each_compiled_kernel_and_a_summary() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "weftboard.cuda.bench.triton_compile", "--arch", "90", "--warps", "8",
                           "--element", "i16"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["kernel", "elem", "variant", "n%16", "arch", "warps", "regs", "stack", "local", "shared",
                                "occup."]
    body = [line.split() for line in lines[1:-1]]
    assert sorted((cols[0], cols[2], cols[3]) for cols in body) == sorted(
        (k, v, n) for n in ("0", "any") for k, v in [
            ("apply_diff_kernel", "-"), ("diff_place_kernel", "UPDATE=False"), ("diff_place_kernel", "UPDATE=True"),
            ("diff_stage_kernel", "UPDATE=False"), ("diff_stage_kernel", "UPDATE=True"), ("scatter_kernel", "-")])
    assert all(cols[1] == "i16" and cols[4] == "sm_90" and cols[5] == "8" and int(cols[6]) > 0 for cols in body)
    spilled = sum(int(cols[7]) > 0 or int(cols[8]) > 0 for cols in body)
    assert lines[-1] == f"12 kernels compiled; {spilled} use stack or local memory"


@pytest.mark.parametrize("args", [["--arch", "nine"], ["--warps", "3"], ["--warps", "64"], ["--warps", "0"]])
def test_bad_arguments_exit_with_usage_errors(args) -> None:
    with pytest.raises(SystemExit) as exc:
        tc.main(args)
    assert exc.value.code == 2
