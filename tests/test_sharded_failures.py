"""Sharded publishing when one rank's publish fails or the ranks' inputs disagree: every rank
fails the same version at the same collective (no rank waits out the timeout), nothing of it is
committed, and every later publish raises, so no version ever pairs two training steps.

Real board and blob store; two gloo ranks, each a process of its own (torch.multiprocessing).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distkit import run_ranks

from weftboard.board.blobs.localdir import LocalDirBlobStore
from weftboard.board.client import BoardClient
from weftboard.board.embedded import free_port
from weftboard.proto.errors import InvalidArgument
from weftboard.publisher.sharded import ShardedPublisher, Slice
from weftboard.publisher.sharded_layout import RankHeader, TensorEntry, plan_slices

pytestmark = pytest.mark.timeout(180)


def _state(rank: int, step: int, *, extra: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s half (two rows) of a (4, 4) tensor whose every element is ``step + 1``."""
    state: dict[str, Any] = {"w": Slice(torch.full((2, 4), float(step + 1)), (4, 4), (2 * rank, 0))}
    if extra:
        state["b"] = torch.ones(3)
    return state


def _job(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Three steps of one scenario; each step's outcome (version or error) goes to the report."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    scenario = cfg["scenario"]
    pub = ShardedPublisher(cfg["board"], scenario, token=cfg["token"], blob_store=LocalDirBlobStore(cfg["blobs"]),
                           collective_timeout_s=60, work_dir=Path(cfg["out"]) / f"work-{scenario}-{rank}")
    if scenario == "oom" and rank == 1:
        real, calls = pub._snapshot, [0]

        def flaky(held: dict[str, tuple]) -> dict[str, torch.Tensor]:
            calls[0] += 1
            if calls[0] == 2:  # the snapshot of step 1 fails (as a transient CUDA OOM would)
                raise RuntimeError("CUDA out of memory (injected)")
            return real(held)

        pub._snapshot = flaky  # type: ignore[method-assign]
    report: list[Any] = []
    t0 = time.monotonic()
    for step in range(3):
        state = _state(rank, step, extra=scenario == "added" and step >= 1)
        said = step + 1 if scenario == "steps" and rank == 1 and step == 1 else step  # rank 1 skips a step
        try:
            report.append(pub.publish(state, step=said).result(60).version)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            report.append(f"{type(exc).__name__}: {exc}")
    report.append(time.monotonic() - t0)
    (Path(cfg["out"]) / f"report-{scenario}-{rank}.json").write_text(json.dumps(report))
    pub.close(flush=False)
    os._exit(0)


def _spawn(cfg: dict[str, Any], deadline_s: float = 120.0) -> list[list[Any]]:
    """Run one two-rank job; each rank's report (no rank outlives the test: ``run_ranks``)."""
    cfg = dict(cfg, port=free_port())
    run_ranks(_job, 2, (2, cfg), deadline_s=deadline_s)
    out = Path(cfg["out"])
    return [json.loads((out / f"report-{cfg['scenario']}-{r}.json").read_text()) for r in range(2)]


async def _head(board: Any, run: str) -> int:
    async with BoardClient(board.address, board.admin_token) as client:
        return (await client.get_head(run)).version


async def test_a_failed_snapshot_on_one_rank_fails_that_version_on_every_rank_and_all_later_ones(
        board, local_store, tmp_path: Path) -> None:
    cfg = {"board": board.address, "token": board.admin_token, "blobs": str(local_store.root), "out": str(tmp_path)}
    oom, steps = await asyncio.gather(asyncio.to_thread(_spawn, dict(cfg, scenario="oom")),
                                      asyncio.to_thread(_spawn, dict(cfg, scenario="steps")))
    # rank 1's snapshot of version 2 (step 1) raised: rank 1 re-raises it, rank 0's version 2
    # fails at the header exchange (not after the collective timeout), then both refuse step 2
    (r0, r1) = oom
    assert r0[0] == r1[0] == 1
    assert r1[1] == "RuntimeError: CUDA out of memory (injected)"
    assert r0[1].startswith("FailedPrecondition: version 2 was not committed: rank 1's publish of version 2 "
                            "(step 1) failed: RuntimeError: CUDA out of memory"), r0
    for r in (r0, r1):
        assert "rank 1's publish of version 2 (step 1) failed" in r[2], r
        assert r[3] < 45, f"a rank waited for the collective timeout: {r}"
    assert await _head(board, "oom") == 1  # no version mixes two steps
    # rank 1 says step 2 where rank 0 says step 1: version 2 is refused on both, then step 2 too
    for r in steps:
        assert r[0] == 1
        assert r[1] == ("InvalidArgument: ranks disagree on the training step of version 2: step 1 on rank(s) [0]; "
                        "step 2 on rank(s) [1] (a rank skipped or repeated a publish): the version is refused on "
                        "every rank"), r
        assert "ranks disagree on the training step of version 2" in r[2]
    assert await _head(board, "steps") == 1


async def test_a_tensor_added_after_the_first_version_is_refused_naming_it(
        board, local_store, tmp_path: Path) -> None:
    cfg = {"board": board.address, "token": board.admin_token, "blobs": str(local_store.root), "out": str(tmp_path)}
    for r in await asyncio.to_thread(_spawn, dict(cfg, scenario="added")):
        assert r[0] == 1
        assert r[1].startswith("InvalidArgument: this rank's state dict names other tensors than the first version "
                               "of this publisher (added: ['b'], missing: [])"), r
        assert "added: ['b']" in r[2]
    assert await _head(board, "added") == 1


def test_plan_refuses_ranks_at_different_steps_naming_them() -> None:
    def header(rank: int, step: int | None) -> RankHeader:
        box = ((2 * rank, 0), (2, 4))
        return RankHeader(rank, 3, 7, (TensorEntry("w", "bfloat16", (6, 4), box),), step)

    assert plan_slices([header(0, 5), header(1, 5), header(2, 5)]).tensors[0].owner == 0
    assert plan_slices([header(0, None), header(1, None), header(2, None)])  # the setup headers
    with pytest.raises(InvalidArgument, match=r"training step of version 7: step 5 on rank\(s\) \[0, 2\]; "
                                              r"step 4 on rank\(s\) \[1\]"):
        plan_slices([header(0, 5), header(1, 4), header(2, 5)])
