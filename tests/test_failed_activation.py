"""A failed activation that leaves the engine on weights nobody vouches for is never served.

The island in front of an engine in its own process (a verified checkpoint folder, the
engine's adapter, the sidecar): when a weight change fails and the adapter cannot say the
engine is back on the version it held (a load the engine never answered and may still be
running; vLLM workers that did not put the old bytes back), the island admits no request for
any version (503 naming why), holds 0 (what the subscriber heartbeats to the board) and
serves again once a verified version is loaded. Where the old weights are back, it keeps
serving them, in error, as before.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from test_destinations import _anchor, _target
from test_engine_adapters import RecordingEngine
from test_sidecar import PROMPT, SMALL, call, get, versions_of

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.admission import AdmissionGate, VersionState
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.engine_destination import EngineDestination
from weftboard.subscriber.engines.base import ActivationMode, EngineAdapter
from weftboard.subscriber.engines.reference import ReferenceHttpAdapter
from weftboard.subscriber.engines.vllm import VllmAdapter
from weftboard.subscriber.reference_engine.engine import ReferenceEngine
from weftboard.subscriber.reference_engine.openai_api import serve_engine
from weftboard.subscriber.sidecar import Sidecar, SidecarConfig


class FolderIsland:
    """A checkpoint folder, an engine adapter over HTTP and the sidecar, wired as ``start_island`` does."""

    def __init__(self, adapter: EngineAdapter, engine_url: str, root: Path) -> None:
        self.adapter, self.root = adapter, root
        self.state, self.gate = VersionState(), AdmissionGate(ActivationMode.DRAIN)
        self.folder = CheckpointDirDestination(root / "ckpt")
        self.dest = EngineDestination(adapter, self.gate, self.state, self.folder, checkpoint_dir=self.folder.current)
        self.sidecar = Sidecar(SidecarConfig(engine_url, "run-a", "island-1", default_deadline_s=5),
                               self.state, self.gate)
        self.versions = versions_of(3)
        self.url = ""

    async def start(self) -> FolderIsland:
        self.url = await self.sidecar.start()
        return self

    async def activate(self, v: int) -> None:
        """The subscriber's anchor step: the folder written and verified (once), then the engine loads it."""
        await self.state.set_head(v)
        await self.dest.load_anchor(_anchor(self.root / f"anchor-{v}", self.versions[v]), _target(self.versions[v], v))

    async def refused_everything(self, why: str) -> None:
        """No request is admitted, whatever version it asks for, and readiness says why."""
        for header in ("exact=1", "min=1", None):
            t0 = time.monotonic()
            status, headers, body = await call(self.url, PROMPT, {"X-Weftboard-Version": header} if header else {})
            assert time.monotonic() - t0 < 2.0  # at once, not after the deadline
            assert status == 503 and body["error"] == "no_verified_version", (header, body)
            assert body["held"] == 0 and why in body["message"] and headers["Retry-After"] == "1", body
        status, body = await get(self.url + "/health/ready")
        assert status == 503 and why in body["reason"] and body["held"] == 0, body

    async def stop(self) -> None:
        await self.sidecar.stop()
        await self.adapter.close()


async def test_a_load_the_engine_never_answered_is_not_served_until_a_verified_load(tmp_path: Path) -> None:
    engine = ReferenceEngine(SMALL)
    server = await serve_engine(engine)
    island = await FolderIsland(ReferenceHttpAdapter(server.url, timeout_s=5, load_timeout_s=0.3),
                                server.url, tmp_path).start()
    try:
        await island.activate(1)
        status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=1"})
        assert status == 200 and body["weftboard"]["version_start"] == 1

        load = engine.load_checkpoint_dir
        loaded = asyncio.Event()
        loop = asyncio.get_running_loop()

        def slow_load(directory: Path) -> None:  # the engine's loader thread: still at it when the island gives up
            time.sleep(0.8)
            load(directory)
            loop.call_soon_threadsafe(loaded.set)

        engine.load_checkpoint_dir = slow_load  # type: ignore[method-assign]
        with pytest.raises(ApplyError, match="did not answer POST /admin/load_checkpoint"):
            await island.activate(2)  # the failure still surfaces to the subscriber
        assert island.dest.held_version() == 0 and island.state.held == 0  # the board is told: nothing held
        assert island.adapter.unverified is not None and "version 2" in (island.state.error or "")
        await island.refused_everything("activation of version 2 failed")

        await asyncio.wait_for(loaded.wait(), 10)  # the engine finished loading on its own: still not vouched for
        await island.refused_everything("activation of version 2 failed")
        del engine.load_checkpoint_dir  # the engine loads in time again
        await island.activate(2)  # the next sync's verified load (the folder already holds version 2)
        assert island.dest.held_version() == 2 and island.state.held == 2 and island.state.error is None
        assert (await get(island.url + "/health/ready"))[0] == 200
        status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=2"})
        assert status == 200 and body["weftboard"]["version_start"] == 2
        status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=1"})
        assert status == 409 and body["error"] == "version_not_ready"  # older: refused as usual
    finally:
        await island.stop()
        await server.stop()


