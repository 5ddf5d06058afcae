"""Names, digests and blob keys: the identifiers every other part of weftboard checks the same way.

Invariants:
- A run or island name matches ``NAME_PATTERN`` whole (no trailing newline slips through).
- A digest is ``xxh3-128:<32 lowercase hex>``.
- Blob keys are content addressed (``<run>/blobs/<hex>``), so an upload retried after a
  crash overwrites a blob with the very same bytes.
"""

from __future__ import annotations

import re

from weftboard.proto.errors import InvalidArgument

# Matched whole (fullmatch): "$" would also accept a name ending in a newline.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DIGEST_ALGORITHM = "xxh3-128"
_DIGEST_PATTERN = re.compile(r"xxh3-128:[0-9a-f]{32}")


def check_name(field: str, value: str) -> str:
    """Validate a run or island name; the message names the field so a caller can fix it."""
    if not NAME_PATTERN.fullmatch(value or ""):
        raise InvalidArgument(
            f"{field} {value!r} is not a valid name: 1-64 characters of [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return value


def format_digest(raw: bytes) -> str:
    if len(raw) != 16:
        raise ValueError(f"an xxh3-128 digest has 16 bytes, got {len(raw)}")
    return f"{DIGEST_ALGORITHM}:{raw.hex()}"


def check_digest(field: str, value: str) -> str:
    if not _DIGEST_PATTERN.fullmatch(value or ""):
        raise InvalidArgument(f"{field} {value!r} is not a digest of the form 'xxh3-128:<32 lowercase hex>'")
    return value


def blobs_prefix(run: str) -> str:
    """The prefix of every content-addressed key of ``run`` (``blob_key``)."""
    check_name("run", run)
    return f"{run}/blobs/"


def blob_key(run: str, digest: str) -> str:
    """Content-addressed key of a blob of ``run`` whose bytes hash to ``digest``."""
    check_name("run", run)
    check_digest("digest", digest)
    return f"{run}/blobs/{digest.split(':', 1)[1]}"
