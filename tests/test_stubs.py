"""The committed gRPC stubs match proto/weftboard/v1/*.proto (regenerate with python -m weftboard.proto.generate)."""

from __future__ import annotations

import subprocess
import sys


def test_stubs_are_not_stale():
    result = subprocess.run(
        [sys.executable, "-m", "weftboard.proto.generate", "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "up to date" in result.stdout
