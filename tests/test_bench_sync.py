"""Smoke run of ``weftboard bench sync`` on a tiny model: the JSON keys and bitwise_ok.

Timings are not asserted here (they belong to the benchmark's own ratios).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The smoke runs start a trainer and islands in processes of their own, which load the CPU
# codec's kernels from the disk cache; on an empty cache (a fresh clone) each compiled them at
# once on two cores, and a run took more than its 280 s. So the session's kernel warm-up
# (conftest's ``warm_kernels``) fills the cache first: 433 s on an empty cache on a two-core host,
# where this module is the first to ask for it, so the time limit has room for that and a run
# (30 s each once warm).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_kernels"), pytest.mark.timeout(900)]

KEYS = {
    "params", "islands", "versions", "delta_bytes_per_version", "full_bytes_per_version",
    "delta_sync_p50_s", "delta_sync_p99_s", "full_sync_p50_s", "speedup_p50", "bytes_ratio",
    "trainer_blocked_s_per_version", "publisher_extra_memory_ratio", "bitwise_ok", "island_sync_p50_s",
    "island_spread_p50_s",
}


@pytest.mark.parametrize("encoding,part_bytes,board,presigned", [("default", None, "--board-in-process", False),
                                                                  ("context", 4096, "--board-process", True)])
def test_bench_sync_smoke(tmp_path: Path, encoding: str, part_bytes: int | None, board: str, presigned: bool) -> None:
    """The default parts (staged while an island asks for them), and (context) patches in
    parts of a set size staged before their commit, with the board on the bench's loop and in
    its own process; islands with S3 credentials, and islands on the board's presigned URLs."""
    proc = subprocess.run(
        [sys.executable, "-m", "weftboard.board.cli", "bench", "sync", "--params", "1000000", "--islands", "2",
         "--versions", "2", "--warm-steps", "2", "--json", "--work-dir", str(tmp_path / "work"), "--encoding", encoding,
         *(["--part-bytes", str(part_bytes)] if part_bytes is not None else []), board,
         *(["--presigned"] if presigned else [])],
        capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) >= KEYS
    assert result["bitwise_ok"] is True and result["encoding"] == encoding
    assert result["part_bytes"] == ("auto" if part_bytes is None else part_bytes)
    if part_bytes is not None:
        assert result["patch_parts_per_version"] > 1
    assert result["board"] == ("own process" if board == "--board-process" else "on the bench's event loop")
    assert result["islands"] == 2 and result["versions"] == 2
    assert ("presigned" in result["island_blobs"]) is presigned
    assert result["params"] >= 1_000_000 * 0.8
    assert 0 < result["delta_bytes_per_version"] < result["full_bytes_per_version"]
    assert result["bytes_ratio"] == pytest.approx(result["full_bytes_per_version"] / result["delta_bytes_per_version"],
                                                  rel=1e-3)
    assert result["trainer_gc"].startswith("manual")
    assert result["trainer_gc_s_per_step"] >= 0
    # each island's own span: none is later than the last island's, which the figure is
    assert 0 < result["island_sync_p50_s"] <= result["delta_sync_p50_s"] + 1e-4
    assert 0 <= result["island_spread_p50_s"] <= result["delta_sync_p99_s"]


def test_trainer_collector_manual_collects_young_at_boundaries_and_restores() -> None:
    """Manual mode: automatic collection off between start and stop, a young collection every
    ``every`` steps (counted), and the collector's state given back as it was found."""
    import gc

    from weftboard.publisher.bench.trainer import TrainerCollector

    assert gc.isenabled()
    collector = TrainerCollector("manual", every=3)
    collected: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collected.append(info["generation"])

    gc.callbacks.append(on_gc)
    try:
        collector.start()
        assert not gc.isenabled()
        assert collected == [2]  # one full collection at start-up
        for step in range(7):
            collector.step_boundary(step)
        assert collector.collections == 3 and collected == [2, 1, 1, 1]  # steps 0, 3, 6
        assert collector.seconds > 0
    finally:
        collector.stop()
        gc.callbacks.remove(on_gc)
    assert gc.isenabled()
    auto = TrainerCollector("auto")
    auto.start()
    auto.step_boundary(0)
    assert gc.isenabled() and auto.collections == 0
    with pytest.raises(ValueError):
        TrainerCollector("sometimes")
