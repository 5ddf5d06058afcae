"""How the board reaches Redis: one node or a Redis Cluster, plaintext or TLS, from one URL.

URL forms (``--redis-url``, ``WEFTBOARD_REDIS_URL``):
- ``redis://[user:password@]host:port[/db]``: one node (``rediss://`` for TLS; ``unix://`` too);
- ``redis+cluster://[user:password@]host:port[,host:port...]``: a Redis Cluster, found from
  any of the seed nodes listed (``rediss+cluster://`` for TLS);
- ``redis://host:port,host:port[,...]`` (more than one node): a Redis Cluster as well.
TLS query options (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``)
apply to both forms.

Invariants:
- A cluster URL never names a database (a cluster has only database 0): ``/1`` is refused.
- Both kinds of client expose the same commands, scripts and pipelines; everything the store
  sends is single-slot (one run's hash tag), so it runs unchanged on either.
- The password never appears in ``redacted`` (what logs and errors print).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from weftboard.proto.errors import InvalidArgument

__all__ = ["RedisTarget", "open_redis", "parse_redis_url"]

_CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
_NODE_SCHEMES = {"redis": False, "rediss": True}
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis URL: the nodes to try, whether it is a cluster, TLS and credentials."""

    url: str
    nodes: tuple[tuple[str, int], ...]
    cluster: bool
    tls: bool
    username: str | None = None
    password: str | None = None
    db: int = 0
    tls_options: dict[str, str] = field(default_factory=dict)

    @property
    def redacted(self) -> str:
        """The URL without its credentials."""
        if not self.nodes:
            return _redact(self.url)
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}" + ("" if self.cluster else f"/{self.db}")


def parse_redis_url(url: str) -> RedisTarget:
    """Parse one of the forms above; a malformed URL is an ``InvalidArgument`` naming it."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "unix":  # one node over a Unix socket: redis-py reads the rest
        return RedisTarget(url, (), cluster=False, tls=False)
    if scheme not in _CLUSTER_SCHEMES and scheme not in _NODE_SCHEMES:
        raise InvalidArgument(f"unsupported Redis URL scheme {parts.scheme!r} in {_redact(url)!r}: use redis://, "
                              f"rediss://, redis+cluster:// or rediss+cluster://")
    creds, _, hostlist = parts.netloc.rpartition("@")
    username, _, password = creds.partition(":") if creds else ("", "", "")
    nodes: list[tuple[str, int]] = []
    for item in filter(None, hostlist.split(",")):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "6379")
        try:
            nodes.append((host.strip("[]") or "127.0.0.1", int(port)))
        except ValueError:
            raise InvalidArgument(f"bad Redis node {item!r} in {_redact(url)!r} (want host:port)") from None
    if not nodes:
        raise InvalidArgument(f"no Redis node in {_redact(url)!r}")
    cluster = scheme in _CLUSTER_SCHEMES or len(nodes) > 1
    tls = _CLUSTER_SCHEMES.get(scheme, _NODE_SCHEMES.get(scheme, False))
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise InvalidArgument(f"bad Redis database {path!r} in {_redact(url)!r}")
    db = int(path or 0)
    if cluster and db:
        raise InvalidArgument(f"a Redis Cluster has only database 0, {_redact(url)!r} asks for {db}")
    query = dict(parse_qsl(parts.query))
    return RedisTarget(url, tuple(nodes), cluster, tls, unquote(username) or None, unquote(password) or None, db,
                       {k: v for k, v in query.items() if k in _TLS_OPTIONS})


def _redact(url: str) -> str:
    parts = urlsplit(url)
    return url.replace(parts.netloc, parts.netloc.rpartition("@")[2]) if "@" in parts.netloc else url


def open_redis(
    target: RedisTarget, *, socket_timeout_s: float, connect_timeout_s: float, max_connections: int
) -> aioredis.Redis | RedisCluster:
    """A client for ``target``: a ``Redis`` on a blocking pool (a burst of requests waits for a
    free connection instead of failing), or a ``RedisCluster`` (a pool per node)."""
    if target.cluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
            username=target.username,
            password=target.password,
            ssl=target.tls,
            max_connections=max_connections,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            **target.tls_options,
        )
    return aioredis.Redis(
        connection_pool=aioredis.BlockingConnectionPool.from_url(
            target.url,
            max_connections=max_connections,
            timeout=connect_timeout_s,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
        )
    )
