"""Prometheus metrics of one publisher (``Publisher(metrics_port=...)``), on a port of its own.

Invariants:
- Each ``PublisherMetrics`` owns its own ``CollectorRegistry`` (never the global one), so a
  trainer with several publishers, or a test process, never collides on metric names.
- Every series carries the publisher's ``run``; ``kind`` is anchor or patch.
- A version is recorded once, when it commits (the publisher's commit thread); the HTTP server
  reads the registry from its own thread, which prometheus_client allows. ``pending`` is read
  when scraped.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from weftboard.board.metrics import MetricsEndpoint
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.job import Job

_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class PublisherMetrics:
    def __init__(self, run: str, pending: Callable[[], int] | None = None) -> None:
        self.run = run
        self.registry = CollectorRegistry()
        r = self.registry
        self.published = Counter("weftboard_publisher_versions", "Versions committed by this publisher, by kind (anchor: it carries one)",
                                 ["run", "kind"], registry=r)
        self.version = Gauge("weftboard_publisher_version", "Newest version this publisher committed",
                             ["run"], registry=r)
        self.uploaded_bytes = Counter("weftboard_publisher_uploaded_bytes",
                                      "Bytes of the blobs each committed version names, by kind",
                                      ["run", "kind"], registry=r)
        self.blocked_seconds = Histogram(
            "weftboard_publisher_blocked_seconds",
            "How long the trainer waited in publish (and, with an optimizer attached, in its next step) per version",
            ["run"], buckets=_SECONDS_BUCKETS, registry=r)
        self.snapshot_seconds = Histogram(
            "weftboard_publisher_snapshot_seconds",
            "From publish to the version queued for its commit: read, diff, digests, anchor files",
            ["run"], buckets=_SECONDS_BUCKETS, registry=r)
        self.commit_latency = Histogram("weftboard_publisher_commit_latency_seconds",
                                        "From publish to the version committed on the board",
                                        ["run"], buckets=_SECONDS_BUCKETS, registry=r)
        self.pending = Gauge("weftboard_publisher_pending", "Versions published and not yet committed",
                             ["run"], registry=r)
        for kind in ("anchor", "patch"):
            self.published.labels(run, kind)
            self.uploaded_bytes.labels(run, kind)
        for histogram in (self.blocked_seconds, self.snapshot_seconds, self.commit_latency):
            histogram.labels(run)
        if pending is not None:  # held weakly: the endpoint's thread must not keep its publisher alive
            self.pending.labels(run).set_function(_weakly(pending))
        self.endpoint = MetricsEndpoint(r)

    @property
    def port(self) -> int | None:
        return self.endpoint.port

    def serve(self, port: int, addr: str = "127.0.0.1") -> PublisherMetrics:
        """Serve /metrics on ``port`` (0 picks a free one: ``self.port``); returns ``self``."""
        self.endpoint.serve(port, addr)
        return self

    def stop(self) -> None:
        self.endpoint.stop()

    def record_commit(self, record: pb.VersionRecord, job: Job, latency_s: float) -> None:
        """One committed version: ``job`` is the publisher's, ``latency_s`` from publish to commit."""
        self.record_version(record, anchor=job.anchor, blocked_s=sum(h.blocked_s for h in job.handles),
                            snapshot_s=job.timings.get("queued_s", 0.0), latency_s=latency_s)

    def record_version(self, record: pb.VersionRecord, *, anchor: bool, blocked_s: float, snapshot_s: float,
                       latency_s: float) -> None:
        """One committed version, from its parts (the sharded publisher has no ``Job``)."""
        self.published.labels(self.run, "anchor" if anchor else "patch").inc()
        self.version.labels(self.run).set(record.version)
        for artifact in record.artifacts:
            artifact_kind = "patch" if artifact.kind == pb.ARTIFACT_KIND_PATCH else "anchor"
            self.uploaded_bytes.labels(self.run, artifact_kind).inc(sum(b.size for b in artifact.blobs))
        self.blocked_seconds.labels(self.run).observe(blocked_s)
        self.snapshot_seconds.labels(self.run).observe(snapshot_s)
        self.commit_latency.labels(self.run).observe(latency_s)


def _weakly(fn: Callable[[], float]) -> Callable[[], float]:
    """``fn`` (a bound method: a weak reference to its object), or 0 once the object is gone."""
    if not hasattr(fn, "__self__"):
        return fn
    ref = weakref.WeakMethod(fn)  # type: ignore[arg-type]

    def call() -> float:
        method = ref()
        return method() if method is not None else 0

    return call
