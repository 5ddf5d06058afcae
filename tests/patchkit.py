"""Helpers for tests of the patch container."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import xxhash


def with_header(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """``data`` with its weftboard header changed in place by ``edit`` and the header's
    checksum made consistent again, so only the rule a test aims at can refuse the patch."""
    (hlen,) = struct.unpack("<Q", data[:8])
    st_header = json.loads(data[8 : 8 + hlen])
    header = json.loads(st_header["__metadata__"]["weftboard"])
    edit(header)
    text = json.dumps(header)
    st_header["__metadata__"] = {"weftboard": text, "weftboard_xxh3_64": xxhash.xxh3_64_hexdigest(text.encode())}
    blob = json.dumps(st_header).encode()
    return struct.pack("<Q", len(blob)) + blob + data[8 + hlen :]