def _attach_answer(island: FolderIsland, v: int, *failed: dict) -> dict:
    """vLLM's answer to ``weftboard_attach`` from two workers: ``ok`` at ``v`` but for those in ``failed``."""
    ok = {"status": "ok", "root": _target(island.versions[v], v).root_digest, "version": v}
    answers = [*failed, *[ok] * (2 - len(failed))]
    return {"results": [{"rank": rank, **a} for rank, a in enumerate(answers)]}


FAILED = {"status": "install_failed", "error": "CUDA error: out of memory"}


@pytest.mark.parametrize(("failed", "torn"), [
    ([{**FAILED, "restored": False}] * 2, True),  # the review's case: a worker did not put the old bytes back
    ([{**FAILED, "restored": True}], True),  # one worker restored version 1, the other moved to 2
    ([{**FAILED, "restored": True}] * 2, False),  # every worker restored version 1: it is still served
], ids=["not-restored", "one-worker-moved", "restored"])
async def test_vllm_workers_that_did_not_restore_leave_nothing_served(tmp_path: Path, failed: list, torn: bool) -> None:
    """An attach ends in ``install_failed``. Weights left torn are not served under version 1's
    name; weights every worker restored still are, as before."""
    engine = await RecordingEngine().start()
    island = await FolderIsland(VllmAdapter(engine.url, timeout_s=5), engine.url, tmp_path).start()
    try:
        engine.rpc_answers["weftboard_attach"] = _attach_answer(island, 1)
        await island.activate(1)
        assert island.state.held == 1

        engine.rpc_answers["weftboard_attach"] = _attach_answer(island, 2, *failed)
        with pytest.raises(ApplyError, match="install_failed: CUDA error: out of memory"):
            await island.activate(2)  # the failure still surfaces to the subscriber
        if torn:
            assert island.dest.held_version() == 0 and island.state.held == 0  # the board is told: nothing held
            await island.refused_everything("no longer a verified version")
        else:  # the old weights are back: served, the island in error
            assert island.dest.held_version() == 1 and island.state.held == 1 and island.state.error
            status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=1"})
            assert status == 200 and body["weftboard"]["version_start"] == 1
            status, body = await get(island.url + "/health/ready")
            assert status == 503 and "still serves version 1" in body["reason"]

        engine.rpc_answers["weftboard_attach"] = _attach_answer(island, 2)  # the next sync loads it whole
        await island.activate(2)
        assert island.dest.held_version() == 2 and island.state.held == 2 and island.state.error is None
        status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=2"})
        assert status == 200 and body["weftboard"]["version_start"] == 2
    finally:
        await island.stop()
        await engine.stop()


async def test_the_last_resort_anchor_rebuilds_a_damaged_held_copy_before_the_engine_loads_it(tmp_path: Path) -> None:
    """The held version is the anchor the subscriber falls back to and its folder copy is damaged:
    the anchor rebuilds the folder before the engine loads it (before, the damaged folder was
    reloaded as it was); with the folder intact, a retry only repeats the activation."""
    engine = ReferenceEngine(SMALL)
    server = await serve_engine(engine)
    island = await FolderIsland(ReferenceHttpAdapter(server.url, timeout_s=5), server.url, tmp_path).start()
    v1, t1 = island.versions[1], _target(island.versions[1], 1)
    try:
        for attempt in range(2):  # fresh shards each time: a cached shard is hard-linked into the folder
            await island.dest.load_anchor(_anchor(tmp_path / f"a{attempt}", v1), t1)
        first = island.folder.current.resolve()
        assert first.name == "v1" and island.state.held == 1  # the retry did not rewrite the folder
        shard = first / "model.safetensors"
        raw = bytearray(shard.read_bytes())
        raw[-3] ^= 0x40  # in the last tensor
        shard.write_bytes(bytes(raw))

        await island.dest.load_anchor(_anchor(tmp_path / "a2", v1), t1)  # the last resort: anchor 1
        rebuilt = island.folder.current.resolve()
        assert rebuilt != first and rebuilt.name.startswith("v1-") and not first.exists()
        assert await island.folder.verify_held(t1) and island.dest.held_version() == 1
        assert all(torch.equal(engine.tensors[n], v1[n]) for n in v1)  # the engine loaded the verified copy
    finally:
        await island.stop()
        await server.stop()
