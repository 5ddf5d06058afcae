"""A real vLLM (CPU build, its own virtual environment and process) updated in place by patches.

One engine serves the whole module (startup costs about a minute here). For every version the
island's adapter stages the verified patch in the engine's workers while it serves, pauses it,
has the workers write the staged elements into the live parameters and packed kernels, and
resumes, while clients keep sending requests; then the engine's greedy tokens and per-token
log-probs for fixed prompts must equal those it gives after its own full reload of that
version's checkpoint from disk, and its live weights must be bit for bit the version's verified
bytes (the deep digest). For the last version a freshly started engine on the full checkpoint
folder must agree too. The model ties its output head to its embedding: a full reload from disk
(vLLM's ``reload_weights`` loads nothing into the tied head) must still answer like the version it
loaded, never with the previous version's head. Versions are encoded with the codec's ``encode_patch``, bf16, AdamW-like
steps; the last test publishes the same versions through a real board and follows them with a
real island and sidecar in front of the same engine.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import pytest
import torch

from weftboard.board.client import BoardClient
from weftboard.cuda.anchors import checkpoint_files, load_safetensors_buffer
from weftboard.proto.errors import ApplyError
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher import Publisher
from weftboard.subscriber.bench import vllm_kit
from weftboard.subscriber.engine_island import start_island
from weftboard.subscriber.engines.base import ActivationMode
from weftboard.subscriber.engines.vllm import VllmAdapter
from weftboard.subscriber.engines.vllm_worker import (
    module_groups,
    target_from_json,
    target_to_json,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PROMPTS = ["the quick brown fox", "weights move from", "every version is"]
VERSIONS = 8


@dataclass
class Kit:
    python: Path
    root: Path
    model: Path
    versions: list[vllm_kit.Version]
    src: Path
    live: vllm_kit.VllmServer
    outputs: dict[int, list] = field(default_factory=dict)  # version -> the live engine's answers
    island_folder: Path | None = None  # the board test's island checkpoint at the last version


def _start(kit_python: Path, model: Path, log: Path, src: Path) -> vllm_kit.VllmServer:
    server = vllm_kit.VllmServer(kit_python, model, log, pythonpath=src)
    try:
        server.wait_ready()
    except RuntimeError:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kit]:
    python, why = vllm_kit.engine_python()
    if python is None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("vllm")
    model = vllm_kit.build_tiny_model(python, root / "model")
    versions = vllm_kit.make_versions(model, root / "versions", VERSIONS + 1)  # the last for the failure tests
    src = vllm_kit.weftboard_path()
    live = _start(python, model, root / "live.log", src)
    try:
        yield Kit(python, root, model, versions, src, live)
    finally:
        live.stop()


class Load:
    """Clients sending completions without pause while swaps happen; counts what failed."""

    def __init__(self, server: vllm_kit.VllmServer, clients: int = 3) -> None:
        self.server = server
        self.stop_event = threading.Event()
        self.done = 0
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        while not self.stop_event.is_set():
            try:
                self.server.complete(PROMPTS[i % len(PROMPTS)] + " and", max_tokens=8)
                with self._lock:
                    self.done += 1
            except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
                with self._lock:
                    self.failed.append(repr(exc))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        time.sleep(0.3)  # requests in flight before the swap starts
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for t in self._threads:
            t.join(timeout=120)


def answers(server: vllm_kit.VllmServer) -> list:
    return [server.complete(p) for p in PROMPTS]


async def _swap(adapter: VllmAdapter, version: vllm_kit.Version, *, staged: bool = True) -> str:
    assert version.patch is not None
    if staged:
        assert await adapter.prepare_patch(version.patch, version.target)
    await adapter.pause(ActivationMode.IN_PLACE)
    try:
        assert version.patch is not None
        return await adapter.activate_patch(version.patch, version.target, version.folder)
    finally:
        await adapter.resume()


async def test_every_version_in_place_equals_a_full_load(kit: Kit) -> None:
    adapter = VllmAdapter(kit.live.url, timeout_s=120)
    try:
        assert await adapter.warm_up() >= 0
        v0 = kit.versions[0]
        await adapter.pause(ActivationMode.IN_PLACE)
        try:
            await adapter.attach(v0.folder, v0.target)
        finally:
            await adapter.resume()
        assert await adapter.engine_digest() == (0, v0.target.root_digest)
        assert adapter.write_mode == "direct"
        kit.outputs[0] = answers(kit.live)
        served = 0
        for version in kit.versions[1:VERSIONS + 1]:
            with Load(kit.live) as load:
                how = await _swap(adapter, version)
            assert how == "in_place"
            assert not load.failed, load.failed[:3]
            served += load.done
            assert adapter.served_version() == version.target.version
            assert await adapter.engine_digest(deep=True) == (version.target.version, version.target.root_digest)
            in_place = answers(kit.live)
            kit.outputs[version.target.version] = in_place
            # the reference: the engine's own full reload of this version's checkpoint from disk
            with Load(kit.live) as load:
                await adapter.pause(ActivationMode.IN_PLACE)
                try:
                    await adapter.load_checkpoint(version.folder, version.target.version)
                finally:
                    await adapter.resume()
            assert not load.failed, load.failed[:3]
            assert answers(kit.live) == in_place, f"version {version.target.version}"
            await adapter.adopt(version.folder, version.target)  # the next patch goes in place again
            assert adapter.write_mode == "direct"
        assert served > 0
        # versions really differ: the answers move
        assert kit.outputs[1] != kit.outputs[VERSIONS]
    finally:
        await adapter.close()


async def test_a_refused_patch_leaves_the_engine_on_its_version(kit: Kit) -> None:
    adapter = VllmAdapter(kit.live.url, timeout_s=120)
    version, root = await adapter.engine_digest()
    if version != VERSIONS:
        pytest.skip("needs test_every_version_in_place_equals_a_full_load")
    adapter.mark_served(VERSIONS)
    nxt = kit.versions[VERSIONS + 1]
    before = answers(kit.live)
    name = nxt.target.layout[0].name
    tampered = replace(nxt.target, tensor_digests={**nxt.target.tensor_digests, name: "xxh3-128:" + "0" * 32})
    missing = replace(nxt.target, layout=list(nxt.target.layout)[1:])
    try:
        await adapter.pause(ActivationMode.IN_PLACE)
        try:
            with pytest.raises(ApplyError, match=f"still serves version {VERSIONS}"):
                await adapter.activate_patch(nxt.patch, tampered, nxt.folder)
            with pytest.raises(ApplyError, match="layout"):
                await adapter.activate_patch(nxt.patch, missing, nxt.folder)
        finally:
            await adapter.resume()
        assert adapter.served_version() == VERSIONS
        assert await adapter.engine_digest() == (VERSIONS, root)
        assert answers(kit.live) == before
        # a staging for another record is never committed: the tampered record stages and fails,
        # and the commit for the genuine one finds nothing staged for it
        await adapter.prepare_patch(nxt.patch, tampered)
        assert await adapter.engine_digest(deep=True) == (VERSIONS, root)
        # the reverted bytes are exactly the old ones: the genuine patch still applies and verifies
        assert await _swap(adapter, nxt, staged=False) == "in_place"
        assert await adapter.engine_digest(deep=True) == (nxt.target.version, nxt.target.root_digest)
    finally:
        await adapter.close()


async def test_an_unreachable_engine_is_an_apply_error() -> None:
    adapter = VllmAdapter(f"http://127.0.0.1:{vllm_kit.free_port()}", timeout_s=5)
    adapter.mark_served(3)
    try:
        with pytest.raises(ApplyError, match="unreachable"):
            await adapter.activate_patch(Path("/nonexistent.patch"), vllm_kit.version_record(4, {}), None)
        assert adapter.served_version() == 3
    finally:
        await adapter.close()


def test_checkpoint_names_group_by_the_vllm_module_they_load_into() -> None:
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
             "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.1.mlp.gate_proj.weight", "model.embed_tokens.weight"]
    assert module_groups(names, packed) == {
        "model.layers.0.self_attn.qkv_proj": names[:2],
        "model.layers.0.self_attn.o_proj": [names[2]],
        "model.layers.1.mlp.gate_up_proj": names[3:5],
        "model.embed_tokens": [names[5]],
    }


def test_the_version_record_crosses_collective_rpc_as_text() -> None:
    record = vllm_kit.version_record(5, {"a.weight": torch.ones(3, 2, dtype=torch.bfloat16)})
    assert target_from_json(target_to_json(record)) == replace(record, layout=list(record.layout))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(folder):
        part, _ = load_safetensors_buffer(path)
        out.update({n: t.clone() for n, t in part.items()})
    return out


async def _sidecar_answers(url: str) -> list:
    async with aiohttp.ClientSession() as session:
        out = []
        for prompt in PROMPTS:
            async with session.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "logprobs": 1,
                    "ignore_eos": True}, timeout=aiohttp.ClientTimeout(total=60)) as r:
                assert r.status == 200, await r.text()
                lp = (await r.json())["choices"][0]["logprobs"]
                out.append((list(lp["tokens"]), [float(x) for x in lp["token_logprobs"]]))
        return out


class SidecarLoad:
    """Clients sending completions through the island's sidecar while versions arrive."""

    def __init__(self, url: str, clients: int = 3) -> None:
        self.url, self.done, self.failed = url, 0, []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._run(i)) for i in range(clients)]

    async def _run(self, i: int) -> None:
        async with aiohttp.ClientSession() as session:
            while not self._stop.is_set():
                try:
                    async with session.post(self.url + "/v1/completions", json={
                            "model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8},
                            timeout=aiohttp.ClientTimeout(total=60)) as r:
                        if r.status == 200:
                            self.done += 1
                        else:
                            self.failed.append(f"{r.status}: {(await r.text())[:200]}")
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    self.failed.append(repr(exc))
                    await asyncio.sleep(0.1)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), timeout=120)


