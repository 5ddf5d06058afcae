"""Engine adapters send exactly the recorded requests, and turn engine failures into ApplyError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.engines.base import ActivationMode
from weftboard.subscriber.engines.factory import make_adapter

CONTRACTS = Path(__file__).parent / "contracts"


class RecordingEngine:
    """A local HTTP server that records every request and answers as told."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail_paths: dict[str, tuple[int, Any]] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.calls.append({
            "method": request.method,
            "path": request.path,
            "query": dict(request.query),
            "json": json.loads(raw) if raw else None,
        })
        if request.path in self.fail_paths:
            status, body = self.fail_paths[request.path]
            return web.json_response(body, status=status)
        return web.json_response({"success": True})

    async def start(self) -> RecordingEngine:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@pytest.fixture
async def recorder():
    engine = await RecordingEngine().start()
    yield engine
    await engine.stop()


def expected(kind: str, section: str, mode: str | None, directory: Path, version: int) -> list[dict]:
    contract = json.loads((CONTRACTS / f"{kind}.json").read_text())
    calls = contract[section][mode] if mode else contract[section]
    text = json.dumps(calls).replace("{dir}", str(directory)).replace("{version}", str(version))
    return json.loads(text)


async def activate(adapter, mode: ActivationMode, directory: Path, version: int) -> None:
    await adapter.pause(mode)
    await adapter.load_checkpoint(directory, version)
    await adapter.resume()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("mode", [ActivationMode.DRAIN, ActivationMode.IN_PLACE])
async def test_activation_sends_the_recorded_requests(recorder, tmp_path, kind, mode):
    adapter = make_adapter(kind, recorder.url, timeout_s=5)
    try:
        assert adapter.served_version() == 0
        await activate(adapter, mode, tmp_path / "ckpt", 7)
        assert recorder.calls == expected(kind, "activation", mode.value, tmp_path / "ckpt", 7)
        assert adapter.served_version() == 7
        recorder.calls.clear()
        assert await adapter.health() is True
        assert recorder.calls == expected(kind, "health", None, tmp_path, 0)
    finally:
        await adapter.close()


async def test_sglang_model_info_request(recorder):
    adapter = make_adapter("sglang", recorder.url, timeout_s=5)
    try:
        await adapter.model_info()
        assert recorder.calls == expected("sglang", "model_info", None, Path("."), 0)
    finally:
        await adapter.close()


@pytest.mark.parametrize(
    "kind,path",
    [("vllm", "/collective_rpc"), ("sglang", "/update_weights_from_disk")],
)
async def test_engine_error_raises_apply_error_and_keeps_version(recorder, tmp_path, kind, path):
    adapter = make_adapter(kind, recorder.url, timeout_s=5)
    try:
        await activate(adapter, ActivationMode.DRAIN, tmp_path, 3)
        recorder.fail_paths[path] = (500, {"error": "CUDA out of memory while loading"})
        await adapter.pause(ActivationMode.DRAIN)
        with pytest.raises(ApplyError, match="500.*CUDA out of memory"):
            await adapter.load_checkpoint(tmp_path, 4)
        assert adapter.served_version() == 3
    finally:
        await adapter.close()


async def test_sglang_success_false_is_an_error(recorder, tmp_path):
    recorder.fail_paths["/update_weights_from_disk"] = (200, {"success": False, "message": "shape mismatch"})
    adapter = make_adapter("sglang", recorder.url, timeout_s=5)
    try:
        await adapter.pause(ActivationMode.IN_PLACE)
        with pytest.raises(ApplyError, match="shape mismatch"):
            await adapter.load_checkpoint(tmp_path, 1)
        assert adapter.served_version() == 0
    finally:
        await adapter.close()


async def test_unreachable_engine_is_apply_error(tmp_path):
    adapter = make_adapter("vllm", "http://127.0.0.1:9", timeout_s=2)
    try:
        with pytest.raises(ApplyError, match="unreachable"):
            await adapter.pause(ActivationMode.DRAIN)
        assert await adapter.health() is False
    finally:
        await adapter.close()


def test_unknown_engine_and_missing_url():
    from weftboard.proto.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="unknown engine"):
        make_adapter("tgi", "http://x")
    with pytest.raises(InvalidArgument, match="--engine-url"):
        make_adapter("vllm", None)
