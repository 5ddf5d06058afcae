"""The relay process of a WAN topology: ``python -m weftboard.publisher.bench.wan.relayd``.

Relays run in their own process so the caller's CPU work (a publisher diffing 100M parameters)
cannot starve them of the GIL, which would add delay and cap throughput and so distort every
figure measured through the link.

Protocol (stdout lines starting with ``MARKER``; anything else is log output):
- stdin, first line: the JSON config ``{"delay_s", "slow_start", "loss", "target_host",
  "loopback_forwarders", "islands": [{"namespace", "host_ip", "ports": [...]}]}``;
- stdout: ``MARKER {"relays": [[island, port, host, relay_port], ...]}`` once listening;
- stdin EOF (the owner closed it, or died): close every relay, print
  ``MARKER {"bytes_forwarded": [per island]}`` and exit. The process never outlives its owner.

Invariants: only the configured loopback target host is ever connected to from the host
namespace; namespace-side sockets are created on a thread that entered that namespace.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from weftboard.publisher.bench.wan.netns import namespace_executor
from weftboard.publisher.bench.wan.relay import MARKER, DelayRelay


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


def _emit(payload: dict[str, Any]) -> None:
    sys.stdout.write(f"{MARKER} {json.dumps(payload)}\n")
    sys.stdout.flush()


async def serve(config: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    target_host = config["target_host"]
    if not ipaddress.ip_address(target_host).is_loopback:
        raise ValueError(f"only loopback targets may be relayed, got {target_host}")
    delay_s = float(config["delay_s"])
    relays: list[tuple[int, int, DelayRelay]] = []
    forwarders: list[DelayRelay] = []
    executors: list[ThreadPoolExecutor] = []
    try:
        for i, island in enumerate(config["islands"]):
            executor = namespace_executor(island["namespace"])
            executors.append(executor)
            for port in island["ports"]:
                relay = DelayRelay(
                    (target_host, port), delay_s, listen=(island["host_ip"], 0),
                    slow_start=bool(config.get("slow_start", False)), loss=float(config.get("loss", 0.0)),
                )
                relays.append((i, port, await relay.start()))
                if not config.get("loopback_forwarders", True):
                    continue
                listen_sock = await loop.run_in_executor(
                    executor, _listening_socket, target_host, port
                )

                async def make_socket(ex: ThreadPoolExecutor = executor) -> socket.socket:
                    return await loop.run_in_executor(ex, socket.socket)

                forwarder = DelayRelay(
                    relay.address, 0.0, listen_sock=listen_sock, make_socket=make_socket
                )
                forwarders.append(await forwarder.start())
        _emit({"relays": [[i, port, *r.address] for i, port, r in relays]})
        await asyncio.to_thread(sys.stdin.read)  # returns at EOF: the owner is done or gone
    finally:
        await asyncio.gather(
            *(r.close() for r in [*forwarders, *(r for _, _, r in relays)]),
            return_exceptions=True,
        )
        for executor in executors:
            executor.shutdown(wait=False)
    per_island = [0] * len(config["islands"])
    for i, _, relay in relays:
        per_island[i] += relay.bytes_forwarded
    _emit({"bytes_forwarded": per_island})


def main() -> None:
    config = json.loads(sys.stdin.readline())
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
