"""A real Redis Cluster on loopback, for the replica bench and the cluster tests.

``start_cluster`` runs ``masters`` x (1 + ``replicas_per_master``) ``redis-server --cluster-enabled
yes`` processes and joins them with ``redis-cli --cluster create ... --cluster-yes``.

Invariants:
- It returns only once every slot is served (``cluster_state:ok`` on every node) and every
  replica is attached, so a board started on ``url`` sees the whole keyspace.
- ``url`` is the ``redis+cluster://`` seed list of every node; any one of them is enough.
- ``stop`` ends every process it started (also those a test already killed).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from weftboard.board.embedded import free_port, redis_server_binary

LOOPBACK = "127.0.0.1"


@dataclass
class ClusterNode:
    port: int
    process: subprocess.Popen[bytes]
    dir: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def cli(self, *args: str, timeout_s: float = 10.0) -> str:
        return _cli(["-p", str(self.port), *args], timeout_s)


@dataclass
class RedisCluster:
    nodes: list[ClusterNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{LOOPBACK}:{n.port}" for n in self.nodes)

    def masters(self) -> list[ClusterNode]:
        """Live nodes that are masters now (their role can change on failover)."""
        return [n for n in self.nodes if n.alive() and "role:master" in n.cli("info", "replication")]

    def master_of(self, key: str) -> ClusterNode:
        """The live master that serves ``key``'s slot now."""
        by_port = {n.port: n for n in self.nodes if n.alive()}
        asker = next(iter(by_port.values()))
        slot = int(asker.cli("cluster", "keyslot", key).strip())
        for line in asker.cli("cluster", "nodes").splitlines():
            parts = line.split()
            if "master" not in parts[2] or "fail" in parts[2]:
                continue
            port = int(parts[1].split("@", 1)[0].rsplit(":", 1)[1])
            for span in parts[8:]:
                lo, _, hi = span.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo) and port in by_port:
                    return by_port[port]
        raise RuntimeError(f"no live master serves the slot of {key!r}")

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        """The live nodes replicating ``master`` now."""
        return [n for n in self.nodes if n.alive() and n is not master
                and f"master_port:{master.port}" in n.cli("info", "replication")]

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` (after a failover too)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes if n.alive()):
                    return
            except (subprocess.SubprocessError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the Redis Cluster did not reach cluster_state:ok in {timeout_s:.0f}s")

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive():
                node.process.terminate()
        for node in self.nodes:
            try:
                node.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.kill()


def _cli(args: list[str], timeout_s: float) -> str:
    binary = shutil.which("redis-cli") or str(redis_server_binary().with_name("redis-cli"))
    done = subprocess.run([binary, "-h", LOOPBACK, *args], capture_output=True, timeout=timeout_s, check=True)
    return done.stdout.decode()


def start_cluster(workdir: Path, masters: int = 3, replicas_per_master: int = 1,
                  node_timeout_ms: int = 1000) -> RedisCluster:
    """Start and join a cluster; ``node_timeout_ms`` bounds how soon a dead master's replica takes over."""
    cluster = RedisCluster()
    binary = str(redis_server_binary())
    try:
        for _ in range(masters * (1 + replicas_per_master)):
            port = _cluster_port()
            node_dir = Path(workdir) / f"node-{port}"
            node_dir.mkdir(parents=True, exist_ok=True)
            log = open(node_dir / "redis.log", "wb")  # noqa: SIM115 - the child keeps it
            process = subprocess.Popen(
                [binary, "--port", str(port), "--bind", LOOPBACK, "--dir", str(node_dir),
                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(node_timeout_ms), "--appendonly", "no", "--save", "",
                 "--daemonize", "no", "--cluster-replica-validity-factor", "0"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ),
            )
            log.close()
            cluster.nodes.append(ClusterNode(port, process, node_dir))
        for node in cluster.nodes:
            _wait_ping(node)
        _cli(["--cluster", "create", *(f"{LOOPBACK}:{n.port}" for n in cluster.nodes),
              "--cluster-replicas", str(replicas_per_master), "--cluster-yes"], timeout_s=60)
        cluster.wait_ok()
        _wait_replicas(cluster, masters * replicas_per_master)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, as Redis Cluster needs."""
    for _ in range(200):
        port = free_port()
        if port <= 55535 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _wait_ping(node: ClusterNode, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not node.alive():
            raise RuntimeError(f"redis-server on port {node.port} exited: "
                               f"{(node.dir / 'redis.log').read_text(errors='replace')[-2000:]}")
        try:
            if "PONG" in node.cli("ping", timeout_s=2):
                return
        except (subprocess.SubprocessError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {node.port} did not answer in {timeout_s:.0f}s")


def _wait_replicas(cluster: RedisCluster, want: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        linked = sum("master_link_status:up" in n.cli("info", "replication") for n in cluster.nodes)
        if linked >= want:
            return
        time.sleep(0.2)
    raise RuntimeError(f"only some of {want} Redis replicas attached in {timeout_s:.0f}s")
