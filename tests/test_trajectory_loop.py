"""Islands under the real subscriber, board, Redis and blob store; trajectories back to a trainer.

A real Publisher commits versions of the reference model (real AdamW steps on fp32
masters, bf16 served view); islands follow it and serve version-aware requests; the
sidecars' trajectory records are consumed by consumer groups with staleness.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time

import aiohttp
import pytest
import torch
from pubsubkit import WARM_KERNELS, run_cli

from weftboard.board.client import BoardClient
from weftboard.cuda.digest import root_digest, tensor_digest
from weftboard.proto.errors import ApplyError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.publisher import Publisher
from weftboard.publisher.trajectories import SyncTrajectoryConsumer, TrajectoryConsumer
from weftboard.subscriber.demo.rl_loop import Trainer
from weftboard.subscriber.engine_island import REFERENCE_CONFIG_LABEL, start_island

pytestmark = WARM_KERNELS

MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq": 32}
RUN = "traj"


class Training:
    """A trainer that publishes one version per AdamW step (lr high enough to change bf16 bits)."""

    def __init__(self, board, store, tmp_path) -> None:
        import json

        self.trainer = Trainer(MODEL, lr=1e-2)
        self.publisher = Publisher(board.address, RUN, token=board.admin_token, blob_store=store,
                                   anchor_every=4, work_dir=tmp_path / "pub",
                                   run_labels={REFERENCE_CONFIG_LABEL: json.dumps(self.trainer.config)})
        self.views: dict[int, dict[str, torch.Tensor]] = {}

    def _publish(self) -> int:
        if self.views:
            loss = sum((p.float() ** 2).mean() for p in self.trainer.params.values())
            self.trainer.opt.zero_grad()
            loss.backward()
            self.trainer.opt.step()
        version = self.publisher.publish(self.trainer.state_dict(), step=len(self.views)).version
        self.publisher.flush(60)
        self.views[version] = self.trainer.served_view()
        return version

    async def publish(self) -> int:
        return await asyncio.to_thread(self._publish)

    def close(self) -> None:
        self.publisher.close(flush=False)


@pytest.fixture
async def training(board, local_store, tmp_path):
    t = Training(board, local_store, tmp_path)
    yield t
    await asyncio.to_thread(t.close)


async def island_of(board, store, tmp_path, name: str, **kw):
    return await start_island(board=board.address, token=board.admin_token, run=RUN, island_id=name,
                              cache_dir=tmp_path / name, blob_store=store, heartbeat_s=0.5,
                              default_deadline_s=5.0, **kw)


async def complete(url: str, constraint: str | None, labels: str = "", request_id: str | None = None,
                   deadline_ms: int = 3000) -> tuple[int, dict]:
    headers = {"X-Weftboard-Deadline-Ms": str(deadline_ms)}
    if constraint:
        headers["X-Weftboard-Version"] = constraint
    if labels:
        headers["X-Weftboard-Labels"] = labels
    if request_id:
        headers["X-Request-Id"] = request_id
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"prompt": "say ab:", "max_tokens": 4, "logprobs": 1,
                                                         "seed": 0}, headers=headers,
                          timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.json()


async def ready(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health/ready", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status, await r.json()


def engine_root(engine) -> str:
    return root_digest([(k, "bfloat16", tuple(t.shape), tensor_digest(t)) for k, t in engine.tensors.items()])


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in b)


async def test_island_serves_versions_and_trajectories_reach_each_group_once(board, local_store, training, tmp_path):
    for _ in range(3):
        await training.publish()
    island = await island_of(board, local_store, tmp_path, "isl-1", mode="in_place")
    client = BoardClient(board.address, board.admin_token)
    try:
        await island.subscriber.wait_for_version(3, timeout_s=30)
        assert bits_equal(island.engine.tensors, training.views[3])
        status, body = await complete(island.url, "exact=3", labels="k=v", request_id="r-exact")
        assert status == 200 and body["weftboard"]["version_start"] == 3
        status, body = await complete(island.url, "exact=2")
        assert status == 409 and body["held"] == 3 and body["head"] == 3
        status, body = await complete(island.url, "max_staleness=0", request_id="r-stale")
        assert status == 200

        # the board's head moves to 4 before the trainer reads: staleness is head at delivery - version
        await training.publish()
        await island.subscriber.wait_for_version(4, timeout_s=30)
        status, body = await complete(island.url, "min=4", request_id="r-new")
        assert status == 200 and body["weftboard"]["version_end"] == 4
        await island.sidecar.reporter.flush()

        groups = {}
        for group in ("trainer", "auditor"):
            consumer = TrajectoryConsumer(client, RUN, group, "c0", block_ms=200)
            got = {}
            for _ in range(10):
                for t in await consumer.poll():
                    assert t.request_id not in got, "delivered twice to one group"
                    got[t.request_id] = t
                if len(got) >= 3:
                    break
            await consumer.ack(got.values())
            assert await consumer.poll(block_ms=100) == []  # acknowledged: nothing comes back
            groups[group] = got
        for got in groups.values():
            assert set(got) == {"r-exact", "r-stale", "r-new"}
            assert (got["r-exact"].version, got["r-exact"].staleness) == (3, 1)
            assert (got["r-new"].version, got["r-new"].staleness) == (4, 0)
            rec = got["r-exact"].record
            assert rec.island_id == "isl-1" and rec.run == RUN and dict(rec.labels) == {"k": "v"}
            assert rec.prompt_tokens == 7 and rec.completion_tokens == 4
            assert rec.logprob_sum < 0 and rec.logprob_min <= rec.logprob_sum / 4 and rec.latency_ms > 0

        # the staleness filter: a fresh group with max_staleness=0 never sees version-3 records
        fresh = TrajectoryConsumer(client, RUN, "fresh", "c0", max_staleness=0, block_ms=200)
        async for first in fresh:  # the async-iterator form
            break
        assert first.request_id == "r-new" and first.staleness == 0 and fresh.dropped_stale == 2
        assert await fresh.poll(block_ms=100) == []
    finally:
        await client.close()
        await island.stop()


async def test_late_joiner_enters_rotation_only_when_caught_up(board, local_store, training, tmp_path):
    for _ in range(6):
        await training.publish()
    island = await island_of(board, local_store, tmp_path, "late")
    try:
        observations = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, body = await ready(island.url)
            observations.append((status, body["held"], body["head"]))
            if status == 200:
                break
            await asyncio.sleep(0.01)
        assert observations[0][0] == 503  # not in rotation at start
        assert observations[-1] == (200, 6, 6)
        assert all(held < 6 for status, held, _ in observations if status == 503)
        assert bits_equal(island.engine.tensors, training.views[6])
        # in rotation it keeps up: a new version is served bitwise
        await training.publish()
        await island.subscriber.wait_for_version(7, timeout_s=30)
        assert bits_equal(island.engine.tensors, training.views[7])
    finally:
        await island.stop()


async def test_activation_failure_keeps_old_version_and_reports_error(board, local_store, training, tmp_path):
    for _ in range(2):
        await training.publish()
    island = await island_of(board, local_store, tmp_path, "flaky", mode="drain")
    client = BoardClient(board.address, board.admin_token)
    try:
        await island.subscriber.wait_for_version(2, timeout_s=30)
        old_root = (await client.get_version(RUN, 2)).root_digest

        async def refuse(mode):  # the engine refuses to pause for the weight change
            raise ApplyError("engine did not acknowledge the pause")

        island.adapter.pause = refuse
        await training.publish()  # version 3
        deadline = time.monotonic() + 30
        state = None
        while time.monotonic() < deadline:
            islands = {i.status.island_id: i for i in (await client.list_islands(RUN)).islands}
            state = islands.get("flaky")
            if state is not None and state.status.state == pb.ISLAND_STATE_ERROR:
                break
            await asyncio.sleep(0.1)
        assert state is not None and state.status.state == pb.ISLAND_STATE_ERROR
        assert "pause" in state.status.message and state.status.version == 2
        assert island.state.held == 2 and island.adapter.served_version() == 2
        assert engine_root(island.engine) == old_root  # old weights, bitwise: never a mix
        assert bits_equal(island.engine.tensors, training.views[2])
        status, body = await ready(island.url)
        assert status == 503 and "error" in body["reason"]
        status, body = await complete(island.url, "min=1")
        assert status == 200 and body["weftboard"]["version_start"] == 2
        status, body = await complete(island.url, "exact=3", deadline_ms=300)
        assert status == 409

        del island.adapter.pause  # the engine recovers: the subscriber's retry activates 3
        await island.subscriber.wait_for_version(3, timeout_s=30)
        assert bits_equal(island.engine.tensors, training.views[3])
        assert island.state.error is None and (await ready(island.url))[0] == 200
    finally:
        await client.close()
        await island.stop()


async def test_sync_consumer_and_sidecar_cli(board, local_store, training, tmp_path):
    """``weftboard sidecar`` as its own process, and the synchronous consumer (on a thread)."""
    await training.publish()
    env = {**os.environ, "WEFTBOARD_LOG_JSON": "1"}
    log_path = tmp_path / "sidecar.log"
    log_file = log_path.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weftboard.board.cli", "sidecar", "--board", board.address, "--token",
        board.admin_token, "--run", RUN, "--engine", "reference", "--listen", "127.0.0.1:0",
        "--dir", str(tmp_path / "cli-island"), "--blob-dir", str(local_store.root), "--island-id", "cli",
        stdout=log_file, stderr=asyncio.subprocess.STDOUT, env=env)
    try:
        # the sidecar picks a free port itself (no race with other sockets) and says which;
        # a cold kernel cache compiles the catch-up kernels in the new process first: minutes on 2 busy cores
        deadline = time.monotonic() + 300
        url = None
        while True:
            assert proc.returncode is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, "sidecar not ready in 300 s:\n" + log_path.read_text()[-2000:]
            found = re.search(r"serving on (http://\S+)", log_path.read_text())
            url = found.group(1) if found else None
            try:
                if url and (await ready(url))[0] == 200:
                    break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        status, body = await complete(url, "exact=1", request_id="cli-1")
        assert status == 200, body
        assert body["weftboard"] == {"version_start": 1, "version_end": 1, "request_id": "cli-1"}

        def consume() -> list:
            with SyncTrajectoryConsumer(board.address, RUN, "sync", "c0", token=board.admin_token,
                                        block_ms=500) as c:
                got = []
                for _ in range(20):
                    got += c.poll()
                    if got:
                        break
                assert c.ack(got) == len(got)
                return got

        got = await asyncio.to_thread(consume)
        assert [t.request_id for t in got] == ["cli-1"] and got[0].version == 1
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log_file.close()
    output = log_path.read_text()
    assert proc.returncode == 0, output[-2000:]


async def test_an_island_whose_token_cannot_plan_ends_and_its_sidecar_process_exits(board, local_store, training,
                                                                                   tmp_path):
    """A READER token may watch but not plan a catch-up (PERMISSION_DENIED): retrying cannot
    cure that, so the island's follower ends, ``failed()`` says why, and ``weftboard sidecar``
    exits 1 with the reason instead of serving nothing forever. A token the board does not know
    stops the sidecar at start, with the reason and no traceback."""
    from weftboard.proto import errors

    await training.publish()
    async with BoardClient(board.address, board.admin_token) as admin:
        reader = (await admin.create_token("reader", pb.ROLE_READER)).token
    island = await start_island(board=board.address, token=reader, run=RUN, island_id="ro", cache_dir=tmp_path / "ro",
                                blob_store=local_store, heartbeat_s=0.5)
    try:
        failure = await asyncio.wait_for(island.failed(), 30)
        assert isinstance(failure, errors.PermissionDenied) and "PlanCatchUp" in str(failure)
        assert island.state.held == 0
    finally:
        await island.stop()

    def sidecar(token: str):
        return run_cli("sidecar", "--board", board.address, "--token", token, "--run", RUN, "--listen", "127.0.0.1:0",
                       "--dir", str(tmp_path / "cli-ro"), "--blob-dir", str(local_store.root))

    code, err = await sidecar(reader)
    assert code == 1 and f"the island no longer follows run {RUN}: PermissionDenied" in err, err[-2000:]
    code, err = await sidecar("not-a-token")
    assert code == 1 and "sidecar did not start: Unauthenticated" in err and "Traceback" not in err, err[-2000:]


async def test_engine_in_its_own_server_loads_verified_checkpoints(board, local_store, training, tmp_path):
    """The checkpoint path (as for vLLM/SGLang): subscriber writes a verified checkpoint
    directory while serving; activation makes the engine load it over its admin HTTP API."""
    from weftboard.subscriber.reference_engine.engine import ReferenceEngine
    from weftboard.subscriber.reference_engine.openai_api import serve_engine

    engine = ReferenceEngine(MODEL)
    server = await serve_engine(engine)
    await training.publish()
    island = await island_of(board, local_store, tmp_path, "http-engine", engine="reference",
                             engine_url=server.url, checkpoint_dir=tmp_path / "ckpt", mode="drain")
    try:
        await island.subscriber.wait_for_version(1, timeout_s=30)
        assert engine.version == 1 and bits_equal(engine.tensors, training.views[1])
        for _ in range(2):
            await training.publish()
        await island.subscriber.wait_for_version(3, timeout_s=30)
        assert engine.version == 3 and bits_equal(engine.tensors, training.views[3])
        status, body = await complete(island.url, "exact=3")
        assert status == 200 and body["weftboard"]["version_end"] == 3
    finally:
        await island.stop()
        await server.stop()


async def test_restarted_sidecar_serves_its_checkpoint_on_disk(board, local_store, training, tmp_path):
    """A checkpoint engine's island restarted: the verified checkpoint on disk is activated
    at once, before the subscriber even asks the board."""
    from weftboard.subscriber.reference_engine.engine import ReferenceEngine
    from weftboard.subscriber.reference_engine.openai_api import serve_engine

    for _ in range(2):
        await training.publish()
    engine = ReferenceEngine(MODEL)
    server = await serve_engine(engine)
    try:
        island = await island_of(board, local_store, tmp_path, "restart", engine="reference",
                                 engine_url=server.url, checkpoint_dir=tmp_path / "ckpt")
        await island.subscriber.wait_for_version(2, timeout_s=30)
        await island.stop()
        fresh = ReferenceEngine(MODEL)  # the engine restarted too, with no weights of the run
        await server.stop()
        server = await serve_engine(fresh)
        island = await island_of(board, local_store, tmp_path, "restart", engine="reference",
                                 engine_url=server.url, checkpoint_dir=tmp_path / "ckpt")
        try:
            assert island.state.held == 2 and fresh.version == 2  # before any catch-up
            assert bits_equal(fresh.tensors, training.views[2])
        finally:
            await island.stop()
    finally:
        await server.stop()
