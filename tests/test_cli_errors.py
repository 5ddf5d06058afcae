"""The command line's surface where it meets mistakes and secrets: usage errors exit 2 with one
line naming the option; what stops a command starting (a directory under a file, a port taken,
S3 away) exits 1 with one line and leaves nothing open, and so does what only a changed
setting cures (S3 or Redis refusing the credentials), with exit 2; the serve
banner never prints an admin token the operator supplied; a config file's top-level client
certificate and ``listen`` never configure ``serve``; and ``weftboard subscribe --blob-dir``
follows a board that serves no blob URLs (``--blob-http-port -1``).

Commands that configure process-wide logging or start servers run in a ``weftboard`` process
of their own; pure usage errors run in-process through typer's CliRunner.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import typer
from boardkit import read_serve_banner
from pubsubkit import Trainer
from typer.testing import CliRunner

from weftboard.board.auth import bootstrap_id
from weftboard.board.cli import build_app
from weftboard.board.config_file import config_default_map
from weftboard.board.defaults import ADMIN_TOKEN_FILE
from weftboard.board.embedded import ManagedProcess, free_port, redis_server_binary
from weftboard.proto.errors import InvalidArgument
from weftboard.publisher.publisher import Publisher

WEFTBOARD = [sys.executable, "-m", "weftboard.board.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEFTBOARD_")}
    env.update(COLUMNS="200", NO_COLOR="1", **extra)
    return env


def _invoke(*args: str) -> typer.testing.Result:
    cleared: dict[str, str | None] = {k: None for k in os.environ if k.startswith("WEFTBOARD_")}
    return CliRunner().invoke(build_app(), list(args), env={**cleared, "COLUMNS": "200", "NO_COLOR": "1"},
                              prog_name="weftboard")


def _run(*args: str, timeout_s: float = 90, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*WEFTBOARD, *args], capture_output=True, text=True, env=_env(**env), timeout=timeout_s)


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


# ---------------------------------------------------------------------------
# usage errors: exit 2, one line naming the option
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "option"), [
    (["sidecar", "--board", "127.0.0.1:1", "--run", "r", "--activation", "nope"], "--activation"),
    (["sidecar", "--board", "127.0.0.1:1", "--run", "r", "--listen", "nonsense"], "--listen"),
    (["sidecar", "--board", "127.0.0.1:1", "--run", "r", "--listen", "127.0.0.1:99999"], "--listen"),
    (["subscribe", "--board", "127.0.0.1:1", "--run", "r", "--dir", "DIR", "--destination", "nope"], "--destination"),
])
def test_usage_errors_exit_2_with_one_line_naming_the_option(args: list[str], option: str, tmp_path: Path) -> None:
    args = [str(tmp_path / "d") if a == "DIR" else a for a in args]
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    line = _one_line(result.output)
    assert line.startswith(f"error: {option}:"), line
    assert not (tmp_path / "d").exists()  # refused before anything was made


# ---------------------------------------------------------------------------
# start-up OSErrors: exit 1, one line, nothing left open
# ---------------------------------------------------------------------------


def test_subscribe_dir_under_a_file_is_one_line_exit_1(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    result = _run("subscribe", "--board", f"127.0.0.1:{free_port()}", "--run", "r", "--dir",
                  str(tmp_path / "afile" / "island"), "--no-progress")
    assert result.returncode == 1, result.stderr
    line = _one_line(result.stderr)
    assert line.startswith("subscribe stopped:") and str(tmp_path / "afile" / "island") in line, line


@pytest.mark.parametrize("which", ["data-dir", "blob-dir"])
def test_serve_with_a_directory_under_a_file_is_one_line_exit_1(which: str, redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    bad = tmp_path / "afile" / "sub"
    dirs = {"data-dir": str(tmp_path / "data"), "blob-dir": str(tmp_path / "blobs"), which: str(bad)}
    # the data dir is first needed by the embedded redis-server (a given Redis and token need none)
    redis = [] if which == "data-dir" else ["--redis-url", redis_url]
    result = _run("serve", "--listen", f"127.0.0.1:{free_port()}", *redis, "--admin-token",
                  "a" * 24, "--blob-http-port", "-1", "--data-dir", dirs["data-dir"], "--blob-dir", dirs["blob-dir"])
    assert result.returncode == 1, result.stdout + result.stderr
    line = _one_line(result.stderr)
    assert line.startswith("cannot serve:") and str(bad) in line, line


def test_sidecar_on_a_port_in_use_is_one_line_exit_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("sidecar", "--board", f"127.0.0.1:{free_port()}", "--run", "r", "--listen",
                      f"127.0.0.1:{port}", "--dir", str(tmp_path / "island"))
    assert result.returncode == 1, result.stderr
    line = _one_line(result.stderr)  # no "Unclosed client session" either
    assert line.startswith("sidecar did not start: --listen") and str(port) in line, line


# ---------------------------------------------------------------------------
# serve: S3 must answer with working credentials at start-up
# ---------------------------------------------------------------------------


def _serve_s3(redis_url: str, tmp_path: Path, endpoint: str, access: str, secret: str, bucket: str,
              ) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*WEFTBOARD, "serve", "--listen", f"127.0.0.1:{free_port()}", "--redis-url", redis_url,
         "--admin-token", "a" * 24, "--s3-endpoint", endpoint, "--s3-access-key", access, "--s3-secret-key", secret,
         "--s3-bucket", bucket, "--s3-region", "us-east-1", "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


@pytest.mark.parametrize("fault", ["wrong-secret", "unreachable"])
def test_serve_exits_2_when_s3_refuses_the_credentials_and_1_when_it_is_away(fault: str, s3_server: ManagedProcess,
                                                                             redis_url: str, tmp_path: Path) -> None:
    """Exit 1 may pass (a supervisor restarts the board), exit 2 only a changed setting cures."""
    assert s3_server.access_key and s3_server.secret_key and s3_server.bucket
    endpoint = s3_server.endpoint if fault == "wrong-secret" else f"127.0.0.1:{free_port()}"
    secret = "not-the-secret" if fault == "wrong-secret" else s3_server.secret_key
    proc = _serve_s3(redis_url, tmp_path, endpoint, s3_server.access_key, secret, s3_server.bucket)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == (2 if fault == "wrong-secret" else 1), out + err
    assert "is serving" not in out, out
    assert "Traceback" not in err, err
    # urllib3 logs each retry of an unreachable endpoint; the error itself is one line
    (line,) = [line for line in err.splitlines() if line.startswith("cannot serve")]
    expected = "PERMISSION_DENIED" if fault == "wrong-secret" else "UNAVAILABLE"
    assert line.startswith(f"cannot serve ({expected})") and secret not in err, err


@pytest.mark.parametrize("password", ["wrong", None])
def test_serve_exits_2_when_redis_refuses_the_credentials(password: str | None, tmp_path: Path) -> None:
    """A Redis with a password, asked with a wrong one or none: the board does not start, names
    PERMISSION_DENIED without the password, and exits 2 (before, 1: a restart loop)."""
    port = free_port()
    redis = subprocess.Popen([str(redis_server_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--requirepass", "the-right-one", "--dir", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        auth = f":{password}@" if password else ""
        result = _run("serve", "--listen", f"127.0.0.1:{free_port()}", "--redis-url", f"redis://{auth}127.0.0.1:{port}/0",
                      "--admin-token", "a" * 24, "--blob-http-port", "-1", "--data-dir", str(tmp_path / "data"))
    finally:
        redis.kill()
        redis.wait()
    assert result.returncode == 2, result.stdout + result.stderr
    line = _one_line(result.stderr)
    assert line.startswith("cannot serve (PERMISSION_DENIED)") and "the-right-one" not in line, line
    assert password is None or f":{password}@" not in line, line


def test_serve_creates_a_missing_bucket_and_serves(s3_server: ManagedProcess, redis_url: str, tmp_path: Path) -> None:
    assert s3_server.access_key and s3_server.secret_key
    bucket = f"wb-start-{uuid.uuid4().hex[:12]}"
    proc = _serve_s3(redis_url, tmp_path, s3_server.endpoint, s3_server.access_key, s3_server.secret_key, bucket)
    try:
        banner = read_serve_banner(proc)
        assert f"s3://{bucket}/" in banner, banner
    finally:
        code, _ = _stop(proc)
    assert code == 0


# ---------------------------------------------------------------------------
# serve's banner and the admin token
# ---------------------------------------------------------------------------


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out + err


def _banner(redis_url: str, data_dir: Path, *args: str, **env: str) -> tuple[str, str]:
    """The banner of a serve started with ``args``/``env``, and everything it printed after."""
    proc = subprocess.Popen(
        [*WEFTBOARD, *args[:args.index("serve") + 1], "--listen", f"127.0.0.1:{free_port()}", "--redis-url", redis_url,
         "--blob-http-port", "-1", "--data-dir", str(data_dir), *args[args.index("serve") + 1:]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(**env))
    try:
        banner = read_serve_banner(proc)
    finally:
        code, rest = _stop(proc)
    assert code == 0, rest
    return banner, rest


def test_the_banner_never_prints_a_supplied_admin_token(redis_url: str, tmp_path: Path) -> None:
    given = "wb_admin_" + "s" * 40
    config = tmp_path / "serve.toml"
    config.write_text(f'[serve]\nadmin-token = "{given}"\n')
    for args, env, source in ((("serve", "--admin-token", given), {}, "--admin-token"),
                              (("serve",), {"WEFTBOARD_ADMIN_TOKEN": given}, "WEFTBOARD_ADMIN_TOKEN"),
                              (("--config", str(config), "serve"), {}, "the config file")):
        banner, rest = _banner(redis_url, tmp_path / "data", *args, **env)
        assert given not in banner + rest, banner
        assert f"given by {source}" in banner and bootstrap_id(given) in banner, banner


def test_the_banner_prints_a_token_only_when_it_generated_it(redis_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    banner, _ = _banner(redis_url, data_dir, "serve")
    token = (data_dir / ADMIN_TOKEN_FILE).read_text().strip()
    assert token in banner and "generated and stored in" in banner, banner
    again, rest = _banner(redis_url, data_dir, "serve")  # the restart reads it back: not printed
    assert token not in again + rest and "read from" in again and bootstrap_id(token) in again, again


# ---------------------------------------------------------------------------
# config file: a server's own settings only from its table
# ---------------------------------------------------------------------------


def test_top_level_client_certificate_never_becomes_the_servers(tmp_path: Path) -> None:
    root = typer.main.get_command(build_app())
    shared = {"board": "b:1", "tls-ca": "/ca.pem", "tls-cert": "/client.pem", "tls-key": "/client.key"}
    default_map = config_default_map(root, shared, "f.toml")
    assert default_map["status"]["tls_cert"] == "/client.pem" and default_map["subscribe"]["tls_key"] == "/client.key"
    assert "serve" not in default_map  # neither its server certificate nor its key
    own = config_default_map(root, {**shared, "serve": {"tls-cert": "/server.pem", "tls-key": "/server.key",
                                                          "listen": "0.0.0.0:7420"}}, "f.toml")
    assert own["serve"] == {"tls_cert": "/server.pem", "tls_key": "/server.key", "listen": "0.0.0.0:7420"}
    assert own["status"]["tls_cert"] == "/client.pem"
    for key, tables in (("listen", "[serve] or [sidecar]"), ("tls-client-ca", "[serve]")):
        with pytest.raises(InvalidArgument, match=f"key '{key}' at the top .* put it in {re.escape(tables)}"):
            config_default_map(root, {key: "x"}, "f.toml")


def test_serve_ignores_a_shared_files_client_certificate(redis_url: str, tmp_path: Path) -> None:
    """End to end: ``serve`` with a shared file whose top level names the clients' certificate
    (here files that do not exist, which it could not load as its own) serves plaintext."""
    config = tmp_path / "shared.toml"
    config.write_text(f'tls-ca = "{tmp_path / "ca.pem"}"\ntls-cert = "{tmp_path / "client.pem"}"\n'
                      f'tls-key = "{tmp_path / "client.key"}"\n')
    banner, rest = _banner(redis_url, tmp_path / "data", "--config", str(config), "serve", "--admin-token", "a" * 24)
    assert "listening on" in banner and "(TLS)" not in banner and "client.pem" not in banner + rest, banner


# ---------------------------------------------------------------------------
# subscribe --blob-dir: a board serving no blob URLs, on the same filesystem
# ---------------------------------------------------------------------------


@pytest.mark.usefixtures("warm_kernels")  # pubsubkit.WARM_KERNELS: kernels compiled before the publish
@pytest.mark.timeout(600)
async def test_subscribe_follows_a_board_without_blob_urls_through_blob_dir(board, local_store, tmp_path: Path) -> None:
    """The ``board`` fixture serves its local store over no HTTP (as ``serve --blob-http-port -1``):
    the plan carries no URL, so the island reads the board's blob directory itself."""
    trainer = Trainer(lr=1e-4)

    def go() -> None:
        with Publisher(board.address, "nohttp", token=board.admin_token, blob_store=local_store) as pub:
            for _ in range(2):
                trainer.step()
                pub.publish(trainer.model, step=trainer.step_no)

    await asyncio.to_thread(go)
    island = tmp_path / "island"
    proc = await asyncio.create_subprocess_exec(
        *WEFTBOARD, "subscribe", "--board", board.address, "--token", board.admin_token, "--run", "nohttp",
        "--dir", str(island), "--no-progress", "--exit-at-version", "2", env=_env(WEFTBOARD_BLOB_DIR=str(local_store.root)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 180)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert (island / "checkpoint" / "current").resolve().name == "v2"
