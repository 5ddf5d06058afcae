"""Several board replicas on one real Redis Cluster (3 masters, 3 replicas).

The cluster is started once per session; each test starts its own three in-process boards on
it and uses run names of its own. The test that kills a Redis master runs last in this file
(its cluster is left with one master without a replica).
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from boardkit import make_record, make_run

from weftboard.board.bench.redis_cluster import RedisCluster, start_cluster
from weftboard.board.blobs import LocalDirBlobStore
from weftboard.board.client import BoardClient
from weftboard.board.process import BoardConfig, RunningBoard, start_board
from weftboard.board.redis_conn import parse_redis_url
from weftboard.board.store import RedisStore, k_events, k_staged
from weftboard.proto import errors
from weftboard.proto.v1 import board_pb2 as pb

REPLICAS = 3


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"), masters=3, replicas_per_master=1)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def blobs(tmp_path: Path) -> LocalDirBlobStore:
    return LocalDirBlobStore(tmp_path / "blobs")  # shared by the replicas, like one S3 bucket


@pytest_asyncio.fixture
async def boards(redis_cluster: RedisCluster, blobs: LocalDirBlobStore) -> AsyncIterator[list[RunningBoard]]:
    token = "admin-" + secrets.token_hex(8)
    started = [
        await start_board(BoardConfig(redis_url=redis_cluster.url, admin_token=token, watch_progress_s=0.5), blobs=blobs)
        for _ in range(REPLICAS)
    ]
    try:
        yield started
    finally:
        for board in started:
            await board.stop(grace=0)


def run_name() -> str:
    return "c-" + secrets.token_hex(4)


class Watcher:
    """One watch stream; records every version it yields."""

    def __init__(self, client: BoardClient, run: str) -> None:
        self.client = client
        self.seen: list[int] = []
        self.task = asyncio.create_task(self._follow(run))

    async def _follow(self, run: str) -> None:
        async for event in self.client.watch(run, progress_interval_ms=200):
            if event.WhichOneof("event") == "version":
                self.seen.append(event.version.version)

    async def until(self, last: int, timeout_s: float = 30.0) -> list[int]:
        async def wait() -> None:
            while not self.seen or self.seen[-1] < last:
                if self.task.done():
                    self.task.result()
                await asyncio.sleep(0.02)

        await asyncio.wait_for(wait(), timeout_s)
        return self.seen

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def commit_retrying(client: BoardClient, record: pb.VersionRecord, timeout_s: float = 30.0) -> None:
    """Commit as a publisher does: an UNAVAILABLE board or Redis is retried (the retry of an
    identical record is idempotent)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await client.commit_version(record)
            return
        except errors.Unavailable:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


def test_redis_url_forms() -> None:
    one = parse_redis_url("redis://:pw@10.0.0.1:6380/2")
    assert not one.cluster and one.nodes == (("10.0.0.1", 6380),) and one.db == 2 and one.password == "pw"
    seeds = parse_redis_url("redis+cluster://a:7000,b:7001")
    assert seeds.cluster and seeds.nodes == (("a", 7000), ("b", 7001)) and not seeds.tls
    assert parse_redis_url("redis://a:7000,b:7001").cluster  # a seed list is a cluster too
    tls = parse_redis_url("rediss+cluster://u:secret@a:7000?ssl_ca_certs=/ca.pem")
    assert tls.tls and tls.username == "u" and tls.tls_options == {"ssl_ca_certs": "/ca.pem"}
    assert "secret" not in tls.redacted
    with pytest.raises(errors.InvalidArgument, match="database 0"):
        parse_redis_url("redis+cluster://a:7000/3")
    with pytest.raises(errors.InvalidArgument, match="scheme"):
        parse_redis_url("http://a:7000")


async def test_store_is_single_slot_and_hints_reach_the_slot_node(redis_cluster: RedisCluster) -> None:
    store = RedisStore(redis_cluster.url)
    run = run_name()
    try:
        await store.ping()
        await store.heartbeat(pb.IslandStatus(run=run, island_id="i1"), lease_s=30)  # a MULTI over 3 keys
        assert [r.status.island_id for r in await store.islands(run, forget_before_ms=0)] == ["i1"]
        await store.heartbeat(pb.IslandStatus(run=run, island_id="i2"), lease_s=120)
        soon = int(time.time() * 1000) + 60_000  # i1's lease ends before it, i2's after: one script forgets i1
        assert [r.status.island_id for r in await store.islands(run, forget_before_ms=soon)] == ["i2"]
        listener = await store.staged_listener(run)
        await listener.subscribe(k_staged(run))
        assert await store.staged_feeds(run) == 1
        assert await store.publish_staged(run, 1, "k", 3, b"hint") == 1
        message = None
        for _ in range(3):  # the first read may consume the (ignored) subscribe confirmation
            message = message or await listener.get_message(timeout=2)
        assert message is not None and message["data"] == b"hint"
        await listener.aclose()
    finally:
        await store.close()


async def test_watchers_on_every_replica_see_every_commit_once_in_order(boards, blobs) -> None:
    run = run_name()
    clients = [BoardClient(b.address, b.admin_token) for b in boards]
    try:
        await clients[0].create_run(make_run(run))
        await clients[0].commit_version(await make_record(blobs, run, 1))
        watchers = [Watcher(c, run) for c in clients for _ in range(2)]
        for v in range(2, 12):  # commits through every replica in turn
            await clients[v % REPLICAS].commit_version(await make_record(blobs, run, v))
        for w in watchers:
            assert await w.until(11) == list(range(1, 12))
        # commit stays one compare-and-set across replicas: two different records for version 12
        first, second = await make_record(blobs, run, 12), await make_record(blobs, run, 12)
        results = await asyncio.gather(clients[1].commit_version(first), clients[2].commit_version(second),
                                       return_exceptions=True)
        assert sum(isinstance(r, errors.WeftboardError) for r in results) == 1, results
        for w in watchers:
            assert await w.until(12) == list(range(1, 13))
            await w.stop()
    finally:
        for c in clients:
            await c.close()


