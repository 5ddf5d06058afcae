"""The board's bearer tokens in Redis (``RedisStore`` inherits ``TokenStore``).

Keys (one hash tag, ``{tokens}``, so every transaction and script here runs on one Redis
Cluster slot):

- ``wb:{tokens}:id:<id>``         hash: name, role, hash (sha256 hex of the token); a bootstrap
                                  token also ``start``, the number of the latest start that
                                  configured it
- ``wb:{tokens}:hash:<sha256>``   token id, for lookup by the presented token
- ``wb:{tokens}:retired``         set of bootstrap token ids revoked through RevokeToken: never
                                  stored again (``PUT_UNLESS_RETIRED_LUA`` refuses them)
- ``wb:{tokens}:bootstrap_seq``   counter: each start that stores bootstrap tokens takes a number

Invariants:
- Only sha256 hashes of tokens are stored, never a token.
- A bootstrap token is stored only by ``PUT_UNLESS_RETIRED_LUA`` (it checks the retired set and
  writes in one atomic step) and its ``start`` stamp only grows; a start retires a bootstrap
  token it does not configure only by ``REVOKE_IF_OLDER_LUA``, which deletes it only while its
  stamp is older than that start's number: a start never retires a later start's token.
- Revoking a token for good (``revoke_token(..., for_good=True)``) deletes it and adds its id to
  the retired set in one transaction, so no start can store it between the two.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from weftboard.board.store_scripts import PUT_UNLESS_RETIRED_LUA, REVOKE_IF_OLDER_LUA
from weftboard.proto.errors import NotFound

RETIRED_KEY = "wb:{tokens}:retired"
BOOTSTRAP_SEQ_KEY = "wb:{tokens}:bootstrap_seq"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def k_token_id(token_id: str) -> str:
    return f"wb:{{tokens}}:id:{token_id}"


def k_token_hash(digest: str) -> str:
    return f"wb:{{tokens}}:hash:{digest}"


@dataclass(frozen=True)
class TokenInfo:
    token_id: str
    name: str
    role: int


class TokenStore:
    """Token storage on ``self.redis`` (set by ``RedisStore``)."""

    redis: Any  # redis.asyncio.Redis or RedisCluster
    _pipeline: Callable[..., Awaitable[list]]  # RedisStore's: build(pipe), then execute

    @cached_property
    def _put_unless_retired(self) -> Any:
        return self.redis.register_script(PUT_UNLESS_RETIRED_LUA)

    @cached_property
    def _revoke_if_older(self) -> Any:
        return self.redis.register_script(REVOKE_IF_OLDER_LUA)

    async def put_token(self, token_id: str, name: str, role: int, token: str) -> None:
        """Store a minted token (``CreateToken``)."""
        digest = token_hash(token)
        await self._pipeline(
            lambda p: (
                p.hset(k_token_id(token_id), mapping={"name": name, "role": role, "hash": digest}),
                p.set(k_token_hash(digest), token_id),
            ),
            transaction=True,
        )

    async def next_bootstrap_start(self) -> int:
        """This start's number: larger than that of every start before it (``INCR``)."""
        return int(await self.redis.incr(BOOTSTRAP_SEQ_KEY))

    async def put_bootstrap_token(self, token_id: str, name: str, role: int, token: str, start: int) -> bool:
        """Store a configured admin token stamped with ``start`` (a newer stamp stays); False,
        storing nothing, when its id was retired for good."""
        digest = token_hash(token)
        stored = await self._put_unless_retired(
            keys=[k_token_id(token_id), k_token_hash(digest), RETIRED_KEY],
            args=[token_id, name, role, digest, start],
        )
        return bool(int(stored))

    async def revoke_bootstrap_if_older(self, token_id: str, start: int) -> bool | None:
        """Revoke a bootstrap token unless a start numbered ``start`` or later configured it:
        True revoked, False kept, None not stored (gone already)."""
        digest = await self.redis.hget(k_token_id(token_id), "hash")
        if digest is None:
            return None
        digest = digest.decode()
        outcome = int(await self._revoke_if_older(keys=[k_token_id(token_id), k_token_hash(digest)],
                                                  args=[start, digest, token_id]))
        return None if outcome < 0 else bool(outcome)

    async def lookup_token(self, token: str) -> TokenInfo | None:
        token_id = await self.redis.get(k_token_hash(token_hash(token)))
        if token_id is None:
            return None
        info = await self.redis.hgetall(k_token_id(token_id.decode()))
        if not info:
            return None
        return TokenInfo(token_id.decode(), info[b"name"].decode(), int(info[b"role"]))

    async def token_ids(self, id_prefix: str, name: str) -> list[str]:
        """The ids, sorted, of stored tokens whose id starts with ``id_prefix`` and whose name is ``name``."""
        ids = []
        async for key in self.redis.scan_iter(match=k_token_id(id_prefix) + "*", count=1000):
            ids.append((key.decode() if isinstance(key, bytes) else key).rpartition(":id:")[2])
        named = []
        for token_id in sorted(ids):
            stored = await self.redis.hget(k_token_id(token_id), "name")
            if stored is not None and stored.decode() == name:
                named.append(token_id)
        return named

    async def revoke_token(self, token_id: str, *, for_good: bool = False) -> bool:
        """Delete a token; ``for_good``: also retire its id, so that it is never stored again
        (then an id not stored now is retired all the same). Returns whether a stored token was
        deleted; raises ``NotFound`` for an id that is not stored, unless ``for_good``."""
        info = await self.redis.hgetall(k_token_id(token_id))
        if not info and not for_good:
            raise NotFound(f"token id {token_id!r} does not exist (already revoked?)")

        def build(p: Any) -> None:
            p.delete(k_token_id(token_id))
            if info:
                p.delete(k_token_hash(info[b"hash"].decode()))
            if for_good:
                p.sadd(RETIRED_KEY, token_id)

        await self._pipeline(build, transaction=True)
        return bool(info)
