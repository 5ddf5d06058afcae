"""An island's own process (``weftboard subscribe``, ``weftboard sidecar``) tunes its garbage
collector as ``weftboard serve`` does (``board/process.py`` ``tune_gc_for_serving``): its
startup heap frozen out of the generations, young objects collected less often, before its
event loop starts. Each command runs in a subprocess (it changes the interpreter's collector),
with the island's start replaced by a report of the collector's state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from weftboard.board.process import SERVING_GC_THRESHOLDS

_RUN_COMMAND = """
import gc, json, sys
from weftboard.subscriber import engine_island, local_follower
from weftboard.board.cli import main
from weftboard.proto.errors import Unavailable

def report():
    print(json.dumps([gc.get_freeze_count(), list(gc.get_threshold())]), flush=True)

async def follow(cfg):
    report()
    return 0

async def start_island(**kwargs):
    report()
    raise Unavailable("no board in this test")

local_follower.run_local_follower = follow  # where the commands import them when they run
engine_island.start_island = start_island
sys.argv = ["weftboard", *json.loads(sys.argv[1])]
main()
"""


@pytest.mark.parametrize("command", ["subscribe", "sidecar"])
def test_an_island_command_freezes_its_heap_before_it_starts(command: str, tmp_path: Path) -> None:
    args = [command, "--board", "127.0.0.1:1", "--run", "r", "--dir", str(tmp_path / "island")]
    if command == "sidecar":
        args += ["--listen", "127.0.0.1:0"]
    done = subprocess.run([sys.executable, "-c", _RUN_COMMAND, json.dumps(args)], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip(), done.stderr[-2000:]
    frozen, threshold = json.loads(done.stdout.splitlines()[0])
    assert frozen > 10_000  # the imported modules' objects are out of the generations
    assert threshold == list(SERVING_GC_THRESHOLDS) and threshold[0] > 700
    assert done.returncode == (0 if command == "subscribe" else 1), done.stderr[-2000:]
