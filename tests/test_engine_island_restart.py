"""An engine that restarts (crash, OOM kill) behind the island is noticed and given its verified weights back.

It comes back on its start-up weights: the island must not go on labelling its answers with the
version it loaded before. The engine watch (``engine_island._watch_engine``) withdraws the island
(503) when the engine stops answering or reports another version, and loads the verified folder
into it once it answers again. A restart whose first load of the held version fails still starts
the island: the watch reloads it. The held version goes in as a version (``load_version`` with the
folder's record: vLLM's workers verify and bind it), not as a bare reload. vLLM's health answer
says nothing of weights, so its probe asks the workers which version they hold; SGLang's reads
the weight version each load set.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

from test_destinations import _anchor, _target
from test_engine_adapters import RecordingEngine
from test_failed_activation import FolderIsland
from test_sidecar import PROMPT, SMALL, call, versions_of

from weftboard.subscriber.admission import AdmissionGate, VersionState
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.engine_destination import EngineDestination
from weftboard.subscriber.engine_island import _watch_engine, start_island
from weftboard.subscriber.engines.base import ActivationMode
from weftboard.subscriber.engines.reference import ReferenceHttpAdapter
from weftboard.subscriber.engines.sglang import SglangAdapter
from weftboard.subscriber.engines.vllm import VllmAdapter
from weftboard.subscriber.engines.vllm_worker import target_to_json
from weftboard.subscriber.reference_engine.engine import ReferenceEngine
from weftboard.subscriber.reference_engine.openai_api import serve_engine


async def test_a_restarted_engine_is_withdrawn_then_reloaded(tmp_path: Path) -> None:
    engine = ReferenceEngine(SMALL)
    server = await serve_engine(engine)
    port = int(server.url.rsplit(":", 1)[1])
    adapter = ReferenceHttpAdapter(server.url, timeout_s=5)
    island = await FolderIsland(adapter, server.url, tmp_path).start()
    watch = asyncio.create_task(_watch_engine(adapter, island.dest, island.gate, every_s=0.1))
    try:
        await island.activate(1)
        await island.activate(2)
        status, _, before = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=2"})
        assert status == 200

        await server.stop()  # the engine dies ...
        assert await island.state.wait_for(lambda: island.state.withdrawn is not None, 5.0)
        status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "min=1"})
        assert status == 503 and body["error"] == "no_verified_version" and "health check" in body["message"]
        assert island.dest.held_version() == 0  # the board is told: nothing held

        fresh = ReferenceEngine(SMALL)  # ... and comes back with its start-up weights
        server = await serve_engine(fresh, "127.0.0.1", port)
        assert await island.state.wait_for(lambda: island.state.held == 2 and island.state.error is None, 10.0)
        assert fresh.version == 2
        status, headers, after = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=2"})
        assert status == 200 and headers["X-Weftboard-Version-Start"] == "2"
        assert after["choices"][0]["text"] == before["choices"][0]["text"]  # version 2's weights, not start-up ones
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await island.stop()
        await server.stop()


async def test_an_engine_restarted_between_two_probes_is_caught_by_its_version(tmp_path: Path) -> None:
    """The restart is faster than a probe: the engine answers, but with its start-up version."""
    engine = ReferenceEngine(SMALL)
    server = await serve_engine(engine)
    port = int(server.url.rsplit(":", 1)[1])
    adapter = ReferenceHttpAdapter(server.url, timeout_s=5)
    island = await FolderIsland(adapter, server.url, tmp_path).start()
    watch: asyncio.Task | None = None
    try:
        await island.activate(1)
        await server.stop()
        fresh = ReferenceEngine(SMALL)
        server = await serve_engine(fresh, "127.0.0.1", port)
        withdrawn: list[str] = []

        async def see_withdrawal() -> None:
            await island.state.wait_for(lambda: island.state.withdrawn is not None, 10.0)
            withdrawn.append(island.state.withdrawn or "")

        seen = asyncio.create_task(see_withdrawal())
        watch = asyncio.create_task(_watch_engine(adapter, island.dest, island.gate, every_s=0.1))
        await asyncio.wait_for(seen, 10.0)
        assert "reports version 0" in withdrawn[0]
        assert await island.state.wait_for(lambda: island.state.held == 1 and island.state.withdrawn is None, 10.0)
        assert fresh.version == 1
    finally:
        if watch is not None:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        await island.stop()
        await server.stop()


async def _folder_holding(root: Path, v: int) -> CheckpointDirDestination:
    """A checkpoint folder that holds version ``v`` (as an island left it before a restart)."""
    weights = versions_of(v)[v]
    folder = CheckpointDirDestination(root)
    await folder.load_anchor(_anchor(root.parent / f"anchor-{v}", weights), _target(weights, v))
    return folder


async def test_the_held_version_goes_into_a_vllm_engine_verified_not_as_a_bare_reload(tmp_path: Path) -> None:
    folder = await _folder_holding(tmp_path / "ckpt", 2)
    target = await folder.held_target()
    assert target is not None and target.version == 2
    engine = await RecordingEngine().start()
    engine.rpc_answers["weftboard_attach"] = {"results": [
        {"rank": 0, "status": "ok", "root": target.root_digest, "version": 2}]}
    adapter = VllmAdapter(engine.url, timeout_s=5)
    state = VersionState()
    dest = EngineDestination(adapter, AdmissionGate(ActivationMode.DRAIN), state, folder, checkpoint_dir=folder.current)
    try:
        assert await dest.activate_held() == 2
        rpcs = [c["json"] for c in engine.calls if c["path"] == "/collective_rpc"]
        assert rpcs == [{"method": "weftboard_attach", "kwargs": {
            "checkpoint_dir": str(folder.current), "target": target_to_json(target)}}]
        assert state.held == 2 and adapter.served_version() == 2
    finally:
        await adapter.close()
        await engine.stop()


def _digest_answer(version: int, root: str | None) -> dict:
    return {"results": [{"rank": 0, "status": "ok", "version": version, "root": root}]}


async def _a_restart_between_two_probes(adapter, folder: CheckpointDirDestination, *, probes: Callable[[], int],
                                        restart: Callable[[], None], reload: Callable[[], None]) -> None:
    """The folder's version 2 activated and the engine watched: probes that find it change
    nothing; once ``restart`` made the engine answer as a restarted one, the island is withdrawn,
    and once ``reload`` made it answer as a reloaded one, the island holds version 2 again."""
    state = VersionState()
    gate = AdmissionGate(ActivationMode.DRAIN)
    dest = EngineDestination(adapter, gate, state, folder, checkpoint_dir=folder.current)
    assert await dest.activate_held() == 2
    watch = asyncio.create_task(_watch_engine(adapter, dest, gate, every_s=0.05))
    try:
        for _ in range(100):
            if probes() >= 3:
                break
            await asyncio.sleep(0.05)
        assert probes() >= 3 and state.held == 2 and state.withdrawn is None
        restart()
        assert await state.wait_for(lambda: state.withdrawn is not None, 10.0)
        assert "reports version 0 where the island loaded version 2" in (state.withdrawn or "")
        assert adapter.served_version() == 0
        reload()
        assert await state.wait_for(lambda: state.held == 2 and state.withdrawn is None, 10.0)
        assert adapter.served_version() == 2
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)


async def test_a_vllm_engine_restarted_between_two_probes_is_caught_by_its_workers_version(tmp_path: Path) -> None:
    """vLLM's ``/health`` says nothing of weights: while the workers hold the served version bound,
    the probe asks them (``weftboard_digest``), and workers that came back with none (a restart
    faster than a probe, on the engine's start-up weights) withdraw the island until the verified
    folder is in again."""
    folder = await _folder_holding(tmp_path / "ckpt", 2)
    target = await folder.held_target()
    assert target is not None
    engine = await RecordingEngine().start()
    engine.rpc_answers["weftboard_attach"] = {"results": [
        {"rank": 0, "status": "ok", "root": target.root_digest, "version": 2}]}
    engine.rpc_answers["weftboard_digest"] = _digest_answer(2, target.root_digest)
    adapter = VllmAdapter(engine.url, timeout_s=5)

    def rpcs(method: str) -> int:
        return sum(1 for c in engine.calls if c["path"] == "/collective_rpc" and c["json"]["method"] == method)

    try:
        await _a_restart_between_two_probes(
            adapter, folder, probes=lambda: rpcs("weftboard_digest"),
            restart=lambda: engine.rpc_answers.update(weftboard_digest=_digest_answer(0, None)),  # none held
            reload=lambda: engine.rpc_answers.update(weftboard_digest=_digest_answer(2, target.root_digest)))
        assert rpcs("weftboard_attach") == 2  # the verified folder, verified by the workers
    finally:
        await adapter.close()
        await engine.stop()


async def test_an_sglang_engine_restarted_between_two_probes_is_caught_by_its_weight_version(tmp_path: Path) -> None:
    """SGLang's ``/health`` says nothing of weights either: its ``weight_version``, which each load
    sets to the island's version, is back at ``default`` after a restart; the island is withdrawn
    until its verified folder is loaded again."""
    folder = await _folder_holding(tmp_path / "ckpt", 2)
    engine = await RecordingEngine().start()
    engine.answers["/v1/models"] = {"data": [{"id": "base"}]}
    engine.answers["/model_info"] = {"weight_version": "2"}
    adapter = SglangAdapter(engine.url, timeout_s=5)

    def calls(path: str) -> int:
        return sum(1 for c in engine.calls if c["path"] == path)

    try:
        await _a_restart_between_two_probes(
            adapter, folder, probes=lambda: calls("/model_info"),
            restart=lambda: engine.answers.update({"/model_info": {"weight_version": "default"}}),
            reload=lambda: engine.answers.update({"/model_info": {"weight_version": "2"}}))
        assert calls("/update_weights_from_disk") == 2
    finally:
        await adapter.close()
        await engine.stop()


async def test_the_probe_asks_no_worker_after_the_engines_own_reload_or_while_a_patch_stages(tmp_path: Path) -> None:
    """The engine's own reload unbinds the workers (until ``adopt``): they hold no version then,
    which is no restart, so the probe is ``/health`` alone. Nor does it ask while a patch is
    staged: the workers' digest would wait for the staging inside the engine."""
    target = _target(versions_of(3)[3], 3)
    engine = await RecordingEngine().start()
    engine.rpc_answers["weftboard_adopt"] = {"results": [
        {"rank": 0, "status": "ok", "root": target.root_digest, "version": 3}]}
    engine.rpc_answers["weftboard_digest"] = _digest_answer(3, target.root_digest)
    engine.rpc_answers["weftboard_warm_up"] = {"results": [{"rank": 0, "status": "ok", "seconds": 0.0}]}
    for method in ("weftboard_stage_patch", "weftboard_stage_status"):  # a staging that goes on
        engine.rpc_answers[method] = {"results": [{"rank": 0, "status": "staging"}]}
    adapter = VllmAdapter(engine.url, timeout_s=5, load_timeout_s=1.0)

    def paths() -> list[str]:
        return [c["json"]["method"] if c["path"] == "/collective_rpc" else c["path"] for c in engine.calls]

    try:
        await adapter.load_checkpoint(tmp_path / "ckpt", 3)
        assert adapter.served_version() == 3
        engine.calls.clear()
        assert await adapter.health_answer() == {"success": True}
        assert paths() == ["/health"]

        await adapter.adopt(tmp_path / "ckpt", target)  # the workers bind the reloaded version
        engine.calls.clear()
        assert await adapter.health_answer() == {"version": 3}
        assert paths() == ["/health", "weftboard_digest"]

        staging = asyncio.create_task(adapter.prepare_patch(tmp_path / "p4.patch", _target(versions_of(4)[4], 4)))
        while "weftboard_stage_patch" not in paths():
            await asyncio.sleep(0.01)
        engine.calls.clear()
        assert await adapter.health_answer() == {"success": True}
        assert paths().count("weftboard_digest") == 0
        assert await staging is False  # never staged within the load timeout
        engine.calls.clear()
        assert await adapter.health_answer() == {"version": 3}  # staging over: asked again
    finally:
        await adapter.close()
        await engine.stop()


async def test_a_failed_load_of_the_held_version_at_start_does_not_end_the_start(tmp_path: Path) -> None:
    """The engine refuses the first load of the version on disk: the island starts anyway, in
    error and serving nothing, and the engine watch loads the verified folder once it can."""
    await _folder_holding(tmp_path / "ckpt", 2)
    engine = ReferenceEngine(SMALL)
    server = await serve_engine(engine)
    load = engine.load_checkpoint_dir
    refused: list[Path] = []

    def refuse_once(directory: Path) -> None:
        if not refused:
            refused.append(directory)
            raise OSError("disk read error")
        load(directory)

    engine.load_checkpoint_dir = refuse_once  # type: ignore[method-assign]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        board = f"127.0.0.1:{s.getsockname()[1]}"  # no board there: the island starts without one
    island = None
    try:
        island = await start_island(board=board, token=None, run="run-a", island_id="i1", engine="reference",
                                    engine_url=server.url, checkpoint_dir=tmp_path / "ckpt",
                                    cache_dir=tmp_path / "cache", engine_watch_s=0.1, scrub_interval_s=0)
        assert refused  # the first load was refused, and the island started nevertheless
        assert await island.state.wait_for(lambda: island.state.held == 2 and island.state.error is None, 10.0)
        assert engine.version == 2 and island.adapter.served_version() == 2
    finally:
        if island is not None:
            await island.stop()
        await server.stop()
