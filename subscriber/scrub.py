"""The island's scrub: what it serves is re-hashed against its version's record, and a version
found damaged (memory or disk gone bad under it) is quarantined and fetched again.

``Scrubber.run`` scrubs once the island holds a version, then every ``interval_s`` (0: never).
A scrub (``scrub_once``) takes the held version's tensor digests and root from the board (the
record is the authority, not anything on the island) and has the destination re-hash every
held tensor (``Scrubbable.verify_held``, in a worker thread, under the destination's lock so
no apply runs meanwhile). A mismatch is logged as an error and the destination quarantines
the version (``Scrubbable.quarantine``): it holds no version any more (so the subscriber plans
from nothing), a checkpoint folder is moved under ``quarantine/``, an engine's island admits
no request and reports not ready with the reason; the subscriber heartbeats ERROR. Then
``recover`` has the subscriber catch up again (an anchor and the patches after it), which makes
the island serve, bitwise, again.

Invariants:
- A damaged version is never served once a scrub found it: quarantine happens before
  ``scrub_once`` returns.
- A scrub never quarantines a version the destination no longer holds (it moved on meanwhile:
  the next scrub checks the new one).
- A scrub that cannot ask the board (away, the version collected) changes nothing and says so.
"""

from __future__ import annotations

import asyncio

import structlog

from weftboard.proto.errors import CorruptData, WeftboardError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.subscriber.destination import Scrubbable, TensorEntry, VersionTarget
from weftboard.subscriber.subscriber import Subscriber

log = structlog.get_logger("weftboard.subscriber")

DEFAULT_SCRUB_INTERVAL_S = 3600.0


class Scrubber:
    """Scrubs the versions ``subscriber``'s destination holds (see the module docstring)."""

    def __init__(self, subscriber: Subscriber, *, interval_s: float = DEFAULT_SCRUB_INTERVAL_S) -> None:
        self.subscriber = subscriber
        self.destination: Scrubbable = subscriber.destination  # type: ignore[assignment]
        self.interval_s = interval_s

    async def target(self, version: int) -> VersionTarget:
        """What ``version`` must hash to, from the board (its record and the run's layout)."""
        client, run = self.subscriber.client, self.subscriber.run_name
        record = await client.get_version(run, version)
        layout = (await client.get_run(run)).layout
        return VersionTarget(
            version=version,
            root_digest=record.root_digest,
            tensor_digests={d.name: d.digest for d in record.tensor_digests},
            layout=[TensorEntry(t.name, t.dtype, tuple(t.shape)) for t in layout.tensors],
            labels=dict(record.labels),
        )

    async def scrub_once(self) -> int | None:
        """Re-verify the held version; the version quarantined, or None (intact, nothing held,
        or the board could not say what it must hash to)."""
        version = self.destination.held_version()
        if version == 0:
            return None
        try:
            target = await self.target(version)
        except (WeftboardError, OSError) as exc:  # the board away, or the version collected (OutOfRange)
            log.warning("cannot scrub: the board does not say what the held version must hash to",
                        island=self.subscriber.island_id, version=version, error=f"{type(exc).__name__}: {exc}")
            return None
        try:
            await self.destination.verify_held(target)  # False: it moved on; the next scrub checks that
            return None
        except CorruptData as exc:
            reason = f"{type(exc).__name__}: {exc}"
        log.error("scrub found the served version damaged; quarantining it and fetching it again",
                  island=self.subscriber.island_id, run=self.subscriber.run_name, version=version, error=reason)
        if not await self.destination.quarantine(version, reason):
            return None  # it moved on meanwhile: the next scrub checks what it holds then
        self.subscriber.state = pb.ISLAND_STATE_ERROR
        self.subscriber.message = f"version {version} quarantined by the scrub: {reason}"
        await self.subscriber.heartbeat()
        return version

    async def recover(self) -> int:
        """Catch up again after a quarantine (from nothing: an anchor and the patches after
        it); the version held after."""
        return await self.subscriber.sync_to()

    async def run(self) -> None:
        """Scrub once the island holds a version, then every ``interval_s``, repairing what it
        finds, until cancelled; nothing when ``interval_s`` is 0."""
        if self.interval_s <= 0:
            return
        await self.subscriber.wait_for_version(1)
        while True:
            try:
                if await self.scrub_once() is not None:
                    await self.recover()
            except (WeftboardError, OSError) as exc:  # the follow loop keeps catching up meanwhile
                log.error("scrubbing or fetching a quarantined version again failed; trying at the next scrub",
                          island=self.subscriber.island_id, error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(self.interval_s)
