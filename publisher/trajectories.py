"""The trainer's side of the trajectory stream: consume, filter by staleness, acknowledge.

Islands report one record per request (version at start/end, tokens, log-prob summary,
latency, labels). A trainer reads them with a consumer group: each record reaches one
consumer of the group once, until acknowledged; another group sees every record again.

Invariants:
- Staleness is the board's (head at delivery minus the version the request started on).
  With ``max_staleness`` set, staler records are acknowledged and dropped by the board and
  counted in ``dropped_stale``; they are never yielded.
- Nothing is acknowledged implicitly: the caller acks what it has used (``ack``), so a
  trainer that dies mid-batch gets the unacknowledged records again
  (``redeliver_after_ms``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weftboard.board.channel import TlsConfig, client_tls
from weftboard.board.client import BoardClient
from weftboard.proto.v1 import board_pb2 as pb


@dataclass(frozen=True)
class Trajectory:
    """One delivered record: ``id`` for ``ack``, the record, and its staleness at delivery."""

    id: str
    record: pb.TrajectoryRecord
    staleness: int

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def version(self) -> int:
        return self.record.version

    @property
    def version_end(self) -> int:
        return self.record.version_end or self.record.version

    @property
    def labels(self) -> Mapping[str, str]:
        return self.record.labels

    @property
    def reward(self) -> float | None:
        return self.record.reward if self.record.HasField("reward") else None


class TrajectoryConsumer:
    """``async for t in TrajectoryConsumer(client, run, group, consumer): ...`` (runs forever),
    or ``await consumer.poll()`` for one batch."""

    def __init__(
        self,
        client: Any,
        run: str,
        group: str,
        consumer: str,
        *,
        max_staleness: int | None = None,
        max_records: int = 1000,
        block_ms: int = 1000,
        redeliver_after_ms: int = 0,
    ) -> None:
        self.client = client
        self.run = run
        self.group = group
        self.consumer = consumer
        self.max_staleness = max_staleness
        self.max_records = max_records
        self.block_ms = block_ms
        self.redeliver_after_ms = redeliver_after_ms
        self.head = 0
        self.delivered = 0
        self.dropped_stale = 0
        self.acked = 0

    async def poll(self, *, max_records: int | None = None, block_ms: int | None = None) -> list[Trajectory]:
        """One read: up to ``max_records``, waiting up to ``block_ms`` when none are there."""
        response = await self.client.consume_trajectories(
            self.run,
            self.group,
            self.consumer,
            max_records=max_records or self.max_records,
            block_ms=self.block_ms if block_ms is None else block_ms,
            max_staleness=self.max_staleness,
            redeliver_after_ms=self.redeliver_after_ms,
        )
        self.head = max(self.head, response.head)
        self.dropped_stale += response.dropped_stale
        out = [Trajectory(c.id, c.record, int(c.staleness)) for c in response.records]
        self.delivered += len(out)
        return out

    async def ack(self, ids: Iterable[str] | Iterable[Trajectory]) -> int:
        keys = [i.id if isinstance(i, Trajectory) else str(i) for i in ids]
        if not keys:
            return 0
        response = await self.client.ack_trajectories(self.run, self.group, keys)
        self.acked += response.acked
        return response.acked

    def __aiter__(self) -> AsyncIterator[Trajectory]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Trajectory]:
        while True:
            for item in await self.poll():
                yield item


class SyncTrajectoryConsumer:
    """The same for a synchronous training loop: its own event loop on a background thread
    and its own board connection (``address``, ``token``, and the TLS options of
    ``BoardClient``: ``tls``, ``tls_ca``, ``tls_cert``, ``tls_key``, ``server_name``).

    A ``poll`` waits as long as its RPC may run (``timeout_s + block_ms / 1000`` per board
    address tried, plus ``WAIT_MARGIN_S``), never less: a poll given up while its call still
    runs would leave the records that call receives pending, unseen until redelivered. A wait
    that does run out cancels the call."""

    WAIT_MARGIN_S = 5.0

    def __init__(self, address: str, run: str, group: str, consumer: str, *, token: str | None = None,
                 timeout_s: float = 10.0, tls: TlsConfig | bool | None = None, tls_ca: str | Path | None = None,
                 tls_cert: str | Path | None = None, tls_key: str | Path | None = None,
                 server_name: str | None = None, **options: Any) -> None:
        # read the TLS files before the thread starts: a missing one fails here, named
        tls_config = client_tls(tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, server_name=server_name)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weftboard-trajectories", daemon=True)
        self._thread.start()

        async def make() -> TrajectoryConsumer:
            client = BoardClient(address, token, tls=tls_config, timeout_s=timeout_s)
            return TrajectoryConsumer(client, run, group, consumer, **options)

        self.consumer: TrajectoryConsumer = self._call(make())

    def _call(self, coro: Any, timeout: float | None = 60.0) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()  # do not leave the call running unwatched
            raise

    def _rpc_wait_s(self, block_ms: int = 0) -> float:
        """How long to wait for one call that blocks up to ``block_ms`` on the board: its own
        deadline (``BoardClient.timeout_s`` plus the block) for each address it may try, plus
        the margin."""
        client = self.consumer.client
        attempts = max(len(getattr(client, "addresses", ())), 1)
        return attempts * (client.timeout_s + block_ms / 1000.0) + self.WAIT_MARGIN_S

    def poll(self, **kwargs: Any) -> list[Trajectory]:
        block_ms = kwargs.get("block_ms")
        wait_s = self._rpc_wait_s(self.consumer.block_ms if block_ms is None else block_ms)
        return self._call(self.consumer.poll(**kwargs), wait_s)

    def ack(self, ids: Iterable[str] | Iterable[Trajectory]) -> int:
        return self._call(self.consumer.ack(list(ids)), self._rpc_wait_s())

    def __iter__(self) -> Iterator[Trajectory]:
        while True:
            yield from self.poll()

    def close(self) -> None:
        try:
            self._call(self.consumer.client.close(), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> SyncTrajectoryConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
