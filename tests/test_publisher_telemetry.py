"""A publisher's per-version telemetry (committed records, latencies, stage timings, blocked
times) keeps the most recent versions only: a run of months publishes millions of versions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from weftboard.publisher.job import RECENT_VERSIONS
from weftboard.publisher.publisher import Publisher

VERSIONS = RECENT_VERSIONS + 44


async def test_telemetry_keeps_the_recent_versions_only(board, local_store, tmp_path: Path) -> None:
    def publish() -> dict[str, list]:
        weights = torch.zeros(64, dtype=torch.bfloat16)
        with Publisher(board.address, "tele", token=board.admin_token, blob_store=local_store, max_pending=8,
                       anchor_every=1 << 20, anchor_patch_fraction=1e9, work_dir=tmp_path / "pub") as pub:
            for step in range(VERSIONS):
                weights[step % 64] += 1
                pub.publish({"w": weights}, step=step)
            pub.flush()
            return {"committed": list(pub.committed), "commit_latency_s": list(pub.commit_latency_s),
                    "timings": list(pub.timings), "blocked_s": list(pub.blocked_s)}

    kept = await asyncio.to_thread(publish)
    for name, values in kept.items():
        assert len(values) == RECENT_VERSIONS, name
    assert [r.version for r in kept["committed"]] == list(range(VERSIONS - RECENT_VERSIONS + 1, VERSIONS + 1))
    assert [t["version"] for t in kept["timings"]] == list(range(VERSIONS - RECENT_VERSIONS + 1, VERSIONS + 1))
