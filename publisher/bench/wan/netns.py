"""Network namespaces, veth pairs and ``tbf`` rate limits for simulated WAN islands.

Each island gets a network namespace ``wb-isl-<pid>-<i>`` and a veth pair: ``wbh<pid>x<i>`` on the
host side, ``wbn<pid>x<i>`` inside the namespace, addressed from a private /30 inside
10.203.0.0/16 (host .1, namespace .2). Both ends carry a ``tbf`` qdisc, so the link is rate
limited in both directions.

Invariants:
- Only objects this module created are ever touched: names carry our prefix and the creating
  process id, and the /30s are chosen free of every address already configured on the host
  (under a file lock, so concurrent runs never pick the same block).
- Objects of a process that no longer exists are stale and removed by ``remove_stale()``; those of
  a live process are never removed by anyone else.
- Every command has a timeout and its failure says which command failed and what it printed.
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from weftboard.proto.errors import FailedPrecondition

NS_PREFIX = "wb-isl-"
PROBE_PREFIX = "wb-probe-"
HOST_IF_PREFIX = "wbh"
NS_IF_PREFIX = "wbn"
POOL = ipaddress.ip_network("10.203.0.0/16")
LOCK_PATH = Path(tempfile.gettempdir()) / "weftboard-wan.lock"
COMMAND_TIMEOUT_S = 15.0
CLONE_NEWNET = 0x40000000

# Names are unique per process (pid) and per island within it (a process-wide sequence), so two
# topologies in one process, or two processes, never share a name.
_sequence = itertools.count()
_sequence_lock = threading.Lock()

_NS_NAME = re.compile(rf"^(?:{NS_PREFIX}|{PROBE_PREFIX})(\d+)(?:-\d+)?$")
_IF_NAME = re.compile(rf"^(?:{HOST_IF_PREFIX}|{NS_IF_PREFIX})(\d+)x\d+$")


class WanUnavailable(FailedPrecondition):
    """This machine cannot simulate a WAN (not root, no iproute2, no netns or tbf support)."""


class WanCommandError(RuntimeError):
    """An ``ip``/``tc`` command failed while building or tearing down the topology."""


@dataclass(frozen=True)
class IslandNet:
    """One island's namespace and the two ends of its link."""

    index: int
    namespace: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str

    @property
    def exec_prefix(self) -> list[str]:
        """Prefix a command line with this to run it inside the island's namespace."""
        return ["ip", "netns", "exec", self.namespace]


def run(args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise WanCommandError(f"`{' '.join(args)}` did not finish in {COMMAND_TIMEOUT_S}s") from exc
    if check and result.returncode != 0:
        raise WanCommandError(
            f"`{' '.join(args)}` failed (exit {result.returncode}): {result.stderr.strip()}"
        )
    return result


def tbf_args(rate_mbit: float) -> list[str]:
    """tbf parameters: a bucket of at least ~5 ms of traffic (and 64 KiB, for GSO packets),
    a queue of 50 ms before drops (TCP small queues keep it shorter in practice)."""
    rate_bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes_per_s * 0.005))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "50ms"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    out = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links() -> list[str]:
    out = run(["ip", "-o", "link", "show"]).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def remove_stale() -> list[str]:
    """Delete namespaces and host-side veths left by weftboard processes that have died."""
    removed = []
    for name in list_namespaces():
        m = _NS_NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for name in list_links():
        m = _IF_NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            run(["ip", "link", "del", name], check=False)
            removed.append(name)
    return removed


def _setns(namespace: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def namespace_executor(namespace: str) -> ThreadPoolExecutor:
    """A one-thread executor living inside ``namespace``: sockets created there belong to it.

    A socket keeps the namespace it was created in, so the event loop (in the host namespace)
    can use it afterwards; only socket creation has to run on this thread.
    """
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=f"netns-{namespace}", initializer=_setns,
        initargs=(namespace,),
    )


