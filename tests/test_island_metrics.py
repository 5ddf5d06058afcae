"""Prometheus metrics of islands, followers and publishers, scraped from their real servers.

A real board, a real Publisher (``metrics_port=0``) and an island (``start_island``: subscriber,
reference engine, sidecar): the values scraped from ``/metrics`` are compared with what the
board's records, the subscriber and the requests say happened. A follower with corrupted
patches counts its retries and verify failures; ``weftboard subscribe --metrics-port`` serves
them from its own process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import urllib.request
from pathlib import Path

import aiohttp
import prometheus_client
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pubsubkit import WARM_KERNELS, Trainer, zeros_like_layout

from weftboard.board.client import BoardClient
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.metrics import PublisherMetrics
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.demo.rl_loop import Trainer as ReferenceTrainer
from weftboard.subscriber.engine_island import REFERENCE_CONFIG_LABEL, start_island
from weftboard.subscriber.live_tensors import LiveTensorsDestination
from weftboard.subscriber.metrics import IslandMetrics
from weftboard.subscriber.subscriber import Subscriber

pytestmark = WARM_KERNELS

MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq": 32}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus exposition, by (sample name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def scrape(url: str) -> tuple[Samples, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            assert response.status == 200
            return parse(await response.text()), response.headers["Content-Type"]


async def complete(url: str, constraint: str | None, deadline_ms: int = 2000) -> int:
    headers = {"X-Weftboard-Deadline-Ms": str(deadline_ms)}
    if constraint:
        headers["X-Weftboard-Version"] = constraint
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2, "seed": 0},
                                headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as response:
            return response.status


def blob_bytes(records: list[pb.VersionRecord], kind: int) -> int:
    return sum(b.size for r in records for a in r.artifacts if a.kind == kind for b in a.blobs)


def test_every_metrics_object_has_its_own_registry() -> None:
    """Two islands and two publishers in one process: no name clash, nothing in the global registry."""
    before = set(prometheus_client.REGISTRY._names_to_collectors)
    islands = [IslandMetrics("r"), IslandMetrics("r")]
    publishers = [PublisherMetrics("r"), PublisherMetrics("r")]
    assert islands[0].registry is not islands[1].registry and publishers[0].registry is not publishers[1].registry
    assert set(prometheus_client.REGISTRY._names_to_collectors) == before


async def test_island_and_publisher_metrics_match_what_happened(board, local_store, tmp_path: Path) -> None:
    run = "metrics-run"
    trainer = ReferenceTrainer(MODEL, lr=1e-2)
    publisher = Publisher(board.address, run, token=board.admin_token, blob_store=local_store, anchor_every=100,
                          anchor_patch_fraction=100.0, work_dir=tmp_path / "pub", metrics_port=0,
                          run_labels={REFERENCE_CONFIG_LABEL: json.dumps(trainer.config)})

    def publish_one() -> int:
        if publisher.head:
            loss = sum((p.float() ** 2).mean() for p in trainer.params.values())
            trainer.opt.zero_grad()
            loss.backward()
            trainer.opt.step()
        version = publisher.publish(trainer.state_dict()).version
        publisher.flush(60)
        return version

    island = None
    try:
        assert await asyncio.to_thread(publish_one) == 1
        island = await start_island(board=board.address, token=board.admin_token, run=run, island_id="m1",
                                    region="eu-west", cache_dir=tmp_path / "island", blob_store=local_store,
                                    heartbeat_s=0.5, mode="in_place")
        await island.subscriber.wait_for_version(1, timeout_s=30)
        for expected in (2, 3):  # each a one-patch step the island takes as it is committed
            assert await asyncio.to_thread(publish_one) == expected
            await island.subscriber.wait_for_version(expected, timeout_s=30)

        statuses = {c: await complete(island.url, c) for c in ("exact=3", "min=2", "max_staleness=0", None)}
        statuses["exact=2"] = await complete(island.url, "exact=2")  # older than held: refused at once
        statuses["min=9"] = await complete(island.url, "min=9")  # beyond the board's head: refused
        assert statuses == {"exact=3": 200, "min=2": 200, "max_staleness=0": 200, None: 200, "exact=2": 409, "min=9": 409}

        samples, content_type = await scrape(island.url + "/metrics")
        assert content_type.startswith("text/plain")  # the Prometheus text format
        async with BoardClient(board.address, board.admin_token) as client:
            head = (await client.get_head(run)).version
            records = [await client.get_version(run, v) for v in (1, 2, 3)]
            fleet = {i.status.island_id: i.status for i in (await client.list_islands(run)).islands}
        assert fleet["m1"].region == "eu-west"  # what its heartbeats report
        labels = {"run": run}
        assert head == 3
        assert value(samples, "weftboard_island_version", **labels) == head == island.subscriber.held_version
        assert value(samples, "weftboard_island_head", **labels) == head
        assert value(samples, "weftboard_island_lag_versions", **labels) == 0
        assert value(samples, "weftboard_island_ready", **labels) == 1
        assert value(samples, "weftboard_island_inflight_requests", **labels) == 0
        # version 1 as an anchor, then 2 and 3 as one patch each: their bytes are the records' blobs
        anchor_bytes, patch_bytes = blob_bytes(records[:1], pb.ARTIFACT_KIND_ANCHOR), blob_bytes(records[1:], pb.ARTIFACT_KIND_PATCH)
        assert anchor_bytes > 0 and patch_bytes > 0
        assert value(samples, "weftboard_island_versions_applied_total", kind="anchor", **labels) == 1
        assert value(samples, "weftboard_island_versions_applied_total", kind="patch", **labels) == 2
        assert value(samples, "weftboard_island_fetched_bytes_total", kind="anchor", **labels) == anchor_bytes
        assert value(samples, "weftboard_island_fetched_bytes_total", kind="patch", **labels) == patch_bytes
        downloaded = value(samples, "weftboard_island_downloaded_bytes_total", **labels)
        assert downloaded == island.subscriber.fetcher.bytes_downloaded == anchor_bytes + patch_bytes
        assert value(samples, "weftboard_island_apply_seconds_count", kind="anchor", **labels) == 1
        assert value(samples, "weftboard_island_apply_seconds_count", kind="patch", **labels) == 2
        assert value(samples, "weftboard_island_fetch_seconds_count", kind="patch", **labels) == 2
        assert value(samples, "weftboard_island_activate_seconds_count", **labels) == 3  # one per version
        assert value(samples, "weftboard_island_activate_seconds_sum", **labels) > 0
        assert value(samples, "weftboard_island_retries_total", reason="step", **labels) == 0
        assert value(samples, "weftboard_island_verify_failures_total", **labels) == 0
        requests = {(dict(key)["constraint"], dict(key)["outcome"]): v for (name, key), v in samples.items()
                    if name == "weftboard_island_requests_total" and v}
        assert requests == {("exact", "admitted"): 1, ("min", "admitted"): 1, ("max_staleness", "admitted"): 1,
                            ("any", "admitted"): 1, ("exact", "refused"): 1, ("min", "refused"): 1}
        assert island.sidecar.rejected == 2  # the sidecar's own count agrees

        assert publisher.metrics.port is not None
        exposition = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{publisher.metrics.port}/metrics", timeout=5).read())
        published = parse(exposition.decode())
        assert value(published, "weftboard_publisher_versions_total", kind="anchor", **labels) == 1
        assert value(published, "weftboard_publisher_versions_total", kind="patch", **labels) == 2
        assert value(published, "weftboard_publisher_version", **labels) == 3
        assert value(published, "weftboard_publisher_uploaded_bytes_total", kind="anchor", **labels) == blob_bytes(
            records, pb.ARTIFACT_KIND_ANCHOR)
        assert value(published, "weftboard_publisher_uploaded_bytes_total", kind="patch", **labels) == blob_bytes(
            records, pb.ARTIFACT_KIND_PATCH)
        assert value(published, "weftboard_publisher_commit_latency_seconds_count", **labels) == 3
        assert value(published, "weftboard_publisher_commit_latency_seconds_sum", **labels) == pytest.approx(
            sum(publisher.commit_latency_s))
        assert value(published, "weftboard_publisher_blocked_seconds_count", **labels) == 3
        assert value(published, "weftboard_publisher_snapshot_seconds_count", **labels) == 3
        assert value(published, "weftboard_publisher_pending", **labels) == 0
    finally:
        if island is not None:
            await island.stop()
        await asyncio.to_thread(publisher.close, False)


async def _corrupt(store, ref: pb.BlobRef) -> None:
    data = bytearray(await store.get_bytes(ref.key))
    data[len(data) // 2] ^= 0x5A
    await store.put_bytes(ref.key, bytes(data))


async def test_a_follower_counts_its_retries_and_verify_failures(board, local_store, tmp_path: Path) -> None:
    """Versions 2 and 3's patches corrupted: two failed steps (refetch, then an anchor), both
    failing their digests, then version 3's anchor; served by ``IslandMetrics.serve``."""
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict[str, torch.Tensor]] = {}

    def go() -> None:
        with Publisher(board.address, "cm", token=board.admin_token, blob_store=local_store, anchor_every=2,
                       anchor_patch_fraction=100.0) as pub:
            for _ in range(3):
                trainer.step()
                views[pub.publish(trainer.model, step=trainer.step_no).version] = trainer.served()

    await asyncio.to_thread(go)
    metrics = IslandMetrics("cm")
    async with BoardClient(board.address, board.admin_token) as client:
        sub = Subscriber(client, "cm", LiveTensorsDestination(zeros_like_layout(views[1])), island_id="isl",
                         blob_store=local_store, cache_dir=tmp_path / "c", metrics=metrics)
        port = await metrics.serve("127.0.0.1", 0)
        try:
            assert await sub.sync_to(1) == 1
            for v in (2, 3):
                record = await client.get_version("cm", v)
                patch = next(a for a in record.artifacts if a.kind == pb.ARTIFACT_KIND_PATCH)
                await _corrupt(local_store, patch.blobs[0])
            assert await sub.sync_to(3) == 3
            samples, _ = await scrape(f"http://127.0.0.1:{port}/metrics")
        finally:
            await metrics.stop()
    labels = {"run": "cm"}
    assert value(samples, "weftboard_island_retries_total", reason="step", **labels) == 2
    assert value(samples, "weftboard_island_verify_failures_total", **labels) == 2
    assert value(samples, "weftboard_island_versions_applied_total", kind="anchor", **labels) == 2  # 1, then 3
    assert value(samples, "weftboard_island_versions_applied_total", kind="patch", **labels) == 0
    assert value(samples, "weftboard_island_version", **labels) == 3
    # the corrupted patches were downloaded (twice each attempt's blobs), then verified bytes applied
    assert value(samples, "weftboard_island_downloaded_bytes_total", **labels) == sub.fetcher.bytes_downloaded
    assert sub.fetcher.bytes_downloaded > value(samples, "weftboard_island_fetched_bytes_total", kind="anchor", **labels)


