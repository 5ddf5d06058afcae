"""Where an island reads its blobs (``subscriber/blob_source.py``), the same for ``weftboard
subscribe`` and ``weftboard sidecar``: settings checked whole before anything opens (exit 2 with
one line on the command line), the S3 region the one given or else the bucket's own (never an
assumed ``us-east-1``, which AWS refuses for a bucket elsewhere, as it did the shipped island
example's eu-west-1 endpoint), a request signed for the wrong region refused as
``PermissionDenied`` (retrying cannot cure it), and a real ``weftboard subscribe`` reading a run
from SeaweedFS with its own credentials and no region given. Both commands also take the
island's own ``--region`` (where it runs, in its heartbeats)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import typer
from pubsubkit import Trainer, bits_equal, first_difference, island_and_trainer_tokens
from safetensors.torch import load_file

from weftboard.board.blobs import LocalDirBlobStore, S3BlobStore
from weftboard.board.cli import build_app
from weftboard.proto.errors import InvalidArgument, PermissionDenied
from weftboard.publisher.bench.island_processes import IslandProcess, IslandSpec
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.blob_source import PRESIGNED, IslandBlobSettings

# -- the settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "message"), [
    (dict(s3_endpoint="127.0.0.1:9000", s3_access_key="key"), "--s3-access-key needs --s3-secret-key"),
    (dict(s3_endpoint="127.0.0.1:9000", s3_secret_key="secret"), "--s3-secret-key needs --s3-access-key"),
    (dict(s3_endpoint="127.0.0.1:9000", blob_dir=Path("/tmp/blobs")), "--s3-endpoint or --blob-dir, not both"),
    (dict(s3_endpoint="http://127.0.0.1:9000/bucket"), "must not contain a path"),
    (dict(s3_endpoint="127.0.0.1:9000", s3_bucket="ab"), "bucket name 'ab' is invalid"),
    (dict(s3_endpoint="127.0.0.1:9000", s3_prefix="runs/../other"), "--s3-prefix 'runs/../other'"),
    # the store refused "/" only when it opened (after the command had started): now the settings do
    (dict(s3_endpoint="127.0.0.1:9000", s3_prefix="/"), "--s3-prefix '/' is not a key prefix"),
])
def test_settings_that_do_not_fit_together_are_refused_before_anything_opens(settings: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        IslandBlobSettings(**settings)


async def test_the_store_is_s3_with_the_region_given_else_none_a_blob_directory_or_presigned_urls(tmp_path: Path) -> None:
    assert PRESIGNED.open() is None
    local = IslandBlobSettings(blob_dir=tmp_path / "blobs").open()
    assert isinstance(local, LocalDirBlobStore) and (tmp_path / "blobs").is_dir()
    await local.close()
    for region in ("eu-west-1", None):
        store = IslandBlobSettings(s3_endpoint="https://s3.example.com", s3_access_key="k", s3_secret_key="s",
                                   s3_region=region, s3_prefix="runs/").open()
        assert isinstance(store, S3BlobStore)
        try:
            assert (store.region, store.bucket, store.prefix, store.secure) == (region, "weftboard", "runs/", True)
        finally:
            await store.close()


class _WrongRegionS3(BaseHTTPRequestHandler):
    """AWS's answer to a request signed for another region than the bucket's."""

    def do_HEAD(self) -> None:  # the bucket exists
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AuthorizationHeaderMalformed</Code>"
                b"<Message>The authorization header is malformed; the region 'us-east-1' is wrong; expecting "
                b"'eu-west-1'</Message><Region>eu-west-1</Region><RequestId>1</RequestId></Error>")
        self.send_response(400)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def wrong_region_s3() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _WrongRegionS3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_a_request_signed_for_the_wrong_region_is_permission_denied_naming_the_region(wrong_region_s3: str) -> None:
    store = IslandBlobSettings(s3_endpoint=wrong_region_s3, s3_access_key="k", s3_secret_key="s",
                               s3_region="us-east-1").open()
    assert store is not None
    try:
        with pytest.raises(PermissionDenied, match="AuthorizationHeaderMalformed.*region"):
            await store.get_bytes("blobs/x")
    finally:
        await store.close()


# -- the command line -----------------------------------------------------------------------

# the real command line, with the follower and the island it would start replaced where the
# commands import them when they run
_RUN_COMMAND = """
import json, sys
from weftboard.subscriber import engine_island, local_follower
from weftboard.board.cli import main
from weftboard.proto.errors import Unavailable

