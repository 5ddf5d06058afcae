"""Prometheus metrics of one island: ``weftboard sidecar`` serves them at ``/metrics`` on its own
port, ``weftboard subscribe --metrics-port`` on a port of their own (``serve``).

Invariants:
- Each ``IslandMetrics`` owns its own ``CollectorRegistry``: several islands in one process
  (tests, the demo) never collide on metric names, and nothing lands in the global registry.
- Every series carries the island's ``run``; other labels are bounded: ``kind`` (anchor,
  patch), ``reason`` (step, follow), ``constraint`` (``CONSTRAINT_KINDS``), ``outcome``
  (``OUTCOMES``). Every combination exists from the start, at 0.
- The gauges (held version, head, lag, in-flight requests, readiness) are read from the
  island's own state when scraped, so they never drift from it; counters and histograms are
  recorded where the event happens. The registry is read on the island's event loop (the
  sidecar's route, or ``serve``), the thread that changes that state.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from weftboard.proto.domain import VersionConstraint
from weftboard.proto.errors import CorruptData

STEP_KINDS = ("anchor", "patch")
RETRY_REASONS = ("step", "follow")  # a step refetched or re-anchored; the follow loop restarted after an error
CONSTRAINT_KINDS = ("any", "exact", "min", "max_staleness", "min+max_staleness")
OUTCOMES = ("admitted", "refused", "timeout")

_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ACTIVATE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def constraint_kind(constraint: VersionConstraint) -> str:
    """The ``constraint`` label of a request: which fields it set (an exact version decides alone)."""
    if constraint.exact is not None:
        return "exact"
    fields = [name for name, value in (("min", constraint.minimum), ("max_staleness", constraint.max_staleness))
              if value is not None]
    return "+".join(fields) or "any"


class IslandMetrics:
    """The metrics of one island following ``run`` (see the module docstring)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.registry = CollectorRegistry()
        r = self.registry
        self.version = Gauge("weftboard_island_version", "Version the island holds (verified and activated)",
                             ["run"], registry=r)
        self.head = Gauge("weftboard_island_head", "Head version of the run, as the island last learnt it",
                          ["run"], registry=r)
        self.lag = Gauge("weftboard_island_lag_versions", "Versions the island is behind the head", ["run"], registry=r)
        self.ready = Gauge("weftboard_island_ready", "1 while the sidecar is in rotation (/health/ready is 200)",
                           ["run"], registry=r)
        self.inflight = Gauge("weftboard_island_inflight_requests", "Requests admitted and not yet answered",
                              ["run"], registry=r)
        self.applied = Counter("weftboard_island_versions_applied", "Steps applied and verified, by kind",
                               ["run", "kind"], registry=r)
        self.fetch_seconds = Histogram(
            "weftboard_island_fetch_seconds", "From a step's plan to its blobs verified on disk, by kind",
            ["run", "kind"], buckets=_STEP_BUCKETS, registry=r)
        self.apply_seconds = Histogram(
            "weftboard_island_apply_seconds",
            "Applying and verifying a step once its blobs are here (for a patch applied while it "
            "arrives, what came after its last byte), by kind", ["run", "kind"], buckets=_STEP_BUCKETS, registry=r)
        self.activate_seconds = Histogram(
            "weftboard_island_activate_seconds",
            "How long an activation kept new requests out: draining, then the engine's swap",
            ["run"], buckets=_ACTIVATE_BUCKETS, registry=r)
        self.fetched_bytes = Counter("weftboard_island_fetched_bytes",
                                     "Bytes of the blobs of the steps applied, by kind", ["run", "kind"], registry=r)
        self.downloaded_bytes = Counter(
            "weftboard_island_downloaded_bytes",
            "Bytes downloaded from the blob store (model files and downloads of failed steps included)",
            ["run"], registry=r)
        self.retries = Counter("weftboard_island_retries", "Failures retried, by reason (step: refetch or "
                               "anchor; follow: the follow loop after an error)", ["run", "reason"], registry=r)
        self.verify_failures = Counter("weftboard_island_verify_failures",
                                       "Steps whose blobs or result did not verify", ["run"], registry=r)
        self.requests = Counter("weftboard_island_requests",
                                "Version-aware requests, by the constraint they named and the outcome",
                                ["run", "constraint", "outcome"], registry=r)
        for kind in STEP_KINDS:
            for metric in (self.applied, self.fetch_seconds, self.apply_seconds, self.fetched_bytes):
                metric.labels(run, kind)
        for reason in RETRY_REASONS:
            self.retries.labels(run, reason)
        for constraint in CONSTRAINT_KINDS:
            for outcome in OUTCOMES:
                self.requests.labels(run, constraint, outcome)
        self.activate_seconds.labels(run)
        self.downloaded_bytes.labels(run)
        self.verify_failures.labels(run)
        self._runner: web.AppRunner | None = None

    # -- what is read when scraped -------------------------------------------------------

    def follow(self, subscriber: Any) -> None:
        """Read the held version and the head from ``subscriber`` (a ``Subscriber``) when scraped."""
        def lag() -> int:
            return max(subscriber.head - subscriber.held_version, 0)

        self.version.labels(self.run).set_function(lambda: subscriber.held_version)
        self.head.labels(self.run).set_function(lambda: max(subscriber.head, subscriber.held_version))
        self.lag.labels(self.run).set_function(lag)

    def watch_requests(self, state: Any, gate: Any) -> None:
        """Read readiness from ``state`` (a ``VersionState``) and in-flight requests from ``gate``
        (an ``AdmissionGate``) when scraped."""
        self.ready.labels(self.run).set_function(lambda: 1 if state.ready else 0)
        self.inflight.labels(self.run).set_function(lambda: gate.inflight)

    # -- events --------------------------------------------------------------------------

    def step_applied(self, kind: str, nbytes: int, fetched_s: float, apply_s: float) -> None:
        self.applied.labels(self.run, kind).inc()
        self.fetched_bytes.labels(self.run, kind).inc(nbytes)
        self.fetch_seconds.labels(self.run, kind).observe(fetched_s)
        self.apply_seconds.labels(self.run, kind).observe(apply_s)

    def step_failed(self, exc: BaseException) -> None:
        """A step failed and will be retried (refetched, or from an anchor)."""
        self.retries.labels(self.run, "step").inc()
        if isinstance(exc, CorruptData):  # a blob's digest, or the applied result's, did not match
            self.verify_failures.labels(self.run).inc()

    def follow_retried(self) -> None:
        self.retries.labels(self.run, "follow").inc()

    def downloaded(self, nbytes: int) -> None:
        """``Fetcher.on_bytes``: bytes of one blob downloaded."""
        self.downloaded_bytes.labels(self.run).inc(nbytes)

    def activated(self, seconds: float) -> None:
        self.activate_seconds.labels(self.run).observe(seconds)

    def request(self, constraint: VersionConstraint, outcome: str) -> None:
        self.requests.labels(self.run, constraint_kind(constraint), outcome).inc()

    # -- exposition ----------------------------------------------------------------------

    async def handle(self, _: web.Request) -> web.Response:
        """The ``GET /metrics`` route (Prometheus text format)."""
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` on ``host:port`` on this event loop (0 picks a port); returns the port."""
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
