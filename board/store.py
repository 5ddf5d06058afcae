"""The board's metadata in Redis: runs, versions, head, commit events, islands, trajectories, tokens.

Key layout (every key of a run carries the hash tag ``{<run>}`` so a run lives in one
Redis Cluster slot and the commit script touches one slot only):

- ``wb:runs``                    sorted set of run names (score 0; lexicographic listing)
- ``wb:{run}:run``               serialized ``Run`` (without head / oldest_available; with its model files)
- ``wb:{run}:state``             hash: head, committed_at_ms, oldest
- ``wb:{run}:versions``          hash: version -> deterministic ``VersionRecord`` bytes, committed_at_ms = 0
- ``wb:{run}:committed``         hash: version -> committed_at_ms
- ``wb:{run}:index``             hash: version -> compact ``VersionRecord`` (version, root digest,
                                 artifacts only): what catch-up planning and GC read, so they
                                 never parse hundreds of tensor digests per version
- ``wb:{run}:events``            stream of commits; entry id ``<version>-1``, fields v, r (record bytes), t
- ``wb:{run}:islands``           hash: island id -> serialized ``IslandStatus``
- ``wb:{run}:seen``              hash: island id -> last_seen_ms
- ``wb:{run}:leases``            sorted set: island id scored by lease expiry (ms)
- ``wb:{run}:traj``              stream of trajectory records (field r), consumer groups on it
- ``wb:{run}:checked``           hash: blob key -> "<size>:<version>:<checked_ms>" of the parts
                                 (and anchor files) StagePart found; no expiry: a commit takes out the keys it names
                                 and moves the rest of its version and older to the orphans
- ``wb:{run}:orphans``           hash: blob key -> size of staged parts whose version was committed
                                 without them (a publisher that restarted mid-version); GC deletes them
- ``wb:{run}:uploads``           hash: upload id -> JSON of a multipart upload (``board/uploads.py``)
- ``wb:{tokens}:...``            tokens: by id, by hash, bootstrap start numbers and ids retired
  for good (``board/store_tokens.py``; one hash tag for all tokens, so creating and revoking
  stay one-slot transactions)

Invariants:
- Every script, pipeline and multi-key command names keys of ONE hash tag (a run, or
  ``{tokens}``), so each runs on one Redis Cluster slot; ``wb:runs`` is written on its own.
- A version is written only by ``COMMIT_LUA`` (``store_scripts.py``), which checks
  idempotence, then the compare-and-set (head == n-1), then writes record, head and the
  commit event in one atomic step: a half-published version is never visible and an event
  exists for every committed version.
- Stream entry ids of the events stream are the version numbers, so a watcher resumes
  with ``XRANGE (<after>-1 +`` and gaps are impossible to hide.
- ``oldest`` only moves forward.
- A staged part is an orphan only once its version is committed: its container names that
  version, so no other version's record can name its key.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPubSub, RedisCluster
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import (
    AuthenticationWrongNumberOfArgsError,
    ClusterError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from weftboard.board.redis_conn import open_redis, parse_redis_url
from weftboard.board.replica_ack import eval_and_wait, touch_and_wait
from weftboard.board.store_scripts import (
    ADD_TRAJECTORIES_LUA,
    ADVANCE_OLDEST_LUA,
    COMMIT_LUA,
    FORGET_ISLANDS_LUA,
    SETTLE_STAGED_LUA,
)
from weftboard.board.store_tokens import TokenStore
from weftboard.proto.commit import CommitReport, StoreResult
from weftboard.proto.errors import NotFound, PermissionDenied, Unavailable
from weftboard.proto.v1 import board_pb2 as pb

# Redis unreachable, or a cluster between two states (a failover, a slot moving): retry later.
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, ClusterError, TryAgainError, RedisClusterException)
BLOCKING_LIMIT_S = 60.0  # longest BLOCK any caller may ask for


def now_ms() -> int:
    return int(time.time() * 1000)


def k_run(run: str) -> str:
    return f"wb:{{{run}}}:run"


def k_state(run: str) -> str:
    return f"wb:{{{run}}}:state"


def k_versions(run: str) -> str:
    return f"wb:{{{run}}}:versions"


def k_committed(run: str) -> str:
    return f"wb:{{{run}}}:committed"


def k_index(run: str) -> str:
    return f"wb:{{{run}}}:index"


def k_events(run: str) -> str:
    return f"wb:{{{run}}}:events"


def k_staged(run: str) -> str:
    """Pub/Sub channel of a run's staged-part hints (not a key: nothing is stored)."""
    return f"wb:{{{run}}}:staged"


