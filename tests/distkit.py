"""Jobs on real process groups in tests: each rank a process of its own (``torch.multiprocessing``,
gloo on CPU), one deadline for all of them, and no rank left running once a test is over."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(fn: Callable[..., None], world: int, args: tuple[Any, ...], *, deadline_s: float,
              describe: Callable[[], str] | None = None) -> list[int | None]:
    """``fn(rank, *args)`` on ``world`` processes; their exit codes. A rank still running after
    ``deadline_s`` (all ranks together) is killed and the test fails naming it (and what
    ``describe`` says of the job)."""
    ctx = mp.spawn(fn, args=args, nprocs=world, join=False)
    end = time.monotonic() + deadline_s
    for p in ctx.processes:
        p.join(max(0.1, end - time.monotonic()))
    hung = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
    for rank in hung:
        ctx.processes[rank].kill()
        ctx.processes[rank].join(10)
    assert not hung, (f"job of {world} ranks: rank(s) {hung} still running after {deadline_s:.0f}s (killed)"
                      + (f"; {describe()}" if describe is not None else ""))
    return [p.exitcode for p in ctx.processes]
