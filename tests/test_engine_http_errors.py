"""HttpEngineAdapter's error plumbing against a fake engine.

- A timeout's message keeps its fraction of a second ("within 0.3s", not "within 0s").
- An error answer to ``change_weights`` keeps the served version for an engine whose loads are
  transactional (the reference engine) and vouches for none where they are not
  (``error_answer_keeps_weights`` False).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from enginekit import CatchAllServer

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.engines.http import EngineErrorAnswer, EngineNoAnswer
from weftboard.subscriber.engines.reference import ReferenceHttpAdapter


class SlowOrFailingEngine(CatchAllServer):
    """Answers ``/slow`` after ``delay_s``, ``/admin/load_checkpoint`` with ``status``, anything else ``{}``."""

    delay_s = 2.0
    status = 500

    async def _handle(self, request: web.Request) -> web.Response:
        if request.path == "/slow":
            await asyncio.sleep(self.delay_s)
        if request.path == "/admin/load_checkpoint":
            return web.json_response({"error": "checkpoint refused"}, status=self.status)
        return web.json_response({})


@pytest.fixture
async def engine():
    server = await SlowOrFailingEngine().start()
    yield server
    await server.stop()


async def test_a_sub_second_timeout_reads_as_such(engine):
    adapter = ReferenceHttpAdapter(engine.url, timeout_s=5)
    try:
        with pytest.raises(EngineNoAnswer, match=r"within 0\.3s"):
            await adapter.call("POST", "/slow", timeout_s=0.3)
    finally:
        await adapter.close()


async def test_a_whole_second_timeout_reads_without_fraction(engine):
    adapter = ReferenceHttpAdapter(engine.url, timeout_s=1)
    try:
        with pytest.raises(EngineNoAnswer, match=r"within 1s"):
            await adapter.call("POST", "/slow")
    finally:
        await adapter.close()


async def test_an_error_answer_carries_its_status(engine):
    adapter = ReferenceHttpAdapter(engine.url, timeout_s=5)
    try:
        with pytest.raises(EngineErrorAnswer, match="answered 500 to POST /admin/load_checkpoint") as raised:
            await adapter.call("POST", "/admin/load_checkpoint")
        assert raised.value.status == 500 and "checkpoint refused" in raised.value.body
    finally:
        await adapter.close()


async def test_the_reference_engine_refusing_a_load_still_serves_the_old_version(engine, tmp_path: Path):
    adapter = ReferenceHttpAdapter(engine.url, timeout_s=5)
    adapter.mark_served(3)
    try:
        with pytest.raises(ApplyError, match="answered 500"):
            await adapter.load_checkpoint(tmp_path, 4)
        assert adapter.served_version() == 3 and adapter.unverified is None
    finally:
        await adapter.close()


async def test_an_engine_whose_loads_are_not_transactional_vouches_for_nothing_after_an_error(engine, tmp_path):
    adapter = ReferenceHttpAdapter(engine.url, timeout_s=5)
    adapter.error_answer_keeps_weights = False
    adapter.mark_served(3)
    try:
        with pytest.raises(ApplyError, match="answered 500"):
            await adapter.change_weights("POST", "/admin/load_checkpoint", json={}, what="the test's load")
        assert adapter.served_version() == 0
        assert (adapter.unverified or "").startswith("the test's load answered HTTP 500")
    finally:
        await adapter.close()
