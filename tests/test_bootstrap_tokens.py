"""Bootstrap (configured) admin tokens across starts, on a real Redis.

- RevokeToken retires a bootstrap token for good: a later start with the same config does not
  bring it back, and a start whose configured tokens are all so retired refuses to start.
- Retirement by config is soft and ordered by start numbers: the last start wins, whatever the
  timing of two replicas started with different configs; a token it retired comes back when a
  later start configures it again; a start never leaves neither config's tokens valid.
- With auth off nothing is written to Redis.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from weftboard.board.auth import (
    BOOTSTRAP_NAME,
    BOOTSTRAP_PREFIX,
    Authenticator,
    bootstrap_id,
)
from weftboard.board.client import BoardClient
from weftboard.board.store import RedisStore
from weftboard.proto import errors
from weftboard.proto.v1 import board_pb2 as pb

X = "admin-x-" + "x" * 24
Y = "admin-y-" + "y" * 24
Z = "admin-z-" + "z" * 24


async def _token_keys(redis_url: str) -> list[bytes]:
    r = aioredis.Redis.from_url(redis_url)
    try:
        return sorted(await r.keys("wb:{tokens}:*"))
    finally:
        await r.aclose()


async def _works(address: str, token: str) -> bool:
    async with BoardClient(address, token) as client:
        try:
            await client.list_runs()
        except errors.Unauthenticated:
            return False
    return True


async def test_revoked_bootstrap_token_stays_revoked_after_a_restart(board_factory, redis_url):
    running = await board_factory(admin_token=Y, admin_tokens=(X,))
    async with BoardClient(running.address, Y) as admin:
        assert (await admin.revoke_token(bootstrap_id(X))).was_stored
    assert not await _works(running.address, X)

    await running.restart()  # the same config, X still in it
    assert not await _works(running.address, X), "a restart brought back a token revoked through RevokeToken"
    assert await _works(running.address, Y)
    store = RedisStore(redis_url)
    try:
        assert await store.lookup_token(X) is None
    finally:
        await store.close()


async def test_a_start_whose_admin_tokens_are_all_revoked_refuses_to_start(board_factory):
    running = await board_factory(admin_token=X)
    async with BoardClient(running.address, X) as admin:
        await admin.revoke_token(bootstrap_id(X))
    await running.stop()
    with pytest.raises(errors.FailedPrecondition, match="configure a new admin token"):
        await board_factory(admin_token=X)


async def test_revoking_a_soft_retired_bootstrap_token_retires_it_for_good(redis_url):
    store = RedisStore(redis_url)
    try:
        auth = Authenticator(store)
        await auth.bootstrap([X])
        await auth.bootstrap([Y])  # X soft-retired (not stored now)
        assert await store.lookup_token(X) is None
        assert await auth.revoke(bootstrap_id(X)) is False  # succeeds (nothing was stored), and X can never come back
        with pytest.raises(errors.FailedPrecondition):
            await auth.bootstrap([X])
        with pytest.raises(errors.NotFound):
            await auth.revoke("0123456789abcdef")  # a minted token's id that does not exist
    finally:
        await store.close()


async def test_last_start_wins_whatever_the_timing(redis_url):
    """Replica A (config X) and replica B (config Y) start at the same time on one Redis: A stores X,
    then B runs its whole start, then A looks for tokens to retire. Before start numbers A retired
    B's token and B retired A's: no admin token was left."""
    store_a, store_b, store_c = RedisStore(redis_url), RedisStore(redis_url), RedisStore(redis_url)
    try:
        a_paused, a_go = asyncio.Event(), asyncio.Event()
        listing = store_a.token_ids

        async def paused_listing(*args, **kwargs):
            a_paused.set()
            await a_go.wait()
            return await listing(*args, **kwargs)

        store_a.token_ids = paused_listing  # type: ignore[method-assign]
        a = asyncio.create_task(Authenticator(store_a).bootstrap([X]))
        await asyncio.wait_for(a_paused.wait(), 10)
        await Authenticator(store_b).bootstrap([Y])  # started later: its number is larger
        a_go.set()
        await asyncio.wait_for(a, 10)

        assert (await store_c.lookup_token(Y)).token_id == bootstrap_id(Y), "the last start's token was retired"
        assert await store_c.lookup_token(X) is None, "the last start did not win"

        # a third start configuring X again brings it back (soft retirement), and retires Y
        await Authenticator(store_c).bootstrap([X, Z])
        assert (await store_c.lookup_token(X)).token_id == bootstrap_id(X)
        assert (await store_c.lookup_token(Z)).token_id == bootstrap_id(Z)
        assert await store_c.lookup_token(Y) is None
        assert await store_c.token_ids(BOOTSTRAP_PREFIX, BOOTSTRAP_NAME) == sorted([bootstrap_id(X), bootstrap_id(Z)])
    finally:
        for store in (store_a, store_b, store_c):
            await store.close()


async def test_an_older_start_never_retires_a_newer_starts_token(redis_url):
    """However the two starts interleave, the tokens of the start with the larger number stay valid."""
    first, second = RedisStore(redis_url), RedisStore(redis_url)
    try:
        await Authenticator(first).bootstrap([X])
        older = await first.next_bootstrap_start()  # a start that took its number, then stalled
        await Authenticator(second).bootstrap([Y])
        assert not await first.revoke_bootstrap_if_older(bootstrap_id(Y), older)
        assert (await first.lookup_token(Y)).token_id == bootstrap_id(Y)
    finally:
        await first.close()
        await second.close()


async def test_auth_off_writes_no_token(board_factory, redis_url):
    running = await board_factory(auth=False, admin_token=X)  # a token configured, auth off
    async with BoardClient(running.address) as client:
        assert await client.list_runs() is not None
    assert await _token_keys(redis_url) == []
    store = RedisStore(redis_url)
    try:
        await Authenticator(store, enabled=False).bootstrap([Y])
    finally:
        await store.close()
    assert await _token_keys(redis_url) == []


async def test_minted_token_revocation_does_not_retire(board, redis_url):
    async with BoardClient(board.address, board.admin_token) as admin:
        minted = await admin.create_token("reader", pb.ROLE_READER)
        await admin.revoke_token(minted.token_id)
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert await r.smembers("wb:{tokens}:retired") == set()
    finally:
        await r.aclose()


async def _serve_once(settings, redis_url: str, tmp_path, monkeypatch, check) -> list[str]:
    """``weftboard serve``'s process body on ``redis_url`` until ``check(address)`` is done;
    returns the banner's lines."""
    from weftboard.board import serving
    from weftboard.board.blobs import LocalDirBlobStore

    stop, seen, banner = asyncio.Event(), {}, []
    embedded = serving.Embedded(redis_url=redis_url, blobs=LocalDirBlobStore(tmp_path / "blobs"))
    monkeypatch.setattr(serving, "print_banner", lambda lines: banner.extend(f"{k}: {v}" for k, v in lines))
    task = asyncio.create_task(serving.serve_async(settings, embedded, tmp_path, ready=seen.update, stop_event=stop))
    while not seen and not task.done():
        await asyncio.sleep(0.05)
    if task.done():
        await task  # raises what the start raised
    try:
        await check(seen["address"])
    finally:
        stop.set()
        await task
    return banner


