"""Smoke run of ``weftboard bench codec`` at a small size: keys, lossless, consistent sizes.

Timings are not asserted here (benchmarks report ratios; unit tests do not time)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
    # The default coder conditions on the old value's class, so it may beat the i.i.d. bound, but
    # not the context-conditional one (which also conditions positions on the left neighbour).
    assert result["context_bound_bytes_per_change"] <= result["entropy_bound_bytes_per_change"]
    assert result["bytes_per_change"] >= result["context_bound_bytes_per_change"]
    assert all(result[k] > 0 for k in ("diff_encode_gbps", "decode_apply_gbps", "copy_gbps"))


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
