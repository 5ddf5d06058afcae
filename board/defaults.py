"""Default locations and addresses shared by the board's settings and CLI.

Dependency-free on purpose: the CLI imports it at start-up, and ``weftboard --help`` must
not pay for pydantic, grpc or the S3 client.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_LISTEN = "127.0.0.1:7420"
ADMIN_TOKEN_FILE = "admin-token"


def default_data_dir() -> Path:
    """``$WEFTBOARD_DATA_DIR``, else ``$XDG_DATA_HOME/weftboard`` (``~/.local/share/weftboard``)."""
    explicit = os.environ.get("WEFTBOARD_DATA_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "weftboard"
