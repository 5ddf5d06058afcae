"""Run a ``python -m ...`` command line with every checkpoint directory hanging inside an apply.

Used as an ``IslandSpec.prefix`` (``prefix(version, seconds)``): the island's command becomes
``python tests/hang_in_apply.py VERSION SECONDS python -m weftboard.board.cli subscribe ...``.
Each ``CheckpointDirDestination`` built in that process sleeps SECONDS once VERSION is written
and verified aside, before it is swapped in (its ``before_swap`` hook), so a test can kill the
island there. The product reads no test hook of its own.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination


def prefix(version: int, seconds: float) -> tuple[str, ...]:
    return (sys.executable, str(Path(__file__).resolve()), str(version), str(seconds))


def main() -> None:
    version, seconds, command = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    if command[1:2] != ["-m"]:
        raise SystemExit(f"expected 'python -m module ...' after the hang, got {command}")

    def hang(tmp: Path) -> None:
        if tmp.name.startswith(f".tmp-v{version}-"):
            print(f"hang_in_apply: holding version {version} before its swap for {seconds}s", file=sys.stderr, flush=True)
            time.sleep(seconds)

    build = CheckpointDirDestination.__init__

    def build_hanging(self: CheckpointDirDestination, *args: object, **kwargs: object) -> None:
        build(self, *args, **kwargs)  # type: ignore[arg-type]
        self.before_swap = hang

    CheckpointDirDestination.__init__ = build_hanging  # type: ignore[method-assign]
    sys.argv = [command[2], *command[3:]]
    runpy.run_module(command[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
