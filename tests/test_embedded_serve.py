"""The embedded default across processes: ``weftboard serve`` with no flags serves its local
blobs over signed, expiring HTTP URLs, so a Publisher (the README's snippet) and ``weftboard
subscribe``, each in a process of its own and without credentials, agree bitwise on every
version. Plus the signed URLs themselves: expiry, tampering, digest-checked PUTs, Range reads."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import xxhash
from boardkit import read_serve_banner
from safetensors.torch import load_file

from weftboard.board.blob_http import BlobHttpServer
from weftboard.board.blobs import LocalDirBlobStore, fetch_url, upload_bytes_url
from weftboard.board.embedded import free_port
from weftboard.cuda.digest import root_digest, tensor_digest
from weftboard.proto.errors import UrlExpired, WeftboardError
from weftboard.proto.names import blob_key, format_digest

WEFTBOARD = [sys.executable, "-m", "weftboard.board.cli"]


def _key(data: bytes, run: str = "r") -> str:
    return blob_key(run, format_digest(xxhash.xxh3_128(data).digest()))


@pytest.fixture
async def served(tmp_path: Path):
    store = LocalDirBlobStore(tmp_path / "blobs")
    server = BlobHttpServer(store, b"s" * 32)
    await server.start()
    try:
        yield store
    finally:
        await server.stop()


async def test_signed_put_then_ranged_get(served: LocalDirBlobStore, tmp_path: Path) -> None:
    data = os.urandom(3_000_000)
    key = _key(data)
    put = await served.presign_put(key, 60, size=len(data))
    assert put and put.startswith("http://127.0.0.1:")
    assert await upload_bytes_url(put, data) == len(data)
    assert await served.get_bytes(key) == data

    get = await served.presign_get(key, 60)
    dest = tmp_path / "down.bin"
    assert await fetch_url(get, dest) == len(data) and dest.read_bytes() == data
    dest.write_bytes(data[:1_234_567])  # resume: a Range read from there
    assert await fetch_url(get, dest, offset=1_234_567) == len(data) and dest.read_bytes() == data
    assert await fetch_url(get, dest, offset=len(data)) == len(data)  # complete: 416, untouched
    async with aiohttp.ClientSession() as session, session.get(get, headers={"Range": "bytes=10-19"}) as resp:
        assert resp.status == 206 and await resp.read() == data[10:20]
        assert resp.headers["Content-Range"] == f"bytes 10-19/{len(data)}"


async def test_expired_or_tampered_urls_are_refused(served: LocalDirBlobStore, tmp_path: Path) -> None:
    await served.put_bytes("r/blobs/" + "a" * 32, b"aaa")
    await served.put_bytes("r/blobs/" + "b" * 32, b"bbb")
    url = await served.presign_get("r/blobs/" + "a" * 32, 60)
    expired = served.signer.sign("GET", "r/blobs/" + "a" * 32, 1, now=time.time() - 10)
    other_key = url.replace("a" * 32, "b" * 32)
    later = re.sub(r"expires=(\d+)", lambda m: f"expires={int(m.group(1)) + 3600}", url)
    forged = re.sub(r"sig=[0-9a-f]+", "sig=" + "0" * 64, url)
    for bad in (expired, other_key, later, forged, url.split("?")[0]):
        with pytest.raises(UrlExpired):
            await fetch_url(bad, tmp_path / "x")
    # a GET's signature does not allow a PUT of the same key
    with pytest.raises(UrlExpired):
        await upload_bytes_url(url, b"aaa")


async def test_put_of_other_bytes_is_refused_and_leaves_nothing(served: LocalDirBlobStore) -> None:
    data = b"the declared bytes" * 1000
    key = _key(data)
    url = await served.presign_put(key, 60, size=len(data))
    wrong = bytearray(data)
    wrong[7] ^= 1
    with pytest.raises(WeftboardError, match="400"):
        await upload_bytes_url(url, bytes(wrong))
    with pytest.raises(WeftboardError, match="400"):
        await upload_bytes_url(url, data[:-1])  # short of the signed size
    assert await served.stat(key) is None
    assert [p for p in served.root.rglob("*") if p.is_file()] == []  # no temporary file left either
    tampered_size = url.replace(f"size={len(data)}", f"size={len(data) - 1}")
    with pytest.raises(UrlExpired):
        await upload_bytes_url(tampered_size, data[:-1])


async def test_a_store_without_its_server_does_not_presign(tmp_path: Path) -> None:
    store = LocalDirBlobStore(tmp_path / "blobs")
    server = BlobHttpServer(store, b"s" * 32)
    await server.start()
    await server.stop()
    assert await store.presign_get("r/blobs/" + "a" * 32, 60) is None


# ---------------------------------------------------------------------------
# weftboard serve, no flags; a publisher and an island, each its own process
# ---------------------------------------------------------------------------

# The README's publisher snippet, with a small model around it; each step waits for a line on
# stdin (so the test can check the island at every version) and prints the committed root.
PUBLISHER = textwrap.dedent('''
    import json, os, sys
    import torch
    from weftboard.publisher import Publisher
    from weftboard.cuda.formats import ServedFormatSpec

    PUBLISHER_TOKEN = os.environ["PUBLISHER_TOKEN"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = int(sys.argv[2])

    with Publisher(sys.argv[1], "my-run", token=PUBLISHER_TOKEN,
                   served_format=ServedFormatSpec("bf16"), anchor_every=3) as pub:
        for step in range(steps):
            sys.stdin.readline()
            loss = model(torch.randn(32, 64)).pow(2).mean()
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            handle = pub.publish(model, step=step, labels={"lr": "1e-3"})
            record = handle.result(timeout=120)
            print(json.dumps({"version": record.version, "root": record.root_digest}), flush=True)
''')


def _env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEFTBOARD_")}
    env.update(WEFTBOARD_DATA_DIR=str(data_dir), COLUMNS="200", NO_COLOR="1")
    return env


def _island_root(version_dir: Path) -> str:
    tensors: dict = {}
    for f in sorted(version_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    layout = json.loads((version_dir / "weftboard.json").read_text())["layout"]
    assert sorted(tensors) == sorted(name for name, _, _ in layout)
    return root_digest([(name, str(tensors[name].dtype).removeprefix("torch."), list(tensors[name].shape),
                         tensor_digest(tensors[name])) for name, _, _ in layout])


@dataclass
class NoFlagBoard:
    address: str
    admin: str
    env: dict[str, str]
    banner: str


@pytest.fixture(scope="module")
def no_flag_board(tmp_path_factory: pytest.TempPathFactory, warm_kernels: object) -> Iterator[NoFlagBoard]:
    """``weftboard serve`` with no flags but the address (the test's port); the data dir by
    environment, as a user's default would be."""
    env = _env(tmp_path_factory.mktemp("data"))
    address = f"127.0.0.1:{free_port()}"
    board = subprocess.Popen([*WEFTBOARD, "serve", "--listen", address], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        banner = read_serve_banner(board)
        admin = re.search(r"admin token\s+(\S+)", banner).group(1)
        yield NoFlagBoard(address, admin, env, banner)
    finally:
        board.send_signal(signal.SIGTERM)
        _, rest = board.communicate(timeout=60)
    assert board.returncode == 0, rest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_flag_serve_publisher_and_island_in_other_processes(no_flag_board: NoFlagBoard, tmp_path: Path) -> None:
    address, env, banner = no_flag_board.address, no_flag_board.env, no_flag_board.banner
    procs: list[subprocess.Popen[str]] = []
    try:
        assert "local directory" in banner and "signed" in banner
        assert re.search(r"blob urls\s+http://127\.0\.0\.1:\d+/blobs/", banner), banner

        def token(role: str) -> str:
            made = subprocess.run([*WEFTBOARD, "token", "create", role, "--role", role, "--board", address,
                                   "--token", no_flag_board.admin], capture_output=True, text=True, env=env,
                                  timeout=60)
            assert made.returncode == 0, made.stderr
            return re.search(r"token:\s+(\S+)", made.stdout).group(1)

        steps = 5
        pub_log, island_log = tmp_path / "publisher.log", tmp_path / "island.log"
        pub = subprocess.Popen([sys.executable, "-c", PUBLISHER, address, str(steps)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=pub_log.open("w"), text=True,
                               env=dict(env, PUBLISHER_TOKEN=token("publisher")))
        procs.append(pub)
        island_dir = tmp_path / "island"
        pub.stdin.write("step\n")
        pub.stdin.flush()
        line = pub.stdout.readline()
        assert line, pub_log.read_text()
        first = json.loads(line)
        island = subprocess.Popen(
            [*WEFTBOARD, "subscribe", "--board", address, "--token", token("island"), "--run", "my-run",
             "--dir", str(island_dir), "--events", "--no-progress", "--heartbeat-s", "1"],
            stdout=subprocess.PIPE, stderr=island_log.open("w"), text=True, env=env)
        procs.append(island)

        def wait_applied(version: int) -> None:
            while True:
                line = island.stdout.readline()
                assert line, f"island exited ({island.wait()}): {island_log.read_text()}"
                event = json.loads(line)
                if event.get("event") == "applied" and event["version"] >= version:
                    assert event["version"] == version, event
                    return

        published = {first["version"]: first["root"]}
        wait_applied(first["version"])
        roots = {first["version"]: _island_root(island_dir / "checkpoint" / "current")}
        for _ in range(steps - 1):
            pub.stdin.write("step\n")
            pub.stdin.flush()
            line = pub.stdout.readline()
            assert line, pub_log.read_text()
            done = json.loads(line)
            published[done["version"]] = done["root"]
            wait_applied(done["version"])
            roots[done["version"]] = _island_root(island_dir / "checkpoint" / "current")
        pub.stdin.close()
        assert pub.wait(timeout=120) == 0, pub_log.read_text()
        assert sorted(published) == list(range(1, steps + 1))
        assert roots == published
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


# A library user: publishes two versions and follows them with a Subscriber, in one process.
LIBRARY_USER = textwrap.dedent('''
    import asyncio, logging, sys, tempfile
    import torch
    if sys.argv[4] == "info":
        logging.basicConfig(level=logging.INFO)
    from weftboard.board.client import BoardClient
    from weftboard.publisher import Publisher
    from weftboard.subscriber.live_tensors import LiveTensorsDestination
    from weftboard.subscriber.subscriber import Subscriber

    address, token, run = sys.argv[1], sys.argv[2], sys.argv[3]
    model = torch.nn.Linear(32, 32)
    with Publisher(address, run, token=token, anchor_every=2) as pub:
        for step in range(2):
            with torch.no_grad():
                model.weight.add_(0.01)
            pub.publish(model, step=step).result(timeout=120)

    async def follow() -> None:
        async with BoardClient(address, token) as client:
            layout = (await client.get_run(run)).layout
            dest = LiveTensorsDestination({t.name: torch.zeros(tuple(t.shape), dtype=getattr(torch, t.dtype))
                                           for t in layout.tensors})
            sub = Subscriber(client, run, dest, island_id="quiet", cache_dir=tempfile.mkdtemp())
            done = asyncio.Event()
            sub.add_listener(lambda version: version >= 2 and done.set())
            task = asyncio.ensure_future(sub.run())
            await asyncio.wait_for(done.wait(), 120)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(follow())
''')


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_library_prints_nothing_unless_logging_is_configured(no_flag_board: NoFlagBoard) -> None:
    def use(run: str, logging_mode: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-c", LIBRARY_USER, no_flag_board.address, no_flag_board.admin, run,
                               logging_mode], capture_output=True, text=True, env=no_flag_board.env, timeout=300)
        assert done.returncode == 0, done.stderr
        return done

    quiet = use("quiet-run", "none")
    assert quiet.stdout == "" and quiet.stderr == ""
    loud = use("loud-run", "info")
    assert loud.stdout == ""
    assert "INFO:weftboard." in loud.stderr, loud.stderr
