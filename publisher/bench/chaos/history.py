"""The chaos run's history and its checker, in the manner of a linearizability checker.

The bench records what every party saw, each at its time (seconds since the run's start):
versions the publisher was told were committed and versions the observer saw on the board
(``acks``), the board's history at the end (``final_versions``), each island's checkpoint as
audited on disk (``audits``), every request with its constraint and its answer
(``responses``), the trajectory records found in the board's stream (``reported``) and those
the consumer was handed (``deliveries``), each fault and each recovery. ``check`` then says
what was violated:

- a version committed with two different root digests (``conflicting_versions``), or
  acknowledged or seen and missing from the board's final history (``versions_lost``);
- an island whose checkpoint on disk is not, bit for bit, the version it names, or two answers
  of one version to one seeded prompt that differ (``torn_activations``);
- an answer outside its request's constraint, or from a version never committed
  (``wrong_version_responses``);
- a record the board acknowledged (found in its stream) that never reached the consumer
  (``trajectories_lost``), or one request id delivered with two different contents
  (``trajectories_duplicated``; the same record delivered again is ``trajectories_redelivered``,
  removed by deduplication);
- a live island not holding the final head (``islands_behind``), a recovery over its bound or
  that never came (``recovery_exceeded``).

Invariant: the checker is a pure function of the history; it never looks at processes.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Event:
    t: float
    kind: str
    detail: str


@dataclass(frozen=True)
class Ack:
    """A version and root digest someone was told is committed: ``publisher`` or ``observer``."""

    t: float
    version: int
    root: str
    source: str


@dataclass(frozen=True)
class Response:
    t: float
    island: str
    request_id: str
    constraint: str  # "min" or "exact"
    n: int
    status: int  # 0: no HTTP answer (connection failed, timed out)
    version_start: int = 0
    version_end: int = 0
    prompt: str = ""  # the seeded prompt's key: one version answers it with one content
    content: str = ""  # a digest of the generated text and log-probs
    error: str = ""


@dataclass(frozen=True)
class Audit:
    """An island's checkpoint on disk: the version ``current`` names, its bytes' root, the record's."""

    t: float
    island: str
    version: int
    root: str
    expected: str
    when: str


@dataclass(frozen=True)
class Delivery:
    t: float
    request_id: str
    content: str


@dataclass(frozen=True)
class Recovery:
    t: float
    component: str
    kind: str
    seconds: float | None  # None: it never came back within the run


@dataclass(frozen=True)
class FaultRecord:
    index: int
    kind: str
    target: str
    t_start: float
    t_end: float
    detail: str = ""


@dataclass
class History:
    seed: int
    events: list[Event] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    final_versions: dict[int, str] = field(default_factory=dict)
    final_head: int = 0
    responses: list[Response] = field(default_factory=list)
    audits: list[Audit] = field(default_factory=list)
    reported: dict[str, float] = field(default_factory=dict)
    deliveries: list[Delivery] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    final_islands: dict[str, int] = field(default_factory=dict)

    def event(self, t: float, kind: str, detail: str = "") -> None:
        self.events.append(Event(round(t, 3), kind, detail))

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


@dataclass(frozen=True)
class Violation:
    check: str
    t: float
    detail: str


@dataclass
class Verdict:
    versions_committed: int = 0
    versions_lost: int = 0
    conflicting_versions: int = 0
    torn_activations: int = 0
    wrong_version_responses: int = 0
    trajectories_lost: int = 0
    trajectories_duplicated: int = 0
    trajectories_redelivered: int = 0
    trajectories_unreported: int = 0
    islands_behind: int = 0
    recovery_exceeded: int = 0
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def counts(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "violations"}


def _check_versions(history: History, verdict: Verdict) -> None:
    roots: dict[int, Ack] = {}
    conflicting: set[int] = set()
    for ack in sorted(history.acks, key=lambda a: a.t):
        first = roots.setdefault(ack.version, ack)
        if first.root != ack.root and ack.version not in conflicting:
            conflicting.add(ack.version)
            verdict.violations.append(Violation("conflicting_versions", ack.t, (
                f"version {ack.version}: {first.source} saw root {first.root} at {first.t:.1f}s, "
                f"{ack.source} saw {ack.root}")))
    lost: set[int] = set()
    for version, ack in sorted(roots.items()):
        final = history.final_versions.get(version)
        if final is None:
            lost.add(version)
            verdict.violations.append(Violation("versions_lost", ack.t, (
                f"version {version} ({ack.source} at {ack.t:.1f}s, root {ack.root}) is not in the board's history")))
        elif final != ack.root and version not in conflicting:
            conflicting.add(version)
            verdict.violations.append(Violation("conflicting_versions", ack.t, (
                f"version {version}: {ack.source} saw root {ack.root}, the board's history holds {final}")))
    for version in range(1, history.final_head + 1):
        if version not in history.final_versions and version not in lost:
            lost.add(version)
            verdict.violations.append(Violation("versions_lost", 0.0, (
                f"version {version} is missing from the board's history below its head {history.final_head}")))
    verdict.versions_committed = history.final_head
    verdict.versions_lost = len(lost)
    verdict.conflicting_versions = len(conflicting)


