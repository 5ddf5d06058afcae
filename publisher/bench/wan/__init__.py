"""Cross-datacenter simulation for ``weftboard bench sync --wan``.

Islands run in network namespaces behind veth links rate limited with ``tbf`` and a user-space
delaying relay for the round-trip time (``netem`` is not available everywhere). See
``topology.WanTopology`` for the picture; ``netns.check_capability`` says why a machine cannot.
"""

from weftboard.publisher.bench.wan.netns import (
    WanUnavailable,
    check_capability,
    remove_stale,
)
from weftboard.publisher.bench.wan.relay import DelayRelay
from weftboard.publisher.bench.wan.topology import WanTopology

__all__ = ["DelayRelay", "WanTopology", "WanUnavailable", "check_capability", "remove_stale"]
