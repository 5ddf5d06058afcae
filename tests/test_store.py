"""RedisStore against a real redis-server: the Lua commit CAS, key layout, events, tokens."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from boardkit import make_record, make_run

from weftboard.board.store import RedisStore, canonical_record, k_events
from weftboard.proto import errors
from weftboard.proto.v1 import board_pb2 as pb


@pytest_asyncio.fixture
async def store(redis_url):
    s = RedisStore(redis_url)
    yield s
    await s.close()


async def test_commit_cas_under_concurrency(store, local_store):
    await store.create_run(make_run("r"))
    assert (await store.commit(await make_record(local_store, "r", 1))).status == "committed"
    candidates = [await make_record(local_store, "r", 2) for _ in range(8)]
    outcomes = await asyncio.gather(*(store.commit(c) for c in candidates))
    statuses = sorted(o.status for o in outcomes)
    assert statuses.count("committed") == 1
    assert statuses.count("exists_different") == 7  # the others found version 2 taken
    winner = candidates[[o.status for o in outcomes].index("committed")]
    retry = await store.commit(winner)
    assert retry.status == "already_committed" and retry.head == 2
    skipped = await store.commit(await make_record(local_store, "r", 4))
    assert skipped.status == "head_mismatch" and skipped.head == 2
    events = await store.events_after("r", 0)
    assert [e.version for e in events] == [1, 2]
    assert canonical_record(events[1]) == canonical_record(winner)
    assert events[1].committed_at_ms == (await store.get_versions("r", [2]))[2].committed_at_ms > 0


async def test_every_run_key_is_hash_tagged(store, local_store):
    await store.create_run(make_run("tagged"))
    await store.commit(await make_record(local_store, "tagged", 1))
    await store.heartbeat(pb.IslandStatus(island_id="i", run="tagged", state=pb.ISLAND_STATE_READY), 30)
    await store.add_trajectories("tagged", [pb.TrajectoryRecord(run="tagged").SerializeToString()], 100)
    keys = [k.decode() for k in await store.redis.keys("*tagged*")]
    assert len(keys) >= 8
    assert all(k.startswith("wb:{tagged}:") for k in keys), keys


async def test_commit_unknown_run(store, local_store):
    with pytest.raises(errors.NotFound):
        await store.commit(await make_record(local_store, "ghost", 1))


async def test_canonical_record_ignores_board_clock():
    a = pb.VersionRecord(run="r", version=1, committed_at_ms=5, labels={"b": "2", "a": "1"})
    b = pb.VersionRecord(run="r", version=1, committed_at_ms=9, labels={"a": "1", "b": "2"})
    assert canonical_record(a) == canonical_record(b)
    assert canonical_record(a) != canonical_record(pb.VersionRecord(run="r", version=2))


async def test_advance_oldest_is_monotonic_and_trims_events(store, local_store):
    await store.create_run(make_run("r"))
    for v in range(1, 5):
        await store.commit(await make_record(local_store, "r", v))
    assert await store.advance_oldest("r", 3) == 3
    assert await store.advance_oldest("r", 2) == 3
    assert (await store.run_state("r")).oldest == 3
    assert [e.version for e in await store.events_after("r", 0)] == [3, 4]
    assert await store.redis.xlen(k_events("r")) == 2


async def test_tokens_are_hashed(store):
    await store.put_token("tid", "ci", pb.ROLE_READER, "secret-token-value")
    info = await store.lookup_token("secret-token-value")
    assert info is not None and (info.token_id, info.role) == ("tid", pb.ROLE_READER)
    assert await store.lookup_token("other") is None
    dump = b"".join(await store.redis.keys("*")) + b"".join(
        v for v in (await store.redis.hgetall("wb:{tokens}:id:tid")).values()
    )
    assert b"secret-token-value" not in dump
    await store.revoke_token("tid")
    assert await store.lookup_token("secret-token-value") is None
    with pytest.raises(errors.NotFound):
        await store.revoke_token("tid")


async def test_unreachable_redis_is_unavailable():
    s = RedisStore("redis://127.0.0.1:1/0", socket_timeout_s=1)
    try:
        with pytest.raises(errors.Unavailable, match="unreachable"):
            await s.ping()
    finally:
        await s.close()


async def test_compact_index_for_planning(store, local_store):
    await store.create_run(make_run("r"))
    record = await make_record(local_store, "r", 1)
    await store.commit(record)
    index = await store.get_index("r", 1, 3)
    assert list(index) == [1]
    compact = index[1]
    assert compact.root_digest == record.root_digest and compact.artifacts == record.artifacts
    assert len(compact.tensor_digests) == 0 and len(record.tensor_digests) > 0
    assert await store.get_index("r", 2, 1) == {}
