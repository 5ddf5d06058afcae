"""The board CLI end to end: ``weftboard serve`` on the embedded default, then the client
commands against it, as a person would type them (real subprocesses, real Redis)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from boardkit import make_run, publish, read_serve_banner
from typer.testing import CliRunner

from weftboard.board.auth import bootstrap_id
from weftboard.board.blobs import LocalDirBlobStore, S3BlobStore
from weftboard.board.cli import build_app
from weftboard.board.client import BoardClient
from weftboard.board.config import BoardSettings, load_or_create_admin_token
from weftboard.board.embedded import free_port
from weftboard.proto.v1 import board_pb2 as pb

WEFTBOARD = [sys.executable, "-m", "weftboard.board.cli"]


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEFTBOARD_")}
    env.update(WEFTBOARD_DATA_DIR=str(data_dir), COLUMNS="200", NO_COLOR="1", **extra)
    return env


class Served:
    """A ``weftboard serve`` subprocess and the banner it printed."""

    def __init__(self, data_dir: Path, *args: str, timeout_s: float = 60.0):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = _env(data_dir)
        self.proc = subprocess.Popen(
            [*WEFTBOARD, "serve", "--listen", self.address, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
        )
        self.banner = read_serve_banner(self.proc, timeout_s)

    def cli(self, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = dict(self.env, WEFTBOARD_BOARD=self.address)
        if token:
            env["WEFTBOARD_TOKEN"] = token
        return subprocess.run([*WEFTBOARD, *args], capture_output=True, text=True, env=env, timeout=60)

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return self.proc.returncode, rest


def _port_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


async def _publish_and_heartbeat(address: str, token: str, blobs: LocalDirBlobStore | S3BlobStore, n: int,
                                 **retention: int) -> None:
    async with BoardClient(address, token) as client:
        await client.create_run(make_run("demo", **retention))
        await publish(client, blobs, "demo", range(1, n + 1))
        await client.heartbeat(pb.IslandStatus(island_id="isl-1", run="demo", region="eu", version=n - 2,
                                               state=pb.ISLAND_STATE_CATCHING_UP, capacity=4), lease_s=60)


@pytest.mark.slow
def test_serve_embedded_then_client_commands(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    board = Served(data_dir)
    try:
        banner = board.banner
        redis_port = int(re.search(r"redis://127\.0\.0\.1:(\d+)", banner).group(1))
        assert f"listening on {board.address}" in banner
        assert "embedded redis-server" in banner and "local directory" in banner
        admin = (data_dir / "admin-token").read_text().strip()
        assert admin in banner and "generated and stored" in banner
        assert oct((data_dir / "admin-token").stat().st_mode & 0o777) == "0o600"

        asyncio.run(_publish_and_heartbeat(board.address, admin, LocalDirBlobStore(data_dir / "blobs"), 4))

        # history: no --token needed, the embedded admin token is found in the data dir
        hist = board.cli("history", "demo")
        assert hist.returncode == 0, hist.stderr
        rows = [l for l in hist.stdout.splitlines() if re.match(r"^\s*│?\s*\d+\s", l)]
        assert [int(re.findall(r"\d+", r)[0]) for r in rows] == [1, 2, 3, 4]
        assert "anchor" in hist.stdout and "patch" in hist.stdout and "7.500%" in hist.stdout
        last2 = board.cli("history", "demo", "--last", "2", "--json")
        assert [v["version"] for v in json.loads(last2.stdout)["versions"]] == [3, 4]

        status = board.cli("status", "demo")
        assert status.returncode == 0, status.stderr
        assert "head 4" in status.stdout
        island_line = next(l for l in status.stdout.splitlines() if "isl-1" in l)
        assert re.search(r"isl-1\s+│?\s*eu\s+│?\s*2\s+│?\s*2\s+│?\s*catching_up", island_line), island_line
        runs = board.cli("status")
        assert "demo" in runs.stdout and runs.returncode == 0

        # tokens: a reader can read history but not collect garbage
        created = board.cli("token", "create", "ci-reader", "--role", "reader")
        assert created.returncode == 0, created.stderr
        reader = re.search(r"token:\s+(\S+)", created.stdout).group(1)
        token_id = re.search(r"token id:\s+(\S+)", created.stdout).group(1)
        assert board.cli("history", "demo", "--token", reader).returncode == 0
        denied = board.cli("gc", "demo", "--dry-run", token=reader)
        assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
        dry = board.cli("gc", "demo", "--dry-run")
        assert dry.returncode == 0 and "would delete" in dry.stdout
        gone = board.cli("token", "revoke", token_id)
        assert gone.returncode == 0 and f"revoked {token_id}" in gone.stdout
        typo = board.cli("token", "revoke", "bootstrap-0123456789ab")  # a bootstrap id no start stored
        assert typo.returncode == 0 and "no token was stored under bootstrap-0123456789ab" in typo.stdout
        assert "retired for good" in typo.stdout and "revoked" not in typo.stdout
        revoked = board.cli("history", "demo", "--token", reader)
        assert revoked.returncode == 1 and "UNAUTHENTICATED" in revoked.stderr
        missing = board.cli("history", "no-such-run")
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    finally:
        code, rest = board.stop()
    assert code == 0, rest
    assert "stopped" in rest
    assert _port_closed(board.port) and _port_closed(redis_port)

    # A restart on the same data dir keeps history (append-only Redis) and the admin token.
    again = Served(data_dir)
    try:
        # read back, not generated: named by its file and public id, never printed again
        assert "read from" in again.banner and admin not in again.banner and bootstrap_id(admin) in again.banner
        hist = again.cli("history", "demo")
        assert hist.returncode == 0 and "4" in hist.stdout
        assert "head 4" in again.cli("status", "demo").stdout
    finally:
        code, _ = again.stop()
    assert code == 0


@pytest.mark.slow
def test_serve_with_embedded_s3_presigns(tmp_path: Path) -> None:
    board = Served(tmp_path / "data", "--embedded-s3", "--s3-bucket", "cli-test", timeout_s=90)
    try:
        assert "embedded SeaweedFS S3" in board.banner and "cli-test" in board.banner
        admin = (tmp_path / "data" / "admin-token").read_text().strip()

        async def check() -> None:
            async with BoardClient(board.address, admin) as client:
                await client.create_run(make_run("s3run"))
                presigned = await client.presign_upload("s3run", "xxh3-128:" + "0" * 32, 10)
                assert presigned.url.startswith("http://127.0.0.1:")

        asyncio.run(check())
    finally:
        code, rest = board.stop()
    assert code == 0, rest


def test_serve_connects_to_given_redis(redis_url: str, tmp_path: Path) -> None:
    board = Served(tmp_path / "data", "--redis-url", redis_url, "--blob-dir", str(tmp_path / "b"), "--no-auth")
    try:
        assert "embedded redis-server" not in board.banner
        assert "auth" in board.banner and "OFF" in board.banner
        assert board.cli("status").returncode == 0
    finally:
        code, _ = board.stop()
    assert code == 0
    assert not (tmp_path / "data" / "redis").exists()


def test_read_commands_print_one_json_document(redis_url: str, tmp_path: Path) -> None:
    """``--json`` on status, fleet, history and gc: one document on stdout with the board's values."""
    board = Served(tmp_path / "data", "--redis-url", redis_url, "--blob-dir", str(tmp_path / "b"),
                   "--admin-token", "admin-" + "x" * 24)
    admin = "admin-" + "x" * 24
    try:
        asyncio.run(_publish_and_heartbeat(board.address, admin, LocalDirBlobStore(tmp_path / "b"), 4,
                                           keep_versions=1))

        def document(*args: str) -> dict:
            result = board.cli(*args, "--json", token=admin)
            assert result.returncode == 0, result.stderr
            return json.loads(result.stdout)  # the whole of stdout is one document

        runs = document("status")["runs"]
        assert [(r["run"], r["head"], r["kind"], r["served_format"]["kind"], r["tensors"]) for r in runs] == [
            ("demo", 4, "weights", "bf16", 2)]
        fleet = document("fleet", "demo")
        assert document("status", "demo") == fleet
        assert (fleet["run"], fleet["head"], fleet["oldest_available"]) == ("demo", 4, 1)
        assert fleet["committed_at_ms"] > 0
        [island] = fleet["islands"]
        assert {k: island[k] for k in ("island_id", "region", "version", "lag", "state", "capacity", "message")} == {
            "island_id": "isl-1", "region": "eu", "version": 2, "lag": 2, "state": "catching_up", "capacity": 4,
            "message": ""}
        assert island["lease_expires_at_ms"] > island["last_seen_ms"] > 0

        history = document("history", "demo")
        assert history["run"] == "demo" and [v["version"] for v in history["versions"]] == [1, 2, 3, 4]
        first, second = history["versions"][:2]
        assert [a["kind"] for a in first["artifacts"]] == ["anchor"] and first["parent"] == 0
        assert [a["kind"] for a in second["artifacts"]] == ["patch"] and second["artifacts"][0]["base_version"] == 1
        assert (second["step"], second["stats"]["changed_elements"], second["stats"]["density"]) == (20, 3, 3 / 40)
        assert isinstance(second["artifacts"][0]["blobs"][0]["size"], int)  # 64-bit integers as numbers
        assert document("history", "demo", "--from", "3")["versions"][0]["version"] == 3

        async def anchor_and_expected_gc() -> pb.CollectGarbageResponse:
            """Version 5 with an anchor, the island on it: GC may drop versions 1-4's blobs."""
            async with BoardClient(board.address, admin) as client:
                await publish(client, LocalDirBlobStore(tmp_path / "b"), "demo", [5], anchor=True, patch=True)
                await client.heartbeat(pb.IslandStatus(island_id="isl-1", run="demo", region="eu", version=5,
                                                       state=pb.ISLAND_STATE_READY, capacity=4), lease_s=60)
                return await client.collect_garbage("demo", dry_run=True, keep_anchors=1)

        would = asyncio.run(anchor_and_expected_gc())
        dry = document("gc", "demo", "--dry-run", "--keep-anchors", "1")
        assert dry == {"run": "demo", "dry_run": True, "deleted_keys": list(would.deleted_keys),
                       "deleted_blobs": 4, "freed_bytes": would.freed_bytes, "oldest_available": 5,
                       "staged_parts_collected": 0, "abandoned_blobs_collected": 0}
        assert dry["freed_bytes"] == 8 * 64 + 3 * 64  # boardkit: the anchor of version 1, the patches of 2-4
        done = document("gc", "demo", "--keep-anchors", "1")
        assert done == dict(dry, dry_run=False)
        assert document("fleet", "demo")["oldest_available"] == 5

        missing = board.cli("fleet", "no-such-run", "--json", token=admin)
        assert missing.returncode == 1 and missing.stdout == "" and "NOT_FOUND" in missing.stderr
    finally:
        code, _ = board.stop()
    assert code == 0


