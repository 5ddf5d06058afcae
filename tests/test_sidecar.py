"""The sidecar in front of a real reference engine: constraints, waits, 409s, activations.

These tests drive activations through ``EngineDestination`` with a small in-test inner
destination (versions are tensor sets kept in memory), so they pin the sidecar's HTTP and
admission behaviour on their own; tests/test_trajectory_loop.py runs the same sidecar
under the real subscriber, board, Redis and blob store.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web
from enginekit import CatchAllServer

from weftboard.cuda.digest import root_digest, tensor_digest
from weftboard.proto.errors import ApplyError
from weftboard.subscriber.admission import AdmissionGate, VersionState
from weftboard.subscriber.destination import Capabilities, TensorEntry, VersionTarget
from weftboard.subscriber.engine_destination import EngineDestination
from weftboard.subscriber.engines.base import ActivationMode
from weftboard.subscriber.engines.reference import ReferenceAdapter
from weftboard.subscriber.reference_engine.engine import ReferenceEngine
from weftboard.subscriber.reference_engine.model import init_parameters, model_config
from weftboard.subscriber.reference_engine.openai_api import serve_engine
from weftboard.subscriber.sidecar import Sidecar, SidecarConfig

SMALL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq": 96}


def versions_of(n: int) -> dict[int, dict[str, torch.Tensor]]:
    return {v: init_parameters(model_config({**SMALL, "seed": 100 + v}), torch.bfloat16) for v in range(1, n + 1)}


def target_of(v: int, tensors: dict[str, torch.Tensor]) -> VersionTarget:
    digests = {k: tensor_digest(t) for k, t in tensors.items()}
    layout = [TensorEntry(k, "bfloat16", tuple(t.shape)) for k, t in tensors.items()]
    root = root_digest([(e.name, e.dtype, e.shape, digests[e.name]) for e in layout])
    return VersionTarget(v, root, digests, layout)


def live_root(tensors: dict[str, torch.Tensor]) -> str:
    return root_digest([(k, "bfloat16", tuple(t.shape), tensor_digest(t)) for k, t in tensors.items()])


class CopyInto:
    """In-test inner destination: 'applies' version n by copying its tensors in place."""

    capabilities = Capabilities(applies_while_arriving=False, weights_in_memory=True, activates_engine=False)

    def __init__(self, live: dict[str, torch.Tensor], versions: dict[int, dict[str, torch.Tensor]]) -> None:
        self.live, self.versions, self.version = live, versions, 0

    def held_version(self) -> int:
        return self.version

    async def load_anchor(self, shards, target: VersionTarget) -> None:
        await self.apply_patch(Path("unused"), target)

    async def apply_patch(self, patch: Path, target: VersionTarget) -> None:
        for k, t in self.live.items():
            t.copy_(self.versions[target.version][k])
        assert live_root(self.live) == target.root_digest
        self.version = target.version


class Island:
    def __init__(self, mode: ActivationMode, token_delay_s: float = 0.0, versions: int = 4) -> None:
        self.engine = ReferenceEngine(SMALL, token_delay_s=token_delay_s)
        self.adapter = ReferenceAdapter(self.engine)
        self.state = VersionState()
        self.gate = AdmissionGate(mode)
        self.versions = versions_of(versions)
        self.inner = CopyInto(self.engine.tensors, self.versions)
        self.dest = EngineDestination(self.adapter, self.gate, self.state, self.inner)

    async def start(self) -> Island:
        self.engine_server = await serve_engine(self.engine)
        self.sidecar = Sidecar(SidecarConfig(self.engine_server.url, "run-a", "island-1", default_deadline_s=5),
                               self.state, self.gate)
        self.url = await self.sidecar.start()
        return self

    async def activate(self, v: int) -> None:
        await self.state.set_head(v)
        await self.dest.load_anchor([], target_of(v, self.versions[v]))

    async def stop(self) -> None:
        await self.sidecar.stop()
        await self.engine_server.stop()


@pytest.fixture
async def island():
    isl = await Island(ActivationMode.DRAIN).start()
    yield isl
    await isl.stop()


async def call(url: str, body: dict, headers: dict | None = None, path: str = "/v1/completions"):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, headers=headers or {}, timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, dict(r.headers), await r.json()


async def stream(url: str, body: dict, headers: dict | None = None):
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={**body, "stream": True}, headers=headers or {},
                          timeout=aiohttp.ClientTimeout(total=60)) as r:
            hdrs = dict(r.headers)
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return hdrs, events


async def get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
            return r.status, await r.json()


PROMPT = {"prompt": "ab", "max_tokens": 4, "seed": 1, "logprobs": 1}


async def test_ready_only_after_activation(island):
    status, body = await get(island.url + "/health/ready")
    assert status == 503 and "no version" in body["reason"]
    assert (await get(island.url + "/health/live"))[0] == 200
    await island.state.set_head(2)
    await island.activate(1)
    status, body = await get(island.url + "/health/ready")
    assert status == 503 and "catching up" in body["reason"]  # holds 1, head 2: not in rotation yet
    await island.activate(2)
    assert (await get(island.url + "/health/ready"))[0] == 200


async def test_constraints_accept_and_report_versions(island):
    await island.activate(1)
    await island.activate(2)
    for header in ("exact=2", "min=2", "max_staleness=0", "min=1,max_staleness=3"):
        status, headers, body = await call(island.url, PROMPT, {"X-Weftboard-Version": header})
        assert status == 200, body
        assert headers["X-Weftboard-Version-Start"] == "2" and headers["X-Weftboard-Version-End"] == "2"
        assert body["weftboard"]["version_start"] == 2 and body["weftboard"]["version_end"] == 2
        assert body["choices"][0]["logprobs"]["token_logprobs"]
    status, _, body = await call(island.url, {**PROMPT, "weftboard_version": {"exact": 2}})
    assert status == 200 and body["weftboard"]["version_start"] == 2
    # weftboard_* fields are not forwarded to the engine (it would answer 400 on unknown types otherwise)
    status, _, body = await call(island.url, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                              "weftboard_version": "min=1"}, path="/v1/chat/completions")
    assert status == 200 and body["weftboard"]["version_end"] == 2


async def test_unsatisfiable_constraints_get_409_at_once(island):
    await island.activate(1)
    await island.activate(2)
    for header, why in (("exact=1", "older"), ("min=3", "no version up to the head")):
        t0 = time.monotonic()
        status, headers, body = await call(island.url, PROMPT, {"X-Weftboard-Version": header,
                                                                "X-Weftboard-Deadline-Ms": "3000"})
        assert time.monotonic() - t0 < 1.0  # at once, not after the deadline
        assert status == 409 and headers["Retry-After"] == "1"
        assert body["error"] == "version_not_ready" and body["held"] == 2 and body["head"] == 2
        assert body["retry_after_s"] == 1.0 and why in body["message"]
    status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=nope"})
    assert status == 400 and "not an integer" in body["message"]


async def test_behind_waits_for_catch_up_within_deadline(island):
    await island.activate(1)
    await island.state.set_head(2)  # the board says 2 exists; the island still holds 1

    async def later():
        await asyncio.sleep(0.3)
        await island.activate(2)

    task = asyncio.create_task(later())
    status, headers, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=2",
                                                            "X-Weftboard-Deadline-Ms": "5000"})
    await task
    assert status == 200 and headers["X-Weftboard-Version-Start"] == "2"
    # max_staleness=0 behind the head, with a deadline too short for the catch-up: 409 after the deadline
    await island.state.set_head(3)
    t0 = time.monotonic()
    status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "max_staleness=0",
                                                      "X-Weftboard-Deadline-Ms": "300"})
    assert status == 409 and 0.25 < time.monotonic() - t0 < 2.0 and "deadline" in body["message"]
    # a staleness bound the held version still meets is served at once
    status, _, _ = await call(island.url, PROMPT, {"X-Weftboard-Version": "max_staleness=1"})
    assert status == 200


async def test_in_place_activation_spans_a_stream_but_not_an_exact_request():
    isl = await Island(ActivationMode.IN_PLACE, token_delay_s=0.05).start()
    try:
        await isl.activate(1)
        long_body = {"prompt": "a", "max_tokens": 30, "seed": 2, "temperature": 1.0}
        task = asyncio.create_task(stream(isl.url, long_body, {"X-Weftboard-Version": "min=1"}))
        await asyncio.sleep(0.3)
        await isl.activate(2)  # in place: the stream keeps running
        headers, events = await task
        final = [e for e in events if isinstance(e, dict) and "weftboard" in e][0]["weftboard"]
        assert headers["X-Weftboard-Version-Start"] == "1"
        assert final["version_start"] == 1 and final["version_end"] == 2
        engine_versions = [e["engine_version"] for e in events if isinstance(e, dict) and "engine_version" in e]
        assert engine_versions[0] == 1 and engine_versions[-1] == 2  # tokens really ran on both
        assert events[-1] == "[DONE]"

        # An exact request is never crossed by an activation: the activation waits for it.
        task = asyncio.create_task(stream(isl.url, long_body, {"X-Weftboard-Version": "exact=2"}))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await isl.activate(3)
        waited = time.monotonic() - t0
        headers, events = await task
        final = [e for e in events if isinstance(e, dict) and "weftboard" in e][0]["weftboard"]
        assert final == {"version_start": 2, "version_end": 2, "request_id": final["request_id"]}
        assert {e["engine_version"] for e in events if isinstance(e, dict) and "engine_version" in e} == {2}
        assert waited > 0.5  # the activation waited for the exact request to finish
    finally:
        await isl.stop()


async def test_drain_activation_waits_for_in_flight_requests():
    isl = await Island(ActivationMode.DRAIN, token_delay_s=0.03).start()
    try:
        await isl.activate(1)
        task = asyncio.create_task(stream(isl.url, {"prompt": "a", "max_tokens": 20, "seed": 3}))
        await asyncio.sleep(0.2)
        await isl.activate(2)
        _, events = await task
        final = [e for e in events if isinstance(e, dict) and "weftboard" in e][0]["weftboard"]
        assert final["version_start"] == final["version_end"] == 1
        assert {e["engine_version"] for e in events if isinstance(e, dict) and "engine_version" in e} == {1}
    finally:
        await isl.stop()


class RefusingAdapter(ReferenceAdapter):
    """An engine that refuses to pause for a weight change (e.g. stuck scheduler)."""

    refuse = False

    async def pause(self, mode):
        if self.refuse:
            raise ApplyError("engine did not acknowledge pause within 30s")
        await super().pause(mode)


async def test_adapter_failure_keeps_old_version_and_marks_error():
    isl = Island(ActivationMode.DRAIN)
    isl.adapter = RefusingAdapter(isl.engine)
    isl.dest = EngineDestination(isl.adapter, isl.gate, isl.state, isl.inner)
    await isl.start()
    try:
        await isl.activate(1)
        before = live_root(isl.engine.tensors)
        assert before == target_of(1, isl.versions[1]).root_digest
        isl.adapter.refuse = True
        with pytest.raises(ApplyError, match="pause"):
            await isl.activate(2)
        assert isl.dest.held_version() == 1 and isl.state.held == 1
        assert live_root(isl.engine.tensors) == before  # old weights, bitwise; no mix
        status, body = await get(isl.url + "/health/ready")
        assert status == 503 and "error" in body["reason"]
        status, headers, body = await call(isl.url, PROMPT, {"X-Weftboard-Version": "min=1"})
        assert status == 200 and body["weftboard"]["version_start"] == 1
        status, _, body = await call(isl.url, PROMPT, {"X-Weftboard-Version": "exact=2",
                                                       "X-Weftboard-Deadline-Ms": "200"})
        assert status == 409
        isl.adapter.refuse = False
        await isl.activate(2)
        assert isl.state.error is None and (await get(isl.url + "/health/ready"))[0] == 200
    finally:
        await isl.stop()


def test_trajectory_queue_full_drops_and_counts():
    from weftboard.subscriber.trajectory_reporter import TrajectoryReporter, make_record

    reporter = TrajectoryReporter(client=None, max_queue=2)
    record = make_record(run="r", island_id="i", version_start=1, version_end=1, request_id="x", prompt_tokens=1,
                         completion_tokens=1, logprobs=[-0.5, -1.5], latency_ms=1.0, labels={})
    assert [reporter.submit(record) for _ in range(5)] == [True, True, False, False, False]
    assert reporter.dropped == 3
    assert record.logprob_sum == -2.0 and record.logprob_min == -1.5 and not record.HasField("reward")


async def test_models_proxied_and_engine_down_is_502(island):
    await island.activate(1)
    async with aiohttp.ClientSession() as s, s.get(island.url + "/v1/models") as r:
        assert r.status == 200 and r.headers["X-Weftboard-Version-Start"] == "1"
        assert (await r.json())["data"][0]["id"] == "weftboard-reference"
    await island.engine_server.stop()
    status, headers, body = await call(island.url, PROMPT)
    assert status == 502 and body["error"] == "engine_unavailable"
    assert headers["X-Weftboard-Version-Start"] == "1"
    assert island.gate.inflight == 0  # the ticket was released


async def test_a_version_beyond_the_known_head_asks_the_board_once(island):
    await island.activate(1)
    board_head = {"v": 1, "calls": 0}

    async def refresh() -> int:
        board_head["calls"] += 1
        return board_head["v"]

    island.sidecar.refresh_head = refresh
    status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=2"})
    assert status == 409 and board_head["calls"] == 1 and body["head"] == 1  # the board has nothing newer

    board_head["v"] = 2  # committed, but this island has not heard of it yet

    async def later():
        await asyncio.sleep(0.3)
        await island.activate(2)

    task = asyncio.create_task(later())
    status, headers, _ = await call(island.url, PROMPT, {"X-Weftboard-Version": "min=2",
                                                         "X-Weftboard-Deadline-Ms": "5000"})
    await task
    assert status == 200 and headers["X-Weftboard-Version-Start"] == "2" and board_head["calls"] == 2


async def test_deadlines_that_are_not_finite_are_refused(island):
    await island.activate(1)
    for value in ("nan", "inf", "-inf", "soon"):
        status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Deadline-Ms": value})
        assert status == 400 and "X-Weftboard-Deadline-Ms" in body["message"], (value, body)
    status, _, body = await call(island.url, {**PROMPT, "weftboard_deadline_ms": [1]})
    assert status == 400, body


async def test_an_engine_answer_with_unreadable_usage_still_reaches_the_client():
    """Token counts and logprobs feed the trajectory record only: an engine that sends them
    in a shape the sidecar cannot read gets its answer through (with the version headers),
    and the record goes without them; before, the client got a 500."""
    answers = iter([
        {"id": "a", "choices": [{"text": "x", "logprobs": {"content": [7]}}], "usage": {"prompt_tokens": "many"}},
        {"id": "b", "choices": [{"text": "y", "logprobs": {"token_logprobs": [-0.5, None]}}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
    ])

    async def completions(request: web.Request) -> web.Response:
        return web.json_response(next(answers))

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    class Records:
        """Keeps what the sidecar submits, in place of a reporter sending it to a board."""

        sent = dropped = failed = 0

        def __init__(self) -> None:
            self.got: list = []

        def start(self) -> None:
            pass

        async def stop(self) -> None:
            pass

        def submit(self, record) -> bool:
            self.got.append(record)
            return True

    state, reporter = VersionState(), Records()
    await state.set_held(1)  # an engine serving version 1, caught up
    gate = AdmissionGate(ActivationMode.DRAIN)
    sidecar = Sidecar(SidecarConfig(engine_url, "run-a", "island-1", default_deadline_s=5), state, gate, reporter)
    url = await sidecar.start()
    try:
        status, headers, body = await call(url, PROMPT)
        assert status == 200 and body["id"] == "a" and headers["X-Weftboard-Version-Start"] == "1"
        status, _, body = await call(url, PROMPT)
        assert status == 200 and body["id"] == "b"
        assert [(r.prompt_tokens, r.completion_tokens, r.logprob_sum) for r in reporter.got] == [(0, 0, 0.0),
                                                                                                  (3, 1, -0.5)]
    finally:
        await sidecar.stop()
        await runner.cleanup()


# ---------------------------------------------------------------------------
# Headers to the engine: Authorization, tracing, nothing hop-by-hop
# ---------------------------------------------------------------------------

ENGINE_NAME = "/island/checkpoint/current"  # what SGLang serves its model as after a load from the island


class KeyedEngine(CatchAllServer):
    """A real HTTP engine that, like one started with ``--api-key secret``, answers 401 to a
    request without ``Authorization: Bearer secret``, and records the headers it got."""

    def __init__(self, key: str = "secret") -> None:
        self.key = key
        self.seen: list[dict] = []  # per request: path, headers (lower-case names, all values), raw body

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers: dict[str, list[str]] = {}
        for name, value in request.headers.items():
            headers.setdefault(name.lower(), []).append(value)
        self.seen.append({"path": request.path, "headers": headers, "body": body})
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"object": "error", "message": "Unauthorized", "code": 401}, status=401)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [
                {"id": ENGINE_NAME, "object": "model", "root": ENGINE_NAME, "parent": None},
                {"id": "adapter-a", "object": "model", "root": "/loras/a", "parent": ENGINE_NAME}]})
        if json.loads(body).get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n')
            await out.write_eof()
            return out
        return web.json_response({"id": "cmpl-1", "choices": [{"text": "x"}],
                                  "usage": {"prompt_tokens": 2, "completion_tokens": 1}})



@pytest.fixture
async def keyed_engine():
    engine = await KeyedEngine().start()
    yield engine
    await engine.stop()


async def sidecar_for(engine_url: str, **config) -> Sidecar:
    state = VersionState()
    await state.set_held(1)  # an engine serving version 1, caught up
    sidecar = Sidecar(SidecarConfig(engine_url, "run-a", "island-1", default_deadline_s=5, **config), state,
                      AdmissionGate(ActivationMode.DRAIN))
    await sidecar.start()
    return sidecar


async def get_models(url: str, headers: dict | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models", headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.json()


async def test_the_callers_authorization_reaches_the_engine(keyed_engine):
    sidecar = await sidecar_for(keyed_engine.url)
    try:
        status, _, body = await call(sidecar.url, PROMPT, {"Authorization": "Bearer secret"})
        assert status == 200 and body["id"] == "cmpl-1"
        assert keyed_engine.seen[-1]["headers"]["authorization"] == ["Bearer secret"]

        # without it the engine's 401 reaches the client, its answer and the version headers with it
        status, headers, body = await call(sidecar.url, PROMPT)
        assert status == 401 and body["message"] == "Unauthorized" and body["code"] == 401
        assert headers["X-Weftboard-Version-Start"] == "1"
        assert "authorization" not in keyed_engine.seen[-1]["headers"]
        status, _, body = await call(sidecar.url, PROMPT, {"Authorization": "Bearer guess"})
        assert status == 401 and keyed_engine.seen[-1]["headers"]["authorization"] == ["Bearer guess"]

        # a stream and /v1/models go with it as well
        _, events = await stream(sidecar.url, PROMPT, {"Authorization": "Bearer secret"})
        assert events[0] == {"choices": [{"text": "x"}]} and events[-1] == "[DONE]"
        assert keyed_engine.seen[-1]["headers"]["authorization"] == ["Bearer secret"]
        status, headers, models = await get_models(sidecar.url, {"Authorization": "Bearer secret"})
        assert status == 200 and models["data"][0]["id"] == ENGINE_NAME and headers["X-Weftboard-Version-Start"] == "1"
        assert keyed_engine.seen[-1]["headers"]["authorization"] == ["Bearer secret"]
        status, _, models = await get_models(sidecar.url)
        assert status == 401 and models["message"] == "Unauthorized"
        assert sidecar.served == 4 and sidecar.rejected == 0  # completions; /v1/models is not counted
    finally:
        await sidecar.stop()


async def test_a_configured_engine_api_key_replaces_the_callers(keyed_engine):
    sidecar = await sidecar_for(keyed_engine.url, engine_api_key="secret")
    try:
        for client_headers in ({}, {"Authorization": "Bearer client-token"}):
            status, _, body = await call(sidecar.url, PROMPT, client_headers)
            assert status == 200 and body["id"] == "cmpl-1", body
            assert keyed_engine.seen[-1]["headers"]["authorization"] == ["Bearer secret"]  # the key, only it
            status, _, models = await get_models(sidecar.url, client_headers)
            assert status == 200 and models["data"][0]["id"] == ENGINE_NAME
            assert keyed_engine.seen[-1]["headers"]["authorization"] == ["Bearer secret"]
        _, events = await stream(sidecar.url, PROMPT)
        assert events[-1] == "[DONE]" and keyed_engine.seen[-1]["headers"]["authorization"] == ["Bearer secret"]
    finally:
        await sidecar.stop()


async def test_tracing_headers_go_to_the_engine_and_hop_by_hop_ones_do_not(keyed_engine):
    sidecar = await sidecar_for(keyed_engine.url)
    client_headers = {
        "Authorization": "Bearer secret",
        "X-Request-Id": "trace-7",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "Accept": "application/json",
        "Content-Type": "application/json; charset=utf-8",
        "X-Custom": "kept",
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "named by Connection",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Trailer": "X-Checksum",
        "Upgrade": "h2c",
        "Proxy-Authorization": "Basic dXNlcjpwYXNz",
        "Proxy-Connection": "keep-alive",
        "X-Weftboard-Version": "min=1",
        "X-Weftboard-Labels": "team=a",
    }
    try:
        status, headers, body = await call(sidecar.url, {**PROMPT, "weftboard_deadline_ms": 4000}, client_headers)
        request_id = {k.lower(): v for k, v in headers.items()}["x-request-id"]
        assert status == 200 and request_id == "trace-7" == body["weftboard"]["request_id"]
        seen = keyed_engine.seen[-1]["headers"]
        assert seen["x-request-id"] == ["trace-7"] and seen["traceparent"] == [client_headers["traceparent"]]
        assert seen["accept"] == ["application/json"] and seen["x-custom"] == ["kept"]
        assert seen["authorization"] == ["Bearer secret"]
        # the body the engine got is the re-encoded one (weftboard fields out): its own type and length
        assert seen["content-type"] == ["application/json"]
        assert seen["content-length"] == [str(len(keyed_engine.seen[-1]["body"]))]
        assert "weftboard_deadline_ms" not in json.loads(keyed_engine.seen[-1]["body"])
        assert seen["host"] == [keyed_engine.url.removeprefix("http://")]  # the engine's, not the sidecar's
        for name in ("x-hop", "keep-alive", "te", "trailer", "upgrade", "proxy-authorization",
                     "proxy-connection", "x-weftboard-version", "x-weftboard-labels"):
            assert name not in seen, name
        assert seen.get("connection", ["keep-alive"]) == ["keep-alive"]  # aiohttp's own, if any

        # /v1/models gets the same treatment; a request without X-Request-Id gets one of its own
        status, _, _ = await get_models(sidecar.url, client_headers)
        seen = keyed_engine.seen[-1]["headers"]
        assert status == 200 and seen["traceparent"] == [client_headers["traceparent"]]
        assert "x-hop" not in seen and "proxy-authorization" not in seen and "upgrade" not in seen
        status, _, body = await call(sidecar.url, PROMPT, {"Authorization": "Bearer secret"})
        request_id = body["weftboard"]["request_id"]
        assert keyed_engine.seen[-1]["headers"]["x-request-id"] == [request_id] and request_id.startswith("req-")

        # the client library does send all of them: it is the sidecar that leaves them out
        status, _, _ = await call(keyed_engine.url, PROMPT, client_headers)
        assert status == 200 and {"x-hop", "keep-alive", "te", "trailer", "upgrade", "proxy-authorization",
                                  "x-weftboard-version"} <= set(keyed_engine.seen[-1]["headers"])
    finally:
        await sidecar.stop()


async def test_models_lists_the_served_model_name_in_place_of_the_engines(keyed_engine):
    sidecar = await sidecar_for(keyed_engine.url, engine_api_key="secret", served_model_name="Qwen/Qwen2.5-0.5B")
    try:
        status, headers, models = await get_models(sidecar.url)
        assert status == 200 and headers["X-Weftboard-Version-End"] == "1"
        assert models["data"] == [
            {"id": "Qwen/Qwen2.5-0.5B", "object": "model", "root": "Qwen/Qwen2.5-0.5B", "parent": None},
            {"id": "adapter-a", "object": "model", "root": "/loras/a", "parent": "Qwen/Qwen2.5-0.5B"}]
    finally:
        await sidecar.stop()
    keyed_engine.key = "other"  # an error answer is passed on untouched
    sidecar = await sidecar_for(keyed_engine.url, engine_api_key="secret", served_model_name="Qwen/Qwen2.5-0.5B")
    try:
        status, _, body = await get_models(sidecar.url)
        assert status == 401 and body == {"object": "error", "message": "Unauthorized", "code": 401}
    finally:
        await sidecar.stop()


def test_rename_base_models_leaves_what_it_cannot_read():
    from weftboard.subscriber.sidecar import rename_base_models

    for odd in ([1, 2], {"data": "x"}, {"object": "list"}, "text"):
        assert rename_base_models(odd, "m") == odd
    odd_entries = {"data": [7, {"id": ["not", "a", "name"]}, {"id": "base"}, {"id": "x", "parent": {"a": 1}}]}
    assert rename_base_models(odd_entries, "m") == {
        "data": [7, {"id": ["not", "a", "name"]}, {"id": "m"}, {"id": "x", "parent": {"a": 1}}]}


async def test_a_sidecar_listens_on_an_ipv6_address() -> None:
    """``--listen [::1]:PORT``: the host binds without its brackets, and the URL has them."""
    state = VersionState()
    sidecar = Sidecar(SidecarConfig("http://127.0.0.1:1", "run-a", "island-1", host="::1"), state,
                      AdmissionGate(ActivationMode.DRAIN), None)
    url = await sidecar.start()
    try:
        assert url.startswith("http://[::1]:")
        async with aiohttp.ClientSession() as session, session.get(url + "/health/live") as resp:
            assert resp.status == 200
    finally:
        await sidecar.stop()
