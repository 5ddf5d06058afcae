"""A server that ``weftboard.board.embedded`` starts dies with the process that started it, even
when that process is SIGKILLed and runs no clean-up (Linux's parent-death signal, set by
util-linux's ``setpriv``, which then execs the server: no Python runs in the child between
fork and exec, where gRPC's after-fork handlers crashed a child now and then)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")

STARTER = """
import sys, time
from pathlib import Path
from weftboard.board.embedded import start_redis
redis = start_redis(Path(sys.argv[1]))
print(redis.process.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_started_redis_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    pid = 0
    try:
        assert starter.stdout is not None
        pid = int(starter.stdout.readline())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"redis-server" in f.read()  # setpriv became the server: the pid is the server's
        assert _alive(pid)
        starter.kill()  # SIGKILL: no atexit handler runs in the starter
        starter.wait(10)
        for _ in range(200):
            if not _alive(pid):
                break
            time.sleep(0.05)
        assert not _alive(pid), "the server outlived the process that started it"
    finally:
        starter.kill()
        starter.wait(10)
        if pid and _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