def report(store, island_region):
    fields = [store.endpoint, store.bucket, store.region, store.prefix, store.secure] if store else []
    print(json.dumps(fields + [island_region]), flush=True)

async def follow(cfg):
    store = cfg.blobs.open()
    report(store, cfg.region)
    if store:
        await store.close()
    return 0

async def start_island(**kwargs):
    report(kwargs["blob_store"], kwargs["region"])
    raise Unavailable("no board in this test")

local_follower.run_local_follower = follow
engine_island.start_island = start_island
sys.argv = ["weftboard", *json.loads(sys.argv[1])]
main()
"""


def _island_command(command: str, flags: list[str], tmp_path: Path, env: dict[str, str] | None = None
                    ) -> subprocess.CompletedProcess:
    args = [command, "--board", "127.0.0.1:1", "--run", "r", "--dir", str(tmp_path / "island"), *flags]
    if command == "sidecar":
        args += ["--listen", "127.0.0.1:0"]
    ours = ("WEFTBOARD_S3", "WEFTBOARD_REGION", "WEFTBOARD_BLOB_DIR")  # only what the test gives
    environment = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    return subprocess.run([sys.executable, "-c", _RUN_COMMAND, json.dumps(args)], capture_output=True, text=True,
                          timeout=120, env={**environment, **(env or {})})


@pytest.mark.parametrize("command", ["subscribe", "sidecar"])
def test_both_island_commands_take_the_same_blob_flags_and_region(command: str, tmp_path: Path) -> None:
    done = _island_command(command, ["--s3-endpoint", "https://s3.eu-west-1.amazonaws.com", "--s3-access-key", "k",
                                     "--s3-secret-key", "s", "--s3-region", "eu-west-1", "--s3-prefix", "runs"], tmp_path)
    assert done.stdout.strip(), done.stderr[-2000:]
    endpoint, bucket, region, prefix, secure, _ = json.loads(done.stdout.splitlines()[0])
    assert region == "eu-west-1" and bucket == "weftboard" and secure is True
    assert endpoint == "s3.eu-west-1.amazonaws.com" and prefix == "runs/"
    # from the environment, as the systemd units and k8s manifests give it
    done = _island_command(command, [], tmp_path, env={"WEFTBOARD_S3_ENDPOINT": "127.0.0.1:9000",
                                                       "WEFTBOARD_S3_ACCESS_KEY": "k", "WEFTBOARD_S3_SECRET_KEY": "s",
                                                       "WEFTBOARD_S3_REGION": "ap-south-1"})
    assert json.loads(done.stdout.splitlines()[0])[:3] == ["127.0.0.1:9000", "weftboard", "ap-south-1"], done.stderr
    # no region: the store asks (AWS hosts name theirs), nothing assumed
    done = _island_command(command, ["--s3-endpoint", "127.0.0.1:9000"], tmp_path)
    assert json.loads(done.stdout.splitlines()[0])[2] is None, done.stderr


@pytest.mark.parametrize("command", ["subscribe", "sidecar"])
def test_both_island_commands_spell_the_s3_tls_flag_as_serve_does(command: str) -> None:
    """HTTPS to a host:port endpoint: ``--s3-secure``, else ``--s3-insecure`` as ``weftboard serve``
    spells it (a user copying serve's flag got "No such option"), or ``--no-s3-secure``, the island
    commands' first name for it. Parsed by the real command line, in this process."""
    island = typer.main.get_command(build_app()).commands[command]  # type: ignore[attr-defined]
    base = ["--board", "127.0.0.1:1", "--run", "r", "--dir", "island", "--s3-endpoint", "127.0.0.1:9000"]
    for flags, secure in ((["--s3-secure"], True), (["--s3-insecure"], False), (["--no-s3-secure"], False), ([], False)):
        assert island.make_context(command, [*base, *flags]).params["s3_secure"] is secure, flags


@pytest.mark.parametrize("command", ["subscribe", "sidecar"])
def test_a_key_without_its_secret_is_a_usage_error_before_anything_starts(command: str, tmp_path: Path) -> None:
    done = _island_command(command, ["--s3-endpoint", "127.0.0.1:9000", "--s3-access-key", "k"], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert not done.stdout.strip()  # neither the follower nor the island started
    assert "--s3-access-key needs --s3-secret-key" in done.stderr
    assert not (tmp_path / "island").exists()


@pytest.mark.parametrize("command", ["subscribe", "sidecar"])
def test_both_island_commands_report_the_region_they_are_given(command: str, tmp_path: Path) -> None:
    """``--region``/``WEFTBOARD_REGION``: where the island runs, in its heartbeats (the sidecar's
    said "local" whatever it was given before)."""
    done = _island_command(command, ["--region", "eu-west"], tmp_path)
    assert json.loads(done.stdout.splitlines()[0]) == ["eu-west"], done.stderr[-2000:]
    done = _island_command(command, [], tmp_path, env={"WEFTBOARD_REGION": "ap-south"})
    assert json.loads(done.stdout.splitlines()[0]) == ["ap-south"], done.stderr[-2000:]


# -- a real island on S3 --------------------------------------------------------------------


def _checkpoint(island_dir: Path) -> dict:
    out: dict = {}
    for f in sorted((island_dir / "checkpoint" / "current").glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.slow
@pytest.mark.usefixtures("warm_kernels")
@pytest.mark.timeout(600)
async def test_a_subscribe_process_reads_a_run_from_s3_with_its_own_credentials_and_no_region(
        board_factory, s3_server, s3_store, tmp_path: Path) -> None:
    board = await board_factory(blobs=s3_store)
    run = "s3-island"
    island_token, pub_token = await island_and_trainer_tokens(board.address, board.admin_token)
    trainer = Trainer(lr=1e-4)
    views: dict[int, dict] = {}
    pub = Publisher(board.address, run, token=pub_token, blob_store=s3_store, anchor_every=10)

    def publish() -> None:
        trainer.step()
        handle = pub.publish(trainer.model, step=trainer.step_no)
        views[handle.version] = trainer.served()
        handle.result(60)

    island = None
    try:
        await asyncio.to_thread(publish)  # version 1: the anchor, before the island starts
        spec = IslandSpec("island-s3", tmp_path / "island", board.address, run, token=island_token,
                          s3_endpoint=s3_server.endpoint, s3_access_key=s3_server.access_key,
                          s3_secret_key=s3_server.secret_key, s3_bucket=s3_server.bucket, s3_prefix=s3_store.prefix)
        island = IslandProcess(spec)
        await island.start()
        await island.wait_version(1, 90)
        await asyncio.to_thread(publish)  # version 2: a patch
        await island.wait_version(2, 90)
        held = _checkpoint(spec.dir)
        assert bits_equal(held, views[2]), first_difference(held, views[2])
        log = island.log_path.read_text()
        assert f"s3://{s3_server.bucket}/{s3_store.prefix}" in log  # its own store, not presigned URLs
        await island.stop()
        assert island.proc is not None and island.proc.returncode == 0
    finally:
        if island is not None:
            await island.stop()
        await asyncio.to_thread(pub.close, False)
