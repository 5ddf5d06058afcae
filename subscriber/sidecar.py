"""The version-aware sidecar: an HTTP proxy in front of an OpenAI-compatible engine.

A request may name the versions it accepts (header ``X-Weftboard-Version: exact=7`` /
``min=5`` / ``max_staleness=2``, or body field ``weftboard_version: {"exact": 7}``) and a
deadline (``X-Weftboard-Deadline-Ms`` or body ``weftboard_deadline_ms``). Then:
- the engine holds an acceptable version: the request is admitted through the gate and
  proxied (SSE streams pass through chunk by chunk);
- the island is behind but catching up can satisfy it: it waits, up to its deadline
  (a request naming a version beyond the head the island knows makes it ask the board
  for its head once, so a trainer that just published is not turned away);
- otherwise: 409 at once, body ``{"error": "version_not_ready", "held", "head",
  "constraint", "retry_after_s", "message"}`` and a ``Retry-After`` header;
- while the island holds no verified version it can serve (``VersionState.withdrawn``: the
  scrub quarantined it, or a failed activation left the engine's weights unknown): 503 at
  once for every request, body ``{"error": "no_verified_version", ...}`` as above, the
  message naming the reason, until a version is activated again.

Invariants:
- Every response of a proxied route carries ``X-Weftboard-Version-Start`` and
  ``X-Weftboard-Version-End``; JSON bodies get a ``weftboard`` field
  ``{version_start, version_end, request_id}``; an SSE stream gets a last event
  ``{"weftboard": {...}}`` before ``[DONE]``. For a stream the End header is sent with
  the headers, before generation, so it equals Start; the final event is authoritative.
- ``version_start`` is read at admission (no activation can be in progress then) and
  ``version_end`` when the response is complete: a request is attributed to the versions
  it actually ran on. An exact-version request never spans an activation (the gate).
- An answer whose request ran while the island withdrew its version (``VersionState.withdrawn``
  set, or set and cleared again, meanwhile: ``VersionState.withdrawals`` changed) is never served
  nor reported: 503 ``no_verified_version``. Once a stream's headers are sent no second answer
  is possible: a withdrawal, or an engine stream that breaks off, ends it with the error event
  ``{"error": {"code", "message"}, "weftboard": {...}}`` and no ``[DONE]``.
- Reporting trajectory metadata never adds latency: it is queued for a background task.
- ``/health/live`` is always 200; ``/health/ready`` is 200 only once the island has
  caught up and activated, and not in error (503 with the reason otherwise). ``/metrics``
  serves the island's ``IslandMetrics`` (subscriber/metrics.py) when it has them.
- Every request to the engine carries the caller's headers except the hop-by-hop ones
  (RFC 9110 7.6.1: ``Connection`` and those it names, ``Keep-Alive``, ``TE``, ``Trailer``,
  ``Transfer-Encoding``, ``Upgrade``, ``Proxy-*``), those of the sidecar's own connection
  (``Host``, ``Content-Length``, ``Accept-Encoding``, ``Expect``) and the ``X-Weftboard-*``
  controls; a completion also goes with ``X-Request-Id`` (the request's id) and its body
  re-encoded as ``application/json``. ``Authorization`` is the caller's, or
  ``Bearer <engine_api_key>`` in its place when one is configured: the sidecar does not
  authenticate callers itself, so with a configured key whoever reaches it uses the engine.
- With ``served_model_name`` configured, ``/v1/models`` lists the engine's base model under
  that name (an engine that renames its model on a weight load keeps the name it is known by).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from weftboard.proto.errors import DeadlineExceeded, InvalidArgument, WeftboardError
from weftboard.subscriber.admission import AdmissionGate, Ticket, VersionState
from weftboard.subscriber.engines.http import engine_session
from weftboard.subscriber.metrics import IslandMetrics
from weftboard.subscriber.sidecar_request import (  # noqa: F401 - re-exported: the sidecar's request vocabulary
    DEADLINE_HEADER,
    LABELS_HEADER,
    REQUEST_ID_HEADER,
    VERSION_HEADER,
    RequestPlan,
    can_catch_up,
    constraint_from_body,
    constraint_json,
    parse_labels,
    plan_request,
)
from weftboard.subscriber.trajectory_reporter import TrajectoryReporter, make_record

log = structlog.get_logger(__name__)

START_HEADER = "X-Weftboard-Version-Start"
END_HEADER = "X-Weftboard-Version-End"
PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class SidecarConfig:
    engine_url: str
    run: str
    island_id: str
    host: str = "127.0.0.1"
    port: int = 0
    default_deadline_s: float = 30.0
    engine_timeout_s: float = 600.0
    retry_after_s: float = 1.0
    engine_api_key: str | None = None  # sent as ``Authorization: Bearer`` in place of the caller's
    served_model_name: str | None = None  # the name /v1/models lists for the engine's base model


# ---------------------------------------------------------------------------
# What goes to the engine, and what /v1/models lists
# ---------------------------------------------------------------------------

#: Never passed to the engine: hop-by-hop headers and those of the sidecar's own connection
NOT_FORWARDED = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                           "upgrade", "host", "content-length", "accept-encoding", "expect"})


def engine_headers(incoming: Iterable[tuple[str, str]], engine_api_key: str | None,
                   drop: Collection[str] = ()) -> list[tuple[str, str]]:
    """The caller's headers the engine gets (see the module's invariants), less ``drop``
    (lower case names); ``Authorization`` is replaced when ``engine_api_key`` is set."""
    pairs = list(incoming)
    named = {token.strip().lower() for name, value in pairs if name.lower() == "connection"
             for token in value.split(",")}
    skip = NOT_FORWARDED | named | set(drop) | ({"authorization"} if engine_api_key else set())
    out = [(name, value) for name, value in pairs
           if name.lower() not in skip and not name.lower().startswith(("proxy-", "x-weftboard-"))]
    if engine_api_key:
        out.append(("Authorization", f"Bearer {engine_api_key}"))
    return out


def rename_base_models(payload: Any, name: str) -> Any:
    """An OpenAI ``/v1/models`` answer with the engine's base models (entries without a
    ``parent``) listed as ``name``: their ``id`` and ``root``, and the ``parent`` of the
    adapters on them. Anything else is returned as it came."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return payload
    models = [m for m in data if isinstance(m, dict)]
    base = {m["id"] for m in models if isinstance(m.get("id"), str) and not m.get("parent")}
    for model in models:
        for key in ("id", "root", "parent"):
            value = model.get(key)
            if isinstance(value, str) and value in base:
                model[key] = name
    return payload


