"""Islands behind simulated WAN links: namespaces + tbf rate limits + delaying relays.

For each island ``i`` and each loopback target port ``P`` (the board's gRPC port, the S3 port):

    island process (in namespace)          host namespace
    127.0.0.1:P ──forwarder──► veth (tbf) ──► relay on <host veth ip>:Q ──(+delay)──► 127.0.0.1:P

- the relay on the host side adds ``rtt/2`` in each direction and forwards to the loopback target;
- the veth carries a ``tbf`` limit on both ends, so all island traffic is rate limited;
- inside the namespace a plain forwarder listens on 127.0.0.1:P, so an island process started
  with ``prefix(i)`` reaches the same addresses as on loopback, unchanged: presigned URLs and
  signed S3 requests keep their Host header. ``address(i, P)`` gives the relay's own address for
  callers that prefer to pass explicit endpoints.

Invariants:
- Only loopback targets are relayed, and only namespaces/links this process created are touched.
- Everything is torn down on exit, on error during setup, and on KeyboardInterrupt; an ``atexit``
  hook covers an interpreter exit without ``__exit__``; ``remove_stale()`` at start removes what a
  killed run left behind.
- Relays run on their own event loop in a daemon thread, so they keep flowing while the caller
  blocks (a synchronous bench) or computes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ipaddress
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from weftboard.publisher.wan import netns
from weftboard.publisher.wan.netns import IslandNet
from weftboard.publisher.wan.relay import DelayRelay

log = structlog.get_logger(__name__)

STARTUP_TIMEOUT_S = 30.0


class WanTopology:
    """``islands`` namespaces, each behind its own ``rate_mbit`` / ``rtt_ms`` link to loopback.

    Use as a context manager (sync or async). ``prefix(i)`` is the command-line prefix that runs a
    process inside island ``i``.
    """

    def __init__(
        self,
        islands: int,
        target_ports: Sequence[int],
        *,
        rate_mbit: float = 100.0,
        rtt_ms: float = 40.0,
        target_host: str = "127.0.0.1",
        loopback_forwarders: bool = True,
    ) -> None:
        if islands < 1:
            raise ValueError(f"islands must be >= 1, got {islands}")
        if rate_mbit <= 0 or rtt_ms < 0:
            raise ValueError(f"need rate_mbit > 0 and rtt_ms >= 0, got {rate_mbit}, {rtt_ms}")
        if not ipaddress.ip_address(target_host).is_loopback:
            raise ValueError(f"only loopback targets may be relayed, got {target_host}")
        self.islands = islands
        self.target_ports = list(dict.fromkeys(target_ports))
        self.rate_mbit = rate_mbit
        self.rtt_ms = rtt_ms
        self.target_host = target_host
        self.loopback_forwarders = loopback_forwarders
        self.nets: list[IslandNet] = []
        self._relays: dict[tuple[int, int], DelayRelay] = {}
        self._forwarders: list[DelayRelay] = []
        self._executors: list[ThreadPoolExecutor] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = True

    # ---- what callers use -------------------------------------------------------------------

    def prefix(self, island: int) -> list[str]:
        return self.nets[island].exec_prefix

    def namespace(self, island: int) -> str:
        return self.nets[island].namespace

    def address(self, island: int, port: int) -> tuple[str, int]:
        """Where island ``island`` reaches loopback port ``port`` through the relay."""
        return self._relays[(island, port)].address

    def endpoint(self, island: int, port: int) -> str:
        host, relay_port = self.address(island, port)
        return f"{host}:{relay_port}"

    def describe(self) -> dict[str, float]:
        return {"rate_mbit": self.rate_mbit, "rtt_ms": self.rtt_ms}

    # ---- lifecycle --------------------------------------------------------------------------

    def open(self) -> WanTopology:
        netns.check_capability()
        removed = netns.remove_stale()
        if removed:
            log.info("wan_removed_stale", names=removed)
        self._closed = False
        atexit.register(self.close)
        try:
            with netns.allocation_lock():
                blocks = netns.free_blocks(self.islands)
                for index, block in enumerate(blocks):
                    self.nets.append(netns.create_island(index, block, self.rate_mbit))
            self._start_loop()
            self._call(self._start_relays())
        except BaseException:
            self.close()
            raise
        log.info("wan_up", islands=[n.namespace for n in self.nets], **self.describe())
        return self

    def close(self) -> None:
        """Stop relays and remove every namespace and link; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            if self._loop is not None and self._loop.is_running():
                with contextlib.suppress(Exception):
                    self._call(self._stop_relays(), timeout=15.0)
                self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=15.0)
            for executor in self._executors:
                executor.shutdown(wait=False)
        finally:
            for net in self.nets:
                netns.destroy_island(net)
            log.info("wan_down", islands=[n.namespace for n in self.nets])

    def __enter__(self) -> WanTopology:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> WanTopology:
        return await asyncio.to_thread(self.open)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    # ---- relay loop -------------------------------------------------------------------------

    def _start_loop(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="wan-relays", daemon=True)
        self._thread.start()
        if not ready.wait(STARTUP_TIMEOUT_S):
            raise RuntimeError("the WAN relay loop did not start")

    def _call(self, coro: Any, timeout: float = STARTUP_TIMEOUT_S) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start_relays(self) -> None:
        loop = asyncio.get_running_loop()
        delay_s = self.rtt_ms / 2000.0
        for i, net in enumerate(self.nets):
            executor = netns.namespace_executor(net.namespace)
            self._executors.append(executor)
            for port in self.target_ports:
                relay = DelayRelay((self.target_host, port), delay_s, listen=(net.host_ip, 0))
                self._relays[(i, port)] = await relay.start()
                if not self.loopback_forwarders:
                    continue
                listen_sock = await loop.run_in_executor(
                    executor, _listening_socket, self.target_host, port
                )

                async def make_socket(ex: ThreadPoolExecutor = executor) -> socket.socket:
                    return await loop.run_in_executor(ex, socket.socket)

                forwarder = DelayRelay(
                    relay.address, 0.0, listen_sock=listen_sock, make_socket=make_socket
                )
                self._forwarders.append(await forwarder.start())

    async def _stop_relays(self) -> None:
        await asyncio.gather(
            *(r.close() for r in [*self._forwarders, *self._relays.values()]),
            return_exceptions=True,
        )

    def bytes_forwarded(self, island: int) -> int:
        """Bytes the host-side relays of one island forwarded (both directions)."""
        return sum(r.bytes_forwarded for (i, _), r in self._relays.items() if i == island)


def _listening_socket(host: str, port: int) -> socket.socket:
    """Runs on a namespace thread: the socket belongs to that namespace's loopback."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