@pytest.mark.usefixtures("warm_kernels")
async def test_a_real_island_and_sidecar_follow_a_board_in_place(kit: Kit, board, local_store, tmp_path) -> None:
    """The kit's versions published through a real board (anchors every 4, patches between) and
    followed by a real island whose sidecar fronts the same engine, in place, under load."""
    if VERSIONS not in kit.outputs:
        pytest.skip("needs test_every_version_in_place_equals_a_full_load (the reference answers)")
    run = "vllm-live"
    publisher = Publisher(board.address, run, token=board.admin_token, blob_store=local_store, anchor_every=4,
                          work_dir=tmp_path / "pub", model_files=kit.model)
    client = BoardClient(board.address, board.admin_token)
    island = load = None
    kinds: dict[int, str] = {}
    try:
        for i, version in enumerate(kit.versions[:VERSIONS + 1]):
            published = await asyncio.to_thread(
                lambda v=version: publisher.publish(_tensors(v.folder), step=len(kinds)).version)
            await asyncio.to_thread(publisher.flush, 120)
            record = await client.get_version(run, published)
            kinds[published] = "+".join(sorted(pb.ArtifactKind.Name(a.kind) for a in record.artifacts))
            assert record.root_digest == version.target.root_digest  # the same bytes, the same digest
            if island is None:
                island = await start_island(board=board.address, token=board.admin_token, run=run, island_id="vllm",
                                            engine="vllm", engine_url=kit.live.url, checkpoint_dir=tmp_path / "ckpt",
                                            cache_dir=tmp_path / "cache", blob_store=local_store,
                                            mode="in_place", heartbeat_s=0.5, default_deadline_s=60.0)
            await island.subscriber.wait_for_version(published, timeout_s=300)
            if load is None:  # from the first version held on (before it, the sidecar rightly answers 409)
                load = SidecarLoad(island.url)
            assert await island.adapter.engine_digest(deep=True) == (published, record.root_digest)
            assert await island.adapter.health_answer() == {"version": published}  # the watch's probe asks the workers
            assert island.adapter.write_mode == "direct"
            assert await _sidecar_answers(island.url) == kit.outputs[i], f"board version {published}"
        assert load is not None
        await load.stop()
        assert load.done > 0 and not load.failed, load.failed[:3]
        # the island's folder is a complete model folder: the run's model files beside the weights
        folder = (tmp_path / "ckpt" / "current").resolve()
        for name in vllm_kit.NON_WEIGHT_FILES:
            assert (folder / name).read_bytes() == (kit.model / name).read_bytes(), name
        kit.island_folder = kit.root / "island-folder"
        shutil.copytree(folder, kit.island_folder)
        assert len(kinds) >= VERSIONS
        assert {"ARTIFACT_KIND_PATCH", "ARTIFACT_KIND_ANCHOR+ARTIFACT_KIND_PATCH"} <= set(kinds.values()), kinds
    finally:
        if load is not None:
            await load.stop()
        if island is not None:
            await island.stop()
        await client.close()
        await asyncio.to_thread(publisher.close)


