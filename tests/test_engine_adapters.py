"""Engine adapters send exactly the recorded requests, and turn engine failures into ApplyError."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from enginekit import CatchAllServer

from weftboard.board.embedded import free_port
from weftboard.proto.errors import ApplyError
from weftboard.subscriber.engines import sglang
from weftboard.subscriber.engines.base import ActivationMode
from weftboard.subscriber.engines.factory import make_adapter

CONTRACTS = Path(__file__).parent / "contracts"


class RecordingEngine(CatchAllServer):
    """A local HTTP server that records every request and answers as told."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.authorization: list[str | None] = []  # the Authorization header of each call
        self.fail_paths: dict[str, tuple[int, Any]] = {}
        self.answers: dict[str, Any] = {}  # path -> the JSON body of a 200 answer
        self.rpc_answers: dict[str, Any] = {}  # /collective_rpc method -> the JSON body of a 200 answer

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.calls.append({
            "method": request.method,
            "path": request.path,
            "query": dict(request.query),
            "json": json.loads(raw) if raw else None,
        })
        self.authorization.append(request.headers.get("Authorization"))
        if request.path in self.fail_paths:
            status, body = self.fail_paths[request.path]
            return web.json_response(body, status=status)
        method = (self.calls[-1]["json"] or {}).get("method") if request.path == "/collective_rpc" else None
        if method in self.rpc_answers:
            return web.json_response(self.rpc_answers[method])
        return web.json_response(self.answers.get(request.path, {"success": True}))



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
        # an SGLang without /model_info (404): its older name, from then on
        recorder.fail_paths["/model_info"] = (404, {"detail": "Not Found"})
        recorder.answers["/get_model_info"] = {"weight_version": "3"}
        recorder.calls.clear()
        assert await adapter.model_info() == {"weight_version": "3"}
        assert await adapter.model_info() == {"weight_version": "3"}
        assert [c["path"] for c in recorder.calls] == ["/model_info", "/get_model_info", "/get_model_info"]
    finally:
        await adapter.close()


async def test_sglang_health_reports_the_weight_version_each_load_set(recorder, tmp_path):
    """SGLang's ``/health`` says nothing of weights; its ``weight_version`` does: each load sets
    it to the island's version, and a restart puts the start-up one (``default``) back. Before
    the first load, and on an SGLang that reports none, the health answer stands alone."""
    adapter = make_adapter("sglang", recorder.url, timeout_s=5)
    try:
        assert await adapter.health_answer() == {"success": True}  # nothing served yet: /health alone
        assert [c["path"] for c in recorder.calls] == ["/health"]
        await activate(adapter, ActivationMode.DRAIN, tmp_path, 5)
        recorder.answers["/model_info"] = {"weight_version": "5", "model_path": str(tmp_path)}
        assert await adapter.health_answer() == {"version": 5}
        recorder.answers["/model_info"] = {"weight_version": "default"}  # restarted on its start-up weights
        assert await adapter.health_answer() == {"version": 0}
        recorder.answers["/model_info"] = {"model_path": "m"}  # an SGLang without weight versions
        assert await adapter.health_answer() == {"success": True}
    finally:
        await adapter.close()


@pytest.mark.parametrize(
    "kind,path",
    [("vllm", "/collective_rpc"), ("sglang", "/update_weights_from_disk")],
)
async def test_engine_error_raises_apply_error_and_says_what_it_serves(recorder, tmp_path, kind, path):
    """An error answer to a load is an ApplyError. SGLang's load refused keeps the old weights;
    vLLM's ``reload_weights`` is not transactional (a worker that raised may have moved some
    layers), so after its error answer the adapter vouches for no version."""
    adapter = make_adapter(kind, recorder.url, timeout_s=5)
    try:
        await activate(adapter, ActivationMode.DRAIN, tmp_path, 3)
        recorder.fail_paths[path] = (500, {"error": "CUDA out of memory while loading"})
        await adapter.pause(ActivationMode.DRAIN)
        with pytest.raises(ApplyError, match="500.*CUDA out of memory"):
            await adapter.load_checkpoint(tmp_path, 4)
        if kind == "vllm":
            assert adapter.served_version() == 0
            assert "collective_rpc reload_weights answered HTTP 500" in adapter.unverified
        else:
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


# ---------------------------------------------------------------------------
# The engine's API key
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["reference", "vllm", "sglang"])
async def test_a_configured_api_key_goes_with_every_call(recorder, tmp_path, kind):
    adapter = make_adapter(kind, recorder.url, timeout_s=5, api_key="secret")
    try:
        assert await adapter.health() is True
        await adapter.pause(ActivationMode.IN_PLACE)
        await adapter.resume()
        assert recorder.calls and recorder.authorization == ["Bearer secret"] * len(recorder.calls)
        recorder.fail_paths["/health"] = (401, {"error": "bad key"})
        with pytest.raises(ApplyError, match="401") as failure:
            await adapter.call("GET", "/health")
        assert "secret" not in str(failure.value)  # the key is never in a message
    finally:
        await adapter.close()
    adapter = make_adapter(kind, recorder.url, timeout_s=5)  # without a key: no header at all
    try:
        recorder.authorization.clear()
        await adapter.pause(ActivationMode.IN_PLACE)
        assert recorder.authorization and set(recorder.authorization) == {None}
    finally:
        await adapter.close()


