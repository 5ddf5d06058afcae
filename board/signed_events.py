"""Watch events with a presigned GET URL of every blob they name, for the watchers that asked
for them (islands without blob-store credentials): a staged-part hint's part, and a committed
version's blobs, so such an island takes the common one-patch step without asking the board for
a plan. One signing an event for all such watchers of this board.

Invariants:
- A signed event is the feed's event with only the ``url`` of its blobs filled in ("" where
  the blob store cannot presign).
- An event's URLs are made once and handed out for ``reuse_s`` (far below their lifetime,
  ``expires_s``, so every watcher gets URLs valid for ``expires_s - reuse_s`` at least); the
  latest ``max_kept`` events are kept (64: a few versions' hints and records; a record of many
  tensors is tens of KB, kept twice), so the signing work per version does not grow with the
  number of watchers.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from weftboard.proto.v1 import board_pb2 as pb


class SignedEvents:
    def __init__(self, blobs: Any, expires_s: int, *, reuse_s: float = 60.0, max_kept: int = 64) -> None:
        if not 0 < reuse_s < expires_s:
            raise ValueError(f"a signed event is reused for less than its URLs live: 0 < {reuse_s} < {expires_s}")
        self.blobs = blobs
        self.expires_s = expires_s
        self.reuse_s = reuse_s
        self.max_kept = max_kept
        self._kept: collections.OrderedDict[bytes, tuple[float, asyncio.Future[bytes]]] = collections.OrderedDict()

    async def event(self, payload: bytes) -> bytes:
        """The feed's serialized WatchEvent ``payload`` with its blobs' URLs filled in; watchers
        asking at once share one signing (a cancelled watcher does not cancel it, a failed one is
        not kept)."""
        now = time.monotonic()
        kept = self._kept.get(payload)
        if kept is None or now - kept[0] >= self.reuse_s:
            signing = asyncio.ensure_future(self._sign(payload))
            signing.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if none waits
            kept = (now, signing)
            self._kept[payload] = kept
            self._kept.move_to_end(payload)
            while len(self._kept) > self.max_kept:
                self._kept.popitem(last=False)
        try:
            return await asyncio.shield(kept[1])
        except Exception:
            if self._kept.get(payload) is kept:
                del self._kept[payload]  # the next watcher signs anew
            raise

    async def _sign(self, payload: bytes) -> bytes:
        event = pb.WatchEvent.FromString(payload)
        kind = event.WhichOneof("event")
        refs = ([event.staged.blob] if kind == "staged"
                else [b for a in event.version.artifacts for b in a.blobs] if kind == "version" else [])
        urls = await asyncio.gather(*(self.blobs.presign_get(ref.key, self.expires_s) for ref in refs))
        for ref, url in zip(refs, urls, strict=True):
            ref.url = url or ""
        return event.SerializeToString()