async def test_fresh_engine_on_the_last_version_agrees(kit: Kit) -> None:
    if VERSIONS not in kit.outputs:
        pytest.skip("needs test_every_version_in_place_equals_a_full_load")
    # the island's own checkpoint folder (weights and the run's model files) when the board test
    # ran: a complete Hugging Face folder vLLM starts from
    folder = kit.island_folder or vllm_kit.model_folder(kit.model, kit.versions[VERSIONS].folder, kit.root / "fresh")
    fresh = _start(kit.python, folder, kit.root / "fresh.log", kit.src)
    try:
        assert answers(fresh) == kit.outputs[VERSIONS]
        # A restarted engine holds no version: the next patch takes the island's verified folder whole.
        adapter = VllmAdapter(fresh.url, timeout_s=120)
        adapter.mark_served(VERSIONS)
        nxt = kit.versions[VERSIONS + 1]
        await adapter.pause(ActivationMode.IN_PLACE)
        try:
            with pytest.raises(ApplyError, match="no verified folder"):
                await adapter.activate_patch(nxt.patch, nxt.target, None)
            assert adapter.served_version() == VERSIONS
            assert await adapter.activate_patch(nxt.patch, nxt.target, nxt.folder) == "full_load"
        finally:
            await adapter.resume()
        assert await adapter.engine_digest() == (nxt.target.version, nxt.target.root_digest)
        await adapter.close()
    finally:
        fresh.stop()


