"""The seeded fault schedule: which fault, on what, when, for how long.

``make_schedule`` is a pure function of its arguments: one seed gives one schedule, so
``--seed`` replays it (the faults, their targets, times and parameters; how the processes
interleave around them is the machine's). The density scales with the duration: about one
fault every ``mean_gap_s``, and never fewer than one of each kind, so a short run still
injects every kind. The first faults are one of each kind in a seeded order; the rest are
drawn at random. Faults may overlap (a link fails while Redis restarts), as they do in life.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class FaultKind(str, Enum):
    REDIS_KILL = "redis_kill"
    S3_KILL = "s3_kill"
    BOARD_KILL = "board_kill"
    PUBLISHER_KILL = "publisher_kill"
    ISLAND_KILL = "island_kill"
    NET_LATENCY = "net_latency"
    NET_BANDWIDTH = "net_bandwidth"
    NET_RESET = "net_reset"
    NET_BLACKHOLE = "net_blackhole"
    NET_HALF_OPEN = "net_half_open"
    DISK_FULL = "disk_full"
    BLOB_CORRUPT = "blob_corrupt"


NETWORK_KINDS = (FaultKind.NET_LATENCY, FaultKind.NET_BANDWIDTH, FaultKind.NET_RESET, FaultKind.NET_BLACKHOLE,
                 FaultKind.NET_HALF_OPEN)


@dataclass(frozen=True)
class ScheduledFault:
    """``target``: a process (``redis``, ``board-1``, ``island-2``, ``publisher``) or, for network
    faults, a link pattern (``island-0>board-*``); ``hold_s``: how long it lasts (for a kill,
    the time the process stays down); ``param``: the kind's own (a delay in seconds, a rate in
    bytes per second, the moment of a kill as a fraction of a publish or seconds after a commit)."""

    index: int
    at_s: float
    kind: FaultKind
    target: str
    hold_s: float
    param: float = 0.0

    def describe(self) -> str:
        extra = f" param={self.param:g}" if self.param else ""
        return f"#{self.index} {self.kind.value} on {self.target} at {self.at_s:.1f}s for {self.hold_s:.1f}s{extra}"


def _target(rng: random.Random, kind: FaultKind, islands: Sequence[str], replicas: int,
            links: Sequence[str]) -> str:
    if kind == FaultKind.REDIS_KILL:
        return "redis"
    if kind == FaultKind.S3_KILL:
        return "s3"
    if kind == FaultKind.BOARD_KILL:
        return f"board-{rng.randrange(replicas)}"
    if kind == FaultKind.PUBLISHER_KILL:
        return "publisher"
    if kind in (FaultKind.ISLAND_KILL, FaultKind.DISK_FULL, FaultKind.BLOB_CORRUPT):
        return rng.choice(list(islands))
    link = rng.choice(list(links))
    client, server = link.split(">")
    if server.startswith("board-") and rng.random() < 0.5:
        return f"{client}>board-*"  # every replica at once: the client is cut off, not failed over
    return link


def _hold_and_param(rng: random.Random, kind: FaultKind) -> tuple[float, float]:
    if kind in (FaultKind.REDIS_KILL, FaultKind.S3_KILL, FaultKind.BOARD_KILL):
        return rng.uniform(0.5, 4.0), 0.0
    if kind == FaultKind.PUBLISHER_KILL:
        return rng.uniform(0.5, 3.0), rng.random()  # when in a publish: 0 its start, 1 its commit
    if kind == FaultKind.ISLAND_KILL:
        return rng.uniform(0.5, 3.0), rng.uniform(0.0, 0.15)  # seconds after a commit: mid-fetch/apply/activate
    if kind == FaultKind.NET_LATENCY:
        return rng.uniform(2.0, 8.0), rng.uniform(0.05, 0.5)
    if kind == FaultKind.NET_BANDWIDTH:
        return rng.uniform(2.0, 8.0), rng.uniform(16e3, 256e3)
    if kind == FaultKind.NET_RESET:
        return rng.uniform(0.5, 3.0), 0.0
    if kind in (FaultKind.NET_BLACKHOLE, FaultKind.NET_HALF_OPEN):
        return rng.uniform(2.0, 8.0), 0.0
    if kind == FaultKind.DISK_FULL:
        return rng.uniform(3.0, 8.0), 0.0
    return rng.uniform(1.0, 3.0), 0.0  # BLOB_CORRUPT: how long the island is held off its store


def make_schedule(seed: int, duration_s: float, *, kinds: Sequence[FaultKind], islands: Sequence[str],
                  replicas: int, links: Sequence[str], mean_gap_s: float = 6.0,
                  start_s: float = 2.0) -> list[ScheduledFault]:
    """Faults over ``[start_s, 0.9 * duration_s]``, about one per ``mean_gap_s``, each kind at least once."""
    rng = random.Random(seed)
    kinds = list(kinds)
    count = max(len(kinds), int(duration_s / mean_gap_s))
    order = rng.sample(kinds, len(kinds)) + rng.choices(kinds, k=count - len(kinds))
    end = max(start_s + 1.0, duration_s * 0.9)
    slot = (end - start_s) / count
    faults = []
    for index, kind in enumerate(order):
        at = start_s + (index + rng.uniform(0.0, 0.8)) * slot
        hold, param = _hold_and_param(rng, kind)
        faults.append(ScheduledFault(index, round(at, 3), kind, _target(rng, kind, islands, replicas, links),
                                     round(hold, 3), round(param, 6)))
    return faults
