"""A child process of the chaos bench: started, killed with a real signal, restarted, measured.

Invariants:
- One incarnation at a time; ``start`` after the previous one exited makes the next (the log
  file is appended to, each incarnation's lines after a header naming it).
- Every child runs in a session of its own and, where util-linux's ``setpriv`` is installed, is
  killed by Linux when the bench dies (``--pdeathsig KILL``), so a crashed bench leaves no servers
  behind.
- No Python runs in a child between fork and exec (no ``preexec_fn``): in a process with gRPC
  threads, that runs gRPC's after-fork handlers in the child, whose event engine then dies
  (SIGSEGV or SIGABRT: ``epoll_wait ... Bad file descriptor``) when the descriptors are closed
  before exec, and the child is gone before it started.
- ``kill`` sends the signal to the process itself (SIGKILL: no clean-up runs in the child).
- ``proc_figures`` reads RSS and open descriptors from /proc; a process gone meanwhile gives None.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from weftboard.board.embedded import with_parent_death_signal


@dataclass(frozen=True)
class ProcFigures:
    rss_bytes: int
    fds: int


def proc_figures(pid: int) -> ProcFigures | None:
    """RSS (VmRSS) and the number of open file descriptors of a live process."""
    try:
        rss = 0
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                    break
        return ProcFigures(rss, len(os.listdir(f"/proc/{pid}/fd")))
    except (OSError, ValueError):
        return None


class ChildProcess:
    """``argv()`` as a child; stdout lines go to ``on_line`` (and the log), stderr to the log."""

    def __init__(self, name: str, argv: Callable[[], Sequence[str]], log_path: Path, *,
                 env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self._argv = argv
        self.log_path = log_path
        self._env = env
        self._on_line = on_line
        self._cwd = cwd
        self.proc: asyncio.subprocess.Process | None = None
        self.incarnation = 0
        self.started_at = 0.0  # time.monotonic() of the current incarnation's start
        self._reader: asyncio.Task | None = None
        self.expected_exit = False  # set by kill/stop: an exit the bench caused
        self.starting = False  # between start() and the process existing

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def returncode(self) -> int | None:
        """The last incarnation's exit code (negative: the signal that ended it)."""
        return self.proc.returncode if self.proc is not None else None

    async def start(self) -> None:
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.incarnation += 1
        self.expected_exit = False
        self.starting = True
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self._env or {})
        try:
            with open(self.log_path, "ab") as log:
                log.write(f"\n==== {self.name} incarnation {self.incarnation} at {time.time():.3f} ====\n".encode())
                log.flush()
                self.proc = await asyncio.create_subprocess_exec(
                    *with_parent_death_signal(self._argv(), "KILL"), stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE if self._on_line else log, stderr=log, env=env,
                    cwd=self._cwd, start_new_session=True)
        finally:
            self.starting = False
        self.started_at = time.monotonic()
        if self._on_line is not None:
            self._reader = asyncio.ensure_future(self._read(self.proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None and self._on_line is not None
        with open(self.log_path, "ab") as log:
            async for raw in proc.stdout:
                log.write(raw)
                log.flush()
                self._on_line(raw.decode(errors="replace").rstrip("\n"))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the live incarnation (an exit the bench expects)."""
        if self.alive():
            self.expected_exit = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)  # type: ignore[union-attr]

    async def wait(self, timeout_s: float | None = None) -> int | None:
        if self.proc is None:
            return None
        code = await asyncio.wait_for(self.proc.wait(), timeout_s)
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 5)
            self._reader = None
        return code

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if not self.alive():
            return await self.wait()
        self.kill(signal.SIGTERM)
        try:
            return await self.wait(grace_s)
        except asyncio.TimeoutError:
            self.kill(signal.SIGKILL)
            return await self.wait(10)

    def figures(self) -> ProcFigures | None:
        return proc_figures(self.proc.pid) if self.alive() else None  # type: ignore[union-attr]

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
