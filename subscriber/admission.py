"""The island's admission gate and the version state the sidecar decides on.

``VersionState`` is what the sidecar knows: the version the engine serves (``held``),
the board's head, whether the island has caught up once, its last error, and whether its
weights are withdrawn (``withdrawn``: no verified version, nothing is admitted). Waiters
are woken on every change.

``AdmissionGate`` keeps requests and weight activations apart:
- a request is admitted with a ticket and holds it until its response is complete;
- an activation closes the gate to new requests, then waits for the requests that may
  not run across a change: all of them in ``drain`` mode, only exact-version ones in
  ``in_place`` mode (others keep running and continue on the new weights);
- when the activation ends the gate reopens and held requests are admitted.

Invariants:
- No request is admitted while an activation is in progress, so ``version_start`` read
  at admission is the version the request started on.
- An exact-version request never overlaps an activation (it is drained or held).
- Activations are serialized.
- ``withdrawn`` is set only with ``held`` 0 (``withdraw``) and cleared only when a version is
  activated (``set_held``): an error alone (a failed activation that left the previous version
  in place) does not withdraw anything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from weftboard.proto.errors import DeadlineExceeded
from weftboard.subscriber.engines.base import ActivationMode, require_mode


class VersionState:
    """Held version, head, readiness and error of one island, with change notification."""

    def __init__(self) -> None:
        self.held = 0
        self.head = 0
        self.error: str | None = None
        self.withdrawn: str | None = None  # why the engine's weights are no verified version, else None
        self.withdrawals = 0  # how many times ``withdraw`` was called: a request spanning one sees it change
        self.caught_up_once = False
        self.activated_at: dict[int, float] = {}
        self._changed = asyncio.Condition()

    @property
    def ready(self) -> bool:
        """In rotation: caught up with the head at least once, activated, and not in error."""
        return self.caught_up_once and self.held > 0 and self.error is None

    async def _notify(self) -> None:
        if self.held > 0 and self.held >= self.head:
            self.caught_up_once = True
        async with self._changed:
            self._changed.notify_all()

    async def set_held(self, version: int) -> None:
        self.held = version
        self.withdrawn = None
        self.activated_at[version] = time.time()
        self.head = max(self.head, version)
        await self._notify()

    async def set_head(self, head: int) -> None:
        if head > self.head:
            self.head = head
            await self._notify()

    async def set_error(self, message: str | None) -> None:
        self.error = message
        await self._notify()

    async def withdraw(self, message: str) -> None:
        """The engine's weights are no verified version any more (the scrub found them damaged, or
        a failed activation left them unknown): nothing is admitted (``held`` 0, ``withdrawn``) and
        readiness says why, until a version is activated (``set_held``)."""
        self.held = 0
        self.error = self.withdrawn = message
        self.withdrawals += 1  # counted here, at once: a version activated right after cannot hide it
        await self._notify()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``predicate()`` holds or ``timeout_s`` passes; returns the predicate."""
        if predicate():
            return True
        if timeout_s <= 0:
            return False
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout_s)
        except TimeoutError:
            return predicate()
        return True


@dataclass
class Ticket:
    """One admitted request; ``release`` exactly once when its response is complete."""

    gate: AdmissionGate
    exact: bool
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gate._release(self)


class AdmissionGate:
    def __init__(self, mode: ActivationMode | str = ActivationMode.DRAIN) -> None:
        self.mode = require_mode(mode)
        self.inflight = 0
        self.inflight_exact = 0
        self._activating = False
        self._lock = asyncio.Lock()  # serializes activations
        self._cond = asyncio.Condition()
        self._wakers: set[asyncio.Task] = set()

    @property
    def activating(self) -> bool:
        return self._activating

    async def admit(self, *, exact: bool, timeout_s: float) -> Ticket:
        """Wait while an activation runs (bounded by ``timeout_s``), then take a ticket."""
        deadline = time.monotonic() + timeout_s
        async with self._cond:
            while self._activating:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded("the island was activating a new version for the whole request deadline")
                try:
                    await asyncio.wait_for(self._cond.wait(), remaining)
                except TimeoutError:
                    continue
            self.inflight += 1
            if exact:
                self.inflight_exact += 1
        return Ticket(self, exact)

    def _release(self, ticket: Ticket) -> None:
        self.inflight -= 1
        if ticket.exact:
            self.inflight_exact -= 1
        task = asyncio.get_running_loop().create_task(self._wake())
        self._wakers.add(task)  # keep a reference until it ran (the loop holds tasks weakly)
        task.add_done_callback(self._wakers.discard)

    async def _wake(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    def _must_wait(self) -> bool:
        if self.mode is ActivationMode.DRAIN:
            return self.inflight > 0
        return self.inflight_exact > 0

    @asynccontextmanager
    async def activation(self) -> AsyncIterator[None]:
        """Close the gate, wait for the requests that may not see a change, run the body, reopen."""
        async with self._lock:
            async with self._cond:
                self._activating = True
                try:
                    await self._cond.wait_for(lambda: not self._must_wait())
                except BaseException:
                    self._activating = False
                    self._cond.notify_all()
                    raise
            try:
                yield
            finally:
                async with self._cond:
                    self._activating = False
                    self._cond.notify_all()
