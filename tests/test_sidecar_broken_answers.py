"""Answers the sidecar must not serve as they came: a stream the engine breaks off, and answers
computed while the island withdrew its version.

Once a streamed answer's headers are sent, nothing else can answer the request: the stream ends
with an error event carrying the weftboard labels (no ``[DONE]``), promptly, and is not reported
as a trajectory. An answer whose request ran while the island's version was withdrawn (the engine
on weights nobody vouches for) is 503 ``no_verified_version``, or for a stream an error event.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from test_failed_activation import FolderIsland
from test_sidecar import SMALL, call

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.admission import AdmissionGate, VersionState
from weftboard.subscriber.engines.base import ActivationMode
from weftboard.subscriber.engines.reference import ReferenceHttpAdapter
from weftboard.subscriber.reference_engine.engine import ReferenceEngine
from weftboard.subscriber.reference_engine.openai_api import serve_engine
from weftboard.subscriber.sidecar import Sidecar, SidecarConfig


class Reports:
    """A trajectory reporter that keeps what it was given."""

    sent = dropped = failed = 0

    def __init__(self) -> None:
        self.records: list[Any] = []

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def submit(self, record: Any) -> None:
        self.records.append(record)


class StepEngine:
    """An engine whose answers go out when the test says: ``step`` lets the next part go."""

    def __init__(self, *, break_off: bool = False) -> None:
        self.step = asyncio.Queue[None]()
        self.arrived = asyncio.Event()
        self.break_off = break_off
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.arrived.set()
        if not body.get("stream"):
            await self.step.get()
            return web.json_response({"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"text":"hel"}]}\n\n')
        await self.step.get()
        if self.break_off:
            assert request.transport is not None
            request.transport.close()  # the engine dies mid-stream
            return resp
        await resp.write(b'data: {"choices":[{"text":"lo"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def start(self) -> StepEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def started(engine: StepEngine, mode: ActivationMode = ActivationMode.IN_PLACE) -> tuple[Sidecar, Reports]:
    state, reports = VersionState(), Reports()
    await state.set_held(5)
    sidecar = Sidecar(SidecarConfig(engine.url, "run-a", "island-1"), state, AdmissionGate(mode), reports)  # type: ignore[arg-type]
    await sidecar.start()
    return sidecar, reports


async def read_stream(url: str) -> tuple[int, dict[str, str], list[Any], float]:
    """Status, headers, the events and the seconds the stream took to end (a client that times out raises)."""
    t0 = time.monotonic()
    events: list[Any] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=8)) as s:
        async with s.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            async for line in r.content:
                text = line.decode().strip()
                if text.startswith("data: "):
                    events.append(text[6:] if text[6:] == "[DONE]" else json.loads(text[6:]))
            return r.status, dict(r.headers), events, time.monotonic() - t0


async def test_a_stream_the_engine_breaks_off_ends_with_an_error_event() -> None:
    engine = await StepEngine(break_off=True).start()
    sidecar, reports = await started(engine)
    try:
        reading = asyncio.create_task(read_stream(sidecar.url))
        await engine.arrived.wait()
        engine.step.put_nowait(None)
        status, headers, events, took = await reading
        assert status == 200 and headers["X-Weftboard-Version-Start"] == "5"
        assert took < 3.0  # the stream ended: the client did not wait out its timeout
        assert events[0] == {"choices": [{"text": "hel"}]}
        last = events[-1]
        assert last["error"]["code"] == "engine_unavailable" and "broke off" in last["error"]["message"]
        assert last["weftboard"]["version_start"] == 5 and last["weftboard"]["version_end"] == 5
        assert "[DONE]" not in events
        await asyncio.sleep(0.05)
        assert reports.records == [] and sidecar.gate.inflight == 0  # not a trajectory; the ticket is back
    finally:
        await sidecar.stop()
        await engine.stop()


async def test_an_answer_computed_while_the_island_withdrew_is_503_and_not_reported() -> None:
    engine = await StepEngine().start()
    sidecar, reports = await started(engine)
    try:
        answering = asyncio.create_task(call(sidecar.url, {"prompt": "x"}))
        await engine.arrived.wait()
        await sidecar.state.withdraw("activation of version 6 failed: the engine never answered")
        engine.step.put_nowait(None)
        status, headers, body = await answering
        assert status == 503 and body["error"] == "no_verified_version", body
        assert "activation of version 6 failed" in body["message"] and body["held"] == 0
        assert headers["X-Weftboard-Version-Start"] == "5" and headers["X-Weftboard-Version-End"] == "0"
        await asyncio.sleep(0.05)
        assert reports.records == []

        await sidecar.state.set_held(6)  # a request spanning a withdrawal and a new activation
        engine.arrived.clear()
        answering = asyncio.create_task(call(sidecar.url, {"prompt": "x"}))
        await engine.arrived.wait()
        await sidecar.state.withdraw("version 6 quarantined: damaged")
        await asyncio.sleep(0.05)
        await sidecar.state.set_held(7)
        engine.step.put_nowait(None)
        status, _, body = await answering
        assert status == 503 and body["error"] == "no_verified_version" and "withdrew" in body["message"], body

        engine.arrived.clear()  # a request that saw no withdrawal is served and reported as before
        answering = asyncio.create_task(call(sidecar.url, {"prompt": "x"}))
        await engine.arrived.wait()
        engine.step.put_nowait(None)
        status, _, body = await answering
        assert status == 200 and body["weftboard"]["version_end"] == 7
        await asyncio.sleep(0.05)
        assert len(reports.records) == 1
    finally:
        await sidecar.stop()
        await engine.stop()


async def test_a_stream_running_when_the_island_withdraws_ends_with_an_error_event() -> None:
    engine = await StepEngine().start()
    sidecar, reports = await started(engine)
    try:
        reading = asyncio.create_task(read_stream(sidecar.url))
        await engine.arrived.wait()
        await sidecar.state.withdraw("activation of version 6 failed: the engine never answered")
        engine.step.put_nowait(None)
        status, _, events, took = await reading
        assert status == 200 and took < 3.0
        last = events[-1]
        assert last["error"]["code"] == "no_verified_version" and "version 6 failed" in last["error"]["message"]
        assert last["weftboard"]["version_start"] == 5 and last["weftboard"]["version_end"] == 0
        assert "[DONE]" not in events and {"choices": [{"text": "lo"}]} not in events
        await asyncio.sleep(0.05)
        assert reports.records == []
    finally:
        await sidecar.stop()
        await engine.stop()


async def test_in_place_request_across_an_activation_that_withdraws_is_not_served(tmp_path: Path) -> None:
    """The reviewer's case: in ``in_place`` mode a request generating on version 1 runs across a load
    the engine never answered; it finished on unverified weights and came back 200, labelled End 0."""
    engine = ReferenceEngine(SMALL, token_delay_s=0.05)
    server = await serve_engine(engine)
    island = FolderIsland(ReferenceHttpAdapter(server.url, timeout_s=5, load_timeout_s=0.3), server.url, tmp_path)
    island.gate = island.dest.gate = island.sidecar.gate = AdmissionGate(ActivationMode.IN_PLACE)
    await island.start()
    try:
        await island.activate(1)
        engine.tokenizer.eos_id = -1  # never stop early: the request spans the activation
        load = engine.load_checkpoint_dir

        def slow_load(directory: Path) -> None:  # the engine's loader: still at it when the island gives up
            time.sleep(0.8)
            load(directory)

        engine.load_checkpoint_dir = slow_load  # type: ignore[method-assign]
        answering = asyncio.create_task(call(island.url, {"prompt": "ab", "max_tokens": 30, "seed": 1},
                                             {"X-Weftboard-Version": "min=1"}))
        await asyncio.sleep(0.3)  # generating on version 1
        try:
            await island.activate(2)
        except ApplyError:
            pass
        assert island.state.withdrawn is not None
        status, headers, body = await answering
        assert status == 503 and body["error"] == "no_verified_version", (status, body)
        assert headers["X-Weftboard-Version-Start"] == "1"
    finally:
        await asyncio.sleep(1.0)  # the engine's loader thread ends
        await island.stop()
        await server.stop()


async def test_a_withdrawal_undone_at_once_is_still_counted() -> None:
    """``withdraw`` then ``set_held`` with no yield between them (a reload right after an engine
    loss): a request admitted before still sees that the weights it ran on were withdrawn."""
    from weftboard.subscriber.admission import VersionState

    state = VersionState()
    await state.set_held(3)
    admitted = state.withdrawals
    await state.withdraw("the engine restarted")
    await state.set_held(3)
    assert state.withdrawn is None and state.held == 3
    assert state.withdrawals == admitted + 1