# ---------------------------------------------------------------------------
# Metadata gathered from the engine's answer
# ---------------------------------------------------------------------------


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    version_end: int | None = None  # the End reported to the client
    unreadable: bool = False  # some answer's usage or logprobs could not be read
    failed: str | None = None  # why a streamed answer (status 200 already sent) is no success: not reported

    def absorb(self, payload: Any) -> None:
        """Take token counts and logprobs from one engine answer (or stream chunk). Best
        effort: fields this cannot read are left out of the trajectory (logged once per
        request), never a failed answer to the client."""
        try:
            usage = payload.get("usage") or {}
            prompt = int(usage.get("prompt_tokens", self.prompt_tokens) or self.prompt_tokens)
            completion = int(usage.get("completion_tokens", self.completion_tokens) or self.completion_tokens)
            logprobs: list[float] = []
            for choice in payload.get("choices") or []:
                lp = choice.get("logprobs") or {}
                if isinstance(lp, Mapping):
                    if lp.get("token_logprobs"):
                        logprobs.extend(float(x) for x in lp["token_logprobs"] if x is not None)
                    for item in lp.get("content") or []:
                        if item.get("logprob") is not None:
                            logprobs.append(float(item["logprob"]))
        except (AttributeError, TypeError, ValueError) as exc:
            if not self.unreadable:
                log.warning("the engine's usage or logprobs could not be read; left out of the trajectory",
                            error=f"{type(exc).__name__}: {exc}")
            self.unreadable = True
            return
        self.prompt_tokens, self.completion_tokens = prompt, completion
        self.logprobs.extend(logprobs)


# ---------------------------------------------------------------------------
# The sidecar
# ---------------------------------------------------------------------------


