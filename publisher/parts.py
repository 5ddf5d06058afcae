"""Cutting a version's patch into parts while its streams are finished, so islands can start
downloading before the version commits.

A patch's streams are finished one tensor at a time (``FinishAhead``: each right after the
read folded it); waiting for the last one and the root digest before uploading anything
leaves a far island idle for all of that time.
A ``PartCutter`` collects finished streams and, once they hold ``part_bytes`` of streams, makes
them one part (a patch container with an empty root, ``weftboard.cuda.codec``) and hands it to
``ship`` (upload, then ``StagePart`` on the board), which returns at once with a future of the
part's ``BlobRef``; the streams left at the end go out the same way (``flush``). The version's
commit names these parts, plus one last part (with the root) when some tensors were not staged:
those the read could not encode itself (their deltas are encoded later), or none were changed.

Invariants:
- Parts hold disjoint tensors, in the order their streams were finished; a tensor's stream is
  in exactly one part of the committed patch.
- Cutting never waits for an upload: the caller (the publisher's read thread) only assembles.
- A staged part is a hint until the commit names it: a version merged into a later one
  (``on_backpressure="skip"``) commits other parts and leaves its staged ones unused.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from weftboard.cuda.codec import assemble_patch
from weftboard.cuda.jit import serial_kernels
from weftboard.proto.errors import InvalidArgument

Ship = Callable[[bytes], "concurrent.futures.Future[Any]"]

# Parts only where they pay: shipping parts during the finish slows the finish on a host whose
# cores the trainer keeps busy, which near islands pay for and far ones gain from (figures in
# cuda/PERFORMANCE.md and ``weftboard bench sync --wan``). So a publisher stages parts while an
# island asks for them (islands do when their blob store is far) and ships one blob otherwise.
# The size: each part costs one upload, one StagePart and one download per island, so a part
# is a few hundred kB, small against a patch but long against a part's fixed costs.
SUGGESTED_PART_BYTES = 384 << 10


def staged_names(parts: list[tuple[list[str], Any]]) -> set[str]:
    """Names of the tensors in shipped parts (``PartCutter.parts``)."""
    return {name for names, _ in parts for name in names}


class PartCutter:
    def __init__(self, version: int, encoding: str, part_bytes: int, ship: Ship) -> None:
        if part_bytes <= 0:
            raise InvalidArgument(f"part_bytes must be > 0, got {part_bytes}")
        self.version = version
        self.encoding = encoding
        self.part_bytes = part_bytes
        self.ship = ship
        self.parts: list[tuple[list[str], concurrent.futures.Future]] = []  # (tensor names, future BlobRef)
        self._pending: list[Any] = []
        self._pending_bytes = 0

    def add(self, encoded: Any) -> None:
        """One finished tensor stream (``EncodedTensor``); ships a part once enough are here."""
        self._pending.append(encoded)
        self._pending_bytes += int(encoded.stream.nbytes)
        if self._pending_bytes >= self.part_bytes:
            self._cut()

    def flush(self) -> None:
        """Ship what is collected (the read's last streams) as one more part."""
        if self._pending_bytes:
            self._cut()

    def _cut(self) -> None:
        data = assemble_patch(self._pending, base_version=self.version - 1, target_version=self.version,
                              target_root="", encoding=self.encoding).data
        self.parts.append(([e.name for e in self._pending], self.ship(data)))
        self._pending, self._pending_bytes = [], 0


class FinishAhead:
    """Finishes a read's scanned tensors as the read folds them, handing each stream to
    ``cutter``: the first parts ship during the read, not after it (a far island's download
    starts that much sooner). The encode runs on the read thread right after the tensor's
    fold, on serial kernels like the finish's. The read then shares the host with the
    uploads (on the bench's host also with the islands and the simulated links), so the
    trainer waits longer for it (``cuda/PERFORMANCE.md``); ``parts_during_read=False`` on the
    ``Publisher`` finishes after the read instead.

    ``encode(name, scans)`` gives a tensor's stream, or None when its scans make none (the
    finish then recovers its delta from the view). Invariants: every tensor handed in is
    encoded exactly once, in the order handed in; a failed encode raises in ``add``, which
    fails the read.
    """

    def __init__(self, cutter: PartCutter, encode: Callable[[str, Any], Any]) -> None:
        self.cutter = cutter
        self._encode = encode
        self._streams: dict[str, Any] = {}

    def add(self, name: str, scans: Any) -> None:
        """A tensor the read just folded into its scans (called on the read thread)."""
        with serial_kernels():  # the trainer's step runs beside the read (see jit.serial_kernels)
            encoded = self._streams[name] = self._encode(name, scans)
        if encoded is not None:
            self.cutter.add(encoded)

    def streams(self) -> dict[str, Any]:
        """Each tensor's stream (or None), in the order they were finished."""
        return dict(self._streams)
