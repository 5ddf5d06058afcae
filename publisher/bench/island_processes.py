"""Island daemons as child processes, for the sync benchmark and end-to-end tests.

Each island is ``python -m weftboard.board.cli subscribe ... --events``; its stdout JSON
lines (``started``, ``applied``) are collected with their timestamps. The command line can
be prefixed (``ip netns exec NS`` for the WAN simulation) and the board / S3 addresses are
plain parameters, so a caller can point them at relays.

Invariants: a started island is always stopped by ``stop()`` (SIGTERM, then SIGKILL), and
``kill()`` delivers a real signal to the real process (crash tests use SIGKILL).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class IslandSpec:
    island_id: str
    dir: Path
    board: str
    run: str
    token: str | None = None
    s3_endpoint: str | None = None  # None: presigned URLs from the board
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_bucket: str | None = None
    s3_prefix: str = ""
    destination: str = "dir"
    prefix: Sequence[str] = ()  # e.g. ("ip", "netns", "exec", "wb-isl-1")
    env: dict[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()

    def command(self) -> list[str]:
        cmd = [*self.prefix, sys.executable, "-m", "weftboard.board.cli", "subscribe",
               "--board", self.board, "--run", self.run, "--dir", str(self.dir), "--island-id", self.island_id,
               "--destination", self.destination, "--events", "--no-progress", "--heartbeat-s", "1"]
        if self.s3_endpoint:
            cmd += ["--s3-endpoint", self.s3_endpoint]
            for flag, value in (("--s3-access-key", self.s3_access_key), ("--s3-secret-key", self.s3_secret_key),
                                ("--s3-bucket", self.s3_bucket), ("--s3-prefix", self.s3_prefix)):
                if value:  # unset: the command's default (no credentials: anonymous; the board's bucket)
                    cmd += [flag, value]
        return cmd + list(self.extra_args)


class IslandProcess:
    def __init__(self, spec: IslandSpec) -> None:
        self.spec = spec
        self.proc: asyncio.subprocess.Process | None = None
        self.events: list[dict[str, Any]] = []
        self._cond = asyncio.Condition()
        self._reader: asyncio.Task | None = None
        self.log_path = spec.dir.parent / f"{spec.island_id}.log"

    async def start(self) -> None:
        self.spec.dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if self.spec.token:
            env["WEFTBOARD_TOKEN"] = self.spec.token
        env.setdefault("WEFTBOARD_LOG_JSON", "true")
        env.update(self.spec.env)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = await asyncio.create_subprocess_exec(
                *self.spec.command(), stdout=asyncio.subprocess.PIPE, stderr=log, env=env,
                start_new_session=True,
            )
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            async with self._cond:
                self.events.append(event)
                self._cond.notify_all()
        async with self._cond:
            self._cond.notify_all()

    def applied(self) -> dict[int, float]:
        return {e["version"]: e["t"] for e in self.events if e.get("event") == "applied"}

    def applied_event(self, version: int) -> dict[str, Any]:
        """The island's ``applied`` event for ``version`` (its timings ride along), or {}."""
        return next((e for e in self.events if e.get("event") == "applied" and e["version"] == version), {})

    def held(self) -> int:
        versions = [e["version"] for e in self.events if e.get("event") == "applied"]
        started = [e.get("held", 0) for e in self.events if e.get("event") == "started"]
        return max(versions + started + [0])

    async def wait_event(self, predicate, timeout_s: float) -> dict[str, Any]:
        async def wait() -> dict[str, Any]:
            async with self._cond:
                while True:
                    for e in self.events:
                        if predicate(e):
                            return e
                    if self.proc is not None and self.proc.returncode is not None and self._reader and self._reader.done():
                        raise RuntimeError(f"island {self.spec.island_id} exited with {self.proc.returncode}; "
                                           f"log: {self.log_tail()}")
                    await self._cond.wait()

        try:
            return await asyncio.wait_for(wait(), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"island {self.spec.island_id}: no matching event in {timeout_s}s; log: {self.log_tail()}") from None

    async def wait_version(self, version: int, timeout_s: float = 60.0) -> None:
        await self.wait_event(lambda e: e.get("event") == "applied" and e["version"] >= version, timeout_s)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, sig)

    async def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.kill(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                self.kill(signal.SIGKILL)
                await self.proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        return self.proc.returncode
