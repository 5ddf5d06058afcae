"""A board whose Redis is killed and restarted again and again: watchers miss nothing and the
board's Redis connections do not pile up (each restart drops every Redis connection, and the
feeds, the pool and the health check reconnect). The board's two pools (short commands and
blocking reads; Pub/Sub takes its connection from a pool too) hold at most
``redis_max_connections`` each, so every socket to Redis must be one of theirs: a connection
dropped without closing, or a client made anew per restart, shows as a socket over that bound."""

from __future__ import annotations

import asyncio
import contextlib
import os

from boardkit import make_record, make_run

from weftboard.board.client import BoardClient
from weftboard.board.embedded import start_redis
from weftboard.board.process import BoardConfig, start_board
from weftboard.proto import errors

TOKEN = "r" * 32
CYCLES = 8
POOL = 3  # redis_max_connections: small, so that the bound is tight
PER_CYCLE = 3


def redis_sockets(port: int) -> set[str]:
    """The inodes of this process's open sockets whose far end is ``port`` (any TCP state): a
    connection the board dropped without closing stays here, in CLOSE_WAIT. Other tests'
    leftovers in the process (a pytest run is one process) are told apart by inode: the test
    counts only sockets that were not there before its board started."""
    inodes = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                found.add(link[8:-1])
    return found


async def commit(client: BoardClient, record) -> None:
    for _ in range(200):  # Redis may still be coming back
        try:
            await client.commit_version(record)
            return
        except errors.Unavailable:
            await asyncio.sleep(0.1)
    raise AssertionError(f"version {record.version} was never committed")


async def test_watchers_miss_nothing_and_redis_connections_stay_flat_across_redis_restarts(tmp_path, local_store):
    redis_dir = tmp_path / "redis"
    redis = start_redis(redis_dir, persistent=True)
    port = redis.port
    running = None
    watchers: list[asyncio.Task] = []
    before = redis_sockets(port)  # an earlier test's leftover to a Redis that had this port
    try:
        config = BoardConfig(redis_url=f"redis://127.0.0.1:{port}/0", admin_token=TOKEN, health_check_s=0.2,
                             redis_max_connections=POOL)
        running = await start_board(config, blobs=local_store)
        async with BoardClient(running.address, TOKEN) as client:
            await client.create_run(make_run("r"))
            await commit(client, await make_record(local_store, "r", 1))
            seen: list[list[int]] = [[] for _ in range(8)]

            async def watch(into: list[int]) -> None:
                async with BoardClient(running.address, TOKEN) as own:
                    async for event in own.watch("r", progress_interval_ms=200, max_backoff_s=0.2):
                        if event.WhichOneof("event") == "version":
                            into.append(event.version.version)

            watchers = [asyncio.create_task(watch(s)) for s in seen]
            version = 1
            counts = []
            for _ in range(CYCLES):
                for _ in range(PER_CYCLE):
                    version += 1
                    await commit(client, await make_record(local_store, "r", version))
                redis.stop()  # SIGTERM; the append-only file keeps every commit
                await asyncio.sleep(0.5)
                redis = start_redis(redis_dir, port=port, persistent=True)
                await commit(client, await make_record(local_store, "r", version + 1))  # served again
                version += 1
                for _ in range(5):  # short-lived clients come and go
                    async with BoardClient(running.address, TOKEN) as brief:
                        await brief.get_head("r")
                await asyncio.sleep(0.3)
                counts.append(len(redis_sockets(port) - before))
            for _ in range(100):
                if all(s and s[-1] == version for s in seen):
                    break
                await asyncio.sleep(0.1)
            assert all(s == list(range(1, version + 1)) for s in seen), [s[-3:] for s in seen]
            # How many the pools hold at a moment depends on how many requests overlapped (a
            # busy machine makes more overlap), so the count is checked against the bound only.
            assert counts[0] > 0 and max(counts) <= 2 * POOL, counts
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        if running is not None:
            await running.stop()
        redis.stop()