def k_checked(run: str) -> str:
    """Hash: blob key -> "<size>:<version>:<checked_ms>", for parts StagePart found in the blob store.

    No TTL on the hash: it is the ledger of staged parts as well as a cache of their checks,
    and a part of a version that never committed must stay known until GC can delete it.
    The check alone goes stale, by its own time (``checked_sizes``)."""
    return f"wb:{{{run}}}:checked"


def k_orphans(run: str) -> str:
    """Hash: blob key -> size, staged parts of committed versions that their record does not name."""
    return f"wb:{{{run}}}:orphans"


CHECKED_TTL_S = 900  # how long a StagePart's existence check stands in for the commit's (the entry stays)


def k_islands(run: str) -> str:
    return f"wb:{{{run}}}:islands"


def k_seen(run: str) -> str:
    return f"wb:{{{run}}}:seen"


def k_leases(run: str) -> str:
    return f"wb:{{{run}}}:leases"


def k_traj(run: str) -> str:
    return f"wb:{{{run}}}:traj"


RUNS_KEY = "wb:runs"
# Pub/Sub channel (not a key) on which the commit script names each run it committed a version
# of: every board process's feeds wake on it and read the run's events stream (``fanout.py``).
# Classic Pub/Sub reaches every node of a Redis Cluster, so one subscription anywhere hears all.
COMMITS_CHANNEL = "wb:commits"
PUBSUB_MAX_CONNECTIONS = 10_000  # Redis's own default limit of clients


def canonical_record(record: pb.VersionRecord) -> bytes:
    """Deterministic bytes of a record with the board's field cleared: what a retry must repeat."""
    copy = pb.VersionRecord()
    copy.CopyFrom(record)
    copy.committed_at_ms = 0
    return copy.SerializeToString(deterministic=True)


def compact_record(record: pb.VersionRecord) -> bytes:
    """The part of a record that planning and GC need: version, root digest, artifacts."""
    return pb.VersionRecord(
        run=record.run, version=record.version, root_digest=record.root_digest, artifacts=record.artifacts
    ).SerializeToString(deterministic=True)


@dataclass(frozen=True)
class RunState:
    head: int
    committed_at_ms: int
    oldest: int  # 0 when nothing is committed


@dataclass(frozen=True)
class IslandRow:
    status: pb.IslandStatus
    last_seen_ms: int
    lease_expires_at_ms: int


# The commit script's result codes 0-3; 4 (unknown run) is NOT_FOUND.
_COMMIT_RESULT = {
    0: StoreResult.COMMITTED,
    1: StoreResult.ALREADY_COMMITTED,
    2: StoreResult.EXISTS_DIFFERENT,
    3: StoreResult.HEAD_MISMATCH,
}


