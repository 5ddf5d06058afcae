"""The island network of ``weftboard bench sync --wan``: every island behind its own WAN link.

It fills the bench's island-network hook (``prefix``, ``board_address``, ``s3_endpoint``,
``describe``) and adds ``start``/``close``, because the loopback ports it relays to (board, S3)
exist only once the bench has started its servers.

Invariants: only loopback endpoints are relayed; islands get the relay's address on their own
link (the loopback forwarders inside each namespace keep 127.0.0.1 URLs, e.g. presigned ones,
working as well); ``close`` removes every namespace even if the bench failed half-way.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from typing import Any

from weftboard.publisher.bench.wan.netns import WanUnavailable, check_capability
from weftboard.publisher.bench.wan.topology import WanTopology


def _loopback_port(endpoint: str) -> int:
    """``127.0.0.1:PORT`` / ``localhost:PORT`` / ``http://127.0.0.1:PORT`` -> PORT (the relays
    forward to 127.0.0.1, so other loopback spellings are refused rather than misrouted)."""
    hostport = endpoint.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if host != "localhost":
        address = ipaddress.ip_address(host.strip("[]"))
        if address.version != 4 or not address.is_loopback:
            raise ValueError(f"the WAN simulation only relays IPv4 loopback endpoints, got {endpoint!r}")
    return int(port)


# The default chance that a segment is lost on a simulated link: 0.01%, a good path between
# regions (a loss every ~7,000 segments, about 10 MB); --wan-loss sets another.
WAN_LOSS = 1e-4


class WanNetwork:
    """Islands in network namespaces behind ``rate_mbit`` and ``rtt_ms`` links."""

    def __init__(
        self, islands: int, rate_mbit: float = 100.0, rtt_ms: float = 40.0, slow_start: bool = True,
        loss: float = WAN_LOSS,
    ) -> None:
        self.islands = islands
        self.rate_mbit = rate_mbit
        self.rtt_ms = rtt_ms
        self.slow_start = slow_start
        self.loss = loss
        self.topology: WanTopology | None = None

    @staticmethod
    def check() -> None:
        """Raise WanUnavailable (with the reason) before any expensive setup."""
        check_capability()

    async def start(self, endpoints: Sequence[str]) -> None:
        ports = [_loopback_port(e) for e in endpoints]
        self.topology = WanTopology(
            self.islands, ports, rate_mbit=self.rate_mbit, rtt_ms=self.rtt_ms,
            slow_start=self.slow_start, loss=self.loss,
        )
        await self.topology.__aenter__()

    async def close(self) -> None:
        if self.topology is not None:
            await self.topology.__aexit__(None, None, None)

    def _relay(self, index: int, endpoint: str) -> str:
        if self.topology is None:
            raise RuntimeError("WanNetwork.start() must run before islands are started")
        scheme = endpoint.split("://", 1)[0] + "://" if "://" in endpoint else ""
        return scheme + self.topology.endpoint(index, _loopback_port(endpoint))

    def prefix(self, index: int) -> Sequence[str]:
        if self.topology is None:
            raise RuntimeError("WanNetwork.start() must run before islands are started")
        return self.topology.prefix(index)

    def board_address(self, index: int, board: str) -> str:
        return self._relay(index, board)

    def s3_endpoint(self, index: int, endpoint: str) -> str:
        return self._relay(index, endpoint)

    def queue_drops(self) -> int:
        """``WanTopology.queue_drops`` (0 before ``start``)."""
        return self.topology.queue_drops() if self.topology is not None else 0

    def describe(self) -> dict[str, Any]:
        return {
            "network": "wan",
            "wan": {"rate_mbit": self.rate_mbit, "rtt_ms": self.rtt_ms, "tcp_slow_start": self.slow_start,
                    "loss": self.loss},
        }


def skipped_line(exc: WanUnavailable) -> str:
    """The bench's last stdout line when the machine cannot simulate a WAN."""
    return json.dumps({"skipped": f"--wan unavailable: {exc}"})