class Sidecar:
    def __init__(
        self,
        config: SidecarConfig,
        state: VersionState,
        gate: AdmissionGate,
        reporter: TrajectoryReporter | None = None,
        refresh_head: Callable[[], Awaitable[int]] | None = None,
        metrics: IslandMetrics | None = None,
    ) -> None:
        self.config = config
        self.refresh_head = refresh_head  # asks the board when a request names a version beyond our head
        self.state = state
        self.gate = gate
        self.reporter = reporter
        self.metrics = metrics  # served at /metrics; requests counted by constraint and outcome
        if metrics is not None:
            metrics.watch_requests(state, gate)
        self.url = ""
        self.served = 0
        self.rejected = 0
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    # -- lifecycle ---------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health/live", self._live)
        app.router.add_get("/health/ready", self._ready)
        app.router.add_get("/weftboard/status", self._status)
        app.router.add_get("/v1/models", self._models)
        if self.metrics is not None:
            app.router.add_get("/metrics", self.metrics.handle)
        for path in PROXIED_PATHS:
            app.router.add_post(path, self._proxy)
        return app

    async def start(self) -> str:
        self._session = engine_session()
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        host = self.config.host
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        if self.reporter is not None:
            self.reporter.start()
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self.reporter is not None:
            await self.reporter.stop()

    # -- health ------------------------------------------------------------

    def _status_body(self) -> dict[str, Any]:
        return {"island_id": self.config.island_id, "run": self.config.run, "held": self.state.held,
                "head": self.state.head, "ready": self.state.ready, "error": self.state.error,
                "withdrawn": self.state.withdrawn,
                "activating": self.gate.activating, "inflight": self.gate.inflight, "mode": self.gate.mode.value,
                "served": self.served, "rejected": self.rejected,
                "trajectories": None if self.reporter is None else
                {"sent": self.reporter.sent, "dropped": self.reporter.dropped, "failed": self.reporter.failed}}

    async def _live(self, _: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def _ready(self, _: web.Request) -> web.Response:
        body = self._status_body()
        if self.state.ready:
            return web.json_response(body)
        if self.state.error:
            body["reason"] = f"island in error: {self.state.error}"
        elif self.state.held == 0:
            body["reason"] = "no version loaded yet"
        else:
            body["reason"] = f"catching up: holds {self.state.held}, head {self.state.head}"
        return web.json_response(body, status=503)

    async def _status(self, _: web.Request) -> web.Response:
        return web.json_response(self._status_body())

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        headers = engine_headers(request.headers.items(), self.config.engine_api_key)
        try:
            async with self._session.get(self.config.engine_url + "/v1/models", headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=10)) as resp:
                payload = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            return web.json_response({"error": "engine_unavailable", "message": str(exc)}, status=502)
        version_headers = self._version_headers(self.state.held, self.state.held)
        if self.config.served_model_name and status == 200:
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                renamed = rename_base_models(json.loads(payload), self.config.served_model_name)
                return web.json_response(renamed, headers=version_headers)
        return web.Response(body=payload, status=status, content_type="application/json", headers=version_headers)

    # -- admission ---------------------------------------------------------

    def _not_ready(self, plan: RequestPlan, why: str, outcome: str = "refused", *, status: int = 409,
                   error: str = "version_not_ready", start: int | None = None) -> web.Response:
        """The refusal (``outcome`` counted) or, with ``start``, the answer of a request that ran
        but whose result is not served (labelled with the versions it ran on)."""
        self.rejected += 1
        if self.metrics is not None and start is None:
            self.metrics.request(plan.constraint, outcome)
        retry = self.config.retry_after_s
        body = {"error": error, "held": self.state.held, "head": self.state.head,
                "constraint": constraint_json(plan.constraint), "retry_after_s": retry, "message": why,
                "request_id": plan.request_id}
        labels = self._version_headers(self.state.held if start is None else start, self.state.held)
        return web.json_response(body, status=status, headers={"Retry-After": str(max(1, math.ceil(retry))),
                                                            **labels})

    def _withdrawn_since(self, withdrawals: int) -> str | None:
        """Why the answer of a request admitted when ``state.withdrawals`` was ``withdrawals`` must not
        be served: the island withdrew its version while it ran (in ``in_place`` mode it went on
        computing on weights nobody vouches for). None when it did not."""
        if self.state.withdrawn is not None:
            return f"the island serves no verified version: {self.state.withdrawn}"
        if self.state.withdrawals != withdrawals:
            return "the island withdrew its version while the request ran (it has activated one again since)"
        return None

    async def _fresh_head(self, plan: RequestPlan) -> bool:
        """Ask the board for its head (once per request); True when it moved."""
        if self.refresh_head is None or plan.head_refreshed:
            return False
        plan.head_refreshed = True
        before = self.state.head
        try:
            head = await asyncio.wait_for(self.refresh_head(), max(0.1, min(2.0, plan.deadline - time.monotonic())))
        except (TimeoutError, WeftboardError) as exc:
            log.warning("could not refresh the head from the board", error=str(exc))
            return False
        await self.state.set_head(head)
        return self.state.head > before

    async def _admit(self, plan: RequestPlan) -> Ticket | web.Response:
        c = plan.constraint
        while True:
            if self.state.withdrawn is not None:  # no verified weights: nothing to serve, whatever the version
                return self._not_ready(plan, f"the island serves no verified version: {self.state.withdrawn}",
                                       status=503, error="no_verified_version")
            held, head = self.state.held, self.state.head
            remaining = plan.deadline - time.monotonic()
            if c.accepts(held, head):
                try:
                    ticket = await self.gate.admit(exact=c.exact is not None, timeout_s=max(remaining, 0.0))
                except DeadlineExceeded as exc:
                    return self._not_ready(plan, str(exc), "timeout")
                if c.accepts(self.state.held, self.state.head):
                    return ticket
                ticket.release()  # the version moved while we waited for the gate; decide again
                continue
            if not can_catch_up(c, held, head):
                wants_newer = (c.exact is not None and c.exact > head) or (c.minimum is not None and c.minimum > head)
                if wants_newer and await self._fresh_head(plan):
                    continue  # the board has moved on: decide again with its head
                if held == 0:
                    why = "the island holds no version yet"
                elif c.exact is not None and c.exact <= held:
                    why = f"version {c.exact} is older than the held version {held}; the island does not go back"
                else:
                    why = f"no version up to the head ({head}) satisfies the constraint"
                return self._not_ready(plan, why)
            if remaining <= 0:
                return self._not_ready(plan, f"catching up from {held} towards {head} did not finish within the deadline",
                                       "timeout")
            await self.state.wait_for(lambda held=held, head=head: self.state.held != held or self.state.head != head,
                                      remaining)

    # -- proxy -------------------------------------------------------------

    @staticmethod
    def _version_headers(start: int, end: int) -> dict[str, str]:
        return {START_HEADER: str(start), END_HEADER: str(end)}

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read() or b"{}")
            if not isinstance(body, dict):
                raise InvalidArgument("the request body must be a JSON object")
            plan = plan_request(request, body, self.config.default_deadline_s)
        except json.JSONDecodeError as exc:
            return web.json_response({"error": "invalid_request", "message": f"body is not JSON: {exc}"}, status=400)
        except InvalidArgument as exc:
            return web.json_response({"error": "invalid_request", "message": str(exc)}, status=400)
        admitted = await self._admit(plan)
        if isinstance(admitted, web.Response):
            return admitted
        ticket = admitted
        if self.metrics is not None:
            self.metrics.request(plan.constraint, "admitted")
        started = time.monotonic()
        start_version, withdrawals = self.state.held, self.state.withdrawals
        usage = Usage()
        try:
            response = await self._forward(request, plan, start_version, usage, withdrawals)
        finally:
            end_version = usage.version_end if usage.version_end is not None else self.state.held
            ticket.release()
        self.served += 1
        if self.reporter is not None and response.status < 400 and usage.failed is None:
            self.reporter.submit(make_record(
                run=self.config.run, island_id=self.config.island_id, version_start=start_version,
                version_end=end_version, request_id=plan.request_id, prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens, logprobs=usage.logprobs,
                latency_ms=(time.monotonic() - started) * 1000.0, labels=plan.labels,
            ))
        return response

    async def _forward(self, request: web.Request, plan: RequestPlan, start: int, usage: Usage,
                       withdrawals: int) -> web.StreamResponse:
        assert self._session is not None
        url = self.config.engine_url + request.path
        # the body goes re-encoded as JSON (aiohttp sets its Content-Type), under the request's id
        headers = engine_headers(request.headers.items(), self.config.engine_api_key,
                                 drop={"content-type", REQUEST_ID_HEADER.lower()})
        headers.append((REQUEST_ID_HEADER, plan.request_id))
        try:
            async with self._session.post(url, json=plan.body, headers=headers, timeout=aiohttp.ClientTimeout(
                    total=self.config.engine_timeout_s)) as upstream:
                is_sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
                if is_sse:  # from here on the answer has started: errors end the stream, never a second answer
                    return await self._pass_stream(request, upstream, plan, start, usage, withdrawals)
                payload = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("engine request failed", url=url, error=str(exc))
            return web.json_response({"error": "engine_unavailable", "message": f"engine at {url}: {exc}"},
                                     status=502, headers=self._version_headers(start, self.state.held))
        end = usage.version_end = self.state.held
        if (why := self._withdrawn_since(withdrawals)) is not None:
            log.warning("an answer computed while the island withdrew its version is not served",
                        request_id=plan.request_id, version_start=start, reason=why)
            return self._not_ready(plan, why, status=503, error="no_verified_version", start=start)
        headers = {**self._version_headers(start, end), REQUEST_ID_HEADER: plan.request_id}
        try:
            parsed = json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.Response(body=payload, status=upstream.status, headers=headers,
                                content_type=upstream.content_type)
        if isinstance(parsed, dict):
            usage.absorb(parsed)
            parsed["weftboard"] = {"version_start": start, "version_end": end, "request_id": plan.request_id}
        return web.json_response(parsed, status=upstream.status, headers=headers)

    async def _pass_stream(self, request: web.Request, upstream: aiohttp.ClientResponse, plan: RequestPlan,
                           start: int, usage: Usage, withdrawals: int) -> web.StreamResponse:
        """Relay an SSE answer, then the ``weftboard`` event and ``[DONE]``. Once its headers are
        sent nothing else can answer the request: an engine stream that breaks off, or a version
        withdrawn while it runs, ends it with an error event ``{"error": {"code", "message"},
        "weftboard": {...}}`` (no ``[DONE]``) and the answer is not reported as a trajectory."""
        out = web.StreamResponse(status=upstream.status, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            **self._version_headers(start, start), REQUEST_ID_HEADER: plan.request_id})
        await out.prepare(request)
        try:
            done_seen, failure = await self._relay(upstream, out, usage, withdrawals)
            end = usage.version_end = self.state.held
            labels = {"version_start": start, "version_end": end, "request_id": plan.request_id}
            if failure is None:
                await out.write(f"data: {json.dumps({'weftboard': labels})}\n\n".encode())
                if done_seen:
                    await out.write(b"data: [DONE]\n\n")
            else:
                code, usage.failed = failure
                log.warning("streamed answer ended with an error event", request_id=plan.request_id, error=code,
                            message=usage.failed, version_start=start, version_end=end)
                event = {"error": {"code": code, "message": usage.failed}, "weftboard": labels}
                await out.write(f"data: {json.dumps(event)}\n\n".encode())
            await out.write_eof()
        except ConnectionResetError:  # the caller went away (aiohttp's ClientConnectionResetError): nobody to tell
            usage.failed = "the caller closed the connection before the stream ended"
            log.info("the caller left during a streamed answer", request_id=plan.request_id)
        return out

    async def _relay(self, upstream: aiohttp.ClientResponse, out: web.StreamResponse, usage: Usage,
                     withdrawals: int) -> tuple[bool, tuple[str, str] | None]:
        """The engine's events to the caller, less ``[DONE]``: whether it was seen, and (error code,
        message) when the stream did not end as the engine's complete answer."""
        done_seen = False
        try:
            async for raw in upstream.content:
                if (why := self._withdrawn_since(withdrawals)) is not None:
                    upstream.close()  # the engine stops generating on weights nobody vouches for
                    return done_seen, ("no_verified_version", why)
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done_seen = True
                        continue  # sent after our final event
                    with contextlib.suppress(json.JSONDecodeError):
                        usage.absorb(json.loads(data))
                await out.write(raw)
        except ConnectionResetError:  # writing to the caller failed: not the engine's doing
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            return done_seen, ("engine_unavailable", f"the engine's stream broke off: {type(exc).__name__}: {exc}")
        if (why := self._withdrawn_since(withdrawals)) is not None:
            return done_seen, ("no_verified_version", why)
        return done_seen, None