def check_capability() -> None:
    """Raise WanUnavailable with the reason unless this machine can build the topology."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        uid = os.geteuid() if hasattr(os, "geteuid") else "n/a"
        raise WanUnavailable(
            f"the WAN simulation needs root for network namespaces and tc (running as uid {uid})"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise WanUnavailable(
            f"the WAN simulation needs iproute2 ({', '.join(missing)} not on PATH); "
            "install it with `apt-get install -y iproute2`"
        )
    probe = f"{PROBE_PREFIX}{os.getpid()}"
    try:
        steps = [
            (["ip", "netns", "add", probe], "create a network namespace"),
            (["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
             "create a veth pair"),
            (["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", *tbf_args(100)],
             "add a tbf qdisc"),
        ]
        for args, what in steps:
            try:
                run(args)
            except WanCommandError as exc:
                raise WanUnavailable(f"this machine cannot {what}: {exc}") from exc
        try:
            with namespace_executor(probe) as ex:
                ex.submit(lambda: None).result(timeout=COMMAND_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure means: not available here
            raise WanUnavailable(f"cannot enter a network namespace from Python: {exc!r}") from exc
    finally:
        run(["ip", "netns", "del", probe], check=False)


@contextmanager
def allocation_lock() -> Iterator[None]:
    """Serialise /30 allocation between concurrent processes on this host."""
    with open(LOCK_PATH, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def used_networks() -> list[ipaddress.IPv4Network]:
    out = run(["ip", "-4", "-o", "addr", "show"]).stdout
    nets = []
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            nets.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    return nets


def free_blocks(count: int) -> list[ipaddress.IPv4Network]:
    """``count`` /30s from the pool that overlap nothing configured on the host. Call under
    ``allocation_lock()`` and configure them before releasing it."""
    used = used_networks()
    blocks = []
    for block in POOL.subnets(new_prefix=30):
        if not any(block.overlaps(net) for net in used):
            blocks.append(block)
            if len(blocks) == count:
                return blocks
    raise WanUnavailable(f"no {count} free /30 blocks left in {POOL} on this host")


def create_island(index: int, block: ipaddress.IPv4Network, rate_mbit: float) -> IslandNet:
    """Build one island; on failure remove what was built and re-raise.

    ``index`` is the island's position in its topology; names use a process-wide sequence."""
    pid = os.getpid()
    with _sequence_lock:
        seq = next(_sequence)
    host_ip, ns_ip = (str(a) for a in list(block.hosts())[:2])
    net = IslandNet(
        index=index,
        namespace=f"{NS_PREFIX}{pid}-{seq}",
        host_if=f"{HOST_IF_PREFIX}{pid}x{seq}",
        ns_if=f"{NS_IF_PREFIX}{pid}x{seq}",
        host_ip=host_ip,
        ns_ip=ns_ip,
    )
    ns, prefix = net.namespace, f"/{block.prefixlen}"
    try:
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "add", net.host_if, "type", "veth", "peer", "name", net.ns_if])
        run(["ip", "link", "set", net.ns_if, "netns", ns])
        run(["ip", "addr", "add", host_ip + prefix, "dev", net.host_if])
        run(["ip", "link", "set", net.host_if, "up"])
        run(["ip", "-n", ns, "addr", "add", ns_ip + prefix, "dev", net.ns_if])
        run(["ip", "-n", ns, "link", "set", net.ns_if, "up"])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        run(["tc", "qdisc", "add", "dev", net.host_if, "root", *tbf_args(rate_mbit)])
        run(["tc", "-n", ns, "qdisc", "add", "dev", net.ns_if, "root", *tbf_args(rate_mbit)])
    except BaseException:
        destroy_island(net)
        raise
    return net


def tbf_drops(qdiscs_json: str) -> int:
    """Packets the ``tbf`` qdiscs in ``tc -s -j qdisc show`` output dropped (its queue was full:
    the relays pushed more than the link and its 50 ms queue hold)."""
    return sum(int(q.get("drops", 0)) for q in json.loads(qdiscs_json or "[]") if q.get("kind") == "tbf")


def queue_drops(net: IslandNet) -> int:
    """Packets dropped so far by the rate limits on both ends of one island's link."""
    host = run(["tc", "-s", "-j", "qdisc", "show", "dev", net.host_if]).stdout
    island = run(["tc", "-n", net.namespace, "-s", "-j", "qdisc", "show", "dev", net.ns_if]).stdout
    return tbf_drops(host) + tbf_drops(island)


def destroy_island(net: IslandNet) -> None:
    """Remove the namespace and the host-side veth; idempotent, never raises for absent ones."""
    run(["ip", "netns", "del", net.namespace], check=False)
    # Deleting the namespace destroys the peer asynchronously; delete the host end explicitly
    # so its address is free at once for the next allocation.
    run(["ip", "link", "del", net.host_if], check=False)

