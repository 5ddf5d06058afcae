"""Islands behind simulated WAN links: namespaces + tbf rate limits + delaying relays.

For each island ``i`` and each loopback target port ``P`` (the board's gRPC port, the S3 port):

    island process (in namespace)          host namespace
    127.0.0.1:P ──forwarder──► veth (tbf) ──► relay on <host veth ip>:Q ──(+delay)──► 127.0.0.1:P

- the relay on the host side adds ``rtt/2`` in each direction and forwards to the loopback target;
  by default it also applies TCP slow start over the simulated round trip (``window.py``), since
  the real connections it terminates would otherwise skip it;
- the veth carries a ``tbf`` limit on both ends, so all island traffic is rate limited;
- inside the namespace a plain forwarder listens on 127.0.0.1:P, so an island process started
  with ``prefix(i)`` reaches the same addresses as on loopback, unchanged: presigned URLs and
  signed S3 requests keep their Host header. ``address(i, P)`` gives the relay's own address for
  callers that prefer to pass explicit endpoints.

Invariants:
- Only loopback targets are relayed, and only namespaces/links this process created are touched.
- Everything is torn down on exit, on error during setup, on KeyboardInterrupt and on SIGTERM
  (turned into SystemExit when no other handler is set); an ``atexit`` hook covers an
  interpreter exit without ``__exit__``; ``remove_stale()`` at start removes what a
  killed run left behind.
- Relays run in a child process (``relayd``) tethered to this one by its stdin, so they keep
  flowing while the caller blocks or computes (no GIL contention), and exit when we do.
"""

from __future__ import annotations

import asyncio
import atexit
import ipaddress
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

import structlog

from weftboard.publisher.bench.wan import netns
from weftboard.publisher.bench.wan.netns import IslandNet
from weftboard.publisher.bench.wan.relay import MARKER
from weftboard.publisher.bench.wan.window import check_loss

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
        slow_start: bool = True,
        loss: float = 0.0,
    ) -> None:
        if islands < 1:
            raise ValueError(f"islands must be >= 1, got {islands}")
        if rate_mbit <= 0 or rtt_ms < 0:
            raise ValueError(f"need rate_mbit > 0 and rtt_ms >= 0, got {rate_mbit}, {rtt_ms}")
        check_loss(loss, slow_start and rtt_ms > 0)
        if not ipaddress.ip_address(target_host).is_loopback:
            raise ValueError(f"only loopback targets may be relayed, got {target_host}")
        self.islands = islands
        self.target_ports = list(dict.fromkeys(target_ports))
        self.rate_mbit = rate_mbit
        self.rtt_ms = rtt_ms
        self.target_host = target_host
        self.loopback_forwarders = loopback_forwarders
        self.slow_start = slow_start
        self.loss = loss
        self.nets: list[IslandNet] = []
        self._relays: dict[tuple[int, int], tuple[str, int]] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._bytes_forwarded: list[int] | None = None
        self._closed = True

    # ---- what callers use -------------------------------------------------------------------

    def prefix(self, island: int) -> list[str]:
        return self.nets[island].exec_prefix

    def namespace(self, island: int) -> str:
        return self.nets[island].namespace

    def address(self, island: int, port: int) -> tuple[str, int]:
        """Where island ``island`` reaches loopback port ``port`` through the relay."""
        return self._relays[(island, port)]

    def endpoint(self, island: int, port: int) -> str:
        host, relay_port = self.address(island, port)
        return f"{host}:{relay_port}"

    def describe(self) -> dict[str, Any]:
        return {"rate_mbit": self.rate_mbit, "rtt_ms": self.rtt_ms, "tcp_slow_start": self.slow_start,
                "loss": self.loss}

    def queue_drops(self) -> int:
        """Packets the links' rate limits dropped so far, over every island and both directions:
        losses the model did not draw (``loss``), which the real TCP behind a relay recovers
        from on its own clock. Runs ``tc``: call it off the event loop."""
        return sum(netns.queue_drops(net) for net in self.nets)

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
            self._start_relays()
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
            self._stop_relays()
        finally:
            for net in self.nets:
                netns.destroy_island(net)
            log.info("wan_down", islands=[n.namespace for n in self.nets])

    def __enter__(self) -> WanTopology:
        _exit_on_sigterm()
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> WanTopology:
        _exit_on_sigterm()
        return await asyncio.to_thread(self.open)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    # ---- relay process ----------------------------------------------------------------------

    def _start_relays(self) -> None:
        config = {
            "delay_s": self.rtt_ms / 2000.0,
            "slow_start": self.slow_start,
            "loss": self.loss,
            "target_host": self.target_host,
            "loopback_forwarders": self.loopback_forwarders,
            "islands": [
                {"namespace": n.namespace, "host_ip": n.host_ip, "ports": self.target_ports}
                for n in self.nets
            ],
        }
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "weftboard.publisher.bench.wan.relayd"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._lines = queue.Queue()
        threading.Thread(
            target=_pump_lines, args=(self._proc.stdout, self._lines), daemon=True,
            name="wan-relayd-stdout",
        ).start()
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(config) + "\n")
        self._proc.stdin.flush()
        ready = self._await_message("relays", STARTUP_TIMEOUT_S)
        for island, port, host, relay_port in ready["relays"]:
            self._relays[(island, port)] = (host, relay_port)

    def _stop_relays(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the relay process closes everything and reports
            stats = self._await_message("bytes_forwarded", 15.0)
            self._bytes_forwarded = stats["bytes_forwarded"]
        except (OSError, RuntimeError, TimeoutError):
            log.warning("wan_relayd_no_stats")
        finally:
            try:
                proc.wait(timeout=15.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15.0)

    def _await_message(self, key: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(remaining, 0.0))
            except queue.Empty:
                raise TimeoutError(f"the WAN relay process sent no {key!r} in {timeout}s") from None
            if line is None:
                raise RuntimeError(f"the WAN relay process exited before sending {key!r}")
            message = json.loads(line)
            if key in message:
                return message

    def bytes_forwarded(self, island: int) -> int:
        """Bytes the host-side relays of one island forwarded (both directions); after close."""
        if self._bytes_forwarded is None:
            raise RuntimeError("bytes_forwarded is known once the topology is closed")
        return self._bytes_forwarded[island]


def _exit_on_sigterm() -> None:
    """Turn a default SIGTERM into SystemExit, so ``finally`` blocks and the atexit hook remove
    the namespaces (a default SIGTERM kills without either). Only from the main thread, and
    never over a handler someone else installed."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_system_exit)


def _raise_system_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _pump_lines(stream: IO[str] | None, lines: queue.Queue[str | None]) -> None:
    """Hand protocol lines to the owner; pass log lines through to our stderr."""
    assert stream is not None
    for line in stream:
        if line.startswith(MARKER + " "):
            lines.put(line[len(MARKER) + 1 :])
        else:
            sys.stderr.write(line)
    lines.put(None)