async def test_a_full_reload_of_a_tied_model_serves_the_new_head(kit: Kit) -> None:
    """From version ``VERSIONS`` (its tied head packed for the CPU kernels), the engine's own reload
    of version 1 from disk, by ``load_checkpoint`` and by ``load_version`` with patches in place
    off, answers exactly as version 1 did (a stale head would keep ``VERSIONS``'s log-probs)."""
    if VERSIONS not in kit.outputs or 1 not in kit.outputs:
        pytest.skip("needs test_every_version_in_place_equals_a_full_load (the reference answers)")
    assert kit.outputs[1] != kit.outputs[VERSIONS]
    last, first = kit.versions[VERSIONS], kit.versions[1]
    adapter = VllmAdapter(kit.live.url, timeout_s=120)
    try:
        assert await adapter.warm_up() >= 0

        async def paused(change) -> None:  # noqa: ANN001 - a coroutine function
            await adapter.pause(ActivationMode.IN_PLACE)
            try:
                await change()
            finally:
                await adapter.resume()

        await paused(lambda: adapter.attach(last.folder, last.target))  # the head packed for VERSIONS
        assert answers(kit.live) == kit.outputs[VERSIONS]
        await paused(lambda: adapter.load_checkpoint(first.folder, first.target.version))
        assert adapter.served_version() == 1
        assert answers(kit.live) == kit.outputs[1], "a full reload served the previous version's tied head"
        await paused(lambda: adapter.attach(last.folder, last.target))
        assert answers(kit.live) == kit.outputs[VERSIONS]
        adapter.in_place = False  # an engine without patches in place: every version is the engine's reload
        await paused(lambda: adapter.load_version(first.folder, first.target))
        assert adapter.served_version() == 1
        assert answers(kit.live) == kit.outputs[1], "load_version's full reload served the previous tied head"
    finally:
        await adapter.close()