async def test_serve_keeps_the_previous_admin_token_valid_until_a_start_without_it(redis_url, tmp_path, monkeypatch):
    """Rotation with the plain ``weftboard serve``: a start given both tokens keeps both valid
    (the banner names the previous one by id, never the token); the next start given only the
    new one retires the old."""
    from weftboard.board.config import BoardSettings

    both = BoardSettings(listen="127.0.0.1:0", admin_token=Y, previous_admin_token=X, blob_http_port=-1)

    async def both_work(address: str) -> None:
        assert await _works(address, X) and await _works(address, Y)

    banner = await _serve_once(both, redis_url, tmp_path, monkeypatch, both_work)
    assert any(line.startswith("previous admin token:") and bootstrap_id(X) in line for line in banner), banner
    assert not any(X in line or Y in line for line in banner)

    async def old_retired(address: str) -> None:
        assert await _works(address, Y) and not await _works(address, X)

    await _serve_once(BoardSettings(listen="127.0.0.1:0", admin_token=Y, blob_http_port=-1), redis_url, tmp_path,
                      monkeypatch, old_retired)


async def test_a_previous_admin_token_without_a_new_one_is_refused(redis_url, tmp_path, monkeypatch):
    from weftboard.board.config import BoardSettings

    alone = BoardSettings(listen="127.0.0.1:0", previous_admin_token=X, blob_http_port=-1)

    async def never(address: str) -> None:
        raise AssertionError("a board started with only a previous admin token")

    with pytest.raises(errors.InvalidArgument, match="give the new one with --admin-token"):
        await _serve_once(alone, redis_url, tmp_path, monkeypatch, never)