def _check_islands(history: History, verdict: Verdict) -> None:
    torn = 0
    for audit in history.audits:
        if audit.root != audit.expected:
            torn += 1
            verdict.violations.append(Violation("torn_activations", audit.t, (
                f"{audit.island} ({audit.when}): current names version {audit.version} whose bytes hash to "
                f"{audit.root}, the record says {audit.expected}")))
    answers: dict[tuple[int, str], Response] = {}
    for r in history.responses:
        if r.status != 200 or r.version_start != r.version_end or not r.prompt:
            continue
        first = answers.setdefault((r.version_start, r.prompt), r)
        if first.content != r.content:
            torn += 1
            verdict.violations.append(Violation("torn_activations", r.t, (
                f"version {r.version_start} answered prompt {r.prompt} with {r.content} on {r.island} "
                f"({r.request_id}) and {first.content} on {first.island} ({first.request_id})")))
    verdict.torn_activations = torn
    for island, version in sorted(history.final_islands.items()):
        if version != history.final_head:
            verdict.islands_behind += 1
            verdict.violations.append(Violation("islands_behind", float("inf"), (
                f"{island} holds version {version} at the end, the head is {history.final_head}")))


def _check_responses(history: History, verdict: Verdict) -> None:
    for r in history.responses:
        if r.status != 200:
            continue
        start, end = r.version_start, r.version_end
        if r.constraint == "exact":
            inside = start == end == r.n
        else:
            inside = start >= r.n and end >= start
        committed = start in history.final_versions and end in history.final_versions
        if not (inside and committed):
            verdict.wrong_version_responses += 1
            why = "outside its constraint" if not inside else "from a version the board never committed"
            verdict.violations.append(Violation("wrong_version_responses", r.t, (
                f"{r.island} answered {r.request_id} ({r.constraint}={r.n}) with versions {start}..{end}: {why}")))


def _check_trajectories(history: History, verdict: Verdict) -> None:
    counts = Counter(d.request_id for d in history.deliveries)
    contents: dict[str, set[str]] = defaultdict(set)
    for d in history.deliveries:
        contents[d.request_id].add(d.content)
    verdict.trajectories_redelivered = sum(c - 1 for c in counts.values())
    for request_id, seen in sorted(contents.items()):
        if len(seen) > 1:
            verdict.trajectories_duplicated += 1
            first = next(d.t for d in history.deliveries if d.request_id == request_id)
            verdict.violations.append(Violation("trajectories_duplicated", first, (
                f"request {request_id} was delivered with {len(seen)} different records")))
    for request_id, t in sorted(history.reported.items(), key=lambda kv: kv[1]):
        if request_id not in counts:
            verdict.trajectories_lost += 1
            verdict.violations.append(Violation("trajectories_lost", t, (
                f"request {request_id}'s record was in the board's stream at {t:.1f}s and never reached the consumer")))
    answered = {r.request_id for r in history.responses if r.status == 200}
    verdict.trajectories_unreported = len(answered - set(history.reported) - set(counts))


def _check_recoveries(history: History, verdict: Verdict, bounds: Mapping[str, float]) -> None:
    for rec in history.recoveries:
        bound = bounds.get(rec.component, float("inf"))
        if rec.seconds is None or rec.seconds > bound:
            verdict.recovery_exceeded += 1
            took = "never recovered" if rec.seconds is None else f"took {rec.seconds:.1f}s"
            verdict.violations.append(Violation("recovery_exceeded", rec.t, (
                f"{rec.component} after {rec.kind}: {took} (bound {bound:.0f}s)")))


def check(history: History, recovery_bounds: Mapping[str, float]) -> Verdict:
    """Every check of the module docstring over ``history``."""
    verdict = Verdict()
    _check_versions(history, verdict)
    _check_islands(history, verdict)
    _check_responses(history, verdict)
    _check_trajectories(history, verdict)
    _check_recoveries(history, verdict, recovery_bounds)
    verdict.violations.sort(key=lambda v: v.t)
    return verdict


def events_around(history: History, t: float, window_s: float = 10.0, limit: int = 40) -> list[Event]:
    """The recorded events within ``window_s`` of ``t`` (the last ones for a violation at the end)."""
    if t == float("inf"):
        return history.events[-limit:]
    near = [e for e in history.events if abs(e.t - t) <= window_s]
    return near[:limit]


def failure_report(history: History, verdict: Verdict, max_violations: int = 5) -> list[str]:
    """Lines for a failed check: the seed that replays the schedule, each violation and its events."""
    lines = [f"chaos check FAILED with seed {history.seed} (replay: weftboard bench chaos --seed {history.seed} "
             f"with the same --duration); {len(verdict.violations)} violations"]
    for v in verdict.violations[:max_violations]:
        lines.append(f"- [{v.check}] at {v.t:.1f}s: {v.detail}")
        for e in events_around(history, v.t):
            lines.append(f"    {e.t:8.2f}s {e.kind:18s} {e.detail}")
    return lines
