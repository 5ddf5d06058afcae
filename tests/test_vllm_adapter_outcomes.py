"""VllmAdapter against a fake vLLM server: what it vouches for after a weight change that failed.

- An HTTP error answer to a weight-changing call (vLLM's ``reload_weights``, the worker methods
  that write weights) is an unknown outcome: a worker raised part-way, and vLLM's reload is not
  transactional. No version is vouched for (``mark_unverified``), the error still surfaces.
- A patch that left the workers apart, followed by a whole load that failed, vouches for nothing,
  whether the load was refused (answers without ``restored``) or answered HTTP 500.
- Staging waits while any worker is still at it (tensor-parallel workers finish apart).
- Only an answer saying the worker extension is missing turns patches in place off; a warm-up
  that got no clear answer leaves them on and the next ``prepare_patch`` asks again.
- Every full reload (``load_checkpoint``, however reached) reties the tied output head before the
  version is served; a failed retie vouches for nothing, unless no warm-up confirmed the extension
  and the engine answers it has none (a warning, the reload stands). ``load_version`` asks again
  about an unknown extension first, and takes the engine's own reload where ``attach`` is missing.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from aiohttp import web
from enginekit import CatchAllServer

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.destination import TensorEntry, VersionTarget
from weftboard.subscriber.engines.vllm import VllmAdapter


def _target(version: int) -> VersionTarget:
    return VersionTarget(version=version, root_digest=f"root-{version}", tensor_digests={"w": f"d{version}"},
                         layout=[TensorEntry("w", "bfloat16", (4,))])


V1, V2 = _target(1), _target(2)


def _ok(target: VersionTarget) -> dict[str, Any]:
    return {"status": "ok", "root": target.root_digest, "version": target.version}


def _results(*answers: dict[str, Any]) -> dict[str, Any]:
    return {"results": [{"rank": rank, **a} for rank, a in enumerate(answers)]}


class FakeVllm(CatchAllServer):
    """Answers ``/collective_rpc`` per worker method: an HTTP status (``rpc_status``), the next of a
    sequence of bodies (``rpc_seq``), or one body (``rpc_answers``); every other path ``{}``."""

    def __init__(self) -> None:
        self.rpcs: list[str] = []
        self.seen: list[str] = []  # every request in order: the worker method, else the path
        self.on_rpc: dict[str, Callable[[], None]] = {}  # called when the method arrives
        self.rpc_status: dict[str, tuple[int, str]] = {}
        self.rpc_seq: dict[str, list[dict[str, Any]]] = {}
        self.rpc_answers: dict[str, dict[str, Any]] = {}
        self.path_answers: dict[str, dict[str, Any]] = {}  # other paths: this body, else {}

    async def _handle(self, request: web.Request) -> web.Response:
        if request.path != "/collective_rpc":
            self.seen.append(request.path)
            return web.json_response(self.path_answers.get(request.path, {}))
        method = json.loads(await request.read())["method"]
        self.rpcs.append(method)
        self.seen.append(method)
        if method in self.on_rpc:
            self.on_rpc[method]()
        if method in self.rpc_status:
            status, text = self.rpc_status[method]
            return web.Response(status=status, text=text)
        if self.rpc_seq.get(method):
            return web.json_response(self.rpc_seq[method].pop(0))
        return web.json_response(self.rpc_answers.get(method, _results(_ok(V1), _ok(V1))))


@pytest.fixture
async def engine():
    server = await FakeVllm().start()
    yield server
    await server.stop()


@pytest.fixture
async def adapter(engine):
    """An adapter whose engine serves version 1 (as after a verified load)."""
    a = VllmAdapter(engine.url, timeout_s=5)
    a.mark_served(1)
    yield a
    await a.close()


# -- 1. an HTTP error to a weight-changing call: the outcome is unknown ------------------------

WEIGHT_CHANGES = {
    "reload_weights": lambda a, d: a.load_checkpoint(d, 2),
    "weftboard_attach": lambda a, d: a.attach(d, V2),
    "weftboard_adopt": lambda a, d: a.adopt(d, V2),
}


@pytest.mark.parametrize("method", sorted(WEIGHT_CHANGES))
async def test_an_error_answer_to_a_weight_change_vouches_for_no_version(engine, adapter, tmp_path, method):
    engine.rpc_status[method] = (500, "Internal Server Error")
    with pytest.raises(ApplyError, match="answered 500"):
        await WEIGHT_CHANGES[method](adapter, tmp_path)
    assert adapter.served_version() == 0
    assert adapter.unverified is not None
    assert f"collective_rpc {method} answered HTTP 500" in adapter.unverified


@pytest.mark.parametrize("method", ["weftboard_commit", "weftboard_apply_patch"])
async def test_an_error_answer_to_a_patch_in_place_vouches_for_no_version(engine, adapter, tmp_path, method):
    if method == "weftboard_commit":  # staged first, so the pause commits
        engine.rpc_answers["weftboard_stage_patch"] = _results({"status": "staged"}, {"status": "staged"})
        assert await adapter.prepare_patch(tmp_path / "p", V2) is True
    engine.rpc_status[method] = (500, "Internal Server Error")
    with pytest.raises(ApplyError, match="answered 500"):
        await adapter.activate_patch(tmp_path / "p", V2, tmp_path)
    assert adapter.served_version() == 0
    assert f"collective_rpc {method} answered HTTP 500" in (adapter.unverified or "")


async def test_an_error_answer_to_a_call_that_changes_no_weights_keeps_the_version(engine, adapter):
    engine.rpc_status["weftboard_digest"] = (500, "Internal Server Error")
    with pytest.raises(ApplyError, match="answered 500"):
        await adapter.engine_digest()
    assert adapter.served_version() == 1 and adapter.unverified is None


# -- 2. a patch that left the workers apart, then a whole load that failed --------------------

TORN = _results(_ok(V2), {"status": "needs_attach", "error": "holds 0", "version": 0})


async def test_workers_left_apart_and_a_refused_whole_load_vouch_for_no_version(engine, adapter, tmp_path):
    engine.rpc_answers["weftboard_apply_patch"] = TORN
    refused = {"status": "rejected", "error": "checkpoint refused: [Errno 5] Input/output error"}  # no "restored"
    engine.rpc_answers["weftboard_attach"] = _results(refused, refused)
    with pytest.raises(ApplyError, match="Input/output error") as raised:
        await adapter.activate_patch(tmp_path / "p", V2, tmp_path)
    assert "still serves version" not in str(raised.value)
    assert adapter.served_version() == 0
    assert "left the workers apart" in (adapter.unverified or "")


async def test_workers_left_apart_and_a_whole_load_answering_500_vouch_for_no_version(engine, adapter, tmp_path):
    engine.rpc_answers["weftboard_apply_patch"] = _results(
        _ok(V2), {"status": "install_failed", "error": "OOM", "restored": False})
    engine.rpc_status["weftboard_attach"] = (500, "Internal Server Error")
    with pytest.raises(ApplyError, match="answered 500"):
        await adapter.activate_patch(tmp_path / "p", V2, tmp_path)
    assert adapter.served_version() == 0
    assert "left the workers apart" in (adapter.unverified or "")


async def test_workers_left_apart_and_a_whole_load_that_succeeds_serve_the_new_version(engine, adapter, tmp_path):
    engine.rpc_answers["weftboard_apply_patch"] = TORN
    engine.rpc_answers["weftboard_attach"] = _results(_ok(V2), _ok(V2))
    assert await adapter.activate_patch(tmp_path / "p", V2, tmp_path) == "full_load"
    assert adapter.served_version() == 2 and adapter.unverified is None


async def test_no_worker_moved_and_a_refused_whole_load_keep_the_version(engine, adapter, tmp_path):
    engine.rpc_answers["weftboard_apply_patch"] = _results(*[{"status": "needs_attach", "version": 0}] * 2)
    refused = {"status": "rejected", "error": "checkpoint refused"}
    engine.rpc_answers["weftboard_attach"] = _results(refused, refused)
    with pytest.raises(ApplyError, match="still serves version 1"):
        await adapter.activate_patch(tmp_path / "p", V2, tmp_path)
    assert adapter.served_version() == 1 and adapter.unverified is None


# -- 3. staging waits for the slowest worker -------------------------------------------------

async def test_staging_waits_while_any_worker_is_still_staging(engine, adapter, tmp_path):
    engine.rpc_answers["weftboard_stage_patch"] = _results({"status": "staging"}, {"status": "staging"})
    engine.rpc_seq["weftboard_stage_status"] = [
        _results({"status": "staging"}, {"status": "staging"}),
        _results({"status": "staged"}, {"status": "staging"}),  # one worker done, the other not yet
        _results({"status": "staged"}, {"status": "staged"}),
    ]
    assert await adapter.prepare_patch(tmp_path / "p", V2) is True
    assert engine.rpcs == ["weftboard_stage_patch"] + ["weftboard_stage_status"] * 3
    engine.rpc_answers["weftboard_commit"] = _results(_ok(V2), _ok(V2))
    assert await adapter.activate_patch(tmp_path / "p", V2, tmp_path) == "in_place"
    assert engine.rpcs[-1] == "weftboard_commit" and adapter.served_version() == 2


# -- 4. warm-up: only a clear "no extension" turns patches in place off ----------------------

async def test_an_unreachable_engine_at_warm_up_keeps_patches_in_place_and_asks_again(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there: an engine still starting
    engine = await FakeVllm().start()
    adapter = VllmAdapter(f"http://127.0.0.1:{port}", timeout_s=2)
    try:
        assert await adapter.warm_up() == 0.0
        assert adapter.in_place is True
        adapter.engine_url = engine.url  # the engine is up now
        engine.rpc_answers["weftboard_warm_up"] = _results({"status": "ok", "seconds": 0.5})
        engine.rpc_answers["weftboard_stage_patch"] = _results({"status": "staged"}, {"status": "staged"})
        assert await adapter.prepare_patch(tmp_path / "p", V2) is True  # asked again, then staged
        assert engine.rpcs == ["weftboard_warm_up", "weftboard_stage_patch"]
    finally:
        await adapter.close()
        await engine.stop()


async def test_a_5xx_at_warm_up_that_says_nothing_of_the_extension_keeps_patches_in_place(engine, adapter, tmp_path):
    engine.rpc_status["weftboard_warm_up"] = (503, "Service Unavailable")
    assert await adapter.warm_up() == 0.0
    assert adapter.in_place is True
    # until it is known, a version is the engine's own reload, which needs no extension
    assert await adapter.prepare_patch(tmp_path / "p", V2) is False  # asked again: still no answer
    assert await adapter.activate_patch(tmp_path / "p", V2, tmp_path) == "full_load"
    assert "reload_weights" in engine.rpcs and "weftboard_apply_patch" not in engine.rpcs
    assert adapter.served_version() == 2


@pytest.mark.parametrize("answer", [
    (500, "NotImplementedError: Method 'weftboard_warm_up' is not implemented."),
    (500, "AttributeError: 'Worker' object has no attribute 'weftboard_warm_up'"),
    (404, '{"detail": "Not Found"}'),
], ids=["not-implemented", "no-attribute", "no-route"])
async def test_an_engine_without_the_extension_turns_patches_in_place_off(engine, adapter, answer):
    engine.rpc_status["weftboard_warm_up"] = answer
    assert await adapter.warm_up() == 0.0
    assert adapter.in_place is False


async def test_results_no_extension_gives_turn_patches_in_place_off(engine, adapter):
    engine.rpc_answers["weftboard_warm_up"] = {"results": [None, None]}
    assert await adapter.warm_up() == 0.0
    assert adapter.in_place is False


async def test_a_warm_up_that_answers_keeps_patches_in_place(engine, adapter):
    engine.rpc_answers["weftboard_warm_up"] = _results({"status": "ok", "seconds": 0.25}, {"status": "ok", "seconds": 1.5})
    assert await adapter.warm_up() == 1.5
    assert adapter.in_place is True


# -- the prefix cache not dropped after new weights ---------------------------------------------


async def test_a_prefix_cache_reset_answered_unsuccessful_vouches_for_no_version(engine, adapter, tmp_path):
    """vLLM answers 200 ``{"success": false}`` when it could not drop the cache: the new weights
    would serve behind entries computed on the old ones."""
    engine.path_answers["/reset_prefix_cache"] = {"success": False}
    with pytest.raises(ApplyError, match="did not reset its prefix cache"):
        await adapter.load_checkpoint(tmp_path, 2)
    assert adapter.served_version() == 0 and "prefix cache" in (adapter.unverified or "")
    engine.path_answers["/reset_prefix_cache"] = {"success": True}
    await adapter.load_checkpoint(tmp_path, 2)
    assert adapter.served_version() == 2


# -- a full reload reties the tied output head ------------------------------------------------

NOT_IMPLEMENTED = "NotImplementedError: Method 'weftboard_{}' is not implemented."


async def _confirm_extension(engine: FakeVllm, adapter: VllmAdapter) -> None:
    engine.rpc_answers["weftboard_warm_up"] = _results({"status": "ok", "seconds": 0.1})
    assert await adapter.warm_up() == 0.1


async def test_a_full_reload_reties_the_head_before_the_version_is_served(engine, adapter, tmp_path):
    served_at_retie: list[int] = []
    engine.on_rpc["weftboard_retie"] = lambda: served_at_retie.append(adapter.served_version())
    await adapter.load_checkpoint(tmp_path, 2)
    assert engine.seen == ["weftboard_detach", "reload_weights", "weftboard_retie", "/reset_prefix_cache"]
    assert served_at_retie == [1]  # the new version counts only once the head is prepared again
    assert adapter.served_version() == 2 and adapter.unverified is None


async def test_a_full_reload_by_load_version_reties_too(engine, adapter, tmp_path):
    adapter.in_place = False  # an engine whose warm-up found no extension: versions are full reloads
    await adapter.load_version(tmp_path, V2)
    assert engine.rpcs[-2:] == ["reload_weights", "weftboard_retie"]
    assert adapter.served_version() == 2


@pytest.mark.parametrize("confirmed,answer", [
    (True, (500, NOT_IMPLEMENTED.format("retie"))),  # confirmed: even a "missing" answer is a failure
    (True, (500, "RuntimeError: CPU kernel packing failed")),
    (True, {"status": "error", "error": "packing failed"}),
    (False, (500, "RuntimeError: CPU kernel packing failed")),  # says nothing of the extension
], ids=["confirmed-missing", "confirmed-500", "confirmed-error-status", "unconfirmed-500"])
async def test_a_failed_retie_vouches_for_no_version(engine, adapter, tmp_path, confirmed, answer):
    if confirmed:
        await _confirm_extension(engine, adapter)
    if isinstance(answer, tuple):
        engine.rpc_status["weftboard_retie"] = answer
    else:
        engine.rpc_answers["weftboard_retie"] = _results(_ok(V2), answer)
    with pytest.raises(ApplyError):
        await adapter.load_checkpoint(tmp_path, 2)
    assert adapter.served_version() == 0
    assert "tied output head was not prepared again" in (adapter.unverified or "")
    assert "/reset_prefix_cache" not in engine.seen


@pytest.mark.parametrize("answer", [
    (500, NOT_IMPLEMENTED.format("retie")),
    (404, '{"detail": "Not Found"}'),
    {"success": True},  # results no extension gives
], ids=["not-implemented", "no-route", "no-results"])
async def test_a_retie_missing_before_the_extension_is_confirmed_serves_with_a_warning(engine, adapter, tmp_path,
                                                                                         answer):
    if isinstance(answer, tuple):
        engine.rpc_status["weftboard_retie"] = answer
    else:
        engine.rpc_answers["weftboard_retie"] = answer
    with structlog.testing.capture_logs() as logs:
        await adapter.load_checkpoint(tmp_path, 2)
        await adapter.load_checkpoint(tmp_path, 3)
    assert adapter.served_version() == 3 and adapter.unverified is None
    warned = [e for e in logs if "cannot retie" in e["event"]]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning"  # once, not at every reload


async def test_load_version_asks_again_about_an_unknown_extension_first(engine, adapter, tmp_path):
    engine.rpc_status["weftboard_warm_up"] = (503, "Service Unavailable")
    assert await adapter.warm_up() == 0.0  # no clear answer: the extension is unknown
    del engine.rpc_status["weftboard_warm_up"]
    engine.rpc_answers["weftboard_warm_up"] = _results({"status": "ok", "seconds": 0.1})
    engine.rpc_answers["weftboard_attach"] = _results(_ok(V2), _ok(V2))
    engine.rpcs.clear()
    await adapter.load_version(tmp_path, V2)
    assert engine.rpcs == ["weftboard_warm_up", "weftboard_attach"]  # verified and bound, not a bare reload
    assert adapter.served_version() == 2


@pytest.mark.parametrize("answer", [
    (500, NOT_IMPLEMENTED.format("attach")),
    (404, '{"detail": "Not Found"}'),
], ids=["not-implemented", "no-route"])
async def test_an_attach_answered_missing_falls_back_to_the_engines_own_reload(engine, adapter, tmp_path, answer):
    await _confirm_extension(engine, adapter)
    engine.rpc_status["weftboard_attach"] = answer
    engine.rpc_status["weftboard_retie"] = (500, NOT_IMPLEMENTED.format("retie"))  # restarted without it
    engine.rpcs.clear()
    await adapter.load_version(tmp_path, V2)
    assert engine.rpcs == ["weftboard_attach", "weftboard_detach", "reload_weights", "weftboard_retie"]
    assert adapter.served_version() == 2 and adapter.unverified is None


async def test_an_attach_refused_for_another_reason_does_not_fall_back(engine, adapter, tmp_path):
    await _confirm_extension(engine, adapter)
    engine.rpc_status["weftboard_attach"] = (500, "RuntimeError: out of memory")
    engine.rpcs.clear()
    with pytest.raises(ApplyError, match="out of memory"):
        await adapter.load_version(tmp_path, V2)
    assert engine.rpcs == ["weftboard_attach"]
    assert adapter.served_version() == 0  # an error answer to a weight change: the outcome is unknown
