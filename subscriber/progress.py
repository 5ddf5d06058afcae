"""Progress of long downloads and applies: a rich display on a terminal, log lines elsewhere.

The subscriber tells the reporter when a step starts (with the files it is downloading
into) and when it is applied; the reporter polls those files' sizes, so the transfer code
needs no callbacks. Nothing here affects what is applied: it only observes.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

log = structlog.get_logger("weftboard.subscriber")


def _size(paths: Sequence[Path]) -> int:
    total = 0
    for p in paths:
        for candidate in (p, p.with_name(p.name + ".part")):
            try:
                total += candidate.stat().st_size
                break
            except OSError:
                continue
    return total


class ProgressReporter:
    """``begin``/``end`` per plan step; ``rich`` when stderr is a terminal unless told otherwise."""

    def __init__(self, *, rich: bool | None = None, interval_s: float = 0.25, log_every_s: float = 5.0) -> None:
        self.use_rich = sys.stderr.isatty() if rich is None else rich
        self.interval_s = interval_s
        self.log_every_s = log_every_s
        self._tasks: dict[int, asyncio.Task] = {}
        self._progress: Progress | None = None
        if self.use_rich:
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                TimeRemainingColumn(), console=Console(stderr=True), transient=False,
            )
            self._progress.start()

    def begin(self, version: int, kind: str, total_bytes: int, paths: Sequence[Path]) -> None:
        task_id = self._progress.add_task(f"v{version} {kind}", total=total_bytes) if self._progress else None
        started = time.monotonic()

        async def poll() -> None:
            last_log = started
            while True:
                done = _size(paths)
                if self._progress is not None:
                    self._progress.update(task_id, completed=done)
                elif time.monotonic() - last_log >= self.log_every_s:
                    last_log = time.monotonic()
                    log.info("downloading", version=version, kind=kind, done_bytes=done, total_bytes=total_bytes,
                             percent=round(100 * done / total_bytes, 1) if total_bytes else 100.0)
                await asyncio.sleep(self.interval_s)

        self._tasks[version] = asyncio.ensure_future(poll())
        if self._progress is None and total_bytes >= 64 * 1024 * 1024:
            log.info("download started", version=version, kind=kind, total_bytes=total_bytes)

    def applying(self, version: int) -> None:
        if self._progress is not None:
            for task in self._progress.tasks:
                if task.description.startswith(f"v{version} ") and not task.description.endswith("applying"):
                    self._progress.update(task.id, completed=task.total, description=f"{task.description} applying")

    def end(self, version: int) -> None:
        task = self._tasks.pop(version, None)
        if task is not None:
            task.cancel()
        if self._progress is not None:
            for t in self._progress.tasks:
                if t.description.startswith(f"v{version} "):
                    self._progress.update(t.id, completed=t.total, description=f"v{version} applied")

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        if self._progress is not None:
            self._progress.stop()
