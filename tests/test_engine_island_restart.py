"""An engine that restarts (crash, OOM kill) behind the island is noticed and given its verified weights back.

It comes back on its start-up weights: the island must not go on labelling its answers with the
version it loaded before. The engine watch (``engine_island._watch_engine``) withdraws the island
(503) when the engine stops answering or reports another version, and loads the verified folder
into it once it answers again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_failed_activation import FolderIsland
from test_sidecar import PROMPT, SMALL, call

from weftboard.subscriber.engine_island import _watch_engine
from weftboard.subscriber.engines.reference import ReferenceHttpAdapter
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