def test_version_flag() -> None:
    result = subprocess.run([*WEFTBOARD, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.strip() == f"weftboard {importlib.metadata.version('weftboard')}"


def test_the_command_line_loads_no_torch_until_a_command_needs_it() -> None:
    """Every command is registered without torch, numba or numpy (each command imports what it
    runs), so ``weftboard serve`` and the board's client commands start in about a second; the
    table still has every command, and a command that needs the codec gets it."""
    probe = ("import json, sys, typer; from weftboard.board.cli import build_app\n"
             "app = typer.main.get_command(build_app())\n"
             "print(json.dumps([[m for m in ('torch', 'numba', 'numpy') if m in sys.modules],\n"
             "                  sorted(app.commands), sorted(app.commands['bench'].commands)]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    loaded, top, bench = json.loads(out.stdout)
    assert loaded == []
    assert {"serve", "history", "status", "fleet", "token", "gc", "warmup", "subscribe", "sidecar", "demo",
            "bench"} <= set(top)
    assert set(bench) == {"board", "codec", "formats", "engine", "sync", "publish", "chaos"}
    result = CliRunner().invoke(build_app(), ["warmup", "--format", "nope"])
    assert result.exit_code == 2 and "nope: choose from" in result.output  # the codec's own list of formats


def test_invalid_settings_exit_2_with_a_message(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(build_app(), ["serve", "--listen", "nonsense"], env=_env(tmp_path))
    assert result.exit_code == 2
    assert "listen" in result.output and "host:port" in result.output


def test_unreachable_board_is_a_one_line_error(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(build_app(), ["status", "--board", f"127.0.0.1:{free_port()}", "--token", "x" * 20],
                           env=_env(tmp_path))
    assert result.exit_code == 1
    assert "UNAVAILABLE" in result.output


def test_settings_env_and_flag_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WEFTBOARD_LISTEN", "0.0.0.0:9000")
    monkeypatch.setenv("WEFTBOARD_REDIS_URL", "redis://10.0.0.1:6379/2")
    monkeypatch.setenv("WEFTBOARD_S3_SECRET_KEY", "very-secret")
    monkeypatch.setenv("WEFTBOARD_AUTH", "false")
    monkeypatch.setenv("WEFTBOARD_METRICS_PORT", "9100")
    monkeypatch.setenv("WEFTBOARD_DATA_DIR", str(tmp_path))
    settings = BoardSettings()
    assert settings.listen == "0.0.0.0:9000" and settings.redis_url == "redis://10.0.0.1:6379/2"
    assert settings.auth is False and settings.metrics_port == 9100 and settings.data_dir == tmp_path
    assert "very-secret" not in repr(settings) and settings.secret("s3_secret_key") == "very-secret"
    flagged = BoardSettings(listen="127.0.0.1:1234")
    assert flagged.listen == "127.0.0.1:1234" and flagged.redis_url == "redis://10.0.0.1:6379/2"
    monkeypatch.setenv("WEFTBOARD_REDIS_URL", "")
    assert BoardSettings().redis_url is None  # empty means "embedded"
    with pytest.raises(ValueError, match="redis://"):
        BoardSettings(redis_url="localhost:6379")


def test_admin_token_file_is_reused(tmp_path: Path) -> None:
    token, path, created = load_or_create_admin_token(tmp_path)
    assert created and len(token) >= 32
    again, _, created_again = load_or_create_admin_token(tmp_path)
    assert again == token and not created_again


@pytest.mark.slow
def test_bench_board_smoke_prints_json_last(tmp_path: Path) -> None:
    """Small numbers; the real figures come from `weftboard bench board --json` (1,000 watchers)."""
    result = subprocess.run(
        [*WEFTBOARD, "bench", "board", "--json", "--watchers", "20", "--commits", "3", "--channels", "2",
         "--reporters", "2", "--traj-seconds", "0.5", "--batch", "100"],
        capture_output=True, text=True, env=_env(tmp_path), timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) > 3 and "fan-out" in result.stdout
    report = json.loads(lines[-1])
    for key in ("watchers", "fanout_p50_ms", "fanout_p99_ms", "commits_per_s", "traj_records_per_s", "history_p99_ms"):
        assert isinstance(report[key], (int, float)), key
    assert report["watchers"] == 20 and report["fanout_missed"] == 0
    assert 0 < report["fanout_p50_ms"] <= report["fanout_p99_ms"]
    assert report["commits_per_s"] > 0 and report["traj_records_per_s"] > 0 and report["history_p99_ms"] > 0


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (IP SAN), made with the cryptography package."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "weftboard-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "board.crt", tmp_path / "board.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_serve_with_tls_and_client_ca_flag(redis_url: str, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    board = Served(tmp_path / "data", "--redis-url", redis_url, "--blob-dir", str(tmp_path / "b"),
                   "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert "(TLS)" in board.banner
        ok = board.cli("status", "--tls-ca", str(cert))
        assert ok.returncode == 0, ok.stderr
        plain = board.cli("status")  # a plaintext client cannot talk to a TLS board
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
    finally:
        code, _ = board.stop()
    assert code == 0


def test_serve_with_unreachable_redis_fails_fast(tmp_path: Path) -> None:
    # A subprocess: serve configures process-wide logging, which must not leak into pytest.
    start = time.monotonic()
    result = subprocess.run(
        [*WEFTBOARD, "serve", "--listen", f"127.0.0.1:{free_port()}", "--redis-url",
         f"redis://127.0.0.1:{free_port()}/0", "--blob-dir", str(tmp_path / "b"), "--admin-token", "a" * 20],
        capture_output=True, text=True, env=_env(tmp_path), timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "UNAVAILABLE" in result.stderr and "Redis" in result.stderr
    assert time.monotonic() - start < 30
