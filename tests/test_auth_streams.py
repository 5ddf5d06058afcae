"""Tokens over time: a revoked token's open Watch ends, and a rotated-out admin token stops working."""

from __future__ import annotations

import asyncio
import time

import pytest
from boardkit import make_run, publish

from weftboard.board.auth import Authenticator, bootstrap_id
from weftboard.board.client import BoardClient
from weftboard.board.store import RedisStore
from weftboard.proto import errors
from weftboard.proto.v1 import board_pb2 as pb

RECHECK_S = 0.2


@pytest.fixture
def fast_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """Boards started after this re-check their streams' tokens every RECHECK_S."""
    monkeypatch.setattr(Authenticator, "stream_recheck_s", RECHECK_S)


async def _watch_versions(client: BoardClient, run: str, got: asyncio.Queue) -> None:
    async for event in client.watch(run, progress_interval_ms=100):
        if event.HasField("version"):
            got.put_nowait(event.version.version)


async def _revoked_stream_ends(watcher_board, admin_board, local_store, *, within_s: float) -> None:
    """Watch on ``watcher_board`` with an ISLAND token, revoke it through ``admin_board``."""
    async with BoardClient(admin_board.address, admin_board.admin_token) as admin:
        await admin.create_run(make_run("w"))
        await publish(admin, local_store, "w", [1])
        minted = await admin.create_token("island-w", pb.ROLE_ISLAND)
        async with BoardClient(watcher_board.address, minted.token) as island:
            got: asyncio.Queue = asyncio.Queue()
            task = asyncio.create_task(_watch_versions(island, "w", got))
            try:
                assert await asyncio.wait_for(got.get(), 10) == 1
                await asyncio.sleep(RECHECK_S * 4)  # several re-checks of a valid token end nothing
                await publish(admin, local_store, "w", [2])
                assert await asyncio.wait_for(got.get(), 10) == 2
                assert not task.done()

                await admin.revoke_token(minted.token_id)
                started = time.monotonic()
                with pytest.raises(errors.Unauthenticated, match="revoked"):
                    await asyncio.wait_for(task, within_s)
                assert time.monotonic() - started < within_s
                await publish(admin, local_store, "w", [3])
                assert got.empty(), "a version reached the revoked token's stream"
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


async def test_revoked_token_ends_its_open_watch_at_once(board, local_store):
    """Revoked on the board that serves the stream: it ends at once, not at the next periodic re-check
    (the default interval, the cache TTL, is longer than ``within_s``): a version committed right
    after the revocation never reaches it."""
    await _revoked_stream_ends(board, board, local_store, within_s=1.0)


async def test_revoked_elsewhere_ends_a_watch_on_another_replica(fast_recheck, board_factory, local_store):
    """Revoked through replica A while replica B serves the stream: B's re-check sees Redis within its cache TTL."""
    a = await board_factory(blobs=local_store)
    b = await board_factory(blobs=local_store, admin_token=a.admin_token)  # replicas share their config
    await _revoked_stream_ends(b, a, local_store, within_s=2.0 + RECHECK_S + 3)


async def test_admin_token_rotated_out_of_the_config_stops_working(board_factory, local_store, redis_url):
    old = "old-admin-" + "a" * 20
    new = "new-admin-" + "b" * 20
    first = await board_factory(blobs=local_store, admin_token=old)
    async with BoardClient(first.address, old) as admin:
        minted = await admin.create_token("minted-admin", pb.ROLE_ADMIN)
    await first.stop()

    second = await board_factory(blobs=local_store, admin_token=new)
    async with BoardClient(second.address, old) as retired:
        with pytest.raises(errors.Unauthenticated):
            await retired.create_token("x", pb.ROLE_READER)
    for token in (new, minted.token):  # the configured one, and one minted through the API, still work
        async with BoardClient(second.address, token) as client:
            assert (await client.create_token("y", pb.ROLE_READER)).token_id

    store = RedisStore(redis_url)
    try:
        assert await store.lookup_token(old) is None
        assert (await store.lookup_token(new)).token_id == bootstrap_id(new)
        assert (await store.lookup_token(minted.token)).token_id == minted.token_id
    finally:
        await store.close()


async def test_bootstrap_without_admin_tokens_retires_nothing(redis_url):
    """No admin token configured: the stored ones stay (retiring them all would lock every admin out)."""
    kept = "kept-admin-" + "c" * 20
    store = RedisStore(redis_url)
    try:
        auth = Authenticator(store)
        await auth.bootstrap([kept])
        await store.put_token("bootstrap-lookalike", "someone", pb.ROLE_ADMIN, "lookalike-" + "d" * 20)
        await auth.bootstrap([])
        assert (await store.lookup_token(kept)).name == "bootstrap-admin"
        await auth.bootstrap(["other-admin-" + "e" * 20])
        assert await store.lookup_token(kept) is None
        # a token under the bootstrap prefix that the bootstrap did not name is not its to retire
        assert (await store.lookup_token("lookalike-" + "d" * 20)).token_id == "bootstrap-lookalike"
    finally:
        await store.close()


def _rechecks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("token-recheck-") and not t.done()]


async def test_streams_of_one_token_share_one_recheck_that_ends_them_all(fast_recheck, board_factory, local_store):
    """Three watches with one token on replica B: one re-check task for the token, not a wake-up
    per stream; a revocation through replica A ends all three, and no re-check task outlives them."""
    a = await board_factory(blobs=local_store)
    b = await board_factory(blobs=local_store, admin_token=a.admin_token)
    async with BoardClient(a.address, a.admin_token) as admin:
        await admin.create_run(make_run("shared"))
        await publish(admin, local_store, "shared", [1])
        minted = await admin.create_token("island-shared", pb.ROLE_ISLAND)
        other = await admin.create_token("island-other", pb.ROLE_ISLAND)
        async with BoardClient(b.address, minted.token) as island, BoardClient(b.address, other.token) as bystander:
            queues = [asyncio.Queue() for _ in range(4)]
            tasks = [asyncio.create_task(_watch_versions(island, "shared", q)) for q in queues[:3]]
            tasks.append(asyncio.create_task(_watch_versions(bystander, "shared", queues[3])))
            try:
                for q in queues:
                    assert await asyncio.wait_for(q.get(), 10) == 1
                await asyncio.sleep(RECHECK_S * 3)
                assert len(_rechecks()) == 2  # one per token, however many streams
                await admin.revoke_token(minted.token_id)
                for task in tasks[:3]:
                    with pytest.raises(errors.Unauthenticated, match="revoked"):
                        await asyncio.wait_for(task, 2.0 + RECHECK_S + 3)
                assert not tasks[3].done()  # another token's stream goes on
                assert len(_rechecks()) == 1
                tasks[3].cancel()
                await asyncio.gather(tasks[3], return_exceptions=True)
                deadline = time.monotonic() + 5
                while _rechecks():  # the last stream of a token gone: its re-check ends
                    assert time.monotonic() < deadline, _rechecks()
                    await asyncio.sleep(0.05)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