async def test_subscribe_serves_metrics_on_its_port(board_factory, s3_store, tmp_path: Path) -> None:
    """``weftboard subscribe --metrics-port 0`` in its own process (blobs through presigned URLs):
    the port its ``started`` event names serves the follower's version, head and bytes."""
    board = await board_factory(blobs=s3_store)
    trainer = Trainer(lr=1e-4)

    def go() -> None:
        with Publisher(board.address, "cli-m", token=board.admin_token, blob_store=s3_store) as pub:
            for _ in range(2):
                trainer.step()
                pub.publish(trainer.model, step=trainer.step_no)

    await asyncio.to_thread(go)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEFTBOARD_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weftboard.board.cli", "subscribe", "--board", board.address, "--run", "cli-m",
        "--dir", str(tmp_path / "isl"), "--token", board.admin_token, "--destination", "memory", "--events",
        "--no-progress", "--metrics-port", "0", env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        events: list[dict] = []
        while not any(e.get("event") == "applied" and e["version"] == 2 for e in events):
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert line, f"subscribe ended early ({await proc.wait()}): {events}"
            events.append(json.loads(line))
        (port,) = [e["metrics_port"] for e in events if e["event"] == "started"]
        samples, _ = await scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 60)
    assert proc.returncode == 0
    labels = {"run": "cli-m"}
    assert value(samples, "weftboard_island_version", **labels) == 2
    assert value(samples, "weftboard_island_head", **labels) == 2
    assert value(samples, "weftboard_island_lag_versions", **labels) == 0
    applied = sum(value(samples, "weftboard_island_versions_applied_total", kind=k, **labels) for k in ("anchor", "patch"))
    fetched = sum(value(samples, "weftboard_island_fetched_bytes_total", kind=k, **labels) for k in ("anchor", "patch"))
    assert applied == len([e for e in events if e["event"] == "applied"])
    assert fetched > 0 and value(samples, "weftboard_island_downloaded_bytes_total", **labels) == fetched
