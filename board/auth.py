"""Bearer-token authentication and the per-method role table.

Invariants:
- Only sha256 hashes of tokens are stored (Redis keys ``wb:{tokens}:hash:<sha256>``); a token
  is shown once, when it is created.
- ``METHOD_ROLES`` is the single source of the table written beside each method in
  board.proto; ADMIN may call every method.
- A request without a valid token is UNAUTHENTICATED; a valid token whose role does not
  allow the method is PERMISSION_DENIED. The distinction is never blurred.
- Lookups are cached for a short time (``cache_ttl_s``) so a busy board does not ask
  Redis on every call; a revocation made on this board drops the cache entry at once,
  one made elsewhere takes effect within the TTL.
- A server stream outlives its first check: a revocation made on the board serving it ends
  it at once (``revocation``); one task per token with open streams (however many) re-checks
  it every ``stream_recheck_s`` (by default the cache TTL, through the same cached lookup), so
  one made on another replica ends them within the TTL plus that interval; the task ends with
  its token's last stream. The streams end as UNAUTHENTICATED.
- Configured admin tokens are stored as ``bootstrap-<sha256 prefix>`` (name
  ``bootstrap-admin``), only with auth on (with auth off nothing is written). Each start takes
  a number (``RedisStore.next_bootstrap_start``) and stores its configured tokens stamped with
  it; the stored bootstrap tokens it does not configure are revoked (logged by id) only if
  their stamp is older than its number, atomically: the last start wins whatever the timing
  of replicas started with different configs, and a start never retires the tokens a later
  start configured, so the tokens of the latest start always stay valid (a start that
  overlaps a later one may leave its own stored beside them, until the next start). That
  retirement is soft: a later start configuring the token again brings it back. Tokens
  minted through ``CreateToken`` (random hex ids) are never touched. A board started with no
  admin token configured retires nothing (it would lock every admin out); it names what
  stays valid.
- ``RevokeToken`` of a bootstrap token retires its id for good: no start stores it again
  (``PUT_UNLESS_RETIRED_LUA``); a start whose configured admin tokens are all so retired
  refuses to start (``FailedPrecondition``: configure a new one) rather than serve with no
  admin token.
- Rotation: configure old and new on every replica (``serve --admin-token NEW
  --previous-admin-token OLD``), then drop the old one. The first start
  with only the new one retires the old; a replica restarted later with both brings it back
  until every replica runs the new config (the last start wins). The new one stays valid
  throughout: every start configures it.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import re
import secrets
import time
from collections.abc import Sequence

import structlog

from weftboard.board.store import RedisStore
from weftboard.board.store_tokens import TokenInfo, token_hash
from weftboard.proto.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)
from weftboard.proto.v1 import board_pb2 as pb

PUBLISHER, ISLAND, READER, ADMIN = pb.ROLE_PUBLISHER, pb.ROLE_ISLAND, pb.ROLE_READER, pb.ROLE_ADMIN

METHOD_ROLES: dict[str, frozenset[int]] = {
    "CreateRun": frozenset({PUBLISHER}),
    "GetRun": frozenset({READER, ISLAND, PUBLISHER}),
    "ListRuns": frozenset({READER}),
    "GetModelFiles": frozenset({ISLAND}),
    "PresignUpload": frozenset({PUBLISHER}),
    "StartUpload": frozenset({PUBLISHER}),
    "PresignUploadParts": frozenset({PUBLISHER}),
    "CompleteUpload": frozenset({PUBLISHER}),
    "AbortUpload": frozenset({PUBLISHER}),
    "CommitVersion": frozenset({PUBLISHER}),
    "StagePart": frozenset({PUBLISHER}),
    "GetVersion": frozenset({READER, ISLAND, PUBLISHER}),
    "GetHead": frozenset({READER, ISLAND, PUBLISHER}),
    "ListVersions": frozenset({READER, ISLAND, PUBLISHER}),
    "Watch": frozenset({ISLAND, READER}),
    "PlanCatchUp": frozenset({ISLAND, PUBLISHER}),  # a restarting publisher follows its run like an island
    "Heartbeat": frozenset({ISLAND}),
    "ListIslands": frozenset({READER}),
    "ReportTrajectories": frozenset({ISLAND}),
    "ConsumeTrajectories": frozenset({PUBLISHER, READER}),
    "AckTrajectories": frozenset({PUBLISHER, READER}),
    "CollectGarbage": frozenset(),
    "CreateToken": frozenset(),
    "RevokeToken": frozenset(),
}

log = structlog.get_logger(__name__)

BOOTSTRAP_PREFIX = "bootstrap-"
BOOTSTRAP_NAME = "bootstrap-admin"
_BOOTSTRAP_ID = re.compile(BOOTSTRAP_PREFIX + "[0-9a-f]{12}")

ROLE_NAMES = {PUBLISHER: "PUBLISHER", ISLAND: "ISLAND", READER: "READER", ADMIN: "ADMIN"}


def allowed(method: str, role: int) -> bool:
    return role == ADMIN or role in METHOD_ROLES[method]


def new_token() -> tuple[str, str]:
    """A fresh (token id, token). The id is public (logs, revocation); the token is secret."""
    token_id = secrets.token_hex(8)
    return token_id, f"wb_{secrets.token_urlsafe(32)}"


def bootstrap_id(token: str) -> str:
    """The id ``bootstrap`` stores a configured admin token under (never that of a minted token:
    ``new_token`` ids are bare hex)."""
    return BOOTSTRAP_PREFIX + hashlib.sha256(token.encode()).hexdigest()[:12]


def is_bootstrap_id(token_id: str) -> bool:
    return _BOOTSTRAP_ID.fullmatch(token_id) is not None


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class Authenticator:
    """Resolves bearer tokens to roles and enforces ``METHOD_ROLES``."""

    # How often an open server stream re-checks its token; None: every ``cache_ttl_s`` (a
    # re-check within the TTL would only read the cache). Tests set it small.
    stream_recheck_s: float | None = None

    def __init__(self, store: RedisStore, *, enabled: bool = True, cache_ttl_s: float = 2.0,
                 stream_recheck_s: float | None = None) -> None:
        self.store = store
        self.enabled = enabled
        self.cache_ttl_s = cache_ttl_s
        if stream_recheck_s is not None:
            self.stream_recheck_s = stream_recheck_s
        self._cache: dict[str, tuple[float, TokenInfo | None]] = {}
        self._revocations: dict[str, set[asyncio.Future[None]]] = {}
        self._rechecks: dict[str, asyncio.Task[None]] = {}  # one per token with open streams

    @property
    def recheck_every_s(self) -> float:
        """Seconds between two checks of an open stream's token."""
        return self.cache_ttl_s if self.stream_recheck_s is None else self.stream_recheck_s

    async def bootstrap(self, admin_tokens: Sequence[str]) -> None:
        """Store configured admin tokens (hashed) so they work on every board replica, stamped
        with this start's number, and revoke the stored bootstrap tokens it does not configure
        whose stamp is older. Nothing at all with auth off. Raises ``FailedPrecondition`` when
        every configured token was revoked through ``RevokeToken`` (retired for good)."""
        if not self.enabled:
            return
        for token in admin_tokens:
            if len(token) < 16:
                raise InvalidArgument("an admin token must be at least 16 characters; generate one with secrets")
        configured = {bootstrap_id(token): token for token in admin_tokens}
        if not configured:
            stored = await self.store.token_ids(BOOTSTRAP_PREFIX, BOOTSTRAP_NAME)
            if stored:
                log.warning("no admin token is configured: the stored bootstrap admin tokens stay valid; configure "
                            "one to retire them, or revoke them with RevokeToken", token_ids=stored)
            return
        start = await self.store.next_bootstrap_start()
        refused = [token_id for token_id, token in configured.items()
                   if not await self.store.put_bootstrap_token(token_id, BOOTSTRAP_NAME, ADMIN, token, start)]
        if len(refused) == len(configured):
            raise FailedPrecondition(
                f"every configured admin token ({', '.join(refused)}) was revoked through RevokeToken and stays "
                "revoked, so this board would have no admin token: configure a new admin token (at least 16 "
                "characters; generate one with secrets) and drop the revoked ones"
            )
        if refused:
            log.warning("configured admin tokens were revoked through RevokeToken and stay revoked; drop them "
                        "from the config", token_ids=refused)
        await self._retire_bootstrap_tokens(set(configured), start)

    async def _retire_bootstrap_tokens(self, configured: set[str], start: int) -> None:
        """Revoke every stored bootstrap token whose id is not in ``configured`` (only ids with
        the bootstrap prefix whose record also carries the bootstrap name) unless a start
        numbered ``start`` or later configured it."""
        stale = [t for t in await self.store.token_ids(BOOTSTRAP_PREFIX, BOOTSTRAP_NAME) if t not in configured]
        retired, kept = [], []
        for token_id in stale:
            outcome = await self.store.revoke_bootstrap_if_older(token_id, start)
            if outcome:
                self._forget(token_id)
                retired.append(token_id)
            elif outcome is False:
                kept.append(token_id)
            # None: gone already (another replica's start retired it)
        if retired:
            log.warning("retired admin tokens this start does not configure (a later start that configures them "
                        "brings them back)", token_ids=retired, start=start)
        if kept:
            log.warning("kept admin tokens this start does not configure: a later start configures them",
                        token_ids=kept, start=start)

    async def authorize(self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> TokenInfo | None:
        """The caller's token info; raises Unauthenticated / PermissionDenied. None when auth is off."""
        if not self.enabled:
            return None
        token = bearer(metadata)
        if token is None:
            raise Unauthenticated(
                f"{method} needs 'authorization: Bearer <token>' metadata; ask an admin for a token"
            )
        info = await self._lookup(token)
        if info is None:
            raise Unauthenticated(f"the token presented to {method} is unknown or revoked")
        if not allowed(method, info.role):
            need = sorted(ROLE_NAMES[r] for r in METHOD_ROLES[method] | {ADMIN})
            raise PermissionDenied(
                f"token {info.token_id!r} has role {ROLE_NAMES.get(info.role, info.role)}; "
                f"{method} needs one of {', '.join(need)}"
            )
        return info

    async def current(self, token: str | None) -> TokenInfo | None:
        """``token``'s info, None once unknown or revoked (the cached lookup)."""
        return None if token is None else await self._lookup(token)

    def revocation(self, info: TokenInfo, token: str) -> asyncio.Future[None]:
        """A future done once ``token`` (whose info is ``info``) is revoked: at once when this
        board revokes it, else when a re-check finds it gone; ``forget_revocation`` it after.

        One re-check task per token, shared by all its open streams, looks it up every
        ``recheck_every_s`` (0: never) while any of them waits; it runs in a fresh context (not
        the first stream's), ends with the last waiter, and a lookup that fails (Redis away)
        ends nothing: the stream was authorized, and its own Redis reads report an outage."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._revocations.setdefault(info.token_id, set()).add(future)
        if self.recheck_every_s > 0 and info.token_id not in self._rechecks:
            # a task copies the context it is made in: here a fresh one (create_task's context=
            # is Python 3.11+)
            self._rechecks[info.token_id] = contextvars.Context().run(
                asyncio.get_running_loop().create_task, self._recheck(info.token_id, token),
                name=f"token-recheck-{info.token_id}")
        return future

    def forget_revocation(self, token_id: str, future: asyncio.Future[None]) -> None:
        waiting = self._revocations.get(token_id)
        if waiting is not None:
            waiting.discard(future)
            if not waiting:
                del self._revocations[token_id]
                recheck = self._rechecks.pop(token_id, None)
                if recheck is not None:
                    recheck.cancel()

    async def _recheck(self, token_id: str, token: str) -> None:
        """While streams of ``token_id`` wait: look ``token`` up every ``recheck_every_s``, and
        once it is gone end them all (``_forget``)."""
        try:
            while self._revocations.get(token_id):
                await asyncio.sleep(self.recheck_every_s)
                try:
                    if await self.current(token) is not None:
                        continue
                except Exception as exc:  # noqa: BLE001 - a transient lookup failure ends nothing
                    log.warning("stream token re-check failed; its streams go on", token_id=token_id,
                                error=f"{type(exc).__name__}: {exc}")
                    continue
                self._forget(token_id)
                return
        finally:
            if self._rechecks.get(token_id) is asyncio.current_task():
                del self._rechecks[token_id]

    async def create(self, name: str, role: int) -> tuple[str, str]:
        if role not in ROLE_NAMES:
            raise InvalidArgument(f"role {role} is not one of PUBLISHER, ISLAND, READER, ADMIN")
        if not name or len(name) > 128:
            raise InvalidArgument("name must be 1-128 characters (who or what the token is for)")
        token_id, token = new_token()
        await self.store.put_token(token_id, name, role, token)
        return token_id, token

    async def revoke(self, token_id: str) -> bool:
        """Revoke a token (``RevokeToken``); returns whether a token was stored under the id. A
        bootstrap token's id is retired for good, stored now or not (a start may have retired it
        softly): no start stores it again."""
        for_good = is_bootstrap_id(token_id)
        stored = await self.store.revoke_token(token_id, for_good=for_good)
        if for_good:
            log.warning("admin token retired for good: no start stores it again; drop it from the config",
                        token_id=token_id, was_stored=stored)
        self._forget(token_id)
        return stored

    def _forget(self, token_id: str) -> None:
        """Drop ``token_id`` from the cache and end the streams this board serves with it."""
        self._cache = {k: v for k, v in self._cache.items() if not (v[1] and v[1].token_id == token_id)}
        for future in self._revocations.pop(token_id, ()):
            if not future.done():
                future.set_result(None)
        recheck = self._rechecks.pop(token_id, None)
        if recheck is not None and recheck is not asyncio.current_task():
            recheck.cancel()

    async def _lookup(self, token: str) -> TokenInfo | None:
        key = token_hash(token)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        info = await self.store.lookup_token(token)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[key] = (now + self.cache_ttl_s, info)
        return info
