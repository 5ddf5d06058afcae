"""Prometheus metrics of one board process.

Invariants:
- Each ``BoardMetrics`` owns its own ``CollectorRegistry``, so several boards in one
  process (tests, the embedded demo) never collide on metric names.
- Labels are bounded: method names come from the service definition, status codes from
  grpc.StatusCode, runs from the runs the board serves, states from IslandState.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from weftboard.proto.v1 import board_pb2 as pb


class MetricsEndpoint:
    """``/metrics`` of one registry on a port of its own (prometheus_client's WSGI server, on a
    thread of its own); ``stop`` closes the socket and joins the thread."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.port: int | None = None
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve on ``port`` (0 picks a free one); returns the bound port."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http = (server, thread)
        self.port = server.server_port
        return self.port

    def stop(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None


_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class BoardMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rpcs = Counter("weftboard_rpcs", "RPCs handled, by method and status code", ["method", "code"], registry=r)
        self.latency = Histogram(
            "weftboard_rpc_latency_seconds", "RPC latency by method", ["method"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.watch_streams = Gauge("weftboard_watch_streams", "Open Watch streams", registry=r)
        self.commits = Counter("weftboard_commits", "Versions committed, by run", ["run"], registry=r)
        self.head = Gauge("weftboard_head", "Head version, by run", ["run"], registry=r)
        self.blob_bytes = Counter(
            "weftboard_blob_bytes", "Bytes of blobs named by committed versions, by kind", ["kind"], registry=r
        )
        self.gc_freed_bytes = Counter("weftboard_gc_freed_bytes", "Bytes deleted by garbage collection", registry=r)
        self.islands = Gauge("weftboard_islands", "Islands by run and state (as of the last heartbeat or listing)",
                             ["run", "state"], registry=r)
        self.trajectories = Counter("weftboard_trajectories", "Trajectory records accepted, by run", ["run"], registry=r)
        self.endpoint = MetricsEndpoint(r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``port`` (0 picks a free one); returns the bound port."""
        return self.endpoint.serve(port, addr)

    def stop(self) -> None:
        self.endpoint.stop()

    def record_commit(self, record: pb.VersionRecord) -> None:
        self.commits.labels(record.run).inc()
        self.head.labels(record.run).set(record.version)
        for artifact in record.artifacts:
            kind = "patch" if artifact.kind == pb.ARTIFACT_KIND_PATCH else "anchor"
            self.blob_bytes.labels(kind).inc(sum(b.size for b in artifact.blobs))

    def set_islands(self, run: str, counts: dict[int, int]) -> None:
        for name, state in pb.IslandState.items():
            if state == pb.ISLAND_STATE_UNSPECIFIED:
                continue
            self.islands.labels(run, name.removeprefix("ISLAND_STATE_")).set(counts.get(state, 0))
