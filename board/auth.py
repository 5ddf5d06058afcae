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
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Sequence

from weftboard.board.store import RedisStore, TokenInfo, token_hash
from weftboard.proto.errors import InvalidArgument, PermissionDenied, Unauthenticated
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

ROLE_NAMES = {PUBLISHER: "PUBLISHER", ISLAND: "ISLAND", READER: "READER", ADMIN: "ADMIN"}


def allowed(method: str, role: int) -> bool:
    return role == ADMIN or role in METHOD_ROLES[method]


def new_token() -> tuple[str, str]:
    """A fresh (token id, token). The id is public (logs, revocation); the token is secret."""
    token_id = secrets.token_hex(8)
    return token_id, f"wb_{secrets.token_urlsafe(32)}"


def bootstrap_id(token: str) -> str:
    return "bootstrap-" + hashlib.sha256(token.encode()).hexdigest()[:12]


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

    def __init__(self, store: RedisStore, *, enabled: bool = True, cache_ttl_s: float = 2.0) -> None:
        self.store = store
        self.enabled = enabled
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, TokenInfo | None]] = {}

    async def bootstrap(self, admin_tokens: Sequence[str]) -> None:
        """Store configured admin tokens (hashed) so they work on every board replica."""
        for token in admin_tokens:
            if len(token) < 16:
                raise InvalidArgument("an admin token must be at least 16 characters; generate one with secrets")
            await self.store.put_token(bootstrap_id(token), "bootstrap-admin", ADMIN, token)

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

    async def create(self, name: str, role: int) -> tuple[str, str]:
        if role not in ROLE_NAMES:
            raise InvalidArgument(f"role {role} is not one of PUBLISHER, ISLAND, READER, ADMIN")
        if not name or len(name) > 128:
            raise InvalidArgument("name must be 1-128 characters (who or what the token is for)")
        token_id, token = new_token()
        await self.store.put_token(token_id, name, role, token)
        return token_id, token

    async def revoke(self, token_id: str) -> None:
        await self.store.revoke_token(token_id)
        self._cache = {k: v for k, v in self._cache.items() if not (v[1] and v[1].token_id == token_id)}

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
