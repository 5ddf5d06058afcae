"""Reading a proxied request's weftboard fields: the versions it accepts, its deadline, its labels.

The sidecar (``sidecar.py``) turns each completion request into a ``RequestPlan`` here before it
admits it. A request names them in headers (``X-Weftboard-Version``, ``X-Weftboard-Deadline-Ms``,
``X-Weftboard-Labels``, ``X-Request-Id``) or in body fields (``weftboard_version``,
``weftboard_deadline_ms``, ``weftboard_labels``).

Invariants:
- The ``weftboard_*`` body fields are removed from the body that goes to the engine; the body's
  version constraint wins over the header's, the header's deadline over the body's.
- A malformed field raises ``InvalidArgument`` naming it (the sidecar answers 400); a deadline
  is a finite number of milliseconds (``nan`` and ``inf`` are refused).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from weftboard.proto.domain import VersionConstraint
from weftboard.proto.errors import InvalidArgument

VERSION_HEADER = "X-Weftboard-Version"
DEADLINE_HEADER = "X-Weftboard-Deadline-Ms"
LABELS_HEADER = "X-Weftboard-Labels"
REQUEST_ID_HEADER = "X-Request-Id"


def constraint_from_body(value: Any) -> VersionConstraint:
    if isinstance(value, str):
        return VersionConstraint.parse(value)
    if not isinstance(value, Mapping):
        raise InvalidArgument('weftboard_version must be an object like {"exact": 7} or a string like "min=5"')
    aliases = {"exact": "exact", "min": "minimum", "minimum": "minimum", "max_staleness": "max_staleness"}
    fields: dict[str, int] = {}
    for key, raw in value.items():
        if key not in aliases:
            raise InvalidArgument(f"unknown weftboard_version field {key!r}: use exact, min or max_staleness")
        if not isinstance(raw, int) or isinstance(raw, bool):
            raise InvalidArgument(f"weftboard_version.{key} must be an integer, got {raw!r}")
        fields[aliases[key]] = raw
    return VersionConstraint(**fields)


def parse_labels(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` or a JSON object."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{LABELS_HEADER} is not valid JSON: {exc}") from None
        return {str(k): str(v) for k, v in parsed.items()}
    labels = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise InvalidArgument(f"bad label {part!r} in {LABELS_HEADER}: use key=value, comma separated")
        labels[key.strip()] = value.strip()
    return labels


@dataclass
class RequestPlan:
    body: dict
    constraint: VersionConstraint
    deadline: float  # monotonic
    labels: dict[str, str]
    request_id: str
    stream: bool
    head_refreshed: bool = False


def plan_request(request: web.Request, body: dict, default_deadline_s: float) -> RequestPlan:
    constraint = VersionConstraint()
    header = request.headers.get(VERSION_HEADER)
    if header:
        constraint = VersionConstraint.parse(header)
    if "weftboard_version" in body:
        constraint = constraint_from_body(body.pop("weftboard_version"))
    deadline_ms: Any = request.headers.get(DEADLINE_HEADER, body.pop("weftboard_deadline_ms", None))
    try:
        deadline_s = default_deadline_s if deadline_ms is None else float(deadline_ms) / 1000.0
    except (TypeError, ValueError):
        deadline_s = math.nan
    if not math.isfinite(deadline_s):  # "nan" and "inf" parse as floats; neither is a deadline
        raise InvalidArgument(f"{DEADLINE_HEADER} must be a number of milliseconds, got {deadline_ms!r}")
    labels = parse_labels(request.headers.get(LABELS_HEADER, ""))
    body_labels = body.pop("weftboard_labels", None)
    if body_labels is not None:
        if not isinstance(body_labels, Mapping):
            raise InvalidArgument("weftboard_labels must be an object of string values")
        labels.update({str(k): str(v) for k, v in body_labels.items()})
    request_id = request.headers.get(REQUEST_ID_HEADER) or "req-" + uuid.uuid4().hex[:20]
    return RequestPlan(body, constraint, time.monotonic() + max(deadline_s, 0.0), labels, request_id,
                       bool(body.get("stream", False)))


def constraint_json(c: VersionConstraint) -> dict[str, int]:
    out = {}
    if c.exact is not None:
        out["exact"] = c.exact
    if c.minimum is not None:
        out["min"] = c.minimum
    if c.max_staleness is not None:
        out["max_staleness"] = c.max_staleness
    return out


def can_catch_up(c: VersionConstraint, held: int, head: int) -> bool:
    """Whether a version the island has not reached yet (held < v <= head) satisfies ``c``."""
    if head <= held:
        return False
    if c.exact is not None:
        return held < c.exact <= head
    return c.accepts(head, head)