# ---------------------------------------------------------------------------
# SGLang: pause modes, the served model name, failures
# ---------------------------------------------------------------------------

MODELS = {"object": "list", "data": [{"id": "Qwen/Qwen2.5-0.5B", "object": "model", "root": "Qwen/Qwen2.5-0.5B"}]}


async def test_sglang_warm_up_records_the_served_model_name(recorder, tmp_path):
    recorder.answers["/v1/models"] = MODELS
    adapter = make_adapter("sglang", recorder.url, timeout_s=5)
    try:
        assert adapter.served_model_name is None
        assert await adapter.warm_up() >= 0
        assert recorder.calls == expected("sglang", "warm_up", None, tmp_path, 0)
        assert adapter.served_model_name == "Qwen/Qwen2.5-0.5B"
        # the engine renames its model to the folder it loads; the recorded name stays
        recorder.answers["/v1/models"] = {"data": [{"id": str(tmp_path)}]}
        await activate(adapter, ActivationMode.IN_PLACE, tmp_path, 1)
        await adapter.warm_up()
        assert adapter.served_model_name == "Qwen/Qwen2.5-0.5B"
    finally:
        await adapter.close()
    recorder.calls.clear()
    adapter = make_adapter("sglang", recorder.url, timeout_s=5, served_model_name="my-model")
    try:
        await adapter.warm_up()  # a name given is not asked for
        assert recorder.calls == [] and adapter.served_model_name == "my-model"
    finally:
        await adapter.close()


@pytest.mark.parametrize("answer", [{"data": []}, {"object": "list"}, {"data": [{"id": ""}]}, "text"])
async def test_sglang_models_answer_without_a_name_is_apply_error(recorder, answer):
    recorder.answers["/v1/models"] = answer
    adapter = make_adapter("sglang", recorder.url, timeout_s=5)
    try:
        with pytest.raises(ApplyError, match="without a model id"):
            await adapter.warm_up()
    finally:
        await adapter.close()


async def test_sglang_in_place_pause_is_undone_even_when_the_load_fails(recorder, tmp_path):
    recorder.fail_paths["/update_weights_from_disk"] = (400, {
        "success": False, "num_paused_requests": 0,
        "message": "Failed to get weights iterator: model.safetensors: no such file"})
    adapter = make_adapter("sglang", recorder.url, timeout_s=5)
    try:
        await adapter.pause(ActivationMode.IN_PLACE)
        with pytest.raises(ApplyError) as failure:
            await adapter.load_checkpoint(tmp_path, 5)
        message = str(failure.value)
        assert "version 5" in message and str(tmp_path) in message and "400" in message
        assert "no such file" in message  # the engine's own words
        await adapter.resume()
        assert [c["path"] for c in recorder.calls] == ["/pause_generation", "/update_weights_from_disk",
                                                       "/continue_generation"]
        assert adapter.served_version() == 0

        # a pause the engine refused is still undone: it may have paused before it failed
        recorder.calls.clear()
        recorder.fail_paths = {"/pause_generation": (500, {"error": "scheduler busy"})}
        with pytest.raises(ApplyError, match="scheduler busy"):
            await adapter.pause(ActivationMode.IN_PLACE)
        await adapter.resume()
        await adapter.resume()  # nothing left to continue
        assert [c["path"] for c in recorder.calls] == ["/pause_generation", "/continue_generation"]
    finally:
        await adapter.close()


async def test_sglang_drain_never_pauses_the_engine(recorder, tmp_path):
    adapter = make_adapter("sglang", recorder.url, timeout_s=5)
    try:
        for version in (1, 2):
            await activate(adapter, ActivationMode.DRAIN, tmp_path, version)
        assert [c["path"] for c in recorder.calls] == ["/update_weights_from_disk"] * 2
        assert [c["json"]["weight_version"] for c in recorder.calls] == ["1", "2"]
        assert adapter.served_version() == 2
    finally:
        await adapter.close()


async def test_sglang_warm_up_waits_for_an_engine_still_starting(monkeypatch) -> None:
    """A sidecar started beside its engine: nothing listens at first, then the engine answers
    503 while it loads, then it serves; warm-up waits through both (before, the first refused
    connection ended the sidecar's start with exit 1, which its systemd unit does not restart)."""
    monkeypatch.setattr(sglang, "_WARM_UP_RETRY_S", 0.05)
    port = free_port()
    loading = True

    async def models(request: web.Request) -> web.Response:
        if loading:
            return web.Response(status=503, text="loading")
        return web.json_response(MODELS)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    adapter = make_adapter("sglang", f"http://127.0.0.1:{port}", timeout_s=2, load_timeout_s=30)
    try:
        warm = asyncio.create_task(adapter.warm_up())
        await asyncio.sleep(0.3)
        assert not warm.done()  # no engine yet: still asking
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.sleep(0.3)
        assert not warm.done()  # loading: still asking
        loading = False
        await asyncio.wait_for(warm, 10)
        assert adapter.served_model_name == "Qwen/Qwen2.5-0.5B"
    finally:
        await adapter.close()
        await runner.cleanup()


async def test_sglang_warm_up_gives_up_after_the_load_timeout() -> None:
    adapter = make_adapter("sglang", f"http://127.0.0.1:{free_port()}", timeout_s=1, load_timeout_s=0.5)
    try:
        with pytest.raises(ApplyError, match="unreachable.*while it started"):
            await adapter.warm_up()
    finally:
        await adapter.close()