class RedisStore(TokenStore):
    """Async access to the board's Redis keys (tokens: ``TokenStore``).

    Connection failures surface as redis-py exceptions (``REDIS_ERRORS``), which the RPC
    guard turns into UNAVAILABLE; ``ping`` raises ``Unavailable`` itself.

    Two clients: one for short commands, one for blocking reads (a trajectory consumer's
    XREADGROUP BLOCK) so that a long wait never starves ordinary requests. Watch feeds block on
    neither: they wait on ``COMMITS_CHANNEL`` and read without blocking. Each is a single-node client
    or a ``RedisCluster`` as the URL says (``redis_conn``); every command, pipeline and script
    here names keys of one hash tag only, so it runs on one cluster slot.
    """

    def __init__(self, url: str, *, socket_timeout_s: float = 5.0, max_connections: int = 64,
                 min_replicas: int = 0, replica_timeout_ms: int = 1000) -> None:
        self.url = url
        self.min_replicas = min_replicas  # > 0: a commit answers once that many replicas hold it
        self.replica_timeout_ms = replica_timeout_ms
        self.target = parse_redis_url(url)
        self._socket_timeout_s = socket_timeout_s
        self.redis = open_redis(self.target, socket_timeout_s=socket_timeout_s, connect_timeout_s=socket_timeout_s,
                                max_connections=max_connections)
        # Blocking commands wait up to their BLOCK time (at most BLOCKING_LIMIT_S) before answering.
        self.blocking = open_redis(self.target, socket_timeout_s=BLOCKING_LIMIT_S + socket_timeout_s,
                                   connect_timeout_s=socket_timeout_s, max_connections=max_connections)
        # Pub/Sub connections (the commits listener; a hint listener per run whose watchers ask for
        # staged parts) each hold a connection while they listen: on a single Redis, from a client
        # of their own, so that however many runs are watched they never take a connection a
        # request needs. On a cluster they come from the request client's node pools: its slot
        # map is the one the board's commands keep current across a failover (a client that only
        # subscribes never refreshes its own), so a listener that reconnects finds the new master.
        self.pubsub_redis = open_redis(self.target, socket_timeout_s=socket_timeout_s,
                                       connect_timeout_s=socket_timeout_s, max_connections=PUBSUB_MAX_CONNECTIONS)
        self._commit = self.redis.register_script(COMMIT_LUA)
        self._advance = self.redis.register_script(ADVANCE_OLDEST_LUA)
        self._add_traj = self.redis.register_script(ADD_TRAJECTORIES_LUA)
        self._settle_staged = self.redis.register_script(SETTLE_STAGED_LUA)
        self._forget_islands = self.redis.register_script(FORGET_ISLANDS_LUA)

    async def close(self) -> None:
        for client in (self.redis, self.blocking, self.pubsub_redis):
            await client.aclose()
            if isinstance(client, aioredis.Redis):
                await client.connection_pool.disconnect()

    def _slot_node(self, key: str) -> dict:
        """Routing of a key-less command (Pub/Sub) to the node serving ``key``'s slot in a
        cluster, where PUBLISH and PUBSUB NUMSUB count that node's subscribers only."""
        if isinstance(self.redis, RedisCluster):
            return {"target_nodes": self.redis.get_node_from_key(key)}
        return {}

    async def ping(self) -> None:
        """Raise ``Unavailable`` while Redis does not answer, ``PermissionDenied`` when it refuses
        the credentials (a wrong or missing password: no retry will cure that)."""
        try:
            await self.redis.ping()
        except (RedisAuthenticationError, AuthenticationWrongNumberOfArgsError) as exc:
            raise PermissionDenied(f"Redis at {self.target.redacted} refused the credentials: {exc}") from None
        except REDIS_ERRORS as exc:
            raise Unavailable(f"Redis at {self.target.redacted} is unreachable: {exc}") from None

    # -- runs -------------------------------------------------------------

    async def create_run(self, run: pb.Run) -> tuple[pb.Run, bool]:
        """Store a run if absent. Returns (stored run, created)."""
        stored = pb.Run()
        stored.CopyFrom(run)
        stored.head = 0
        stored.oldest_available = 0
        data = stored.SerializeToString(deterministic=True)
        created = await self.redis.set(k_run(run.run), data, nx=True)
        # The listing index lives outside the run's slot, so it cannot join one atomic
        # step in Redis Cluster; adding it on every (idempotent) create heals a crash
        # between the two writes when the publisher retries.
        await self.redis.zadd(RUNS_KEY, {run.run: 0})
        if created:
            return stored, True
        return await self.get_run(run.run), False

    async def get_run(self, run: str) -> pb.Run:
        data, state = await self._pipeline(lambda p: (p.get(k_run(run)), p.hgetall(k_state(run))))
        if data is None:
            raise NotFound(f"run {run!r} does not exist; create it with CreateRun")
        message = pb.Run.FromString(data)
        st = _state(state)
        message.head = st.head
        message.oldest_available = st.oldest
        return message

    async def list_runs(self, after: str, limit: int) -> list[str]:
        start = b"(" + after.encode() if after else b"-"
        names = await self.redis.zrangebylex(RUNS_KEY, start, b"+", start=0, num=limit)
        return [n.decode() for n in names]

    async def run_state(self, run: str) -> RunState:
        return _state(await self.redis.hgetall(k_state(run)))

    # -- versions ---------------------------------------------------------

    async def commit(self, record: pb.VersionRecord) -> CommitReport:
        """Run the compare-and-set; what its result means is ``proto.commit.outcome_of_store``."""
        run = record.run
        keys = [k_state(run), k_versions(run), k_events(run), k_committed(run), k_run(run), k_index(run)]
        args = [record.version, canonical_record(record), now_ms(), compact_record(record), COMMITS_CHANNEL, run]
        if self.min_replicas:
            result = await eval_and_wait(self.redis, COMMIT_LUA, keys, args, min_replicas=self.min_replicas,
                                         timeout_ms=self.replica_timeout_ms)
        else:
            result = await self._commit(keys=keys, args=args)
        code, head, at = (int(x) for x in result)
        if code == 4:
            raise NotFound(f"run {run!r} does not exist; create it with CreateRun")
        return CommitReport(_COMMIT_RESULT[code], head, at)

    async def await_replicas(self, run: str) -> None:
        """With ``min_replicas``: return once that many replicas hold the run's writes so far."""
        if self.min_replicas:
            await touch_and_wait(self.redis, k_state(run), min_replicas=self.min_replicas,
                                 timeout_ms=self.replica_timeout_ms, now_ms=now_ms())

    async def existing_record(self, run: str, version: int) -> bytes | None:
        return await self.redis.hget(k_versions(run), str(version))

    async def get_versions(self, run: str, versions: Sequence[int]) -> dict[int, pb.VersionRecord]:
        """Records of the given versions that exist, with committed_at_ms filled."""
        if not versions:
            return {}
        fields = [str(v) for v in versions]
        records, times = await self._pipeline(
            lambda p: (p.hmget(k_versions(run), fields), p.hmget(k_committed(run), fields))
        )
        out: dict[int, pb.VersionRecord] = {}
        for v, data, at in zip(versions, records, times, strict=True):
            if data is not None:
                rec = pb.VersionRecord.FromString(data)
                rec.committed_at_ms = int(at or 0)
                out[v] = rec
        return out

    async def get_index(self, run: str, first: int, last: int) -> dict[int, pb.VersionRecord]:
        """Compact records (version, root digest, artifacts) of versions first..last that exist."""
        if last < first:
            return {}
        versions = range(first, last + 1)
        rows = await self.redis.hmget(k_index(run), [str(v) for v in versions])
        return {v: pb.VersionRecord.FromString(data) for v, data in zip(versions, rows, strict=True) if data is not None}

    async def events_after(self, run: str, after: int, count: int | None = None) -> list[pb.VersionRecord]:
        """Commit events of versions > ``after`` in order (XRANGE of the events stream)."""
        entries = await self.redis.xrange(k_events(run), min=f"({after}-1", max="+", count=count)
        return [event_record(fields) for _, fields in entries]

    async def publish_staged(self, run: str, version: int, key: str, size: int, payload: bytes | None) -> int:
        """Note that blob ``key`` (a part of ``version``) was found with ``size`` bytes, and hand a
        serialized ``WatchEvent`` (the staged part) to every board process's feed of ``run``, in
        one round trip; returns how many Redis subscribers got it (feeds, not watchers)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(k_checked(run), key, f"{size}:{version}:{now_ms()}")
        pipe.persist(k_checked(run))  # a hash written when it still had a TTL keeps none
        if payload is None or isinstance(self.redis, RedisCluster):  # None: an anchor file, only noted
            await pipe.execute()  # (and a cluster pipeline cannot route a key-less PUBLISH)
            return 0 if payload is None else int(await self.redis.publish(k_staged(run), payload,
                                                                           **self._slot_node(k_staged(run))))
        pipe.publish(k_staged(run), payload)
        return int((await pipe.execute())[-1])

    async def checked_sizes(self, run: str, keys: Sequence[str]) -> dict[str, int]:
        """Sizes StagePart found for these blob keys within ``CHECKED_TTL_S`` (others absent:
        older checks, and entries written before the check time was kept)."""
        if not keys:
            return {}
        values = await self.redis.hmget(k_checked(run), list(keys))
        fresh_after = now_ms() - CHECKED_TTL_S * 1000
        sizes: dict[str, int] = {}
        for key, value in zip(keys, values, strict=True):
            fields = value.split(b":") if value is not None else []
            if len(fields) == 3 and int(fields[2]) >= fresh_after:
                sizes[key] = int(fields[0])
        return sizes

    async def staged_notes(self, run: str) -> dict[str, tuple[int, int, int]]:
        """Every noted staged blob of ``run``: key -> (size, version, checked_ms); a note written
        before the check time was kept has checked_ms 0."""
        notes: dict[str, tuple[int, int, int]] = {}
        for raw_key, raw in (await self.redis.hgetall(k_checked(run))).items():
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            fields = (raw.decode() if isinstance(raw, bytes) else raw).split(":")
            size, version = int(fields[0]), int(fields[1]) if len(fields) > 1 else 0
            notes[key] = (size, version, int(fields[2]) if len(fields) == 3 else 0)
        return notes

    async def forget_staged_notes(self, run: str, keys: Sequence[str]) -> None:
        """Drop these blob keys' staged notes (their blobs are about to be collected)."""
        if keys:
            await self.redis.hdel(k_checked(run), *keys)

    async def settle_staged(self, run: str, version: int, named: Sequence[str]) -> int:
        """After ``version`` was committed naming the blob keys ``named``: drop their checks
        (so the checked hash holds only parts still in flight) and move the parts staged for
        this or an earlier version that no record named to the orphans; returns how many."""
        return int(await self._settle_staged(keys=[k_checked(run), k_orphans(run)], args=[version, *named]))

    async def orphans(self, run: str) -> dict[str, int]:
        """Staged parts no committed record names: blob key -> size."""
        return {k.decode(): int(s) for k, s in (await self.redis.hgetall(k_orphans(run))).items()}

    async def forget_orphans(self, run: str, keys: Sequence[str]) -> None:
        if keys:
            await self.redis.hdel(k_orphans(run), *keys)

    async def staged_feeds(self, run: str) -> int:
        """Board processes relaying ``run``'s staged-part hints now (subscribers of its channel:
        a feed subscribes while one of its watchers asks for hints)."""
        reply = await self.redis.pubsub_numsub(k_staged(run), **self._slot_node(k_staged(run)))
        return int(reply[0][1]) if reply else 0

    async def staged_listener(self, run: str) -> aioredis.client.PubSub | ClusterPubSub:
        """A Pub/Sub connection for ``k_staged(run)`` (the caller subscribes and closes it); in a
        cluster, on the node serving the run's slot, where the board publishes its hints."""
        if isinstance(self.redis, RedisCluster):
            await self.redis.initialize()  # (a no-op once the board's first command has run)
            return self.redis.pubsub(node=self.redis.get_node_from_key(k_staged(run)), ignore_subscribe_messages=True)
        return self.pubsub_redis.pubsub(ignore_subscribe_messages=True)

    async def commits_listener(self) -> aioredis.client.PubSub | ClusterPubSub:
        """A Pub/Sub connection for ``COMMITS_CHANNEL`` (the caller subscribes and closes it); in a
        cluster, on the node serving the channel's name, which hears every node's commits."""
        if isinstance(self.redis, RedisCluster):
            await self.redis.initialize()  # (a no-op once the board's first command has run)
            return self.redis.pubsub(node=self.redis.get_node_from_key(COMMITS_CHANNEL))
        return self.pubsub_redis.pubsub()

    async def events_from(self, run: str, cursor: bytes, count: int) -> list[tuple[bytes, dict]]:
        """Up to ``count`` entries of the run's events stream after the entry id ``cursor``, at
        once (an XREAD that does not block: it holds a pooled connection for one round trip)."""
        reply = await self.redis.xread({k_events(run): cursor}, count=count)
        if not reply:
            return []
        return reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]

    async def last_event_id(self, run: str) -> bytes:
        entries = await self.redis.xrevrange(k_events(run), max="+", min="-", count=1)
        return entries[0][0] if entries else b"0-0"

    async def advance_oldest(self, run: str, oldest: int) -> int:
        return int(await self._advance(keys=[k_state(run), k_events(run)], args=[oldest]))

    # -- islands ----------------------------------------------------------

    async def heartbeat(self, status: pb.IslandStatus, lease_s: int) -> int:
        run = status.run
        now = now_ms()
        expires = now + lease_s * 1000
        await self._pipeline(
            lambda p: (
                p.hset(k_islands(run), status.island_id, status.SerializeToString(deterministic=True)),
                p.hset(k_seen(run), status.island_id, now),
                p.zadd(k_leases(run), {status.island_id: expires}),
            ),
            transaction=True,
        )
        return expires

    async def islands(self, run: str, forget_before_ms: int | None = None) -> list[IslandRow]:
        """Every island of a run; those whose lease ended before ``forget_before_ms`` are deleted."""
        if forget_before_ms is not None:  # one script: a lease renewed meanwhile is not forgotten
            await self._forget_islands(keys=[k_islands(run), k_seen(run), k_leases(run)], args=[forget_before_ms])
        statuses, seen, leases = await self._pipeline(
            lambda p: (p.hgetall(k_islands(run)), p.hgetall(k_seen(run)), p.zrange(k_leases(run), 0, -1, withscores=True))
        )
        expiry = {name: int(score) for name, score in leases}
        rows = [
            IslandRow(pb.IslandStatus.FromString(data), int(seen.get(name, 0)), expiry.get(name, 0))
            for name, data in statuses.items()
        ]
        rows.sort(key=lambda r: r.status.island_id)
        return rows

    # -- trajectories -----------------------------------------------------

    async def add_trajectories(self, run: str, payloads: Sequence[bytes], maxlen: int | None) -> None:
        """XADD a whole batch in one script call: one round trip and one command to encode,
        not one per record (the ingest target is tens of thousands of records a second)."""
        if payloads:
            await self._add_traj(keys=[k_traj(run)], args=[maxlen or 0, *payloads])

    async def ensure_group(self, run: str, group: str) -> None:
        try:
            await self.redis.xgroup_create(k_traj(run), group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_group(
        self, run: str, group: str, consumer: str, count: int, block_ms: int | None
    ) -> list[tuple[bytes, dict]]:
        client = self.blocking if block_ms else self.redis
        reply = await client.xreadgroup(group, consumer, {k_traj(run): ">"}, count=count, block=block_ms or None)
        if not reply:
            return []
        # redis-py returns [[key, entries]] (RESP2) or {key: [entries]} (RESP3)
        entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        return [(eid, fields) for eid, fields in entries if fields]

    async def autoclaim(self, run: str, group: str, consumer: str, min_idle_ms: int, count: int) -> list[tuple[bytes, dict]]:
        """Claim entries pending longer than ``min_idle_ms``; entries trimmed meanwhile are acked away."""
        reply = await self.redis.xautoclaim(k_traj(run), group, consumer, min_idle_ms, start_id="0-0", count=count)
        entries = reply[1]
        deleted = reply[2] if len(reply) > 2 else []
        if deleted:
            await self.redis.xack(k_traj(run), group, *deleted)
        return [(eid, fields) for eid, fields in entries if fields]

    async def ack(self, run: str, group: str, ids: Sequence[str | bytes]) -> int:
        if not ids:
            return 0
        return int(await self.redis.xack(k_traj(run), group, *ids))

    # -- helpers ----------------------------------------------------------

    async def _pipeline(self, build, transaction: bool = False) -> list:
        pipe = self.redis.pipeline(transaction=transaction)
        build(pipe)
        return await pipe.execute()


def _state(raw: dict) -> RunState:
    return RunState(
        head=int(raw.get(b"head", 0)),
        committed_at_ms=int(raw.get(b"committed_at_ms", 0)),
        oldest=int(raw.get(b"oldest", 0)),
    )


def event_record(fields: dict) -> pb.VersionRecord:
    record = pb.VersionRecord.FromString(fields[b"r"])
    record.committed_at_ms = int(fields.get(b"t", 0))
    return record
