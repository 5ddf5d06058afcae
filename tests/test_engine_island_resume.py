"""An engine that does not resume after an activation: the island refuses at once and keeps trying.

The change itself succeeded (the engine took the version), so the activation is not reported
as failed; but the engine is paused and would hold every request until the engine timeout. The
island is withdrawn (503 ``no_verified_version`` at once, naming the pause) while a task retries
``resume`` with backoff; once it resumes, the version is served.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from test_failed_activation import FolderIsland
from test_sidecar import PROMPT, SMALL, call, get

from weftboard.proto.errors import ApplyError
from weftboard.subscriber import engine_destination
from weftboard.subscriber.engines.reference import ReferenceHttpAdapter
from weftboard.subscriber.reference_engine.engine import ReferenceEngine
from weftboard.subscriber.reference_engine.openai_api import serve_engine


class StuckResume(ReferenceHttpAdapter):
    """``resume`` fails ``failures`` more times (the engine's admin endpoint refuses it)."""

    failures = 0
    tries = 0

    async def resume(self) -> None:
        self.tries += 1
        if self.failures > 0:
            self.failures -= 1
            raise ApplyError(f"reference engine at {self.engine_url} answered 500 to POST /admin/resume: busy")
        await super().resume()


@pytest.fixture
async def stuck(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(the reference engine, its ``StuckResume`` adapter, an island on them); resume retries
    every 50 ms; everything is stopped after the test."""
    monkeypatch.setattr(engine_destination, "RESUME_RETRY_S", 0.05, raising=False)
    engine = ReferenceEngine(SMALL)
    server = await serve_engine(engine)
    adapter = StuckResume(server.url, timeout_s=5)
    island = await FolderIsland(adapter, server.url, tmp_path).start()
    try:
        yield engine, adapter, island
    finally:
        await island.dest.close()
        await island.stop()
        await server.stop()


async def test_a_failed_resume_withdraws_then_serves_once_resumed(stuck) -> None:
    engine, adapter, island = stuck
    await island.activate(1)
    adapter.failures = 4
    await island.activate(2)  # the change succeeded: not a failed activation
    assert engine.version == 2 and engine.paused and island.dest.held_version() == 2
    assert island.dest.paused is not None and "did not resume" in island.dest.paused
    t0 = time.monotonic()
    status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "min=1"})
    assert time.monotonic() - t0 < 2.0  # at once, not held by the paused engine
    assert status == 503 and body["error"] == "no_verified_version" and "did not resume" in body["message"]
    status, ready = await get(island.url + "/health/ready")
    assert status == 503 and "did not resume" in ready["reason"]

    await island.state.wait_for(lambda: island.state.held == 2 and island.state.error is None, 10.0)  # resumed
    assert adapter.tries >= 5 and not engine.paused and island.dest.paused is None
    assert island.state.withdrawn is None and island.state.error is None
    status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=2"})
    assert status == 200 and body["weftboard"]["version_start"] == 2
    assert (await get(island.url + "/health/ready"))[0] == 200


async def test_a_failed_change_and_a_failed_resume_keep_the_previous_version_in_error(stuck) -> None:
    """The change was refused (the engine still serves version 1) and the resume failed too: once the
    engine resumes, version 1 is served again, the island still in error for the failed change."""
    engine, adapter, island = stuck
    await island.activate(1)

    def refuse(directory: Path) -> None:
        raise ValueError("bad checkpoint")

    engine.load_checkpoint_dir = refuse  # type: ignore[method-assign]
    adapter.failures = 2
    with pytest.raises(ApplyError, match="load_checkpoint"):
        await island.activate(2)
    assert island.state.withdrawn is not None and island.dest.paused is not None
    await island.state.wait_for(lambda: island.state.held == 1, 10.0)
    assert not engine.paused and "activation of version 2 failed" in (island.state.error or "")
    status, _, body = await call(island.url, PROMPT, {"X-Weftboard-Version": "exact=1"})
    assert status == 200 and body["weftboard"]["version_start"] == 1


async def test_close_ends_the_resume_retries(stuck) -> None:
    _, adapter, island = stuck
    await island.activate(1)
    adapter.failures = 1000
    await island.activate(2)
    resumer = island.dest._resumer
    assert resumer is not None and not resumer.done()
    await island.dest.close()
    assert resumer.done()
    await asyncio.sleep(0.05)
