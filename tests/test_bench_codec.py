"""Smoke run of ``weftboard bench codec`` at a small size: keys, lossless, consistent sizes.

Timings are not asserted here (benchmarks report ratios; unit tests do not time)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from weftboard.cuda.bench import bench_codec

KEYS = {
    "format", "params", "density", "bytes_per_change", "entropy_bound_bytes_per_change",
    "baseline_bytes_per_change", "ratio_vs_baseline", "diff_encode_gbps", "decode_apply_gbps",
    "copy_gbps", "lossless", "context_bound_bytes_per_change", "context_bound_position_bits_per_change",
    "context_bound_value_bits_per_change",
}


def test_bench_codec_cli_prints_json_last_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "weftboard.board.cli", "bench", "codec", "--params", "400000", "--repeat", "1", "--json"],
        capture_output=True, text=True, timeout=240, check=True,
    ).stdout.strip().splitlines()
    assert len(out) >= 2  # human-readable lines, then the JSON
    result = json.loads(out[-1])
    assert set(result) >= KEYS
    assert result["format"] == "bf16" and result["lossless"] is True
    assert 300_000 <= result["params"] <= 1_000_000
    assert 0 < result["density"] < 1
    assert result["ratio_vs_baseline"] == pytest.approx(result["baseline_bytes_per_change"] / result["bytes_per_change"])
    assert result["bytes_per_change"] >= result["entropy_bound_bytes_per_change"] * 0.9
    # conditioning on more (the old value's class, the left neighbour) never raises the bound
    assert 0 < result["context_bound_bytes_per_change"] <= result["entropy_bound_bytes_per_change"]
    assert result["context_bound_bytes_per_change"] * 8 == pytest.approx(
        result["context_bound_position_bits_per_change"] + result["context_bound_value_bits_per_change"])
    assert all(result[k] > 0 for k in ("diff_encode_gbps", "decode_apply_gbps", "copy_gbps"))
    for name in ("diff_encode", "decode_apply", "copy"):  # no round is faster than the best
        assert 0 < result[f"{name}_gbps_median"] <= result[f"{name}_gbps"]
    assert result["decode_apply_vs_copy_median"] == pytest.approx(
        result["decode_apply_gbps_median"] / result["copy_gbps_median"])


def test_bench_codec_quantized_format_reports_scales() -> None:
    lines: list[str] = []
    result = bench_codec.run(fmt="mxfp4", params=300_000, repeat=1, log=lines.append)
    assert result["lossless"] is True
    assert result["format"] == "mxfp4"
    assert "density_recompute_scales" in result and result["density_recompute_scales"] >= result["density"] * 0.5
    assert any("density" in line for line in lines)


def test_bench_codec_context_encoding_is_lossless_and_smaller() -> None:
    """``--encoding context`` measures the context streams: lossless, and on a realistic step
    below the default's bytes per change (the i.i.d. bound is not a floor for it)."""
    default = bench_codec.run(fmt="bf16", params=600_000, repeat=1, log=lambda _: None)
    context = bench_codec.run(fmt="bf16", params=600_000, repeat=1, encoding="context", log=lambda _: None)
    assert context["encoding"] == "context" and context["lossless"] is True
    assert context["changed"] == default["changed"]
    assert context["bytes_per_change"] < default["bytes_per_change"]
    # the context coder beats the i.i.d. bound here, but not the context-conditional one
    assert context["context_bound_bytes_per_change"] <= context["bytes_per_change"]


def test_context_bound_is_the_conditional_entropy_of_a_known_source() -> None:
    """Changes at every other element of a 1-D tensor: a left neighbour that changed says the
    element did not, so positions cost nothing given the context; differences alternate between
    +1 and -1 ulp at random, one bit each; the i.i.d. bound pays H(1/2)/(1/2) = 2 bits a position."""
    n = 4096
    old = torch.full((n,), 1.0, dtype=torch.bfloat16)
    bits = old.view(torch.int16).clone()
    gen = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (n // 2,), generator=gen) * 2 - 1
    bits[1::2] += signs.to(torch.int16)
    new = bits.view(torch.bfloat16)
    pos_bits, val_bits = bench_codec.context_bound_bits({"w": old}, {"w": new})
    changes = n // 2
    assert pos_bits / changes == pytest.approx(0.0, abs=0.02)  # only the first element is not in context
    p_plus = float((signs > 0).float().mean())
    h = -(p_plus * math.log2(p_plus) + (1 - p_plus) * math.log2(1 - p_plus))
    assert val_bits / changes == pytest.approx(h, rel=1e-9)
    iid_bits, counted, _ = bench_codec.entropy_bound_bits({"w": old}, {"w": new})
    assert counted == changes
    assert iid_bits / changes == pytest.approx(2.0 + h, rel=1e-6)
