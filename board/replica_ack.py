"""A commit that waits for Redis replicas: the compare-and-set and ``WAIT`` on one connection.

Redis replicates asynchronously: a master that dies right after a commit may take it along,
and the replica promoted in its place never saw it. With ``min_replicas`` set, the board runs
the commit script and ``WAIT min_replicas timeout`` in one pipeline (one connection, so
``WAIT`` covers that script's writes; on a cluster, the node of the run's slot) and answers
only when that many replicas hold the write.

Invariants:
- ``WAIT`` counts replicas that acknowledged this connection's last write; the commit script
  writes on every path it answers for a record (a retried identical commit too), and the
  replication stream is ordered, so an acknowledgement covers the first commit of the record.
- A shortfall is not a rollback: the version stays committed on the master and the caller is
  told so (``Unavailable``, retryable; the retry is the idempotent identical commit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from weftboard.proto.errors import Unavailable


class ReplicaShortfall(Unavailable):
    """The commit is on the master, but fewer replicas than asked acknowledged it in time."""


async def eval_and_wait(redis: Any, script: str, keys: Sequence[str], args: Sequence[Any], *,
                        min_replicas: int, timeout_ms: int) -> Any:
    """Run ``script`` then ``WAIT`` on one connection; the script's result once ``min_replicas``
    replicas acknowledged its writes, else ``ReplicaShortfall``."""
    pipe = redis.pipeline(transaction=False)
    pipe.eval(script, len(keys), *keys, *args)
    if isinstance(redis, RedisCluster):  # WAIT names no key: route it to the slot's node
        pipe.execute_command("WAIT", min_replicas, timeout_ms, target_nodes=redis.get_node_from_key(keys[0]))
    else:
        pipe.execute_command("WAIT", min_replicas, timeout_ms)
    result, acked = await pipe.execute()
    if int(acked) < min_replicas:
        raise ReplicaShortfall(
            f"the commit is on the Redis master, but {int(acked)} of the {min_replicas} replicas asked for "
            f"acknowledged it within {timeout_ms} ms; retry the identical commit (it is idempotent)")
    return result


async def touch_and_wait(redis: Any, key: str, *, min_replicas: int, timeout_ms: int, now_ms: int) -> None:
    """A write to ``key``'s hash then ``WAIT``: the replicas acknowledge everything written to
    the slot before it (an earlier commit whose answer was a shortfall), or ``ReplicaShortfall``."""
    await eval_and_wait(redis, "redis.call('HSET', KEYS[1], 'seen_ms', ARGV[1]) return 0", [key], [now_ms],
                        min_replicas=min_replicas, timeout_ms=timeout_ms)