async def test_a_replica_dies_and_its_clients_move_on(boards, blobs) -> None:
    run = run_name()
    addresses = [b.address for b in boards]
    token = boards[0].admin_token
    # each client lists every replica, starting at a different one
    clients = [BoardClient(addresses[i:] + addresses[:i], token) for i in range(REPLICAS)]
    try:
        await clients[1].create_run(make_run(run))
        watchers = [Watcher(c, run) for c in clients for _ in range(3)]
        for v in range(1, 6):
            await commit_retrying(clients[0], await make_record(blobs, run, v))
        for w in watchers:
            await w.until(5)
        await boards[0].stop(grace=0)  # the replica clients[0] (the publisher) talks to
        for v in range(6, 16):
            await commit_retrying(clients[0], await make_record(blobs, run, v))
        for w in watchers:
            assert await w.until(15) == list(range(1, 16))
        assert clients[0].address != addresses[0]
        for w in watchers:
            await w.stop()
    finally:
        for c in clients:
            await c.close()


async def test_a_commit_answers_once_a_replica_holds_it(redis_cluster: RedisCluster, blobs) -> None:
    """``redis_min_replicas``: the commit and WAIT go to the slot's master on one connection.
    A replica that does not acknowledge (stopped) makes the commit UNAVAILABLE, though the
    master holds it; the retried identical commit answers once the replica has it again."""
    token = "admin-" + secrets.token_hex(8)
    board = await start_board(BoardConfig(redis_url=redis_cluster.url, admin_token=token, redis_min_replicas=1,
                                          redis_replica_timeout_ms=300), blobs=blobs)
    client = BoardClient(board.address, token)
    run = run_name()
    (replica,) = redis_cluster.replicas_of(redis_cluster.master_of(k_events(run)))
    try:
        await client.create_run(make_run(run))
        for v in (1, 2):
            assert not (await client.commit_version(await make_record(blobs, run, v))).already_committed
        record = await make_record(blobs, run, 3)
        replica.process.send_signal(signal.SIGSTOP)
        try:
            for _ in range(2):  # the first commit, then its identical retry
                with pytest.raises(errors.Unavailable, match="0 of the 1 replicas"):
                    await client.commit_version(record)
            assert (await client.get_head(run)).version == 3  # on the master all along
        finally:
            replica.process.send_signal(signal.SIGCONT)
        response = await client.commit_version(record)
        assert response.already_committed and response.record.version == 3
    finally:
        replica.process.send_signal(signal.SIGCONT)
        await client.close()
        await board.stop(grace=0)


async def test_a_redis_master_dies_and_its_replica_takes_over(redis_cluster: RedisCluster, boards, blobs) -> None:
    """Runs last: the cluster keeps a master without a replica afterwards."""
    run = run_name()
    addresses = [b.address for b in boards]
    token = boards[0].admin_token
    clients = [BoardClient(addresses[i:] + addresses[:i], token) for i in range(REPLICAS)]
    try:
        await clients[0].create_run(make_run(run))
        watchers = [Watcher(c, run) for c in clients]
        for v in range(1, 6):
            await commit_retrying(clients[0], await make_record(blobs, run, v))
        for w in watchers:
            await w.until(5)
        master = redis_cluster.master_of(k_events(run))
        await asyncio.sleep(0.3)  # replication is asynchronous: let the replica have version 5
        await asyncio.to_thread(master.kill)
        for v in range(6, 12):  # UNAVAILABLE until the replica is promoted, then commits again
            await commit_retrying(clients[v % REPLICAS], await make_record(blobs, run, v), timeout_s=60)
        for w in watchers:
            assert await w.until(11, timeout_s=60) == list(range(1, 12))
            await w.stop()
        assert redis_cluster.master_of(k_events(run)) is not master
    finally:
        for c in clients:
            await c.close()


async def test_a_commit_wakes_the_feeds_of_every_board_process(redis_cluster: RedisCluster, blobs) -> None:
    """The commit script's notification reaches each process's listener, wherever in the
    cluster the run's slot lives: the feeds' safety poll (a minute here) plays no part."""
    from weftboard.board.fanout import FanOut, FeedEvent

    run = run_name()
    stores = [RedisStore(redis_cluster.url) for _ in range(2)]
    fanouts = [FanOut(store, poll_s=60.0) for store in stores]
    try:
        await stores[0].create_run(make_run(run))
        subs = [await fanout.subscribe(run, 60.0) for fanout in fanouts]
        for fanout in fanouts:
            await asyncio.wait_for(fanout.listening.wait(), 10)
        await asyncio.sleep(0.2)  # the wake-up of the listeners' subscription has been read
        for version in (1, 2):
            await stores[1].commit(await make_record(blobs, run, version))
            for sub in subs:
                item = await asyncio.wait_for(sub.queue.get(), 5)
                assert isinstance(item, FeedEvent) and item.version == version
    finally:
        for fanout in fanouts:
            for task in fanout.cancel_all():
                task.cancel()
        for store in stores:
            await store.close()
