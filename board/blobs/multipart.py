"""The part layout of a multipart upload, shared by the board, its blob stores and uploaders.

A blob of ``size`` bytes goes up in parts of ``part_bytes``: part n (1, 2, ...) holds bytes
``[(n-1)*part_bytes, n*part_bytes)``, the last one the rest. The limits are S3's, applied to
every store so an upload that works on one works on all: parts of 5 MiB to 5 GiB (the last
may be smaller), at most 10,000 of them, a blob of at most 5 TiB.

Invariants:
- ``part_count`` is the one check of a layout: it refuses (``InvalidArgument``) a part size
  out of range, an empty blob and a layout of too many parts, naming the limit.
- ``check_completed`` accepts only every part number once, in order, each with an ETag.
"""

from __future__ import annotations

from collections.abc import Sequence

from weftboard.proto.errors import FailedPrecondition, InvalidArgument

MIN_PART_BYTES = 5 << 20
MAX_PART_BYTES = 5 << 30
MAX_PARTS = 10_000
MAX_BLOB_BYTES = 5 << 40
# The publisher's default: large enough that a 5 GiB anchor shard is 20 requests, small
# enough that a retried part costs little.
DEFAULT_PART_BYTES = 256 << 20


def check_part_bytes(part_bytes: int) -> int:
    """``part_bytes`` if parts of that size are within the limits, else ``InvalidArgument``."""
    if not MIN_PART_BYTES <= part_bytes <= MAX_PART_BYTES:
        raise InvalidArgument(f"part_bytes {part_bytes} is out of range: parts hold {MIN_PART_BYTES} "
                              f"(5 MiB) to {MAX_PART_BYTES} (5 GiB) bytes")
    return part_bytes


def part_count(size: int, part_bytes: int) -> int:
    """How many parts a ``size``-byte blob takes; ``InvalidArgument`` for a layout out of limits."""
    check_part_bytes(part_bytes)
    if size <= 0:
        raise InvalidArgument("size must be positive: an empty blob needs no multipart upload")
    if size > MAX_BLOB_BYTES:
        raise InvalidArgument(f"size {size} is over the {MAX_BLOB_BYTES} bytes (5 TiB) a blob may hold")
    count = -(-size // part_bytes)
    if count > MAX_PARTS:
        raise InvalidArgument(f"{size} bytes in parts of {part_bytes} make {count} parts; at most {MAX_PARTS}: "
                              f"use parts of at least {-(-size // MAX_PARTS)} bytes")
    return count


def part_span(size: int, part_bytes: int, part_number: int) -> tuple[int, int]:
    """``(offset, length)`` of part ``part_number`` in the blob; ``InvalidArgument`` outside it."""
    count = part_count(size, part_bytes)
    if not 1 <= part_number <= count:
        raise InvalidArgument(f"part number {part_number} is outside the upload's parts 1..{count}")
    offset = (part_number - 1) * part_bytes
    return offset, min(part_bytes, size - offset)


def bare_etag(etag: str) -> str:
    """An ETag without the quotes HTTP puts around it."""
    return etag.strip().strip('"')


def check_completed(parts: Sequence[tuple[int, str]], count: int | None = None) -> list[str]:
    """The ETags (bare) of ``(part_number, etag)`` pairs that name parts 1..n once each, in
    order (n = ``count`` when the caller knows it); ``FailedPrecondition`` otherwise."""
    if not parts:
        raise FailedPrecondition("a multipart upload completes with its parts; none were named")
    etags = []
    for index, (number, etag) in enumerate(parts, start=1):
        if number != index:
            raise FailedPrecondition(f"parts must be named in order 1, 2, ...: part {index} is named as {number}")
        if not bare_etag(etag):
            raise FailedPrecondition(f"part {number} carries no ETag: name the ETag its PUT answered")
        etags.append(bare_etag(etag))
    if count is not None and len(etags) != count:
        raise FailedPrecondition(f"the upload has {count} parts; {len(etags)} were named")
    return etags
