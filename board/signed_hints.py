"""Staged-part hints with a presigned GET URL of their part, for the watchers that asked for one
(islands without blob-store credentials): one URL a part for all such watchers of this board.

Invariants:
- A signed hint names the same part as the feed's hint; its URL is "" where the blob store
  cannot presign.
- A part's URL is made once and handed out for ``reuse_s`` (far below its lifetime,
  ``expires_s``, so every watcher gets a URL valid for ``expires_s - reuse_s`` at least);
  the latest ``max_kept`` hints are kept, so the signing work per version does not grow with the
  number of watchers.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from weftboard.proto.v1 import board_pb2 as pb


class SignedHints:
    def __init__(self, blobs: Any, expires_s: int, *, reuse_s: float = 60.0, max_kept: int = 1024) -> None:
        if not 0 < reuse_s < expires_s:
            raise ValueError(f"a signed hint is reused for less than its URL lives: 0 < {reuse_s} < {expires_s}")
        self.blobs = blobs
        self.expires_s = expires_s
        self.reuse_s = reuse_s
        self.max_kept = max_kept
        self._kept: collections.OrderedDict[bytes, tuple[float, asyncio.Future[bytes]]] = collections.OrderedDict()

    async def event(self, payload: bytes) -> bytes:
        """The serialized WatchEvent of the feed's hint ``payload``, its part's URL filled in;
        watchers asking at once share one signing (a cancelled watcher does not cancel it, a
        failed one is not kept)."""
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
        event.staged.blob.url = await self.blobs.presign_get(event.staged.blob.key, self.expires_s) or ""
        return event.SerializeToString()
